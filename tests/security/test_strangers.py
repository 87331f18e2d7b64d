"""Strangers and greedy clients of the ZMQ buffer (issue 30):
- a run's default ZMQ buffer (no CURVE, loopback) serves on a Unix socket in a 0700 folder of the
  run: another local user (uid nobody here) can neither call it (pull, set_eta, recover,
  set_version, stats) nor bind the path; with the folder opened, the same stranger gets in (the
  test can fail);
- the supervisor holds the endpoint across a restart: while the child is dead no one can bind the
  port, and the restarted child answers on the same endpoint;
- the version's rise is bounded per client over time (a token bucket), and the learner's pace
  (one version per acked batch, a resume's burst) is never refused;
- per-connection caps on permits held and on waiting requests, and the store's byte budget: each
  refusal a clear error and a counter.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import zmq
from hypothesis import given, settings
from hypothesis import strategies as st

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "buffer"))  # the buffer tests' helpers
from buffer_helpers import make_group, wait_until  # noqa: E402

from buffer import auth  # noqa: E402
from buffer.client import BufferClient  # noqa: E402
from buffer.codec import encode_group, encode_message, pack_frames  # noqa: E402
from buffer.config import (BufferConfig, ClientConfig, CurveConfig, GateConfig, LogConfig, PerClientLimits,  # noqa: E402
                           StoreConfig)
from buffer.core import BufferCore  # noqa: E402
from buffer.errors import RemoteError  # noqa: E402
from buffer.limits import ClientLimits  # noqa: E402
from buffer.server import BufferServer  # noqa: E402
from services.buffer_handle import BufferSupervisor  # noqa: E402
from services.config import load_config  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
NOBODY = 65534
QUICK = ClientConfig(request_timeout_s=0.3, retries=0)

# Run as uid nobody: every call of a plain client (no key), a raw connect, and a bind of the path.
STRANGER = """
import json, socket, sys
from buffer.client import BufferClient
from buffer.config import ClientConfig
endpoint, path = sys.argv[1], sys.argv[2]
out = {}
client = BufferClient(endpoint, ClientConfig(request_timeout_s=0.3, retries=0))
calls = {"pull_batch": lambda: client.pull_batch(1), "set_eta": lambda: client.set_eta(0),
         "recover": lambda: client.recover(1000), "set_version": lambda: client.set_version(1),
         "stats": lambda: client.stats()}
for name, call in calls.items():
    try:
        call()
        out[name] = "answered"
    except Exception as exc:
        out[name] = type(exc).__name__
client.close()
for what in ("connect", "bind"):
    s = socket.socket(socket.AF_UNIX)
    try:
        (s.connect if what == "connect" else s.bind)(path if what == "connect" else path + ".squat")
        out[what] = "ok"
    except OSError as exc:
        out[what] = type(exc).__name__
    s.close()
