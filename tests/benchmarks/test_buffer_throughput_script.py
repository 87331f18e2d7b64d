"""benchmarks/buffer_throughput.py in its smallest mode: it runs end to end against the real buffer
process and prints every measured line (samples/s and ratio per request pattern, CPU split,
round trips, memory). It asserts the report is complete and consistent, never a speed."""
from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_throughput_script_reports_every_pattern():
    out = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "buffer_throughput.py"), "--samples", "640", "--rounds", "1",
         "--producers", "2", "--memory-samples", "160", "--gpu-scale", "8/16"],
        capture_output=True, text=True, timeout=600, cwd=REPO)
    assert out.returncode == 0, out.stderr[-3000:]
    text = out.stdout
    raw = float(re.search(r"raw PUSH/PULL \+ codec :\s+(\d+) samples/s", text).group(1))
    assert raw > 0
    patterns = re.findall(r"buffer service, (.+):\n  samples/s\s+:\s+(\d+).*\n  ratio service/raw\s+:\s+([\d.]+)", text)
    labels = [label for label, _, _ in patterns]
    assert len(patterns) == 4, text
    assert labels[0].startswith("one group per request") and labels[3].startswith("GPU-scale sizes: 8 groups")
    for _, rate, ratio in patterns:
        assert float(rate) > 0
        assert abs(float(ratio) - round(float(rate) / raw, 2)) <= 0.011  # the ratio is of the printed rates
    paired = re.findall(r"round by round, .*: median ([\d.]+), range ([\d.]+)-([\d.]+)\)", text)
    assert len(paired) == 4 and all(float(lo) <= float(mid) <= float(hi) for mid, lo, hi in paired)
    assert len(re.findall(r"CPU per sample\s+: \d+ us .*learner \d+ us, server \d+ us, producers \d+ us", text)) == 4
    memory = re.search(r"memory for 160 samples : ([\d.]+) MB resident vs ([\d.]+) MB raw arrays = ([\d.]+)x", text)
    assert memory and float(memory.group(2)) > 0
    summary = json.loads(text.strip().splitlines()[-1])
    assert all(abs(p["ratio"] - float(r)) <= 0.006 for p, (_, _, r) in zip(summary["patterns"], patterns, strict=True))


def assert_ratio_of_rounded(ratio: float, top: int, bottom: int) -> None:
    """`ratio` (rounded to 3 decimals) is top / bottom of two rates each rounded to a whole number."""
    low, high = (top - 0.5) / (bottom + 0.5), (top + 0.5) / max(bottom - 0.5, 1e-9)
    assert low - 0.0005 <= ratio <= high + 0.0005, (ratio, top, bottom)


def test_large_mode_reports_throughput_compaction_stalls_and_memory():
    """--large with real sample sizes (1.8 MB groups) and a log small enough to compact twice."""
    out = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "buffer_throughput.py"), "--large", "--large-groups", "24",
         "--large-hold", "4", "--rounds", "1", "--compact-mb", "8"],
        capture_output=True, text=True, timeout=600, cwd=REPO)
    assert out.returncode == 0, out.stderr[-3000:]
    summary = json.loads(out.stdout.strip().splitlines()[-1])
    assert summary["mode"] == "large" and summary["group_mb"] == 1.77
    assert summary["compactions"] >= 1 and summary["raw_mb_per_s"] > 0 and summary["service_mb_per_s"] > 0
    assert summary["relay_mb_per_s"] > 0
    # the ratios come from the unrounded rates; the printed MB/s are whole numbers
    for ratio, top, bottom in (("ratio", "service_mb_per_s", "raw_mb_per_s"),
                               ("relay_ratio", "relay_mb_per_s", "raw_mb_per_s"),
                               ("service_over_relay", "service_mb_per_s", "relay_mb_per_s")):
        assert_ratio_of_rounded(summary[ratio], summary[top], summary[bottom])
    assert summary["memory_ratio"] > 0 and summary["push_p99_ms"] >= summary["push_p50_ms"]
    assert summary["raw_cpu_ms_per_mb"] > 0 and all(ms > 0 for ms in summary["cpu_ms_per_mb"].values())
