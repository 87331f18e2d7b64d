"""The run's JSONL metric log and the PNG plots drawn from it (`etarl plot RUN_DIR` redraws them)."""
from __future__ import annotations

import json
import logging
import math
import os
from pathlib import Path
from typing import Iterable

METRICS_FILE = "metrics.jsonl"

# One PNG per panel: (file stem, title, y label, metric keys drawn as lines).
PANELS = [
    ("reward", "Training reward", "mean reward", ["reward/mean"]),
    ("eval_accuracy", "Held-out evaluation", "accuracy",
     ["eval/accuracy", "eval/pass@1", "eval/pass@k", "eval/by_source/*/accuracy"]),
    ("staleness", "Staleness of consumed samples", "versions", ["staleness/mean", "staleness/max"]),
    ("kl", "Rollout/training mismatch", "KL", ["rollout_corr/kl", "rollout_corr/k3_kl"]),
    ("ess", "IS effective sample size", "ESS (fraction)", ["rollout_corr/rollout_is_eff_sample_size"]),
    ("throughput", "Throughput", "samples/s", ["throughput/samples_per_s"]),
]


class MetricLog:
    """Append-only JSONL, one record per line, flushed per record so a crash keeps what was logged.
    On resume the log is truncated to the checkpoint's step so no step appears twice; a new run
    in the folder of one that ended before its first checkpoint moves that one's log aside to
    `metrics.jsonl.prev`."""

    def __init__(self, run_dir: str | os.PathLike, resume_after_step: int | None = None, trackers=None) -> None:
        self.trackers = trackers  # services.trackers.Trackers: each record also goes to W&B / TensorBoard
        self.path = Path(run_dir) / METRICS_FILE
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if resume_after_step is not None and self.path.exists():
            kept = [r for r in read_metrics(self.path) if r.get("step", 0) <= resume_after_step]
            self.path.write_text("".join(json.dumps(r) + "\n" for r in kept))
        elif self.path.exists():
            self.path.replace(self.path.with_name(METRICS_FILE + ".prev"))
        self._file = open(self.path, "a", encoding="utf-8")

    def write(self, record: dict) -> None:
        self._file.write(json.dumps(_finite(record)) + "\n")
        self._file.flush()
        if self.trackers is not None:
            self.trackers.log(record)

    def close(self) -> None:
        self._file.close()


def _finite(record: dict) -> dict:
    """JSON has no NaN/inf: write them as null so every line stays valid JSON."""
    out = {}
    for key, value in record.items():
        if isinstance(value, float) and not math.isfinite(value):
            value = None
        out[key] = value
    return out


def read_metrics(path: str | os.PathLike) -> list[dict]:
    path = Path(path)
    if path.is_dir():
        path = path / METRICS_FILE
    if not path.is_file():
        raise FileNotFoundError(f"no metric log at {str(path)!r} (is this a run directory?)")
    lines = path.read_text(encoding="utf-8").splitlines()
    records = []
    for lineno, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError as exc:
            # A run killed mid-write may leave a torn last line; anything else is corruption.
            if lineno == len(lines):
                break
            raise ValueError(f"{path}:{lineno}: not valid JSON ({exc.msg})") from None
    return records


def _series(records: Iterable[dict], key: str) -> tuple[list[float], list[float]]:
    xs, ys = [], []
    for r in records:
        value = r.get(key)
        if isinstance(value, (int, float)) and not isinstance(value, bool) and "step" in r:
            xs.append(r["step"])
            ys.append(float(value))
    return xs, ys


def plot_run(run_dir: str | os.PathLike) -> list[Path]:
    """Draw one PNG per panel that has data into RUN_DIR/plots/; returns the files written."""
    import matplotlib

    # its first import on a machine builds a font cache and logs that at INFO: not the run's news
    logging.getLogger("matplotlib").setLevel(logging.WARNING)
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    run_dir = Path(run_dir)
    records = read_metrics(run_dir)
    out_dir = run_dir / "plots"
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for stem, title, ylabel, keys in PANELS:
        keys = _expand(records, keys)
        lines = [(k, *_series(records, k)) for k in keys]
        lines = [(k, xs, ys) for k, xs, ys in lines if xs]
        if not lines:
            continue
        fig, ax = plt.subplots(figsize=(6, 3.5))
        for key, xs, ys in lines:
            ax.plot(xs, ys, marker="o" if len(xs) < 30 else None, markersize=3, label=key)
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        fig.tight_layout()
        path = out_dir / f"{stem}.png"
        fig.savefig(path, dpi=100)
        plt.close(fig)
        written.append(path)
    return written


def _expand(records: list[dict], keys: list[str]) -> list[str]:
    """`eval/pass@k` stands for whichever eval/pass@<k> (k > 1) keys the log holds, and
    `eval/by_source/*/accuracy` for each data source's accuracy (held-out prompts of several)."""
    present = set().union(*(r.keys() for r in records)) if records else set()
    out = []
    for key in keys:
        if key == "eval/pass@k":
            out += sorted(k for k in present if k.startswith("eval/pass@") and k != "eval/pass@1")
        elif "*" in key:
            head, tail = key.split("*")
            out += sorted(k for k in present if k.startswith(head) and k.endswith(tail))
        else:
            out.append(key)
    return out
