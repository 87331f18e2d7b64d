"""What a run takes from its user is checked when it starts, before Ray or any actor: unusable
prompt rows are listed (file, row number, why) and refused, or skipped with skip_invalid; a reward
that cannot be imported or has a wrong signature stops the run with both accepted forms shown;
a held-out set is needed when evaluation is on. And a reward module that is not installed is put
in the Ray job's py_modules so the workers of any cluster can import it."""
from __future__ import annotations

import json
import logging

import pytest

from services.cli import EXIT_CONFIG_ERROR, main
from services.config import ConfigError, load_config
from services.inputs import (check_eval_inputs, check_prompt_room, check_run_inputs, prompt_format, ray_runtime_env,
                             with_epochs)

GOOD_REWARD = "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n    return 1.0\n"


def write_rows(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def file_config(tiny_model_dir, tmp_path, *overrides):
    rows = [{"prompt": "12+3=", "answer": "15"}, {"prompt": "1+1="}, {"prompt": "", "answer": "0"},
            {"prompt": "3+4=", "answer": "7"}]
    train = write_rows(tmp_path / "train.jsonl", rows)
    return load_config(None, [f"run.model={tiny_model_dir}", "rollout.task.kind=file", f"rollout.task.path={train}",
                              "eval.enabled=false", "rollout.reward=math", *overrides])


def train(tiny_model_dir, tmp_path, *overrides) -> int:
    return main(["train", f"run.model={tiny_model_dir}", f"run.run_dir={tmp_path / 'run'}", "run.progress=false",
                 *overrides])


def test_a_run_with_unusable_prompt_rows_does_not_start_and_lists_them(tiny_model_dir, tmp_path, capsys):
    cfg = file_config(tiny_model_dir, tmp_path)
    with pytest.raises(ConfigError) as refused:
        check_run_inputs(cfg, tiny_model_dir)
    message = str(refused.value)
    path = cfg.rollout.task.path
    assert message.startswith("rollout.task.path: prompt file has unusable rows, the run does not start")
    assert f"{path} row 2: no answer ('answer'" in message and f"{path} row 3: empty prompt" in message
    # Through `etarl train`: exit 2 and the same listing, and nothing was started.
    code = train(tiny_model_dir, tmp_path, "rollout.task.kind=file", f"rollout.task.path={path}",
                 "eval.enabled=false")
    err = capsys.readouterr().err
    assert code == EXIT_CONFIG_ERROR and f"{path} row 2: no answer" in err
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_skip_invalid_starts_with_the_usable_rows_and_logs_the_others(tiny_model_dir, tmp_path, caplog):
    cfg = file_config(tiny_model_dir, tmp_path, "rollout.task.skip_invalid=true")
    with caplog.at_level(logging.INFO):
        check_run_inputs(cfg, tiny_model_dir)
    text = caplog.text
    assert "skipping 2 unusable rows" in text and "row 2: no answer" in text
    assert "4 rows, 2 usable, 2 unusable" in text and "tokens per prompt: p50" in text
    assert text.count("row 2: no answer") == 1  # listed once, where they are skipped
    assert "reward math (etarl form)" in text


def test_several_prompt_files_are_checked_each_under_its_own_key(tiny_model_dir, tmp_path, caplog):
    good = write_rows(tmp_path / "more.jsonl", [{"prompt": "2+2=", "answer": "4"}])
    bad = write_rows(tmp_path / "bad.jsonl", [{"prompt": "5+5=", "answer": "10"}, {"prompt": "6+6="}])
    cfg = load_config(None, [f"run.model={tiny_model_dir}", "rollout.task.kind=file",
                             f"rollout.task.path=[{good}, {bad}]", f"rollout.task.heldout_path=[{good}]",
                             "rollout.reward=math"])
    assert cfg.rollout.task.path == [str(good), str(bad)]
    with pytest.raises(ConfigError) as refused:
        check_run_inputs(cfg, tiny_model_dir)
    assert str(refused.value).startswith("rollout.task.path[1]: prompt file has unusable rows")
    assert f"{bad} row 2: no answer" in str(refused.value)
    cfg = cfg.model_copy(update={"rollout": cfg.rollout.model_copy(update={
        "task": cfg.rollout.task.model_copy(update={"skip_invalid": True})})})
    with caplog.at_level(logging.INFO):
        check_run_inputs(cfg, tiny_model_dir)
    assert f"{good}: 1 rows, 1 usable" in caplog.text and f"{bad}: 2 rows, 1 usable, 1 unusable" in caplog.text
    with pytest.raises(ConfigError, match=r"rollout.task.path: .*at least one file"):
        load_config(None, [f"run.model={tiny_model_dir}", "rollout.task.kind=file", "rollout.task.path=[]"])


def test_a_prompt_too_long_for_the_engine_is_refused(tiny_model_dir, tmp_path):
    fits = file_config(tiny_model_dir, tmp_path, "rollout.task.skip_invalid=true", "rollout.engine.max_model_len=12",
                       "rollout.sampling.max_new_tokens=7")
    check_run_inputs(fits, tiny_model_dir)  # "12+3=" (5 tokens) + 7 fits in 12
    too_long = file_config(tiny_model_dir, tmp_path, "rollout.task.skip_invalid=true",
                           "rollout.engine.max_model_len=12", "rollout.sampling.max_new_tokens=8")
    too_long.rollout.task.skip_invalid = False
    with pytest.raises(ConfigError) as refused:
        check_run_inputs(too_long, tiny_model_dir)
    assert "row 1: prompt of 5 tokens + max_new_tokens 8 exceeds the engine's context of 12 tokens" in str(refused.value)
    assert "row 4:" not in str(refused.value)  # "3+4=": 4 + 8 fits


def test_a_max_new_tokens_that_leaves_the_built_in_prompts_no_room_is_refused(tiny_model_dir, tmp_path, capsys):
    """The default task's prompts ("rev:abcde=") are up to 10 tokens of the tiny model's 64: with more
    than 54 new tokens the engine would refuse each of them and the run wait for samples forever
    (it did, silently); the start says so instead, for the rollout's budget and the evaluation's."""
    model = f"run.model={tiny_model_dir}"
    check_run_inputs(load_config(None, [model, "rollout.sampling.max_new_tokens=54"]), tiny_model_dir)
    assert train(tiny_model_dir, tmp_path, "rollout.sampling.max_new_tokens=55") == EXIT_CONFIG_ERROR
    assert ("rollout.sampling.max_new_tokens=55 leaves 9 of the context's 64 tokens for a prompt, too few for the "
            "task's prompts (up to 10 tokens)") in capsys.readouterr().err
    with pytest.raises(ConfigError, match=r"^eval.max_new_tokens=64 leaves 0 of .* at most 54, or give the engine a "
                                          r"longer context \(rollout.engine.max_model_len\)$"):
        check_eval_inputs(load_config(None, [model, "eval.max_new_tokens=64"]), tiny_model_dir)
    check_run_inputs(load_config(None, [model, "rollout.sampling.max_new_tokens=60", "rollout.task.truncation=left"]),
                     tiny_model_dir)  # asked for: the prompts are cut to the 4 tokens left
    with pytest.raises(ConfigError, match=r"^rollout.sampling.max_new_tokens=64 leaves 0 .* too few for any prompt"):
        check_run_inputs(file_config(tiny_model_dir, tmp_path, "rollout.sampling.max_new_tokens=64"), tiny_model_dir)
    # multi-turn: a turn asks for what its trajectory has left, so only the prompt must fit
    turns = ["rollout.multi_turn.environment=calculator", "rollout.sampling.max_new_tokens=100"]
    long_turns = load_config(None, [model, *turns])
    check_prompt_room(long_turns, prompt_format(long_turns, tiny_model_dir))
    short = load_config(None, [model, *turns, "rollout.multi_turn.max_total_tokens=9"])
    with pytest.raises(ConfigError, match=r"^the task's prompts \(up to 10 tokens\) fill the trajectory's context of 9"):
        check_prompt_room(short, prompt_format(short, tiny_model_dir))
    assert not (tmp_path / "run").exists(), "nothing started"


def test_groups_of_one_under_a_group_baseline_are_said_once_at_start(tiny_model_dir, caplog):
    """n=1 runs under grpo as verl's does (baseline 0: the raw reward), but the start says what that
    means; an estimator with a baseline of its own says nothing, nor does a group."""
    model = f"run.model={tiny_model_dir}"
    cases = ((["rollout.sampling.n=1"], 1), (["rollout.sampling.n=1", "learner.advantage.estimator=gae"], 0),
             (["rollout.sampling.n=2"], 0))
    for overrides, said in cases:
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="etarl"):
            check_run_inputs(load_config(None, [model, *overrides]), tiny_model_dir)
        warned = [r.getMessage() for r in caplog.records if "a group of one has none" in r.getMessage()]
        assert len(warned) == said, (overrides, caplog.text)
        assert all(w.startswith("rollout.sampling.n=1: learner.advantage.estimator=grpo takes") for w in warned)


