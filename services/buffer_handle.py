"""The run's buffer: the Ray actor or the supervised ZMQ service, and a client for it.

`BufferHandle` is what the controller holds: a client (Ray actor or ZMQ), and for the Ray
transport the actor itself; for ZMQ the supervised service process (`BufferSupervisor`). Both
survive a SIGKILL of the buffer's process, up to `buffer.max_restarts` times, by replaying the
buffer's durable log, and both give a checkpoint the same snapshot (the buffer's log records) and
start a resumed run's buffer from it: a checkpoint of one transport resumes on the other.
"""
from __future__ import annotations

import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import msgpack
import yaml

from buffer.durable_log import keep_as_previous
from services.config import EtarlConfig

log = logging.getLogger("etarl")


def _buffer_actor_class():
    """The buffer actor plus the two calls a checkpoint needs: a consistent snapshot of the gate
    (tickets, cursor, counters) and of the groups held, as the buffer's own log records (packed:
    `BufferCore.checkpoint_state`), and their restore into a fresh buffer (the buffer's own log
    replay)."""
    import ray

    from services.buffer_actor import LEARNER, BufferActor

    class CheckpointableBufferActor(BufferActor):
        @ray.method(concurrency_group=LEARNER)
        def snapshot(self) -> bytes:
            return self.core.checkpoint_state()

        @ray.method(concurrency_group=LEARNER)
        def restore(self, records: list[dict]) -> None:
            self.core.restore(records)

    return CheckpointableBufferActor


RAY_BUFFER_LOG = "buffer-actor.log"  # the Ray buffer actor's durable log, in the run folder
SERVICE_LOG = "buffer-service.log"  # the ZMQ service's, where buffer.log.path is unset
RESTORE_FILE = "buffer-restore.msgpack"  # a resumed ZMQ service's first state, in the run folder until it serves
RAY_BUFFER_STARTS = "buffer-actor.starts"  # one line per start of the actor (its restart count)
_SUPERVISE_EVERY_S = 0.2
_BUFFER_START_TIMEOUT_S = 120.0
_BUFFER_STATE_CALL_S = 600.0  # a checkpoint's snapshot or restore of a full buffer may take a while


class BufferLost(RuntimeError):
    """The run's buffer died and could not be brought back without losing data; the message says
    why and what to change."""


