"""benchmarks/default_run.py on a short run: it runs the README's first command in a child process
and reports what the run's own log says; the report agrees with the log it read. It asserts the
report is complete and consistent, never a speed."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_the_default_run_script_reports_the_run_from_its_log():
    out = subprocess.run([sys.executable, str(REPO / "benchmarks" / "default_run.py"), "--warmup", "2",
                          "run.steps=6", "eval.enabled=false", "rollout.engine.kind=hf",
                          "rollout.engine.device=cpu", "learner.device=cpu"],  # the CPU path, GPU or not
                         capture_output=True, text=True, timeout=600, cwd=REPO)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout.strip().splitlines()
    summary = json.loads(lines[-1])
    assert summary["benchmark"] == "default_run" and summary["completed"] and summary["steps"] == 6
    assert summary["layout"].startswith("cpu: ")  # both roles on the CPU: the CPU defaults, no GPU memory
    assert summary["gpu_memory_gib"] == {} and "none (no GPU)" in out.stdout
    assert 0 < summary["train_s"] < summary["wall_s"]
    assert summary["samples_per_s"] > 0 and summary["tokens_per_s"] > summary["samples_per_s"]
    split = summary["step_split_s"]
    assert {"wait_data", "old_log_prob", "update_actor", "step"} <= set(split)
    assert 0 < summary["learner_busy_fraction"] <= 1
    assert f"median over steps 3..6: {summary['samples_per_s']} samples/s" in out.stdout