def test_a_critic_that_trains_alone_for_the_whole_run_is_said_at_start(tiny_model_dir, tmp_path, caplog):
    """gae with critic.train_alone_steps >= the run's steps trains the critic only: said once, the run
    goes on; a run longer than that, or without a critic, says nothing. With run.epochs the steps are
    known once the prompts are counted (with_epochs)."""
    gae = [f"run.model={tiny_model_dir}", "learner.advantage.estimator=gae", "learner.critic.train_alone_steps=20"]
    cases = ((["run.steps=20"], 1), (["run.steps=21"], 0), (["run.steps=20", "learner.advantage.estimator=grpo"], 0))
    for overrides, said in cases:
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="etarl"):
            check_run_inputs(load_config(None, [*gae, *overrides]), tiny_model_dir)
        warned = [r.getMessage() for r in caplog.records if "the policy never does" in r.getMessage()]
        assert len(warned) == said, (overrides, caplog.text)
        assert all(w.startswith("learner.critic.train_alone_steps=20 covers the run's 20 steps: the critic trains "
                                "alone") for w in warned)
    train = write_rows(tmp_path / "train.jsonl", [{"prompt": f"{i}+1=", "answer": str(i + 1)} for i in range(8)])
    cfg = load_config(None, [*gae, "rollout.task.kind=file", f"rollout.task.path={train}", "eval.enabled=false",
                             "rollout.reward=math", "buffer.gate.batch_size=4", "run.epochs=3"])
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="etarl"):
        assert with_epochs(cfg, check_run_inputs(cfg, tiny_model_dir)).run.steps == 6
    assert "learner.critic.train_alone_steps=20 covers the run's 6 steps" in caplog.text