class BufferHandle:
    """The buffer as this run uses it: a client (Ray actor or ZMQ), and for the Ray transport
    the actor itself; for ZMQ the supervised service process.

    Both survive a SIGKILL of the buffer's process, up to `buffer.max_restarts` times: Ray
    restarts the actor, a `BufferSupervisor` restarts the service child; either replays its
    durable log and the clients resend what was in flight with the same ids. Each `etarl train`
    starts the buffer's log empty (the last one kept as `.prev`); a resume starts the buffer from
    `restore`, a checkpoint's `snapshot()` records (`restored`: its counts)."""

    def __init__(self, cfg: EtarlConfig, run_dir: Path, restore: list[dict] | None = None):
        import ray

        self.transport = cfg.buffer.transport
        self.max_restarts = cfg.buffer.max_restarts
        self.run_dir = run_dir
        self.actor = None
        self.supervisor = None
        self._restarts_logged = 0
        service_cfg = cfg.buffer.service_config()
        if self.transport == "ray":
            from services.buffer_actor import RayBufferClient, create_buffer_actor

            starts_file = None
            if self.max_restarts:
                # The log serves this run's restarts only: a new `etarl train` (or a resume, which
                # rebuilds the buffer from its checkpoint) starts it empty; the last one (with its
                # settled archive and payload segments) is kept as .prev.
                log_path = run_dir / RAY_BUFFER_LOG
                keep_as_previous(log_path)  # (a compaction's leftover file: the log's open removes it)
                service_cfg = service_cfg.model_copy(
                    update={"log": service_cfg.log.model_copy(update={"path": log_path})})
                starts_file = run_dir / RAY_BUFFER_STARTS
            # Pinned to this node: a restarted actor must find its log in the run folder.
            from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

            here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)
            self.actor = create_buffer_actor(service_cfg, max_restarts=self.max_restarts, starts_file=starts_file,
                                             actor_class=_buffer_actor_class(), scheduling_strategy=here)
            self.client = RayBufferClient(self.actor, service_cfg)
            if restore is not None:
                self.client.call("restore", restore, wait=_BUFFER_STATE_CALL_S)
        else:
            if service_cfg.log.path is None and self.max_restarts:  # restartable, as the actor is by default
                service_cfg = service_cfg.model_copy(
                    update={"log": service_cfg.log.model_copy(update={"path": run_dir / SERVICE_LOG})})
            restore_file = None
            if restore is not None:  # read by the service's first start only, before it serves
                restore_file = run_dir / RESTORE_FILE
                restore_file.write_bytes(msgpack.packb(restore, use_bin_type=True))
            self.supervisor = BufferSupervisor(service_cfg, run_dir, self.max_restarts, restore_file)
            # the run's own calls give up as soon as the supervisor does, not after their timeouts
            self.client = ZmqBufferClient(self.supervisor.config, abandon=lambda: self.supervisor.failure)
            self.supervisor.start()
        stats = self.client.stats()
        self.restored = {k: stats[k] for k in ("version", "groups_ready", "next_ticket", "free_tickets")
                         } if restore is not None else None

    @property
    def worker_client(self):
        """The client the rollout workers use: with CURVE roles, one with the worker key
        (`buffer.curve.worker_client_secret_key_file`); else the run's own."""
        curve = self.supervisor.config.curve if self.supervisor is not None else None
        if curve is None or curve.worker_client_secret_key_file is None:
            return self.client
        worker_curve = curve.model_copy(update={"client_secret_key_file": curve.worker_client_secret_key_file,
                                                "client_public_key_file": None})
        return ZmqBufferClient(self.supervisor.config.model_copy(update={"curve": worker_curve}))

    @property
    def log_path(self) -> Path | None:
        if self.supervisor is not None:
            return self.supervisor.config.log.path
        return self.run_dir / RAY_BUFFER_LOG if self.max_restarts else None

    def restarts(self) -> int:
        """Restarts of the buffer so far (logged once each, as they are first seen)."""
        if self.supervisor is not None:
            return self.supervisor.restarts  # the supervisor logs its own
        count = int(self.client.health().get("restarts", 0))
        if count > self._restarts_logged:
            log.warning("the buffer actor's process died; Ray restarted it (restart %d of buffer.max_restarts=%d) "
                        "and it replayed its log %s: nothing accepted is lost", count, self.max_restarts,
                        self.log_path)
            self._restarts_logged = count
        return count

    def check(self) -> None:
        """Raise BufferLost if the buffer died and cannot come back (the supervisor's verdict)."""
        if self.supervisor is not None and self.supervisor.failure is not None:
            raise BufferLost(self.supervisor.failure)

    def lost(self, exc: BaseException) -> BufferLost:
        """The error that stops the run when the buffer stopped answering (`exc`)."""
        if self.supervisor is not None:
            return BufferLost(self.supervisor.failure or (
                f"the buffer service stopped answering ({exc}) although its process is running "
                f"(restarts so far: {self.supervisor.restarts}); see {self.supervisor.output}"))
        if not self.max_restarts:
            return BufferLost(f"the buffer actor died ({exc}) and buffer.max_restarts=0, so Ray does not restart "
                              f"it: the run stops. Set buffer.max_restarts > 0 to let it come back from its log "
                              f"in the run folder, or resume from the last checkpoint: etarl train --resume "
                              f"{self.run_dir}")
        return BufferLost(f"the buffer actor stopped answering ({exc}) after {self._restarts_logged} restart(s) "
                          f"(buffer.max_restarts={self.max_restarts} allows no more): the run stops. Resume from "
                          f"the last checkpoint: etarl train --resume {self.run_dir}")

    def snapshot(self) -> bytes:
        """The buffer's state for a checkpoint: its log records (work in flight left out: those
        tickets are reissued after a resume), msgpack-packed."""
        if self.actor is not None:
            return self.client.call("snapshot", wait=_BUFFER_STATE_CALL_S)
        return self.client.snapshot(wait=_BUFFER_STATE_CALL_S)

    def gone(self) -> bool:
        """Whether the buffer is lost for good: its supervisor gave up (no log, or no restart left)."""
        return self.supervisor is not None and self.supervisor.failure is not None

    def close(self) -> None:
        import ray

        if self.actor is not None:
            try:
                ray.get(self.actor.shutdown.remote(), timeout=10)
            except Exception:  # the actor may be gone with Ray already
                pass
            ray.kill(self.actor)  # no_restart: a deliberate end is not a death to recover from
        if self.supervisor is not None:
            self.supervisor.stop()


