"""benchmarks/gae_advantages.py at a toy size: both forms are timed on single- and multi-turn
batches, agree, and the ratio is the one of the times it printed. It asserts the report, never a speed."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def test_gae_script_times_the_column_loop_and_the_blocked_form_on_one_batch():
    out = subprocess.run([sys.executable, str(REPO / "benchmarks" / "gae_advantages.py"), "--rows", "8",
                          "--tokens", "700", "--repeats", "1"], capture_output=True, text=True, timeout=300, cwd=REPO)
    assert out.returncode == 0, out.stderr[-3000:]
    summary = json.loads(out.stdout.strip().splitlines()[-1])
    for name in ("single_turn", "multi_turn"):
        part = summary[name]
        assert part["max_abs_difference"] < 1e-4, name  # float32, over 700 columns
        assert part["speedup"] == pytest.approx(part["column_loop_s"] / part["blocked_s"], rel=1e-9)  # unrounded
    assert summary["multi_turn"]["policy_tokens"] < summary["single_turn"]["policy_tokens"]  # tool tokens left out
