"""The README's first command, measured: `etarl train` (with any overrides) as a user runs it, then
what the run did, from its own log.

    .venv/bin/python benchmarks/default_run.py [--warmup 10] [key=value ...]

Runs `etarl train` in a child process exactly as the README's `bash scripts/run.sh` does (the
embedded default; on a GPU machine the layout `etarl plan` chooses), then reads the run folder's
metrics.jsonl and the closing summary and prints: the layout chosen, wall and training seconds,
held-out accuracy first and last, samples/s and tokens/s (median over the steps after `--warmup`), the
learner step's time split (median seconds per step of each `timing_s/*` part), and on GPUs each
role's peak GPU memory (the summary's `gpu_memory_gib`). The last line is a JSON summary.
What issue 28 asks of a one-GPU run: `python benchmarks/default_run.py` on that machine.
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from services.plots import read_metrics  # noqa: E402

SPLIT = ("wait_data", "old_log_prob", "ref", "update_actor", "weight_sync", "weight_sync_blocked", "step")


def closing_summary(stdout: str) -> dict:
    """The JSON object `etarl train` prints when it ends (indented, after the progress bar)."""
    lines = stdout.splitlines()
    starts = [i for i, line in enumerate(lines) if line == "{"]
    ends = [i for i, line in enumerate(lines) if line == "}" and starts and i > starts[-1]]
    if not starts or not ends:
        raise RuntimeError("etarl train printed no closing summary:\n" + stdout[-2000:])
    return json.loads("\n".join(lines[starts[-1] : ends[0] + 1]))


def median_of(records: list[dict], key: str) -> float | None:
    values = [r[key] for r in records if isinstance(r.get(key), (int, float))]
    return round(statistics.median(values), 4) if values else None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--warmup", type=int, default=10, help="first steps left out of the medians")
    args, overrides = parser.parse_known_args()
    with tempfile.TemporaryDirectory(prefix="etarl-default-run-") as tmp:
        run_dir = Path(tmp) / "run"
        # `etarl` is services.cli:run; by module, it also runs from a checkout on PYTHONPATH that no
        # pip install put an `etarl` script beside the interpreter for (a GPU box without a registry)
        command = [sys.executable, "-m", "services.cli", "train", *overrides, f"run.run_dir={run_dir}",
                   "run.progress=false"]
        started = time.perf_counter()
        done = subprocess.run(command, cwd=REPO, capture_output=True, text=True)
        wall_s = time.perf_counter() - started
        if done.returncode != 0:
            sys.exit(f"etarl train failed (exit {done.returncode}):\n{done.stderr[-3000:]}")
        summary = closing_summary(done.stdout)
        layout = next((line.split("etarl INFO layout ", 1)[1] for line in done.stderr.splitlines()
                       if "etarl INFO layout " in line), "?")
        steps = [r for r in read_metrics(run_dir) if "timing_s/step" in r]
    kept = steps[args.warmup:] or steps
    result = {
        "benchmark": "default_run",
        "overrides": overrides,
        "layout": layout,
        "wall_s": round(wall_s, 1),
        "train_s": summary["seconds"],  # from the training loop's start: no set-up, no model build
        "steps": summary["steps"],
        "completed": summary["completed"],
        "eval_accuracy_first": summary["eval_accuracy_first"],
        "eval_accuracy_last": summary["eval_accuracy_last"],
        "samples_per_s": median_of(kept, "throughput/samples_per_s"),
        "tokens_per_s": median_of(kept, "throughput/tokens_per_s"),
        "step_split_s": {part: value for part in SPLIT if (value := median_of(kept, f"timing_s/{part}")) is not None},
        "gpu_memory_gib": summary.get("gpu_memory_gib", {}),
    }
    split = result["step_split_s"]
    # the learner's share of the time between its steps: 1.0 when it never waits for samples
    result["learner_busy_fraction"] = round(split["step"] / (split["step"] + split["wait_data"]), 3) \
        if split.get("step") and "wait_data" in split else None
    print(f"layout: {layout}")
    print(f"{result['steps']} steps in {result['wall_s']} s, {result['train_s']} s of them training (completed: "
          f"{result['completed']}); held-out accuracy "
          f"{result['eval_accuracy_first']} -> {result['eval_accuracy_last']}")
    print(f"median over steps {args.warmup + 1}..{len(steps)}: {result['samples_per_s']} samples/s, "
          f"{result['tokens_per_s']} tokens/s")
    print("learner step split (median s): " + ", ".join(f"{k}={v}" for k, v in split.items())
          + f"; busy {result['learner_busy_fraction']} of the time between steps")
    print("peak GPU memory reserved (GiB): " + (", ".join(f"{k}={v}" for k, v in result["gpu_memory_gib"].items())
                                                or "none (no GPU)"))
    print(json.dumps(result))


if __name__ == "__main__":
    main()
