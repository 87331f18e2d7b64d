"""Tasks (synthetic families, splits, prompt files), rewards (math answers, pluggable functions)
and the reward runner that survives hanging, crashing and dying reward functions."""
from __future__ import annotations

import json

import pytest

from rollout_workers.config import TaskConfig
from rollout_workers.rewards import RewardRunner, extract_final_answer, math_reward, resolve_reward
from rollout_workers.tasks import (
    PromptSet,
    heldout_problems,
    load_prompt_file,
    mixed_problems,
    synthetic_problems,
    train_prompts,
)


@pytest.mark.parametrize("family", ["add", "reverse"])
def test_synthetic_families_are_correct_deterministic_and_split(family):
    train = synthetic_problems(family, 3, "train", 300, seed=5)
    heldout = synthetic_problems(family, 3, "heldout", 100, seed=5)
    assert len(train) == 300 and len(heldout) == 100
    assert synthetic_problems(family, 3, "train", 300, seed=5) == train
    assert synthetic_problems(family, 3, "train", 300, seed=6) != train
    assert not {p.prompt for p in train} & {p.prompt for p in heldout}
    for p in train[:50]:
        if family == "add":
            a, b = p.prompt[:-1].split("+")
            assert len(a) == len(b) == 3 and int(p.answer) == int(a) + int(b)
        else:
            word = p.prompt[len("rev:") : -1]
            assert len(word) == 5 and p.answer == word[::-1]


def test_difficulty_levels_mix_and_small_spaces():
    one_digit = synthetic_problems("add", 1, "train", 1000)
    assert 50 < len(one_digit) < 100  # only 100 one-digit sums exist, ~10% held out
    mixed = mixed_problems(["add", "reverse"], [1, 2], "train", 40)
    assert [(p.family, p.difficulty) for p in mixed[:4]] == [("add", 1), ("add", 2), ("reverse", 1), ("reverse", 2)]
    with pytest.raises(ValueError, match="unknown task family"):
        synthetic_problems("sort", 1, "train", 5)
    with pytest.raises(ValueError, match="split"):
        synthetic_problems("add", 1, "test", 5)


def test_prompt_set_wraps_tickets_and_configs_build_sets():
    problems = mixed_problems(["add"], [2], "train", 5)
    prompts = PromptSet(problems)
    assert prompts.problem(7) == problems[2]
    with pytest.raises(ValueError, match="ticket"):
        prompts.problem(-1)
    task = TaskConfig(families=["add", "reverse"], difficulties=[2], num_prompts=30)
    train, held = train_prompts(task), heldout_problems(task, 20)
    assert len(train) == 30 and len(held) == 20
    assert not {p.prompt for p in train.problems} & {p.prompt for p in held}


