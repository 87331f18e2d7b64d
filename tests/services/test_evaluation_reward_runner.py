"""Evaluation scores through the reward runner (issue 30): a reward that hangs during evaluation
costs its timeout, is scored as a wrong answer and counted, and the evaluation goes on."""
from __future__ import annotations

import logging
import time

import pytest

from rollout_workers.data.problems import Problem
from rollout_workers.rewards import RewardRunner
from services.evaluation import EvalPrompt, RewardScore, evaluate

HANGS_ON_7 = '''
import os, time

def reward(response, answer):
    if response == "7":  # hangs until its parent is gone
        parent = os.getppid()
        while os.getppid() == parent:
            time.sleep(0.05)
    return float(response == answer)
'''


class DigitsTokenizer:
    """Token ids are the digits of the text."""

    def decode(self, ids, skip_special_tokens=True):
        return "".join(str(i) for i in ids)


def test_an_evaluation_with_a_hanging_reward_finishes_within_its_timeout(tmp_path, caplog):
    (tmp_path / "hangs_on_7.py").write_text(HANGS_ON_7)
    prompts = [EvalPrompt(prompt_ids=[i], problem=Problem(f"{i}?", str(i), source="heldout.jsonl", row=i + 1)) for i in range(4)]

    def generate(batch, n, temperature, seed):  # the right answer, except 7 for the third prompt
        return [[[7] if ids == [2] else ids] * n for ids in batch]

    timeout_s = 0.5
    score = RewardScore(RewardRunner(f"{tmp_path / 'hangs_on_7.py'}:reward", timeout_s=timeout_s), DigitsTokenizer())
    try:
        score(prompts[0], [[0]])  # the reward process starts here, outside the timed part
        start = time.monotonic()
        with caplog.at_level(logging.WARNING):
            metrics = evaluate(generate, score, prompts, n_samples=2, k=1, temperature=1.0)
        seconds = time.monotonic() - start
    finally:
        score.close()
    # 3 hanging calls (greedy + 2 samples), each its timeout and a fresh process after it
    assert seconds < 3 * timeout_s + 10, seconds
    assert metrics["eval/accuracy"] == pytest.approx(0.75) and metrics["eval/pass@1"] == pytest.approx(0.75)
    stats = score.stats()
    assert stats["reward_timeouts_total"] == 3 and stats["reward_failures_total"] == 3
    (logged,) = [r.getMessage() for r in caplog.records if "eval: reward" in r.getMessage()]
    assert "took longer than 0.5s" in logged and "row 3" in logged, logged
