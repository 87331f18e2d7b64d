"""Environments: the calculator task, the checks on what an environment returns, and the pool of
child processes: parallel calls, and an environment that hangs, crashes, raises or returns garbage
ends its own trajectory only, counted; its slot works again for the next trajectory."""
from __future__ import annotations

from pathlib import Path

import pytest

from rollout_workers.data import Problem
from rollout_workers.environments import (
    BadEnvironmentResult,
    Calculator,
    EnvironmentPool,
    StepResult,
    calculate,
    resolve_environment,
)
from rollout_workers.environments.base import checked_reset, checked_step

pytestmark = pytest.mark.timeout(120)
HELPERS = Path(__file__).with_name("env_helpers.py")


def test_calculator_reads_sums_and_scores_the_final_answer():
    assert calculate("347+589") == 936 and calculate(" 12 - 30 + 1 ") == -17 and calculate("-5") == -5
    assert calculate("3*4") is None and calculate("1+") is None and calculate("") is None
    env = Calculator(max_calls=1)
    assert env.reset(Problem("347+589=", "936")) is None  # the problem's own prompt
    assert env.step("<calc>347+589</calc>") == StepResult("<r>936</r>", 0.0, False, {})
    assert env.step("<calc>1+1</calc>") == StepResult(None, 0.0, True, {"correct": 0.0, "tool_calls": 1.0,
                                                                        "tool_success": 1.0})
    env = Calculator()
    env.reset(Problem("347+589=", "936"))
    assert env.step("<calc>347+58</calc>").observation == "<r>405</r>"
    assert env.step("<calc>oops</calc>").observation == "<r></r>"
    assert env.step(" 936") == StepResult(None, 1.0, True, {"correct": 1.0, "tool_calls": 2.0, "tool_success": 0.0})


def test_what_an_environment_returns_is_checked():
    assert checked_step(("obs", 1, True, {"a": 2, "b": "text", 3: 1.0})) == StepResult("obs", 1.0, True, {"a": 2.0})
    assert checked_step(StepResult(None, 0.5, 0, None)) == StepResult(None, 0.5, False, {})
    assert checked_reset(None) is None and checked_reset("prompt") == "prompt"
    for bad in [{"observation": "x"}, ("obs", float("nan"), True, {}), ("obs", 1.0, "yes", {}), (3, 1.0, True, {}),
                ("obs", True, True, {}), ("obs", 1.0, True, [1]), ("obs", 1.0, True)]:
        with pytest.raises(BadEnvironmentResult):
            checked_step(bad)
    for bad in [42, ""]:
        with pytest.raises(BadEnvironmentResult):
            checked_reset(bad)
    # chat messages: dicts of text with a role and a content (a tuple, as msgpack may bring, is fine)
    tool = [{"role": "tool", "content": "42"}]
    assert checked_step((tool, 0.0, False, {})).observation == tool
    assert checked_reset(({"role": "user", "content": "hi", "name": "me"},)) == [
        {"role": "user", "content": "hi", "name": "me"}]
    for bad in [[], [{"role": "tool"}], [{"role": "tool", "content": 42}], ["text"],
                [{"role": "tool", "content": "x", "extra": {"a": 1}}], [{"role": "tool", "content": "x" * 1_000_001}]]:
        with pytest.raises(BadEnvironmentResult, match="not text, chat messages|more than"):
            checked_step((bad, 0.0, False, {}))


def test_environment_specs_resolve_like_rewards():
    assert resolve_environment("calculator") is Calculator
    assert resolve_environment("env_helpers:Echo").__name__ == "Echo"
    assert resolve_environment(f"{HELPERS}:Echo").__name__ == "Echo"
    for spec, why in [("nope", "neither a built-in"), ("no_such_module_xyz:Env", "cannot import module"),
                      ("env_helpers:Missing", "has no callable 'Missing'")]:
        with pytest.raises(ValueError, match=why):
            EnvironmentPool(spec)


