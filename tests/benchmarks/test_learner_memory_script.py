"""benchmarks/learner_memory.py at toy sizes (a 512-token vocabulary, sequences of 8 to 32 tokens):
it runs end to end, every measurement in its own child process, and its JSON summary agrees with
the lines it printed. It asserts the report is complete and consistent, never a speed or a size."""
from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_learner_memory_script_reports_every_measurement():
    out = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "learner_memory.py"), "--vocab", "512", "--hidden", "32",
         "--layers", "1", "--min-len", "8", "--max-len", "32", "--batch-sizes", "8,16", "--checkpointing", "selective"],
        capture_output=True, text=True, timeout=600, cwd=REPO)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout.strip().splitlines()
    summary = json.loads(lines[-1])
    text = "\n".join(lines[:-1])
    assert summary["benchmark"] == "learner_memory" and summary["batch_sizes"] == [8, 16]
    assert summary["budget"] == 64 and summary["chunk"] == 4  # the defaults: 2 x longest, budget / 16

    for kind, key, sizes in (("step", "peak_gib", {"8", "16"}), ("old step", "old_peak_gib", {"8"})):
        printed = dict(re.findall(rf"^  {kind} B=\s*(\d+): peak\s+([\d.]+) GiB", text, re.M))
        assert set(printed) == sizes, text
        assert {b: float(v) for b, v in printed.items()} == summary[key]
    assert re.search(r"old step B=  16: not run, its float32 \[B, L, V\] logits alone are", text)
    # The old path pads every row to the batch's longest; the learner now packs.
    assert summary["padding_fraction"]["16"] == 0.0 < 0.375 <= min(
        float(f) for f in re.findall(r"old step B=\s*\d+: .* padding ([\d.]+)", text))
    ratio = summary["peak_gib"]["16"] / summary["peak_gib"]["8"]
    assert abs(summary["peak_ratio_largest_vs_smallest"] - ratio) < 0.01

    head = re.search(r"log-prob head, 2 x 32 tokens \(28 of them response\): chunked ([\d.]+) GiB, former ([\d.]+) "
                     r"GiB", text)
    assert head and float(head.group(1)) == summary["logprob_head_gib"]
    speed = re.search(r"forward\+backward, (\d+) tokens: learner (\d+) tokens/s over (\d+) micro-batches \(packed: "
                      r"True\), plain transformers (\d+) tokens/s over (\d+) padded ones; the learner with full "
                      r"checkpointing (\d+) tokens/s; a plain transformers step \(no-grad forward, forward\+backward, "
                      r"AdamW\) (\d+) tokens/s; .* max \|diff\| (\S+)", text)
    assert speed and int(speed.group(5)) >= 2
    assert abs(summary["tokens_per_s_vs_plain"] - int(speed.group(2)) / int(speed.group(4))) < 0.01
    # Packed micro-batches: no padding in the learner's steps, the same log-probs as padded ones.
    assert summary["packing"] is True and set(summary["padding_fraction"].values()) == {0.0}
    assert float(speed.group(8)) == summary["packed_vs_padded_max_abs_diff"] < 1e-4
    # the learner's whole step at the throughput batch (the smallest, 8) against the plain step
    assert abs(summary["tokens_per_s_plain_step"] - int(speed.group(7))) <= 1
    assert abs(summary["learner_step_vs_plain_step"]
               - summary["warm_tokens_per_s"]["8"] / summary["tokens_per_s_plain_step"]) < 0.01
    # --checkpointing selective: the learner's pass also ran with full checkpointing, for the ratio
    assert summary["checkpointing"] == "selective"
    assert abs(summary["tokens_per_s_learner_full_checkpointing"] - int(speed.group(6))) <= 1
    assert set(summary["goals"]) == {"peak_within_1.15x", "logprob_at_most_1/8_naive",
                                     "tokens_per_s_at_least_0.9x_plain"}
