"""Tasks (synthetic families, splits, prompt sets), rewards (math answers, both accepted forms,
async, files and modules) and the reward runner that survives hanging, crashing and dying reward
functions. Prompt files and their checks: test_data.py."""
from __future__ import annotations

import sys

import pytest

from rollout_workers.config import RolloutConfig, TaskConfig
from rollout_workers.data import (
    Problem,
    PromptSet,
    heldout_problems,
    mixed_problems,
    synthetic_problems,
    train_prompts,
)
from rollout_workers.rewards import (
    PLAIN_FORM,
    REWARD_ERROR,
    VERL_BATCH_FORM,
    VERL_FORM,
    Reward,
    RewardRunner,
    Scored,
    extract_final_answer,
    math_reward,
    resolve_reward,
    reward_metrics,
    reward_py_modules,
)


def problem(answer, **fields) -> Problem:
    return Problem(prompt="q", answer=answer, **fields)


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
    # a small space is drawn to the end (and no further): both splits together hold every prompt
    for family, difficulty, size in [("add", 1, 100), ("add", 2, 90 * 90), ("reverse", 1, 1000)]:
        both = [p.prompt for split in ("train", "heldout") for p in synthetic_problems(family, difficulty, split, size)]
        assert len(set(both)) == len(both) == size
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


@pytest.mark.parametrize("response,answer,kwargs,expected", [
    ("so #### 72", "72", {}, 1.0),
    ("so #### 1,072 apples", "1072", {}, 1.0),  # strict: the number after the last '#### ', commas out
    ("#### 7 then #### 72", "72", {}, 1.0),
    ("the answer is 72", "72", {}, 0.0),  # strict needs '#### '
    ("so ####72", "72", {}, 0.0),
    ("so #### 72.0", "72", {}, 0.0),  # compared as text, as verl compares
    ("#### 71", "72", {"format_score": 0.1}, 0.1),
    ("#### 72" + "x" * 300, "72", {}, 0.0),  # only the last 300 characters are read
    ("the answer is 72.", "72", {"method": "flexible"}, 0.0),  # flexible: the last run is "72."
    ("the answer is 72 .", "72", {"method": "flexible"}, 1.0),  # a lone "." is passed over
    ("1,072", "1072", {"method": "flexible"}, 0.0),  # flexible keeps the commas
    ("no number", "72", {"method": "flexible", "format_score": 0.1}, 0.0),
    ("#### 72", "72", {"score": 2.0}, 2.0),
    ("only . and .", ".", {"method": "flexible"}, 1.0),  # nothing but "." runs: verl takes the first
])
def test_gsm8k_reward_is_verls_rule(response, answer, kwargs, expected):
    """The built-in gsm8k reward scores as verl's openai/gsm8k rule does (checked against verl's
    own function on 400,000 random texts when this was written)."""
    scored = Reward("gsm8k", kwargs or None)(response, problem(answer))
    assert scored.value == expected and not scored.error


def test_gsm8k_reward_names_a_method_it_does_not_have():
    with pytest.raises(ValueError, match="method is 'loose', not strict or flexible"):
        Reward("gsm8k", {"method": "loose"})("#### 1", problem("1"))


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
        assert [s.value for s in runner.score(["46", "47", "x 46"], problem("46"))] == [1.0, 0.0, 1.0]
        assert runner.stats() == {"reward_calls_total": 3, "reward_failures_total": 0, "reward_timeouts_total": 0}
    finally:
        runner.close()


@pytest.mark.parametrize("spec,reason", [
    ("rollout_helpers:hang", "took longer"),
    ("rollout_helpers:crash", "raised RuntimeError: reward bug"),
    ("rollout_helpers:die", "process died"),
    ("rollout_helpers:not_a_number", "not a finite number"),
    ("rollout_helpers:verl_no_score", "whose 'score' is None"),
])
def test_misbehaving_rewards_score_as_failed_and_are_counted(spec, reason):
    runner = RewardRunner(spec, timeout_s=0.5, failure_reward=-1.0)
    try:
        scored = runner.score(["1", "2"], problem("1"))
        assert [(s.value, s.metrics) for s in scored] == [(-1.0, {})] * 2
        assert all(reason in s.error for s in scored)  # each says why: the sample carries it to the run's log
        stats = runner.stats()
        assert stats["reward_failures_total"] == 2 and reason in runner.last_error
        assert stats["reward_timeouts_total"] == (2 if spec.endswith("hang") else 0)
    finally:
        runner.close()


