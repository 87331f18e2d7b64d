"""benchmarks/code_reward.py at a toy size: it scores right and wrong programs as it says and its ratio is
the one of the times it printed. It asserts the report, never a speed."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def test_code_reward_script_reports_checks_and_the_fresh_interpreter_baseline():
    out = subprocess.run([sys.executable, str(REPO / "benchmarks" / "code_reward.py"), "--responses", "2",
                          "--tests", "3"], capture_output=True, text=True, timeout=300, cwd=REPO)
    assert out.returncode == 0, out.stderr[-3000:]
    summary = json.loads(out.stdout.strip().splitlines()[-1])
    assert summary["tests_per_row"] == 3 and summary["checks_per_wrong_response"] == 4
    assert summary["fork_check_ms"] == pytest.approx(summary["wrong_response_ms"] / 4, abs=0.01)
    assert summary["fresh_over_fork"] == pytest.approx(summary["fresh_interpreter_ms"] / summary["fork_check_ms"],
                                                       abs=0.01)
