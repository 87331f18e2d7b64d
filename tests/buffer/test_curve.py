"""CURVE authentication: keys made by the keygen command, an authorized client is served, an
unauthenticated or unknown client is refused; keys never appear in the config or the logs."""
import os
import subprocess
import sys

import msgpack
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


def curve(directory, client="admin", **kw):
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
    stranger = curve(keys).model_copy(update={"client_secret_key_file": tmp_path / "admin.key_secret"})
    with BufferClient(server.endpoint, QUICK, stranger) as client, pytest.raises(BufferUnavailable):
        client.health()


def test_keys_from_environment_variables(server, keys, monkeypatch):
    import zmq.auth

    public, secret = zmq.auth.load_certificate(str(keys / "admin.key_secret"))
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


def test_a_curve_remote_bind_needs_an_allow_list_or_a_deliberate_open_door(keys):
    open_door = dict(host="0.0.0.0", curve=curve(keys).model_copy(update={"authorized_clients_dir": None}))
    with pytest.raises(ValidationError, match="authorized_clients_dir is unset.*allow_any_client"):
        BufferConfig(**open_door)
    allowed = curve(keys).model_copy(update={"authorized_clients_dir": None, "allow_any_client": True})
    assert BufferConfig(host="0.0.0.0", curve=allowed).curve.allow_any_client
    assert BufferConfig(host="0.0.0.0", curve=curve(keys)).curve.authorized_clients_dir is not None


def test_each_key_may_call_only_its_roles_operations(server, keys):
    """A worker key pushes but cannot move the version, recover the gate or read the groups it
    holds (a checkpoint's snapshot); a learner key pulls, sets the version and takes the snapshot
    but cannot push; a refused call changes nothing."""
    from buffer.errors import RemoteError
    from buffer_helpers import make_group

    with BufferClient(server.endpoint, PATIENT, curve(keys, "worker")) as worker, \
            BufferClient(server.endpoint, PATIENT, curve(keys, "learner")) as learner, \
            BufferClient(server.endpoint, PATIENT, curve(keys, "admin")) as admin:
        before = worker.stats()
        for call in (lambda: worker.set_version(5), lambda: worker.recover(10**9), lambda: worker.pull_batch(1),
                     lambda: worker.ack("some-lease"), lambda: worker.snapshot()):
            with pytest.raises(RemoteError, match="forbidden") as info:
                call()
            assert info.value.reason == "forbidden"
        permit = worker.acquire_permit("w", timeout=5)
        with pytest.raises(RemoteError, match="forbidden"):
            learner.push_group(make_group(permit.ticket, version=before["version"]), permit.permit_id)
        worker.push_group(make_group(permit.ticket, version=before["version"]), permit.permit_id)
        after = admin.stats()
        assert after["version"] == before["version"] and after["accepted"] == before["accepted"] + 1
        assert after["request_errors"]["forbidden"] >= 6
        assert len(msgpack.unpackb(learner.snapshot(), raw=False)) == 2  # the gate's record and the group's
        batch = learner.pull_batch(1, timeout=5)
        learner.ack(batch.lease_id, version=before["version"] + 1)
        with pytest.raises(RemoteError, match="version_jump"):
            admin.set_version(before["version"] + 1 + server.config.max_version_jump + 1)
        admin.set_version(before["version"] + 2)  # within the bound: admin may
        assert admin.stats()["version"] == before["version"] + 2


def test_a_key_outside_every_role_folder_is_refused_at_start(keys, tmp_path):
    import shutil

    layout = tmp_path / "authorized_clients"
    shutil.copytree(keys / "authorized_clients", layout)
    shutil.copy(keys / "admin.key", layout / "loose.key")
    with pytest.raises(ValueError, match="loose.key.*in no role folder"):
        auth.load_roles(layout)


def test_keygen_adds_one_client_of_a_role(tmp_path):
    auth.keygen(tmp_path)
    server_key = (tmp_path / "server.key_secret").read_bytes()
    paths = auth.keygen(tmp_path, ("worker",), name="worker-7")
    assert (tmp_path / "server.key_secret").read_bytes() == server_key, "the server pair is kept"
    assert paths["worker_client_secret_key_file"].name == "worker-7.key_secret"
    assert auth.load_roles(tmp_path / "authorized_clients")[
        (tmp_path / "worker-7.key").read_text().split('public-key = "')[1][:40].encode()] == "worker"