def test_reward_runner_recovers_after_a_hang():
    """The hung child is killed and replaced; later calls are scored normally."""
    runner = RewardRunner("rollout_helpers:length_reward", timeout_s=0.5)
    try:
        assert runner.score_one("abc", problem("x")).value == 3.0
        first_child = runner._child._proc.pid
        runner._child.args = ["rollout_helpers:hang"]
        runner._child.kill()  # the next call starts a child running the hanging reward
        assert runner.score_one("abc", problem("x")).value == 0.0
        runner._child.args = ["rollout_helpers:length_reward"]
        assert runner.score_one("abcd", problem("x")).value == 4.0
        assert runner._child._proc.pid != first_child and runner.stats()["reward_timeouts_total"] == 1
    finally:
        runner.close()
    with pytest.raises(ValueError, match="timeout_s"):
        RewardRunner("math", timeout_s=0)


def test_both_reward_forms_are_detected_and_called_their_way():
    """etarl's fn(response, answer) gets the answer as text; verl's compute_score gets its four
    keywords with the ground truth as the file held it (here a number)."""
    plain = Reward("rollout_helpers:length_reward")
    assert plain.form == "etarl" and plain("abcd", problem(7)) == Scored(4.0, {})
    assert Reward("math")("the answer is 7", problem(7)).value == 1.0  # 7 -> "7" for the etarl form

    verl = Reward("rollout_helpers:verl_exact")
    assert verl.form == "verl"
    scored = verl("42", problem("42", data_source="demo", extra_info={"index": 3}))
    assert scored.value == 1.0
    # Numbers become reward/<key> metrics; the score itself and a string ("pred") do not.
    assert scored.metrics == {"reward/acc": 1.0, "reward/has_extra": 1.0, "reward/source_is_demo": 1.0}
    assert verl("41", problem("42")).metrics == {"reward/acc": 0.0, "reward/has_extra": 0.0,
                                                  "reward/source_is_demo": 0.0}


@pytest.mark.parametrize("spec", ["rollout_helpers:three_args", "rollout_helpers:verl_batch_needs_more"])
def test_a_wrong_reward_signature_is_refused_with_every_accepted_form(spec):
    with pytest.raises(ValueError) as err:
        Reward(spec)
    message = str(err.value)
    assert f"{spec.split(':')[1]}(" in message
    assert PLAIN_FORM in message and VERL_FORM in message and VERL_BATCH_FORM in message
    with pytest.raises(ValueError, match="fits no accepted form"):
        RewardRunner(spec)  # the runner refuses it in its caller, before any child


def test_a_verl_batch_reward_scores_a_group_in_one_call():
    reward = Reward("rollout_helpers:verl_batch_exact")
    assert reward.form == "verl batch" and reward.batch
    assert reward("42", problem("42", data_source="demo")).metrics == {
        "reward/batch_size": 1.0, "reward/source_is_demo": 1.0, "reward/has_extra": 0.0}
    runner = RewardRunner("rollout_helpers:verl_batch_exact", timeout_s=30, kwargs={"bonus": 0.5})
    try:
        scored = runner.score(["42", "41", "42"], problem("42", data_source="demo", extra_info={"index": 1}))
        assert [s.value for s in scored] == [1.5, 0.5, 1.5], runner.last_error
        assert all(s.metrics == {"reward/batch_size": 3.0, "reward/source_is_demo": 1.0, "reward/has_extra": 1.0}
                   for s in scored)  # one call held all three
        assert runner.score_one("7", problem("7")).value == 1.5  # etarl eval's path: a call of one
        assert runner.score([], problem("7")) == []
        assert runner.stats() == {"reward_calls_total": 4, "reward_failures_total": 0, "reward_timeouts_total": 0}
    finally:
        runner.close()