@pytest.mark.parametrize("reward, needle", [
    ("wrong_sig.py:compute_score", "fits no accepted form"),
    ("no_such_reward_module_xyz:compute_score", "cannot import module 'no_such_reward_module_xyz'"),
    ("missing_file.py:compute_score", "does not exist"),
    ("good.py:score_fn", "has no callable 'score_fn'"),
])
def test_a_bad_reward_stops_the_run_at_start(tiny_model_dir, tmp_path, capsys, reward, needle):
    (tmp_path / "wrong_sig.py").write_text("def compute_score(solution_str, ground_truth, tokenizer):\n    return 0\n")
    (tmp_path / "good.py").write_text(GOOD_REWARD)
    spec = f"{tmp_path}/{reward}" if ".py:" in reward else reward
    assert train(tiny_model_dir, tmp_path, f"rollout.reward={spec}") == EXIT_CONFIG_ERROR
    err = capsys.readouterr().err
    assert "rollout.reward:" in err and needle in err
    if "fits no accepted" in needle:
        assert "fn(response, answer)" in err and "compute_score(data_source, solution_str, ground_truth" in err


def test_a_tools_run_checks_its_tools_and_their_reward_at_start(tiny_model_dir, tmp_path, caplog):
    documented = 'def double(x: int) -> int:\n    """Twice x.\n\n    Args:\n        x: A number.\n    """\n    return 2 * x\n'
    (tmp_path / "good_tools.py").write_text(documented)
    (tmp_path / "bad_tools.py").write_text("def undocumented(x):\n    return x\n")
    base = ["rollout.multi_turn.environment=tools", "rollout.task.skip_invalid=true"]
    path = "rollout.multi_turn.environment_kwargs.path"
    good = file_config(tiny_model_dir, tmp_path, *base, f"{path}={tmp_path}/good_tools.py")
    with caplog.at_level(logging.WARNING, logger="etarl"):
        check_run_inputs(good, tiny_model_dir)  # starts: its tools load, their schemas go to the template
    # the tiny model's template does not show the tools: said, the run still starts
    assert any("does not show the tools to the model" in r.getMessage() for r in caplog.records)
    assert good.rollout.environment_arguments() == {"path": f"{tmp_path}/good_tools.py", "max_tool_turns": 3,
                                                    "reward": "math", "reward_kwargs": {}}
    bad = file_config(tiny_model_dir, tmp_path, *base, f"{path}={tmp_path}/bad_tools.py")
    with pytest.raises(ConfigError, match="rollout.multi_turn: .*undocumented.*type hints and a docstring"):
        check_run_inputs(bad, tiny_model_dir)
    wrong_reward = file_config(tiny_model_dir, tmp_path, *base, "rollout.multi_turn.environment_kwargs.reward=nope",
                               f"{path}={tmp_path}/good_tools.py")
    with pytest.raises(ConfigError, match="rollout.multi_turn: reward 'nope' is neither a built-in"):
        check_run_inputs(wrong_reward, tiny_model_dir)