print(json.dumps(out))
"""


def as_stranger(endpoint: str, path: Path) -> dict:
    # setpriv, not Popen(user=): the interpreter lives under root's 0700 home, which setpriv still
    # resolves as root; the stranger itself runs with uid nobody and no capabilities
    proc = subprocess.run(["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups", sys.executable,
                           "-c", STRANGER, endpoint, str(path)], cwd="/tmp", capture_output=True, text=True,
                          timeout=60, env={**os.environ, "PYTHONPATH": str(REPO), "HOME": "/tmp"})
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.fixture
def open_tmp():
    """A folder other users may enter (pytest's tmp_path is under a 0700 folder of root's, which
    would keep a stranger out whatever the buffer does)."""
    folder = Path(tempfile.mkdtemp(prefix="etarl-strangers-"))
    os.chmod(folder, 0o755)
    yield folder
    subprocess.run(["rm", "-rf", str(folder)], check=False)


@pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("setpriv"), reason="runs a stranger as uid nobody: "
                    "needs root and setpriv")
def test_a_stranger_is_refused_everything_by_a_runs_default_zmq_buffer(open_tmp):
    run_dir = open_tmp / "run"
    run_dir.mkdir(mode=0o755)
    os.chmod(run_dir, 0o755)
    config = load_config(None, ["buffer.transport=zmq"]).buffer.service_config()  # a run's default
    supervisor = BufferSupervisor(config, run_dir, max_restarts=0)
    supervisor.start()
    try:
        path = supervisor.config.ipc_path
        assert supervisor.config.endpoint == f"ipc://{path}" and path.parent == run_dir / "buffer-socket"
        assert (path.parent.stat().st_mode & 0o777) == 0o700
        with BufferClient.from_config(supervisor.config) as own:
            own.set_version(3)
            before = own.stats()
            refused = as_stranger(supervisor.config.endpoint, path)
            assert refused == {"pull_batch": "BufferUnavailable", "set_eta": "BufferUnavailable",
                               "recover": "BufferUnavailable", "set_version": "BufferUnavailable",
                               "stats": "BufferUnavailable", "connect": "PermissionError", "bind": "PermissionError"}
            after = own.stats()
            assert (after["version"], after["eta"], after["accepted"]) == (before["version"], before["eta"],
                                                                           before["accepted"]) == (3, 2, 0)
            # The control: the folder (not something else) keeps the stranger out.
            os.chmod(path, 0o777)
            os.chmod(path.parent, 0o755)
            let_in = as_stranger(supervisor.config.endpoint, path)
            os.chmod(path.parent, 0o700)
            assert let_in["stats"] == let_in["set_eta"] == "answered" and let_in["connect"] == "ok", let_in
            assert own.stats()["eta"] == 0, "the stranger's set_eta went through: the test can fail"
    finally:
        supervisor.stop()
    assert not path.exists(), "the socket is removed with the run"


def curve_config(tmp_path: Path, **more) -> BufferConfig:
    paths = auth.keygen(tmp_path / "keys")
    curve = CurveConfig(enabled=True, server_public_key_file=paths["server_public_key_file"],
                        server_secret_key_file=paths["server_secret_key_file"],
                        client_public_key_file=paths["learner_client_public_key_file"],
                        client_secret_key_file=paths["learner_client_secret_key_file"],
                        authorized_clients_dir=paths["authorized_clients_dir"])
    return BufferConfig(port=0, curve=curve, **more)


def test_a_restart_comes_back_on_the_held_port_and_no_squatter_can_take_it(tmp_path):
    config = curve_config(tmp_path, log=LogConfig(path=tmp_path / "buffer.log", fsync="interval"),
                          client=ClientConfig(request_timeout_s=1.0, retries=30, retry_backoff_s=0.05))
    supervisor = BufferSupervisor(config, tmp_path, max_restarts=1)
    supervisor.start()
    try:
        port = supervisor.config.port
        assert supervisor.config.endpoint == f"tcp://127.0.0.1:{port}" and port != 0
        with BufferClient.from_config(supervisor.config) as client:
            client.set_version(2)
            first = supervisor.process
            first.send_signal(signal.SIGKILL)
            first.wait()
            killed = time.monotonic()
            # No child is serving now: the port must still be taken (the supervisor's socket).
            for flags in ((socket.SO_REUSEADDR,), (socket.SO_REUSEADDR, socket.SO_REUSEPORT)):
                squatter = socket.socket()
                for flag in flags:
                    squatter.setsockopt(socket.SOL_SOCKET, flag, 1)
                with pytest.raises(OSError, match="Address already in use"):
                    squatter.bind(("127.0.0.1", port))
                squatter.close()
            assert client.health()["version"] == 2, "the restarted child answers on the same port, from its log"
            print(f"restart on the held port: {time.monotonic() - killed:.2f} s from the kill to the first answer")
            assert supervisor.restarts == 1 and supervisor.process.pid != first.pid
    finally:
        supervisor.stop()
    served = [line for line in (tmp_path / "buffer.out").read_text().splitlines() if "buffer serving on" in line]
    assert len(served) == 2 and served[0] == served[1], served
    with socket.socket() as again:  # freed when the run ends
        again.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        again.bind(("127.0.0.1", port))


# ---- the version's rise, per client over time ------------------------------------------------


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def served(config: BufferConfig, clock=None) -> BufferServer:
    return BufferServer(config, BufferCore(config, clock=clock) if clock else None).start()


def test_a_client_cannot_race_the_version_ahead_and_the_learners_pace_is_never_refused():
    clock = Clock()
    config = BufferConfig(port=0, gate=GateConfig(batch_size=1, eta=None, max_concurrent=8), max_version_jump=16,
                          per_client=PerClientLimits(version_rate_per_s=2.0))
    server = served(config, clock)
    try:
        with BufferClient(server.endpoint, QUICK) as learner:
            learner.set_version(16)  # a resume's burst: max_version_jump at once
            for step in range(40):  # the learner's pace, however fast: one version per acked batch
                permit = learner.acquire_permit("w")
                learner.push_group(make_group(permit.ticket, version=16 + step, n=1), permit.permit_id)
                batch = learner.pull_batch(1)
                learner.ack(batch.lease_id, version=17 + step)
            assert learner.stats()["version"] == 56
            with pytest.raises(RemoteError, match=r"version_jump.*version \+1 refused.*version_rate_per_s"):
                learner.set_version(57)  # the burst is spent, no time passed, nothing acked
            clock.now += 1.5  # 2 per second: 3 tokens
            learner.set_version(59)
            with pytest.raises(RemoteError, match="version_jump"):
                learner.set_version(60)
            stats = learner.stats()
        assert stats["version"] == 59 and stats["request_errors"]["version_jump"] == 2
    finally:
        server.stop()


@settings(max_examples=60, deadline=None, derandomize=True)
@given(st.lists(st.tuples(st.floats(0, 3), st.integers(0, 20), st.integers(0, 2)), max_size=40))
def test_the_version_budget_bounds_every_window(requests):
    """Whatever a client asks and whenever: the rise granted over any span of T seconds is at most
    max_version_jump + rate·T + the batches it acked in that span."""
    clock, burst, rate = Clock(), 16, 1.5
    limits = ClientLimits(PerClientLimits(version_rate_per_s=rate), burst, clock)
    granted = []  # (time, rise, acks)
    for wait, rise, acks in requests:
        clock.now += wait
        try:
            limits.check_version_rise("", rise, acks)
        except Exception:  # noqa: BLE001 - refused: nothing granted
            continue
        limits.spend_version_rise("", rise, acks)
        granted.append((clock.now, rise, acks))
    for i in range(len(granted)):
        for j in range(i, len(granted)):
            span = granted[j][0] - granted[i][0]
            rises = sum(g[1] for g in granted[i:j + 1])
            acks = sum(g[2] for g in granted[i:j + 1])
            assert rises <= burst + rate * span + acks + 1e-9


# ---- per-client caps and the store's byte budget ---------------------------------------------


def test_one_connection_cannot_take_every_permit_or_waiting_slot():
    config = BufferConfig(port=0, gate=GateConfig(batch_size=1, eta=None, max_concurrent=16),
                          per_client=PerClientLimits(max_permits=3, max_waiting=2))
    server = served(config)
    raw = []
    try:
        with BufferClient(server.endpoint, QUICK) as greedy, BufferClient(server.endpoint, QUICK) as other:
            taken = greedy.acquire_permits("greedy", 5)
            assert len(taken) == 3, "a request beyond the cap gets what the cap leaves"
            with pytest.raises(RemoteError, match=r"too_many_permits.*holds 3 permits.*per_client.max_permits=3"):
                greedy.acquire_permits("greedy", 1)
            assert len(other.acquire_permits("other", 3)) == 3, "another client is not held back"
            greedy.push_group(make_group(taken[0].ticket, n=1), taken[0].permit_id)
            assert len(greedy.acquire_permits("greedy", 5)) == 1, "a pushed permit no longer counts"
            # long polls: a pull waits on the empty store; the third from one connection is refused
            sock = zmq.Context.instance().socket(zmq.DEALER)
            sock.linger = 0
            sock.connect(server.endpoint)
            raw.append(sock)
            for i in range(3):
                sock.send_multipart(encode_message({"id": f"p{i}", "op": "pull_batch",
                                                    "args": {"batch_size": 8, "timeout": 30.0}}))
            assert sock.poll(5000), "the third long poll is answered at once"
            reply = sock.recv_multipart()
            assert b"too_many_waiting" in reply[0] and b"per_client.max_waiting=2" in reply[0]
            stats = other.stats()
        assert stats["request_errors"] == {"too_many_permits": 1, "too_many_waiting": 1}
    finally:
        for sock in raw:
            sock.close()
        server.stop()


def test_the_store_refuses_pushes_beyond_its_byte_budget_and_keeps_what_it_accepted():
    one = len(pack_frames(encode_group(make_group(0, tokens=64))))  # a group's packed bytes, as stored
    config = BufferConfig(port=0, gate=GateConfig(batch_size=2, eta=None, max_concurrent=16),
                          store=StoreConfig(max_bytes=2 * one))
    server = served(config)
    try:
        with BufferClient(server.endpoint, QUICK) as client:
            permits = client.acquire_permits("w", 4)
            assert len(permits) == 4, "permits are granted while bytes are left"
            for p in permits[:2]:
                client.push_group(make_group(p.ticket, tokens=64), p.permit_id)
            # a third would pass the budget: refused, nothing dropped to make room
            with pytest.raises(RemoteError, match=r"store_full.*store.max_bytes="):
                client.push_group(make_group(permits[2].ticket, tokens=64), permits[2].permit_id)
            assert client.acquire_permits("w", 1) == [], "no permit for a group the store could not take"
            stats = client.stats()
            assert stats["groups_ready"] == 2 and stats["bytes_held"] == 2 * one and stats["capacity"] <= 0
            assert stats["store_max_bytes"] == 2 * one and stats["request_errors"] == {"store_full": 1}
            batch = client.pull_batch(2)
            assert len(batch.groups) == 2
            assert client.acquire_permits("w", 1) == [], "leased groups still count"
            client.ack(batch.lease_id)
            client.push_group(make_group(permits[2].ticket, tokens=64), permits[2].permit_id)  # room again
            assert client.stats()["groups_ready"] == 1
    finally:
        server.stop()
