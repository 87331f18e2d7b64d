"""The `etarl` command: config errors exit 2 with a message naming the key; config and plot work."""
import json

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
    (["train", "--resume", "/nonexistent/run"], "/nonexistent/run"),
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