def test_evaluation_needs_a_heldout_file(tiny_model_dir, tmp_path):
    cfg = file_config(tiny_model_dir, tmp_path, "rollout.task.skip_invalid=true", "eval.enabled=true")
    with pytest.raises(ConfigError, match="rollout.task.heldout_path is unset"):
        check_run_inputs(cfg, tiny_model_dir)
    held = write_rows(tmp_path / "held.jsonl", [{"prompt": "5+5=", "answer": "10"}, {"prompt": "1+2="}])
    cfg.rollout.task.heldout_path = str(held)
    cfg.rollout.task.skip_invalid = False
    with pytest.raises(ConfigError, match="rollout.task.path: prompt file has unusable rows"):
        check_run_inputs(cfg, tiny_model_dir)
    cfg.rollout.task.path = str(held)
    with pytest.raises(ConfigError, match=f"{held} row 2: no answer"):
        check_run_inputs(cfg, tiny_model_dir)


def test_a_missing_chat_template_file_is_named(tiny_model_dir, tmp_path):
    cfg = file_config(tiny_model_dir, tmp_path, f"rollout.task.chat_template={tmp_path / 'nope.jinja'}")
    with pytest.raises(ConfigError, match="rollout.task.chat_template: .*nope.jinja.* neither auto, none nor a Jinja"):
        check_run_inputs(cfg, tiny_model_dir)


def test_a_reward_module_that_is_not_installed_travels_in_the_job(tmp_path, monkeypatch):
    (tmp_path / "travelling_reward_mod.py").write_text(GOOD_REWARD)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delenv("RAY_JOB_CONFIG_JSON_ENV_VAR", raising=False)
    monkeypatch.delenv("RAY_OVERRIDE_JOB_RUNTIME_ENV", raising=False)
    cfg = load_config(None, ["rollout.reward=travelling_reward_mod:compute_score"])
    module = str(tmp_path / "travelling_reward_mod.py")
    assert ray_runtime_env(cfg, {"OMP_NUM_THREADS": "1"}) == {"env_vars": {"OMP_NUM_THREADS": "1"},
                                                            "py_modules": [module]}
    assert ray_runtime_env(load_config(None, ["rollout.reward=math"])) is None
    # Inside `ray job submit` with py_modules of its own: both lists, and Ray told to take ours, which
    # keeps the job's other fields (its env_vars: a judge's key named in rollout.reward_env)
    job = {"runtime_env": {"py_modules": ["gcs://_ray_pkg_abc.zip"], "env_vars": {"A": "1"}, "pip": ["x"]}}
    monkeypatch.setenv("RAY_JOB_CONFIG_JSON_ENV_VAR", json.dumps(job))
    assert ray_runtime_env(cfg) == {"py_modules": ["gcs://_ray_pkg_abc.zip", module], "env_vars": {"A": "1"},
                                    "pip": ["x"]}
    assert ray_runtime_env(cfg, {"B": "2"})["env_vars"] == {"A": "1", "B": "2"}
    import os

    assert os.environ["RAY_OVERRIDE_JOB_RUNTIME_ENV"] == "1"
    # A job whose working_dir (the driver's cwd) holds the module ships it already.
    monkeypatch.setenv("RAY_JOB_CONFIG_JSON_ENV_VAR", json.dumps({"runtime_env": {"working_dir": "gcs://_ray_pkg_w.zip"}}))
    monkeypatch.chdir(tmp_path)
    assert ray_runtime_env(cfg) is None


