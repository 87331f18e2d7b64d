"""BufferConfig: YAML loading (own file or a run config's `buffer:` section), unknown keys and
missing files are clear errors, presets, and the CLI entry's exit codes."""
import pytest

from buffer.config import BufferConfig
from buffer.server import main


def test_loads_own_file_or_run_section(tmp_path):
    own = tmp_path / "b.yaml"
    own.write_text("port: 6001\ngate: {eta: 2, batch_size: 4}\n")
    assert BufferConfig.from_yaml(own).gate.eta == 2
    run = tmp_path / "run.yaml"
    run.write_text("buffer:\n  gate: {eta: null}\nlearner: {lr: 0.1}\n")
    assert BufferConfig.from_yaml(run).gate.eta is None


def test_unknown_keys_and_missing_files_say_where(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("gate: {etaa: 3}\n")
    with pytest.raises(ValueError, match=r"(?s)bad\.yaml.*etaa"):
        BufferConfig.from_yaml(bad)
    with pytest.raises(FileNotFoundError, match="nope.yaml"):
        BufferConfig.from_yaml(tmp_path / "nope.yaml")
    assert main(["serve", "--config", str(bad)]) == 2


def test_presets():
    assert BufferConfig.synchronous().gate.eta == 0
    assert BufferConfig.math().gate.eta == 8 and BufferConfig.coding().gate.eta == 4


def test_keygen_command(tmp_path, capsys):
    assert main(["keygen", str(tmp_path)]) == 0
    assert (tmp_path / "server.key_secret").is_file() and (tmp_path / "authorized_clients" / "admin" / "admin.key").is_file()
    assert "secret-key" not in capsys.readouterr().out