def test_an_environment_sees_the_variables_named_for_it_and_no_other(monkeypatch):
    monkeypatch.setenv("SANDBOX_TOKEN", "sandbox-123")
    for names, seen in [((), "unset"), (("SANDBOX_TOKEN",), "sandbox-123")]:
        pool = EnvironmentPool("env_helpers:ReadsVariable", {"name": "SANDBOX_TOKEN"}, step_timeout_s=10,
                               env_names=names)
        try:
            assert [o.observation for o in pool.reset([Problem("p", "a")])] == [seen]
        finally:
            pool.close()


def test_the_pool_steps_environments_in_parallel_processes():
    pool = EnvironmentPool("env_helpers:Echo", {"turns": 2}, step_timeout_s=10)
    try:
        assert [o.observation for o in pool.reset([Problem("p", "a")] * 3)] == [None] * 3
        first = pool.step([0, 1, 2], ["a", "bb", "ccc"])
        assert [o.observation for o in first] == ["<r>1</r>", "<r>2</r>", "<r>3</r>"]
        assert all(o.reward == 0.5 and not o.done and not o.error for o in first)
        last = pool.step([2, 0], ["x", "y"])
        assert all(o.done and o.info == {"seen": 2.0} for o in last)
        pids = {c._proc.pid for c in pool.children}
        assert len(pids) == 3  # one process per slot
        pool.reset([Problem("p", "a")])
        assert pool.children[0]._proc.pid in pids  # processes are reused by later trajectories
        stats = pool.stats()
        assert stats["env_calls_total"] == 9 and stats["env_failures_total"] == 0 and stats["env_seconds_total"] > 0
    finally:
        pool.close()


def test_a_reply_forged_past_the_childs_check_is_checked_again_by_the_pool():
    pool = EnvironmentPool(f"{HELPERS}:Misbehaving", {"reward": 1.0}, step_timeout_s=5.0)
    try:
        pool.reset([Problem("p", "forged"), Problem("p", "ok")])
        forged, ok = pool.step([0, 1], ["answer"] * 2)
        assert "reward is nan, not a finite number" in forged.error and forged.done
        assert not ok.error and pool.stats()["env_failures_total"] == 1
        pool.reset([Problem("p", "ok")])  # the slot's child was replaced: it serves the next trajectory
        assert not pool.step([0], ["answer"])[0].error
    finally:
        pool.close()


def test_each_misbehaving_environment_ends_its_own_trajectory():
    pool = EnvironmentPool(f"{HELPERS}:Misbehaving", {"reward": 1.0}, step_timeout_s=1.0)
    behaviours = ["ok", "hang", "crash", "raise", "garbage", "ok"]
    try:
        resets = pool.reset([Problem("p", how) for how in behaviours])
        assert not any(o.error for o in resets)
        outcomes = pool.step(list(range(6)), ["answer"] * 6)
        assert [bool(o.error) for o in outcomes] == [False, True, True, True, True, False]
        assert outcomes[0] == outcomes[0].__class__(None, 1.0, True, {"steps": 1.0}, outcomes[0].seconds)
        assert "took longer than 1.0s" in outcomes[1].error and "process died" in outcomes[2].error
        assert "raised ValueError: environment bug" in outcomes[3].error and "not (observation" in outcomes[4].error
        stats = pool.stats()
        assert stats["env_failures_total"] == 4 and stats["env_timeouts_total"] == 1
        # The slots of the failed environments serve their next trajectories (dead ones restarted).
        again = pool.reset([Problem("p", "ok")] * 6)
        assert not any(o.error for o in again)
        assert not any(o.error for o in pool.step(list(range(6)), ["answer"] * 6))
        failed_resets = pool.reset([Problem("p", "reset_raise"), Problem("p", "hang_reset"), Problem("p", "ok")])
        assert [bool(o.error) for o in failed_resets] == [True, True, False]
        assert pool.stats()["env_failures_total"] == 6 and pool.stats()["env_timeouts_total"] == 2
    finally:
        pool.close()


@pytest.mark.parametrize("module", ["rollout_workers.environments.child", "rollout_workers.rewards"])
def test_a_child_process_imports_neither_numpy_nor_torch(module):
    """A worker starts one environment process per concurrent trajectory (and reward processes):
    thousands at real sizes, so what each imports is paid that many times."""
    import subprocess
    import sys

    probe = f"import sys, {module}; print(sorted({{'numpy', 'torch'}} & set(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.strip() == "[]"