def test_a_context_longer_than_the_models_is_refused_before_the_engine_refuses_it(tiny_model_dir, tmp_path):
    good = write_rows(tmp_path / "good.jsonl", [{"prompt": "1+1=", "answer": "2"}])
    with pytest.raises(ConfigError, match=r"^rollout.engine.max_model_len=96 is longer than the model's context "
                                          r"\(64 tokens, its config.json\)"):
        check_run_inputs(load_config(None, [f"run.model={tiny_model_dir}", "rollout.task.kind=file",
                                            f"rollout.task.path={good}", "eval.enabled=false",
                                            "rollout.engine.max_model_len=96"]), tiny_model_dir)
    stretched = tmp_path / "stretched"  # RoPE scaling (YaRN): the engine may serve more than the config's 64
    stretched.mkdir()
    for item in tiny_model_dir.iterdir():
        if item.is_file():
            (stretched / item.name).symlink_to(item)
    config = json.loads((tiny_model_dir / "config.json").read_text())
    (stretched / "config.json").unlink()
    (stretched / "config.json").write_text(json.dumps({**config, "rope_scaling": {"rope_type": "yarn", "factor": 2.0}}))
    check_run_inputs(load_config(None, [f"run.model={stretched}", "rollout.task.kind=file", f"rollout.task.path={good}",
                                        "eval.enabled=false", "rollout.engine.max_model_len=96"]), stretched)


def test_data_check_refuses_the_environment_a_run_would_refuse_naming_the_key_meant(tiny_model_dir, tmp_path, capsys):
    good = write_rows(tmp_path / "good.jsonl", [{"prompt": "1+1=", "answer": "2"}])
    tools = tmp_path / "tools.py"
    tools.write_text("def add(a: int, b: int) -> int:\n    '''Add.\n\n    Args:\n        a: One.\n        b: Two.\n"
                     "    '''\n    return a + b\n")
    code = main(["data", "check", str(good), f"run.model={tiny_model_dir}", "rollout.multi_turn.environment=tools",
                 f"rollout.multi_turn.environment_kwargs.path={tools}",
                 "rollout.multi_turn.environment_kwargs.max_tool_turn=2"])
    err = capsys.readouterr().err
    assert code == EXIT_CONFIG_ERROR
    assert "rollout.multi_turn: environment_kwargs.max_tool_turn: not an argument of the environment (did you mean " \
           "max_tool_turns?); it takes path, config, reward" in err


