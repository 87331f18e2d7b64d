"""CURVE authentication: keys made by the keygen command, an authorized client is served, an
unauthenticated or unknown client is refused; keys never appear in the config or the logs."""
import os
import subprocess
import sys

import pytest
from buffer_helpers import REPO
from pydantic import ValidationError

from buffer import auth
from buffer.client import BufferClient
from buffer.config import BufferConfig, ClientConfig, CurveConfig
from buffer.errors import BufferUnavailable
from buffer.server import BufferServer

QUICK = ClientConfig(request_timeout_s=0.5, retries=0)  # for clients that must be refused
PATIENT = ClientConfig(request_timeout_s=10, retries=1)


@pytest.fixture(scope="module")
def keys(tmp_path_factory):
    directory = tmp_path_factory.mktemp("keys")
    out = subprocess.run([sys.executable, "-m", "buffer", "keygen", str(directory)], capture_output=True, text=True,
                         cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)}, check=True).stdout
    secret = (directory / "server.key_secret").read_text()
    assert "server_secret_key_file" in out and secret.split("secret-key = ")[1][:10] not in out
    assert oct((directory / "server.key_secret").stat().st_mode)[-3:] == "600"
    return directory


def curve(directory, client="client", **kw):
    return CurveConfig(enabled=True, server_public_key_file=directory / "server.key",
                       server_secret_key_file=directory / "server.key_secret",
                       client_secret_key_file=directory / f"{client}.key_secret",
                       authorized_clients_dir=directory / "authorized_clients", **kw)


@pytest.fixture(scope="module")
def server(keys):
    srv = BufferServer(BufferConfig(port=0, curve=curve(keys))).start()
    yield srv
    srv.stop()


def test_authorized_client_is_served(server, keys):
    with BufferClient(server.endpoint, PATIENT, curve(keys)) as client:
        assert client.health()["ok"]


def test_plain_client_is_refused(server):
    with BufferClient(server.endpoint, QUICK) as client, pytest.raises(BufferUnavailable):
        client.health()


def test_client_with_unknown_key_is_refused(server, keys, tmp_path):
    auth.keygen(tmp_path)  # a fresh pair the server has never seen
    stranger = curve(keys).model_copy(update={"client_secret_key_file": tmp_path / "client.key_secret"})
    with BufferClient(server.endpoint, QUICK, stranger) as client, pytest.raises(BufferUnavailable):
        client.health()


def test_keys_from_environment_variables(server, keys, monkeypatch):
    import zmq.auth

    public, secret = zmq.auth.load_certificate(str(keys / "client.key_secret"))
    server_public, _ = zmq.auth.load_certificate(str(keys / "server.key"))
    monkeypatch.setenv(auth.ENV_CLIENT_SECRET, secret.decode())
    monkeypatch.setenv(auth.ENV_CLIENT_PUBLIC, public.decode())
    monkeypatch.setenv(auth.ENV_SERVER_PUBLIC, server_public.decode())
    with BufferClient(server.endpoint, PATIENT, CurveConfig(enabled=True)) as client:
        assert client.health()["ok"]
    monkeypatch.setenv(auth.ENV_CLIENT_SECRET, "too-short")
    with pytest.raises(ValueError, match="not a 40-character") as info:
        BufferClient(server.endpoint, QUICK, CurveConfig(enabled=True)).health()
    assert "too-short" not in str(info.value)


def test_config_holds_no_keys_and_refuses_open_remote_binds():
    with pytest.raises(ValidationError):
        CurveConfig(enabled=True, server_secret_key="x" * 40)
    with pytest.raises(ValidationError, match="not loopback"):
        BufferConfig(host="0.0.0.0")
    assert BufferConfig(host="0.0.0.0", allow_remote_without_auth=True).host == "0.0.0.0"
    assert BufferConfig().host == "127.0.0.1"