def test_prompt_files_jsonl_and_parquet(tmp_path):
    rows = [{"question": "What is 2+2?", "solution": "4"}, {"question": "3*3?", "solution": 9}]
    jsonl = tmp_path / "p.jsonl"
    jsonl.write_text("\n".join(json.dumps(r) for r in rows) + "\n\n")
    problems = load_prompt_file(jsonl, "question", "solution")
    assert [(p.prompt, p.answer) for p in problems] == [("What is 2+2?", "4"), ("3*3?", "9")]

    import pyarrow as pa
    import pyarrow.parquet as pq

    parquet = tmp_path / "p.parquet"
    pq.write_table(pa.Table.from_pylist([{"prompt": "1+1=", "answer": "2"}]), parquet)
    assert load_prompt_file(parquet)[0].answer == "2"
    task = TaskConfig(kind="file", path=str(parquet))
    assert len(train_prompts(task)) == 1
    with pytest.raises(ValueError, match="heldout_path"):
        heldout_problems(task, 5)

    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "x", "answer": "1"}\n{oops\n')
    with pytest.raises(ValueError, match="bad.jsonl:2"):
        load_prompt_file(bad)
    missing_answer = tmp_path / "m.jsonl"
    missing_answer.write_text('{"prompt": "x"}\n')
    with pytest.raises(ValueError, match="row 1 has no 'answer'"):
        load_prompt_file(missing_answer)
    with pytest.raises(FileNotFoundError):
        load_prompt_file(tmp_path / "nope.jsonl")
    with pytest.raises(ValueError, match=".jsonl or .parquet"):
        load_prompt_file(bad.rename(tmp_path / "p.csv"))


@pytest.mark.parametrize("response,answer,expected", [
    ("46", "46", 1.0),
    ("46<eos>", "46", 1.0),
    ("45", "46", 0.0),
    ("", "46", 0.0),
    ("first 12, then the answer is 1,234.0", "1234", 1.0),
    ("work... #### 7\n", "7", 1.0),
    (r"so \boxed{1/2}", "0.5", 1.0),
    ("the total is 15 and 16", "16", 1.0),  # the last number is the final answer
    ("the total is 16 and 15", "16", 0.0),
    ("-3", "-3", 1.0),
    ("cba", "cba", 1.0),  # a non-numeric reference is compared as text
    ("cab", "cba", 0.0),
])
def test_math_reward(response, answer, expected):
    assert math_reward(response, answer) == expected


def test_extract_final_answer_prefers_explicit_markers():
    assert extract_final_answer(r"3 then \boxed{42} then 7") == "42"
    assert extract_final_answer("no numbers") is None


def test_resolve_reward_errors_name_the_problem():
    assert resolve_reward("math") is math_reward
    assert resolve_reward("rollout_helpers:length_reward")("abc", "") == 3.0
    with pytest.raises(ValueError, match="neither a built-in"):
        resolve_reward("nonsense")
    with pytest.raises(ValueError, match="cannot import module"):
        resolve_reward("no_such_module_xyz:f")
    with pytest.raises(ValueError, match="no callable 'missing'"):
        resolve_reward("rollout_helpers:missing")


def test_reward_runner_scores_in_a_child_process():
    runner = RewardRunner("math", timeout_s=5)
    try:
        assert runner.score(["46", "47", "x 46"], "46") == [1.0, 0.0, 1.0]
        assert runner.stats() == {"reward_calls_total": 3, "reward_failures_total": 0, "reward_timeouts_total": 0}
    finally:
        runner.close()


@pytest.mark.parametrize("spec,reason", [
    ("rollout_helpers:hang", "took longer"),
    ("rollout_helpers:crash", "raised RuntimeError: reward bug"),
    ("rollout_helpers:die", "process died"),
    ("rollout_helpers:not_a_number", "not a finite number"),
])
def test_misbehaving_rewards_score_as_failed_and_are_counted(spec, reason):
    runner = RewardRunner(spec, timeout_s=0.5, failure_reward=-1.0)
    try:
        assert runner.score(["1", "2"], "1") == [-1.0, -1.0]
        stats = runner.stats()
        assert stats["reward_failures_total"] == 2 and reason in runner.last_error
        assert stats["reward_timeouts_total"] == (2 if spec.endswith("hang") else 0)
    finally:
        runner.close()


def test_reward_runner_recovers_after_a_hang():
    """The hung child is killed and replaced; later calls are scored normally."""
    runner = RewardRunner("rollout_helpers:length_reward", timeout_s=0.5)
    try:
        assert runner.score(["abc"], "") == [3.0]
        first_child = runner._proc.pid
        runner.spec = "rollout_helpers:hang"
        runner._kill()  # the next call starts a child running the hanging reward
        assert runner.score(["abc"], "") == [0.0]
        runner.spec = "rollout_helpers:length_reward"
        assert runner.score(["abcd"], "") == [4.0]
        assert runner._proc.pid != first_child and runner.stats()["reward_timeouts_total"] == 1
    finally:
        runner.close()
    with pytest.raises(ValueError, match="timeout_s"):
        RewardRunner("math", timeout_s=0)
