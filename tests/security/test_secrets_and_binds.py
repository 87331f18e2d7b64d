"""Secrets and exposure of the buffer service, as a real process:
- with CURVE keys from environment variables (as Kubernetes Secrets provide them), nothing the
  service prints while authorized, unauthenticated and unknown clients and bad requests arrive
  contains a secret key, at any log level; at the default level no public key either (at DEBUG,
  pyzmq's authenticator names the client public key it allowed or denied: an identity, not a
  credential); a malformed key is refused without echoing it;
- the service listens on 127.0.0.1 only (every listening socket of the process, via psutil).
tests/buffer/test_curve.py covers refusal of clients without the key and key-free configs."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import psutil
import pytest
import yaml
import zmq.auth

from buffer import auth
from buffer.client import BufferClient
from buffer.config import ClientConfig, CurveConfig
from buffer.errors import BufferUnavailable
from services.chaos import free_port

REPO = Path(__file__).resolve().parents[2]
QUICK = ClientConfig(request_timeout_s=0.5, retries=0)


def serve(config: dict, tmp_path: Path, env: dict, level: str = "DEBUG") -> tuple[subprocess.Popen, Path]:
    path = tmp_path / "buffer.yaml"
    path.write_text(yaml.safe_dump(config))
    out = tmp_path / "service.out"
    proc = subprocess.Popen([sys.executable, "-m", "buffer", "serve", "--config", str(path), "--log-level", level],
                            stdout=open(out, "wb"), stderr=subprocess.STDOUT, cwd=REPO,
                            env={**os.environ, "PYTHONPATH": str(REPO), **env})
    return proc, out


def wait_serving(proc, out: Path, timeout: float = 60) -> None:
    import time

    deadline = time.monotonic() + timeout
    while "serving on" not in out.read_text(errors="replace"):
        assert proc.poll() is None, out.read_text(errors="replace")
        assert time.monotonic() < deadline, "the buffer service did not start"
        time.sleep(0.1)


@pytest.fixture(scope="module")
def keys(tmp_path_factory):
    directory = tmp_path_factory.mktemp("keys")
    paths = auth.keygen(directory)
    stranger = auth.keygen(tmp_path_factory.mktemp("stranger"))
    secrets = {name: zmq.auth.load_certificate(str(paths[f"{name}_secret_key_file"]))[1].decode()
               for name in ("server", "learner_client")}
    secrets["stranger"] = zmq.auth.load_certificate(str(stranger["learner_client_secret_key_file"]))[1].decode()
    return directory, paths, stranger, secrets


def public_keys(paths, stranger) -> list[str]:
    files = [paths["server_public_key_file"], paths["learner_client_public_key_file"],
             stranger["learner_client_public_key_file"]]
    return [zmq.auth.load_certificate(str(f))[0].decode() for f in files]


@pytest.mark.parametrize("level", ["DEBUG", "INFO"])
def test_keys_never_appear_in_the_service_output(keys, tmp_path, level):
    directory, paths, stranger, secrets = keys
    server_public = zmq.auth.load_certificate(str(paths["server_public_key_file"]))[0].decode()
    env = {auth.ENV_SERVER_SECRET: secrets["server"], auth.ENV_SERVER_PUBLIC: server_public}
    port = free_port()
    config = {"port": port, "curve": {"enabled": True, "authorized_clients_dir": str(paths["authorized_clients_dir"])}}
    proc, out = serve(config, tmp_path, env, level)
    try:
        wait_serving(proc, out)
        endpoint = f"tcp://127.0.0.1:{port}"
        client_curve = CurveConfig(enabled=True, server_public_key_file=paths["server_public_key_file"],
                                   client_secret_key_file=paths["learner_client_secret_key_file"])
        with BufferClient(endpoint, QUICK, client_curve) as client:
            assert client.health()["ok"]
            with pytest.raises(Exception, match="unknown lease"):
                client.ack("no-such-lease")  # an error reply, logged by the service
        unknown = client_curve.model_copy(update={"client_secret_key_file": stranger["learner_client_secret_key_file"]})
        for curve in (None, unknown):
            with BufferClient(endpoint, QUICK, curve) as client, pytest.raises(BufferUnavailable):
                client.health()
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(20)
    output = out.read_text(errors="replace")
    assert "serving on" in output and "curve=on" in output
    for name, secret in secrets.items():
        assert secret not in output, f"the {name} secret key was printed"
    assert secrets["server"] not in (tmp_path / "buffer.yaml").read_text()
    if level != "DEBUG":
        for public in public_keys(paths, stranger):
            assert public not in output


def test_a_malformed_key_is_refused_without_being_echoed(keys, tmp_path):
    directory, paths, _, _ = keys
    bad = "Q" * 39  # one character short of a Z85 key
    config = {"port": free_port(), "curve": {"enabled": True,
                                              "server_public_key_file": str(paths["server_public_key_file"])}}
    proc, out = serve(config, tmp_path, {auth.ENV_SERVER_SECRET: bad})
    assert proc.wait(60) == 2
    output = out.read_text(errors="replace")
    assert auth.ENV_SERVER_SECRET in output and "40-character" in output
    assert bad not in output


def test_a_missing_key_file_is_named(keys, tmp_path):
    missing = tmp_path / "nowhere" / "server.key_secret"
    config = {"port": free_port(), "curve": {"enabled": True, "server_secret_key_file": str(missing)}}
    proc, out = serve(config, tmp_path, {})
    assert proc.wait(60) == 2
    assert str(missing) in out.read_text(errors="replace")


def listening(pid: int) -> list[tuple[str, int]]:
    return [(c.laddr.ip, c.laddr.port) for c in psutil.Process(pid).net_connections(kind="inet")
            if c.status == psutil.CONN_LISTEN]


def test_the_service_listens_on_loopback_only(tmp_path):
    port = free_port()
    proc, out = serve({"port": port}, tmp_path, {})
    try:
        wait_serving(proc, out)
        sockets = listening(proc.pid)
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(20)
    assert ("127.0.0.1", port) in sockets
    assert all(ip in ("127.0.0.1", "::1") for ip, _ in sockets), sockets
