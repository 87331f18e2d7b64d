"""Bad configuration reaches `etarl train` and stops it before anything starts, with exit code 2
and a message naming the key or the path: a model path that does not exist or is not an HF
model folder, a value of the wrong type in a config file, a run folder that cannot be made.
(Unknown keys, typos and bad overrides: tests/services/test_config.py and test_cli.py; the buffer
service's own config: tests/buffer/test_config.py; CURVE key files:
tests/security/test_secrets_and_binds.py.)"""
import pytest

from services.cli import EXIT_CONFIG_ERROR, main


@pytest.mark.parametrize("make_model, needle", [
    (lambda tmp: tmp / "no-such-model", "does not exist"),
    (lambda tmp: (tmp / "empty").mkdir() or tmp / "empty", "has no config.json"),
])
def test_a_bad_model_path_is_named(tmp_path, capsys, make_model, needle):
    model = make_model(tmp_path)
    code = main(["train", f"run.model={model}", f"run.run_dir={tmp_path / 'run'}", "run.progress=false"])
    err = capsys.readouterr().err
    assert code == EXIT_CONFIG_ERROR
    assert "run.model" in err and str(model) in err and needle in err


def test_a_wrongly_typed_value_in_a_file_names_the_key_and_the_file(tmp_path, capsys):
    config = tmp_path / "run.yaml"
    config.write_text("buffer:\n  gate:\n    batch_size: eight\nrun:\n  steps: 3\n")
    assert main(["train", "--config", str(config)]) == EXIT_CONFIG_ERROR
    err = capsys.readouterr().err
    assert str(config) in err and "buffer.gate.batch_size" in err and "'eight'" in err


def test_a_run_folder_that_cannot_be_made_is_named(tiny_model_dir, tmp_path, capsys):
    """A run.run_dir under a file (or on a read-only mount): exit 2 naming the key and the reason,
    not a traceback from deep in the start."""
    (tmp_path / "file").write_text("")
    run_dir = tmp_path / "file" / "run"
    assert main(["train", f"run.model={tiny_model_dir}", f"run.run_dir={run_dir}"]) == EXIT_CONFIG_ERROR
    err = capsys.readouterr().err
    assert f"run.run_dir {run_dir}: cannot create the run folder (Not a directory)" in err