class ZmqBufferClient:
    """A `buffer.client.BufferClient` that travels to Ray actors: pickled as its settings, it
    opens its own socket in the process that first uses it (sockets do not cross processes)."""

    def __init__(self, config, abandon=None):
        self._settings = config
        self._client = None
        self._abandon = abandon  # this process's only: it does not travel (`BufferClient.abandon`)

    def __getstate__(self):
        return {"_settings": self._settings, "_client": None, "_abandon": None}

    def __getattr__(self, name):
        if name.startswith("__") or name in ("_settings", "_client", "_abandon"):
            raise AttributeError(name)
        if self._client is None:
            from buffer.client import BufferClient

            self._client = BufferClient.from_config(self._settings)
            self._client.abandon = self._abandon
        return getattr(self._client, name)


_SOCKET_NAME = "buffer.sock"
_MAX_SOCKET_PATH = 100  # sun_path holds 108 bytes on Linux (104 on macOS), with its terminating NUL
_BACKLOG = 1024  # connections waiting while a child restarts


def _listen(config) -> socket.socket:
    """A bound, listening socket for the buffer service's endpoint: the Unix socket at
    `config.ipc_path` (a stale one from a dead run is replaced: its folder is this user's own),
    or tcp host:port (port 0: the kernel picks one, kept for the run)."""
    if config.ipc_path is not None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        config.ipc_path.unlink(missing_ok=True)
        sock.bind(str(config.ipc_path))
    else:
        family = socket.AF_INET6 if ":" in config.host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        # a new run may bind a port whose last run's connections linger in TIME_WAIT; without
        # SO_REUSEPORT no other socket can bind it while this one listens
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((config.host, config.port))
    sock.listen(_BACKLOG)
    return sock