def test_a_verl_batch_reward_that_misbehaves_fails_its_responses_and_the_runner_goes_on():
    runner = RewardRunner("rollout_helpers:verl_batch_misbehaves", timeout_s=1, failure_reward=-1.0)
    try:
        # a value that is no number fails its own response only
        assert [s.value for s in runner.score(["a", "poison", "b"], problem(""))] == [1.0, -1.0, 1.0]
        assert "not a finite number" in runner.last_error and runner.stats()["reward_failures_total"] == 1
        assert [s.value for s in runner.score(["array", "b"], problem(""))] == [1.0, 1.0], runner.last_error
        # a wrong count, an exception or a hang fails every response of the call
        assert [s.value for s in runner.score(["a", "short", "b"], problem(""))] == [-1.0] * 3
        assert "returned 2 values for 3 responses" in runner.last_error, runner.last_error
        assert [s.value for s in runner.score(["raise", "b"], problem(""))] == [-1.0] * 2
        assert "raised RuntimeError: the sandbox is down" in runner.last_error, runner.last_error
        failed = runner.stats()["reward_failures_total"]
        assert [s.value for s in runner.score(["hang", "b"], problem(""))] == [-1.0] * 2
        assert "took longer than 2s (1s for each of its 2 responses)" in runner.last_error, runner.last_error
        assert runner.stats()["reward_timeouts_total"] == 2 and runner.stats()["reward_failures_total"] == failed + 2
        assert [s.value for s in runner.score(["a", "b"], problem(""))] == [1.0, 1.0], runner.last_error
    finally:
        runner.close()


def test_async_rewards_are_awaited_in_process_and_in_the_reward_child():
    assert Reward("rollout_helpers:async_length")("abc", problem("")).value == 3.0
    assert Reward("rollout_helpers:async_verl_exact")("7", problem("7")).value == 1.0
    runner = RewardRunner("rollout_helpers:async_verl_exact", timeout_s=5)
    try:
        assert [s.value for s in runner.score(["7", "8"], problem("7"))] == [1.0, 0.0]
        assert runner.stats()["reward_failures_total"] == 0
    finally:
        runner.close()


def test_verl_metrics_travel_through_the_reward_child():
    runner = RewardRunner("rollout_helpers:verl_exact", timeout_s=5)
    try:
        scored = runner.score(["x", "y"], problem("x", data_source="demo", extra_info={"k": [1, 2]}))
        assert [s.value for s in scored] == [1.0, 0.0]
        assert scored[0].metrics["reward/acc"] == 1.0 and scored[0].metrics["reward/has_extra"] == 1.0
        assert scored[1].metrics["reward/acc"] == 0.0
    finally:
        runner.close()


KWARGS_REWARD = '''
def compute_score(data_source, solution_str, ground_truth, extra_info=None, scale=1.0, bonus=None):
    return {"score": scale * float(solution_str.strip() == str(ground_truth)), "bonus": bonus["n"]}
'''


def test_reward_kwargs_reach_the_reward_in_its_process_and_a_keyword_it_lacks_fails_at_start(tmp_path):
    """verl's custom_reward_function.reward_kwargs: keyword arguments beside the response and its
    reference (JSON values: they cross to the reward's process)."""
    path = tmp_path / "kw_reward.py"
    path.write_text(KWARGS_REWARD)
    rollout = RolloutConfig(reward=f"{path}:compute_score", reward_kwargs={"scale": 0.5, "bonus": {"n": 3}})
    runner = RewardRunner.for_rollout(rollout)
    try:
        scored = runner.score(["5", "6"], problem("5"))
        assert [s.value for s in scored] == [0.5, 0.0] and scored[0].metrics == {"reward/bonus": 3.0}
    finally:
        runner.close()
    with pytest.raises(ValueError, match=r"cannot take rollout.reward_kwargs \['typo'\]"):
        RewardRunner(f"{path}:compute_score", kwargs={"typo": 1})
    # A parameter only reward_kwargs fills is not missing; a verl keyword they name, they set (as in verl).
    (tmp_path / "needs.py").write_text("def compute_score(data_source, solution_str, ground_truth, *, scale):\n"
                                       "    return scale * (solution_str == ground_truth)\n"
                                       "def plain(response, answer, scale):\n    return scale * (response == answer)\n")
    assert Reward(f"{tmp_path / 'needs.py'}:compute_score", {"scale": 2.0})("5", problem("5")).value == 2.0
    assert Reward(f"{tmp_path / 'needs.py'}:plain", {"scale": 3.0})("5", problem("5")).value == 3.0
    assert Reward(f"{tmp_path / 'needs.py'}:compute_score", {"scale": 1.0, "ground_truth": "6"})(
        "6", problem("5")).value == 1.0
    with pytest.raises(ValueError, match="cannot take rollout.reward_kwargs"):  # etarl's form: its two are its own
        Reward(f"{tmp_path / 'needs.py'}:plain", {"scale": 1.0, "answer": "6"})
    assert Reward("exact", None)("5", problem("5")).value == 1.0  # none: called as before
    with pytest.raises(ValueError, match="must be JSON values"):
        RolloutConfig(reward_kwargs={"f": object()})