def test_rows_the_verl_reward_cannot_score_are_bad_rows_refused_or_skipped_before_an_engine(tiny_model_dir, tmp_path,
                                                                                           capsys):
    def row(source, answer="4"):
        return {"prompt": [{"role": "user", "content": "2+2?"}], "data_source": source,
                "reward_model": {"style": "rule", "ground_truth": answer}}

    scorable = write_rows(tmp_path / "gsm8k.jsonl", [row("openai/gsm8k"), row("aime24"), row("lighteval/MATH")])
    mixed = write_rows(tmp_path / "mixed.jsonl", [row("openai/gsm8k"), row("taco"), row("my_set"),
                                                  row("my_set"), row("lighteval/MATH", answer=4)])
    cfg = load_config(None, [f"run.model={tiny_model_dir}", "rollout.task.kind=file", f"rollout.task.path={scorable}",
                             f"rollout.task.heldout_path={mixed}", "rollout.reward=verl"])
    with pytest.raises(ConfigError) as refused:
        check_run_inputs(cfg, tiny_model_dir)
    said = str(refused.value)
    assert said.startswith("rollout.task.heldout_path: prompt file has unusable rows, the run does not start")
    assert f"{mixed} row 2: rollout.reward=verl cannot score it: data_source 'taco': its ground_truth is not test " \
           "cases" in said
    assert f"{mixed} row 3: rollout.reward=verl cannot score it: data_source 'my_set': verl's default reward has " \
           "no rule for it either" in said
    assert f"{mixed} row 5: rollout.reward=verl cannot score it: data_source 'lighteval/MATH': its ground_truth is " \
           "a number, not text" in said
    from services.controller import evaluate_model

    with pytest.raises(ConfigError, match="rollout.task.heldout_path: prompt file has unusable rows"):
        evaluate_model(cfg, model=str(tiny_model_dir))  # before an engine starts
    skipping = cfg.model_copy(update={"rollout": cfg.rollout.model_copy(update={
        "task": cfg.rollout.task.model_copy(update={"skip_invalid": True})})})
    check_run_inputs(skipping, tiny_model_dir)  # one bad row does not stop a run that skips them
    from rollout_workers.data import heldout_problems

    held = heldout_problems(skipping.rollout.task, 10, reward=skipping.rollout.rows_reward())  # as a worker reads them
    assert [(p.data_source, p.row) for p in held] == [("openai/gsm8k", 1)]
    code = main(["data", "check", str(scorable), str(mixed), f"run.model={tiny_model_dir}", "rollout.reward=verl"])
    out = capsys.readouterr().out
    assert code == 1 and f"{mixed}: 5 rows, 1 usable, 4 unusable" in out
    assert f"{scorable}: 3 rows, 3 usable, 0 unusable" in out and "data sources: openai/gsm8k (1)" in out
    # Another reward scores what it is given: no data_source is asked for.
    assert main(["data", "check", str(mixed), f"run.model={tiny_model_dir}", "rollout.reward=math"]) == 0
    # The built-in tasks have no data_source to go by.
    with pytest.raises(ConfigError, match="rollout.reward=verl scores verl rows by their data_source, and the "
                                          "built-in rollout.task.kind=synthetic task has none"):
        check_run_inputs(load_config(None, [f"run.model={tiny_model_dir}", "rollout.reward=verl"]), tiny_model_dir)


def test_epochs_become_steps_from_the_usable_prompts_as_verl_counts_them(tiny_model_dir, tmp_path, caplog):
    rows = [{"prompt": f"{i}+1=", "answer": str(i + 1)} for i in range(10)] + [{"prompt": "no answer"}]
    train = write_rows(tmp_path / "train.jsonl", rows)
    cfg = load_config(None, [f"run.model={tiny_model_dir}", "rollout.task.kind=file", f"rollout.task.path={train}",
                             "rollout.task.skip_invalid=true", "eval.enabled=false", "rollout.reward=math",
                             "buffer.gate.batch_size=4", "run.epochs=2.5", "learner.lr_schedule=cosine",
                             "learner.warmup_steps=2"])
    prompts = check_run_inputs(cfg, tiny_model_dir)
    assert prompts == 10  # the row without an answer is skipped, not counted
    with caplog.at_level(logging.INFO, logger="etarl"):
        resolved = with_epochs(cfg, prompts)
    # 10 // 4 = 2 steps an epoch (a last partial batch dropped), x 2.5
    assert (resolved.run.steps, resolved.run.epochs, resolved.learner_for_run("/m").total_steps) == (5, None, 5)
    assert "run.epochs=2.5: 10 usable prompts // buffer.gate.batch_size 4 = 2 steps an epoch -> run.steps=5" \
        in caplog.text
    with pytest.raises(ConfigError, match="run.epochs: 3 usable train prompts make no batch"):
        with_epochs(cfg, 3)
    with pytest.raises(ConfigError, match=r"learner.warmup_steps \(2\) exceeds the 1 steps of run.epochs=0.5"):
        with_epochs(cfg.model_copy(update={"run": cfg.run.model_copy(update={"epochs": 0.5})}), prompts)


def test_etarl_eval_needs_only_held_out_prompts_and_a_run_its_train_file(tiny_model_dir, tmp_path):
    held = write_rows(tmp_path / "held.jsonl", [{"prompt": "5+5=", "answer": "10"}])
    cfg = load_config(None, [f"run.model={tiny_model_dir}", "rollout.task.kind=file",
                             f"rollout.task.heldout_path={held}", "rollout.reward=math"])
    check_eval_inputs(cfg, tiny_model_dir)
    with pytest.raises(ConfigError, match="rollout.task.path is unset: a run trains on the prompts of a file"):
        check_run_inputs(cfg, tiny_model_dir)
    with pytest.raises(ConfigError, match="task.heldout_path is read with task.kind=file"):  # not ignored
        load_config(None, [f"rollout.task.heldout_path={held}"])