class BufferSupervisor:
    """The standalone buffer service (`python -m buffer serve`, through `services.buffer_child`)
    as a child process, kept alive.

    A thread polls the child; when it exits (SIGKILL, crash) it is started again on the same
    config, port and durable log, which it replays; the run's clients resend what was in flight.

    The endpoint is held, never freed: the supervisor binds and listens once and each child serves
    on that socket (`--listen-fd`, ZMQ_USE_FD), so no restart opens a window in which another
    local process could take the port (and serve the workers batches of its own). Clients that
    connect while no child runs wait in the socket's backlog. Without CURVE on a loopback host the
    endpoint is a Unix socket in a 0700 folder of the run (`buffer.ipc_path`): other local users
    cannot connect at all; with CURVE (multi-node) it is the tcp port, and clients verify the
    server's key.
    Each restart is counted and logged. It gives up, setting `failure` (the controller then stops
    the run), after `max_restarts` restarts, or when the service has no durable log (a restart would
    come back empty, losing the groups it had accepted; a run's has one unless max_restarts is 0).

    The first start begins a new log (the last one kept as `.prev`: it belongs to an earlier run,
    or to this run's life after its checkpoint), from `restore_file` on a resume (`serve
    --restore`; the file is removed once the service answers: its log holds the state)."""

    def __init__(self, config, run_dir: Path, max_restarts: int, restore_file: Path | None = None):
        from buffer.config import LOOPBACK_HOSTS

        self._private_dir: Path | None = None
        if config.ipc_path is None and not config.curve.enabled and config.host in LOOPBACK_HOSTS:
            config = config.model_copy(update={"ipc_path": self._socket_path(run_dir)})
        try:
            self.listener = _listen(config)  # held until stop(): a restart serves on it again
        except OSError as exc:
            raise RuntimeError(f"the buffer service's endpoint {config.endpoint} cannot be bound: {exc}") from exc
        if config.ipc_path is None:
            config = config.model_copy(update={"port": self.listener.getsockname()[1]})
        self.config = config
        self.max_restarts = max_restarts
        self.config_file = run_dir / "buffer.yaml"
        self.config_file.write_text(yaml.safe_dump({"buffer": config.model_dump(mode="json")}))
        self.output = run_dir / "buffer.out"
        self.restore_file = restore_file
        self.process: subprocess.Popen | None = None
        self.restarts = 0
        self.failure: str | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="buffer-supervisor", daemon=True)

    def start(self) -> None:
        if self.config.log.path is not None:
            keep_as_previous(self.config.log.path)
        self.process = self._spawn()
        if not self._wait_ready(self.process):
            code = self.process.poll()
            self.process.kill()
            self.listener.close()
            raise RuntimeError(f"the buffer service did not start (exit code {code}); see {self.output}")
        if self.restore_file is not None:  # it answered: its log (if any) holds the state, restarts replay that
            self.restore_file.unlink(missing_ok=True)
            self.restore_file = None
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=_BUFFER_START_TIMEOUT_S + 10)
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self.listener.close()
        if self.config.ipc_path is not None:
            self.config.ipc_path.unlink(missing_ok=True)
            if self._private_dir is not None:
                self._private_dir.rmdir()

    def _socket_path(self, run_dir: Path) -> Path:
        """The Unix socket, in a 0700 folder of the run, or of /tmp when the run's path is too
        long for a socket address (108 bytes on Linux)."""
        from buffer.auth import check_private_dir

        folder = run_dir / "buffer-socket"
        if len(str(folder / _SOCKET_NAME).encode()) > _MAX_SOCKET_PATH:
            import tempfile

            folder = self._private_dir = Path(tempfile.mkdtemp(prefix="etarl-buffer-"))  # made 0700
        else:
            folder.mkdir(mode=0o700, exist_ok=True)
            os.chmod(folder, 0o700)  # an existing folder, or a umask that cleared bits mkdir asked for
        check_private_dir(folder)
        return folder / _SOCKET_NAME

    def _spawn(self) -> subprocess.Popen:
        # Its own session: a Ctrl-C in the terminal stops the run after its step (which still needs
        # the buffer), not the buffer; the controller stops it last. services.buffer_child ends it
        # if the controller dies first (no orphan holding the port and writing the log).
        from services.buffer_child import PARENT_ENV

        env = {**os.environ, PARENT_ENV: str(os.getpid())}
        fd = self.listener.fileno()
        restore = ["--restore", str(self.restore_file)] if self.restore_file is not None else []
        with open(self.output, "ab") as out:
            return subprocess.Popen([sys.executable, "-m", "services.buffer_child", "serve", "--config",
                                     str(self.config_file), "--listen-fd", str(fd), *restore], stdout=out,
                                    stderr=subprocess.STDOUT, start_new_session=True, env=env, pass_fds=(fd,))

    def _wait_ready(self, process: subprocess.Popen) -> bool:
        """Whether the service answers a health check before it exits or the start-up time runs out."""
        from buffer.client import BufferClient
        from buffer.config import ClientConfig

        probe = BufferClient.from_config(self.config)
        probe.settings = ClientConfig(request_timeout_s=1.0, retries=0)
        deadline = time.monotonic() + _BUFFER_START_TIMEOUT_S
        try:
            while time.monotonic() < deadline and not self._stop.is_set():
                if process.poll() is not None:
                    return False
                try:
                    probe.health()
                    return True
                except Exception:
                    time.sleep(0.2)
            return False
        finally:
            probe.close()

    def _watch(self) -> None:
        while not self._stop.wait(_SUPERVISE_EVERY_S):
            code = self.process.poll()
            if code is None or self._stop.is_set():
                continue
            what = f"the buffer service (pid {self.process.pid}) exited with code {code}"
            run_dir, path = self.output.parent, self.config.log.path
            if self.restarts >= self.max_restarts:
                held = (f"Its log {path} holds everything it accepted" if path is not None else
                        "It had no durable log (buffer.max_restarts > 0 gives it one in the run folder)")
                self.failure = (f"{what} after {self.restarts} restart(s); buffer.max_restarts={self.max_restarts} "
                                f"allows no more, so the run stops (see {self.output}). {held}. Resume from the "
                                f"last checkpoint: etarl train --resume {run_dir}")
            elif path is None:
                self.failure = (f"{what}, and it has no durable log (buffer.log.path is unset): a restart would "
                                f"lose every group it had accepted, so the run stops. Set buffer.log.path (e.g. "
                                f"buffer.log.path={run_dir / SERVICE_LOG}) to let the controller restart it from "
                                f"its log")
            if self.failure is not None:
                log.error("%s", self.failure)
                return
            self.restarts += 1
            log.warning("%s; restarting it on %s from its log %s (restart %d of buffer.max_restarts=%d)", what,
                        self.config.endpoint, self.config.log.path, self.restarts, self.max_restarts)
            self.process = self._spawn()
            if self._wait_ready(self.process):
                log.warning("the buffer service is back (pid %d) after replaying its log", self.process.pid)
            elif self.process.poll() is None and not self._stop.is_set():
                self.process.kill()  # never answered: counts as another death on the next poll
                self.process.wait()
