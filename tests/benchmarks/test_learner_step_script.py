"""benchmarks/learner_step.py at a toy size: every path and layout it names is timed and reported,
and the ratios are the ones of the times it printed. It asserts the report, never a speed."""
from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def test_learner_step_script_times_every_proximal_path_and_micro_batch_layout():
    out = subprocess.run([sys.executable, str(REPO / "benchmarks" / "learner_step.py"), "--groups", "2", "--n", "2",
                          "--prompt", "4", "--response", "3", "--vocab", "32", "--hidden", "32", "--layers", "1",
                          "--steps", "1"], capture_output=True, text=True, timeout=600, cwd=REPO)
    assert out.returncode == 0, out.stderr[-3000:]
    summary = json.loads(out.stdout.strip().splitlines()[-1])
    assert set(summary["step_s"]) == {"recompute", "recompute_from_update", "loglinear", "bypass"}
    steps = summary["step_s"]
    assert summary["from_update_pass_vs_recompute"] == pytest.approx(
        steps["recompute_from_update"] / steps["recompute"], rel=0.05)
    # the separate pass is timed; taken from the update pass, there is none to time
    assert summary["proximal_pass_s"]["recompute_from_update"] < summary["proximal_pass_s"]["recompute"]
    layouts = summary["layout_step_s"]
    assert set(layouts) == {"padded", "packed_sdpa", "packed_varlen"} and min(layouts.values()) > 0
    assert summary["packed_vs_padded"] == pytest.approx(layouts["packed_sdpa"] / layouts["padded"], rel=0.05)
    assert summary["varlen_vs_padded"] == pytest.approx(layouts["packed_varlen"] / layouts["padded"], rel=0.05)
    # the line prints the ratio to 2 places, the JSON to 3: compare the numbers, not their rounding twice
    printed = re.search(r"packed \(sdpa\) / padded step time: ([0-9.]+)x", out.stdout)
    assert printed and float(printed.group(1)) == pytest.approx(summary["packed_vs_padded"], abs=0.0051)