REWARD_FILE = '''
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    return {"score": float(solution_str.strip() == str(ground_truth)), "chars": len(solution_str)}
'''


def test_a_reward_file_is_loaded_from_its_path_or_as_its_shipped_module(tmp_path, monkeypatch):
    path = tmp_path / "my_verl_reward.py"
    path.write_text(REWARD_FILE)
    reward = Reward(f"{path}:compute_score")
    assert reward.form == "verl" and reward(" 5", problem(5)) == Scored(1.0, {"reward/chars": 2.0})
    assert reward_py_modules(f"{path}:compute_score") == [str(path)]
    # On a node without the path, the module of the same name (shipped in py_modules) is used.
    shipped = tmp_path / "shipped"
    shipped.mkdir()
    (shipped / "my_verl_reward.py").write_text(REWARD_FILE)
    monkeypatch.syspath_prepend(str(shipped))
    assert Reward(f"{tmp_path / 'elsewhere' / 'my_verl_reward.py'}:compute_score")("5", problem("5")).value == 1.0
    with pytest.raises(ValueError, match="does not exist"):
        Reward(f"{tmp_path / 'no_such_reward_file.py'}:compute_score")
    (tmp_path / "broken.py").write_text("def compute_score(:\n")
    with pytest.raises(ValueError, match="loading .*broken.py.* failed: SyntaxError"):
        Reward(f"{tmp_path / 'broken.py'}:compute_score")


def test_reward_code_that_must_travel_to_the_workers(tmp_path, monkeypatch):
    """A module outside any installed location travels (its file, or its top-level package);
    built-ins, installed packages and etarl's own modules do not."""
    (tmp_path / "loose_reward_mod.py").write_text(REWARD_FILE)
    package = tmp_path / "reward_pkg_x" / "scoring"
    package.mkdir(parents=True)
    (package.parent / "__init__.py").write_text("")
    (package / "__init__.py").write_text(REWARD_FILE)
    monkeypatch.syspath_prepend(str(tmp_path))
    assert reward_py_modules("loose_reward_mod:compute_score") == [str(tmp_path / "loose_reward_mod.py")]
    assert reward_py_modules("reward_pkg_x.scoring:compute_score") == [str(tmp_path / "reward_pkg_x")]
    assert Reward("reward_pkg_x.scoring:compute_score")("1", problem(1)).value == 1.0
    assert reward_py_modules("math") == []
    assert reward_py_modules("json:loads") == []  # the standard library
    assert reward_py_modules("pytest:approx") == []  # an installed package
    assert reward_py_modules("rollout_workers.rewards:math_reward") == []  # etarl itself
    for name in ("loose_reward_mod", "reward_pkg_x", "reward_pkg_x.scoring"):
        sys.modules.pop(name, None)


def test_reward_metrics_are_averaged_over_the_samples_that_carry_them():
    import numpy as np

    from buffer.sample import Group, Sample

    def sample(metadata):
        return Sample(sample_id=f"s{len(metadata)}{sorted(metadata.items())}", group_id="g",
                      prompt_ids=np.ones(2, np.int32), response_ids=np.ones(1, np.int32),
                      rollout_log_probs=np.zeros(1, np.float32), loss_mask=np.ones(1, np.uint8), reward=0.0,
                      weight_version=0, metadata=metadata)

    groups = [Group("g", [sample({"reward/acc": 1.0, "ticket": 1}), sample({"reward/acc": 0.0})], 0),
              Group("h", [sample({"reward/acc": 1.0, "reward/len": 4.0}), sample({"family": "add"})], 1)]
    assert reward_metrics(groups) == {"reward/acc": pytest.approx(2 / 3), "reward/len": 4.0,
                                      "reward/failure_fraction": 0.0}
    # a sample whose reward failed carries why, and counts among all the step's samples
    groups.append(Group("f", [sample({REWARD_ERROR: "reward 'r:f' raised ValueError: bad"})], 2))
    assert reward_metrics(groups)["reward/failure_fraction"] == pytest.approx(1 / 5)
    assert reward_metrics([]) == {}
