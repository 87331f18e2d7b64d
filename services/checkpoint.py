"""Checkpoints of a run, written atomically so a crash mid-write never leaves a half checkpoint.

    RUN_DIR/checkpoints/step_000020/
        policy/           the policy as an HF folder (config, safetensors, tokenizer)   [learner]
        trainer.pt        optimizer + scheduler state, learner version                   [learner]
        buffer.json       the buffer's gate counters, data cursor, tickets and contents [buffer]
        state.json        controller state: step, version, config, the consumption audit
    RUN_DIR/checkpoints/LATEST   name of the newest complete checkpoint

Each part is written by the component that owns the state into a temporary folder; the folder
is renamed into place and LATEST is replaced (both atomic on POSIX) only when all parts exist.
"""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

CHECKPOINTS = "checkpoints"
LATEST = "LATEST"
STATE_FILE = "state.json"
FORMAT_VERSION = 1


def step_name(step: int) -> str:
    return f"step_{step:06d}"


def staging_dir(run_dir: str | os.PathLike, step: int) -> Path:
    """A fresh temporary folder for the checkpoint of `step` (components write into it)."""
    tmp = Path(run_dir) / CHECKPOINTS / (step_name(step) + ".tmp")
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    return tmp


def _write_json_atomic(path: Path, data: dict) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(data, f, indent=1, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def commit(staged: Path, state: dict, keep: int = 2) -> Path:
    """Write state.json into the staged folder, move it into place, point LATEST at it and
    drop all but the newest `keep` checkpoints."""
    if not staged.name.endswith(".tmp") or not staged.is_dir():
        raise ValueError(f"{staged} is not a staging folder from staging_dir()")
    _write_json_atomic(staged / STATE_FILE, {"format": FORMAT_VERSION, **state})
    final = staged.with_name(staged.name[: -len(".tmp")])
    if final.exists():
        shutil.rmtree(final)
    os.replace(staged, final)
    root = final.parent
    (root / (LATEST + ".tmp")).write_text(final.name)
    os.replace(root / (LATEST + ".tmp"), root / LATEST)
    for old in list_checkpoints(root.parent)[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def list_checkpoints(run_dir: str | os.PathLike) -> list[Path]:
    """Complete checkpoints of a run, oldest first."""
    root = Path(run_dir) / CHECKPOINTS
    if not root.is_dir():
        return []
    done = [p for p in root.glob("step_*") if p.is_dir() and not p.name.endswith(".tmp")
            and (p / STATE_FILE).is_file()]
    return sorted(done, key=lambda p: p.name)


def latest_checkpoint(run_dir: str | os.PathLike) -> Path:
    """The checkpoint to resume from; a clear error when the run has none."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise FileNotFoundError(f"run directory {str(run_dir)!r} does not exist")
    pointer = run_dir / CHECKPOINTS / LATEST
    if pointer.is_file():
        candidate = run_dir / CHECKPOINTS / pointer.read_text().strip()
        if (candidate / STATE_FILE).is_file():
            return candidate
    found = list_checkpoints(run_dir)
    if not found:
        raise FileNotFoundError(f"run directory {str(run_dir)!r} holds no complete checkpoint to resume from")
    return found[-1]


def read_state(checkpoint: str | os.PathLike) -> dict:
    path = Path(checkpoint) / STATE_FILE
    try:
        state = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise FileNotFoundError(f"checkpoint {str(checkpoint)!r} has no {STATE_FILE}") from None
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path} is not valid JSON: {exc.msg}") from None
    if state.get("format") != FORMAT_VERSION:
        raise ValueError(f"{path}: checkpoint format {state.get('format')!r}, this etarl reads {FORMAT_VERSION}")
    return state
