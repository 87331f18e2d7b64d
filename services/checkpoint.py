"""Checkpoints of a run, written atomically and durably: neither a crash mid-write nor a power
loss right after a checkpoint leaves LATEST naming a half-written or truncated checkpoint.

    RUN_DIR/checkpoints/step_000020/
        policy/           the policy as an HF folder (config, safetensors, tokenizer)   [learner]
        lora_adapter/     with learner.lora: the adapters as a PEFT folder               [learner]
        trainer.pt        scheduler state, learner version                               [learner]
        trainer_shards/   model + optimizer, each rank its own shards (DCP)              [learner, every rank]
        buffer.msgpack    the buffer's gate counters, data cursor, tickets and contents [buffer]
        state.json        controller state: step, version, config, the consumption audit
    RUN_DIR/checkpoints/LATEST   name of the newest complete checkpoint

Each part is written by the component that owns the state into a temporary folder. `commit`
checks every part is there, fsyncs every file and folder of it, renames it into place, and only
then replaces LATEST (temp file, fsync, rename, fsync of the folder).
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
# The parts' names; their writers (learner.trainer POLICY_DIR / TRAINER_STATE_FILE, the controller's
# BUFFER_STATE_FILE) keep their own constants, a test checks the two agree.
POLICY_PART = "policy"
TRAINER_PART = "trainer.pt"
BUFFER_PART = "buffer.msgpack"
SHARDS_PART = "trainer_shards"  # learner.checkpoint.SHARDS_DIR; complete once DCP wrote .metadata (last)


def step_name(step: int) -> str:
    return f"step_{step:06d}"


def staging_dir(run_dir: str | os.PathLike, step: int) -> Path:
    """A fresh temporary folder for the checkpoint of `step` (components write into it)."""
    tmp = Path(run_dir) / CHECKPOINTS / (step_name(step) + ".tmp")
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    return tmp


def _fsync_path(path: Path) -> None:
    """fsync a file or a folder (a folder's fsync makes the names in it durable)."""
    fd = os.open(path, os.O_RDONLY | (os.O_DIRECTORY if path.is_dir() else 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_tree(folder: Path) -> None:
    """fsync every file under `folder`, then every folder bottom-up, `folder` last. Files written
    by another process (the learner actor) are flushed too: fsync acts on the file, not the fd."""
    for dirpath, _dirnames, filenames in os.walk(folder, topdown=False):
        for name in filenames:
            _fsync_path(Path(dirpath) / name)
        _fsync_path(Path(dirpath))


def _write_text_durably(path: Path, text: str) -> None:
    """Replace `path` by `text`: temp file, fsync, rename, fsync of the folder."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_path(path.parent)


def missing_parts(folder: Path) -> list[str]:
    """The parts a checkpoint needs that `folder` lacks (or holds empty)."""
    missing = []
    policy = folder / POLICY_PART
    if not policy.is_dir() or not any(policy.glob("*.safetensors")):
        missing.append(f"{POLICY_PART}/ (an HF folder with .safetensors weights)")
    shards = folder / SHARDS_PART
    if shards.exists() and not (shards / ".metadata").is_file():
        missing.append(f"{SHARDS_PART}/.metadata (the sharded save did not finish)")
    for name in (TRAINER_PART, BUFFER_PART):
        part = folder / name
        if not part.is_file() or part.stat().st_size == 0:
            missing.append(name)
    return missing


def commit(staged: Path, state: dict, keep: int = 2) -> Path:
    """Make the staged checkpoint durable and current: refuse it if a part is missing, write
    state.json, fsync every file and folder in it, rename it into place, fsync the parent,
    point LATEST at it (durably), and drop all but the newest `keep` checkpoints.

    The fsyncs come before LATEST moves because a file system may persist a rename before the
    data of the files renamed: after a power loss LATEST then names a checkpoint of whole files."""
    staged = Path(staged)
    if not staged.name.endswith(".tmp") or not staged.is_dir():
        raise ValueError(f"{staged} is not a staging folder from staging_dir()")
    missing = missing_parts(staged)
    if missing:
        raise ValueError(f"checkpoint {staged} is incomplete, refusing to commit it: missing {', '.join(missing)}")
    # Nobody reads the staged folder, so state.json needs no temp file; _fsync_tree flushes it.
    (staged / STATE_FILE).write_text(json.dumps({"format": FORMAT_VERSION, **state}, indent=1, sort_keys=True),
                                     encoding="utf-8")
    _fsync_tree(staged)
    final = staged.with_name(staged.name[: -len(".tmp")])
    if final.exists():
        shutil.rmtree(final)
    os.replace(staged, final)
    root = final.parent
    _fsync_path(root)
    _fsync_path(root.parent)  # the first checkpoint also created checkpoints/ in the run folder
    _write_text_durably(root / LATEST, final.name)
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
        raise FileNotFoundError(f"run directory {str(run_dir)!r} holds no complete checkpoint (a run writes one "
                                "every run.checkpoint_every steps, at its end and on Ctrl-C once it has trained)")
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
