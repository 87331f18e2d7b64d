"""The reward process is boxed in (issue 30): it sees an allow-listed environment only, answers in
plain data (the worker never unpickles what it sends), and a reward over its CPU-time or memory
limit fails its response while the runner goes on. Real child processes, real rlimits."""
from __future__ import annotations

import json
import time

import msgpack
import pytest

from rollout_workers.child_process import ENV_ALLOWED, BadChildReply, _pack, child_environment, decode_reply
from rollout_workers.data.problems import Problem
from rollout_workers.rewards import RewardRunner, Scored

SECRETS = {"ETARL_BUFFER_SERVER_SECRET_KEY": "curve-secret", "ETARL_BUFFER_CLIENT_SECRET_KEY": "curve-client",
           "AWS_SECRET_ACCESS_KEY": "aws", "AWS_ACCESS_KEY_ID": "aws-id", "RAY_AUTH_TOKEN": "ray-token",
           "HF_TOKEN": "hf", "WANDB_API_KEY": "wandb", "MY_JUDGE_SECRET": "judge"}


def problem(answer: str) -> Problem:
    return Problem(prompt="?", answer=answer)


def test_the_reward_process_sees_no_secret_of_its_parent(tmp_path, monkeypatch):
    for name, value in SECRETS.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("LC_ALL", "C.UTF-8")
    seen = tmp_path / "names.json"
    runner = RewardRunner("sandbox_rewards:environment_names", timeout_s=30)
    try:
        assert runner.score_one("fine", problem(str(seen))) == Scored(1.0, {}), runner.last_error
    finally:
        runner.close()
    names = set(json.loads(seen.read_text()))
    assert not names & set(SECRETS)
    assert names <= set(ENV_ALLOWED) | {"PYTHONPATH", "LC_ALL", "LC_CTYPE"}, names - set(ENV_ALLOWED)
    assert {"PATH", "PYTHONPATH", "LC_ALL", "OMP_NUM_THREADS"} <= names  # what Python, locales, threads need
    assert child_environment()["OMP_NUM_THREADS"]  # one thread per pool unless the parent says otherwise


@pytest.mark.parametrize("reward,why", [
    ("returns_a_pickle_only_object", "not a finite number"),  # refused in the child, before any pickling
    ("smuggles_a_pickle", "not plain data"),  # a pickle written into the reply pipe: refused, never unpickled
])
def test_a_pickle_from_the_reward_process_is_refused_and_never_unpickled(reward, why, tmp_path):
    marker = tmp_path / "unpickled"
    runner = RewardRunner(f"sandbox_rewards:{reward}", timeout_s=30, failure_reward=-1.0)
    try:
        assert runner.score_one("pickle", problem(str(marker)))[:2] == (-1.0, {})
        assert why in runner.last_error and runner.stats()["reward_failures_total"] == 1, runner.last_error
        assert not marker.exists(), "the worker unpickled what the reward process sent"
        assert runner.score_one("fine", problem("")) == Scored(4.0, {}), runner.last_error  # it goes on
    finally:
        runner.close()


def test_replies_are_plain_msgpack_both_ways():
    assert decode_reply(_pack(["ok", [1.5, {"reward/acc": 1.0}]])) == ["ok", [1.5, {"reward/acc": 1.0}]]
    status, why = decode_reply(_pack(["ok", object()]))  # a handler's non-plain reply fails that request
    assert status == "bad" and "not plain data" in why
    for raw in (msgpack.packb(msgpack.ExtType(5, b"x")), msgpack.packb(1) + b"\x01", b"\x92\x01"):
        with pytest.raises(BadChildReply, match="not plain data"):
            decode_reply(raw)


def test_a_reward_over_its_cpu_limit_fails_its_response_and_the_runner_goes_on():
    runner = RewardRunner("sandbox_rewards:burn_cpu", timeout_s=20, cpu_s=1, failure_reward=-1.0)
    try:
        assert runner.score_one("ok", problem("")) == Scored(2.0, {}), runner.last_error
        start = time.monotonic()
        assert runner.score_one("burn", problem(""))[:2] == (-1.0, {})
        assert time.monotonic() - start < 15, "stopped by its CPU limit, long before the 20 s timeout"
        assert "SIGXCPU" in runner.last_error and "1 CPU seconds" in runner.last_error, runner.last_error
        assert runner.stats() == {"reward_calls_total": 2, "reward_failures_total": 1, "reward_timeouts_total": 0}
        assert runner.score_one("fine", problem("")) == Scored(4.0, {}), runner.last_error
    finally:
        runner.close()


def test_a_batch_reward_gets_the_cpu_seconds_of_its_responses_together():
    runner = RewardRunner("sandbox_rewards:burn_cpu_batch", timeout_s=20, cpu_s=1, failure_reward=-1.0)
    try:
        assert [s.value for s in runner.score(["burn", "a"], problem(""))] == [-1.0] * 2
        assert "SIGXCPU" in runner.last_error and "limit of 2 CPU seconds" in runner.last_error, runner.last_error
        assert [s.value for s in runner.score(["ab", "c"], problem(""))] == [2.0, 1.0], runner.last_error
    finally:
        runner.close()


def test_a_reward_over_its_memory_limit_fails_its_response_and_the_runner_goes_on():
    runner = RewardRunner("sandbox_rewards:allocate", timeout_s=30, memory_mb=512, failure_reward=-1.0)
    try:
        assert runner.score_one("allocate", problem("64")) == Scored(1.0, {}), runner.last_error  # within it
        assert runner.score_one("allocate", problem("2048"))[:2] == (-1.0, {})
        assert "MemoryError" in runner.last_error and "512 MB" in runner.last_error, runner.last_error
        assert runner.score_one("fine", problem("")) == Scored(4.0, {}), runner.last_error
        assert runner.stats()["reward_failures_total"] == 1
    finally:
        runner.close()
    with pytest.raises(ValueError, match="memory_mb"):
        RewardRunner("math", memory_mb=0)
