"""The buffer as a Ray actor (transport "ray"): the same `BufferCore` as the ZMQ service.

`BufferActor` holds the core and a housekeeping thread (permit and lease expiry, log sync); it
is a threaded actor, so blocking calls (long-polled acquire and pull) wait without stopping
others, with separate concurrency groups for the workers' calls and the learner's: however many
workers long-poll for permits, the learner's pull and ack are served. Groups cross the actor boundary as the same packed groups the ZMQ service uses, so both
transports validate and store identically. `RayBufferClient` has the methods of
`buffer.client.BufferClient`.

Surviving a SIGKILL: started with `max_restarts` > 0 and a durable log (`log.path`), Ray restarts
the actor's process and runs its constructor again, which replays the log (permits, groups,
leases, acked lease ids, the ids of every accepted sample). Clients resend a call that failed
because the actor was restarting with the same ids, so a retry is recognised (same permit, same
lease, duplicate push, repeated ack): nothing accepted is lost or delivered twice. A `starts_file`
counts the actor's starts across restarts (Ray tells a restarted actor only that it is one).

Failing stop: once the durable log fails (a write or fsync error, `buffer.durable_log.LogFailed`)
every call raises it, and the housekeeping thread ends the actor's process within a tick
(`LOG_FAILED_EXIT`), so Ray restarts it from the log (or, past `max_restarts`, reports it dead).
`RayBufferClient` resends a call refused that way, as it does one that met a restarting actor.
"""
from __future__ import annotations

import logging
import os
import threading
import time
from pathlib import Path

import ray

from buffer.admission import Permit
from buffer.codec import decode_group, encode_group, pack_frames, pulled_limits, unpack_frames
from buffer.config import BufferConfig
from buffer.core import BufferCore, PullResult
from buffer.errors import BufferError, BufferUnavailable, LogFailed, RemoteError
from buffer.sample import Group, PulledBatch, new_id

log = logging.getLogger(__name__)

# Two thread pools: the workers' calls (long-polled acquires, pushes) and the learner's (pull, ack,
# version, stats; checkpoints), so the controller's requests never wait behind parked acquires.
WORKERS, LEARNER = "workers", "learner"
_CONCURRENCY = {WORKERS: 64, LEARNER: 8}
_TICK_S = 0.2
# A call that meets a dead actor is retried this long. Ray reports an actor that it is restarting
# as unavailable (ActorUnavailableError, retried until the client's time runs out) and one it will
# not restart as dead; the grace is only a margin against a death reported early.
_DEATH_GRACE_S = 1.0
LOG_FAILED_EXIT = 3  # the actor process's exit code when its durable log failed (as the ZMQ service's)


def count_start(starts_file: str | os.PathLike | None) -> int:
    """Record one start of this actor; the number of restarts so far. A fresh actor (not a Ray
    restart) starts the file again."""
    restarted = ray.get_runtime_context().was_current_actor_reconstructed
    if starts_file is None:
        return int(restarted)  # at least one, if this is a restart
    path = Path(starts_file)
    path.parent.mkdir(parents=True, exist_ok=True)
    line = f"{time.time():.3f} pid={os.getpid()}\n".encode()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | (0 if restarted else os.O_TRUNC), 0o600)
    try:
        os.write(fd, line)  # one write on an O_APPEND file: a line per start, never torn by a kill
    finally:
        os.close(fd)
    return max(int(restarted), len(path.read_bytes().splitlines()) - 1)


class BufferActor:
    def __init__(self, config: dict | BufferConfig, starts_file: str | None = None):
        self.restarts = count_start(starts_file)
        self.core = BufferCore(BufferConfig.model_validate(config))  # replays the durable log, if any
        if self.restarts:
            stats = self.core.stats()
            log.warning("buffer actor restarted (restart %d, pid %d): replayed %s: %d groups held, %d permits, "
                        "version %d", self.restarts, os.getpid(), self.core.config.log.path,
                        stats["groups_ready"] + stats["groups_leased"], stats["running"], stats["version"])
        self._stop = threading.Event()
        threading.Thread(target=self._housekeeping, name="buffer-housekeeping", daemon=True).start()

    def _housekeeping(self) -> None:
        """Expire permits and leases, sync the log; never ends quietly: on a failed log (here or
        in any call) the process exits so that Ray restarts it from the log."""
        while not self._stop.wait(_TICK_S):
            try:
                self.core.tick()
            except LogFailed:
                pass  # `core.failed` is set: handled below
            except Exception:  # a bug must not stop expiry and syncs silently: say so, go on
                log.exception("buffer actor: housekeeping tick failed")
            if self.core.failed is not None:
                log.critical("buffer actor (pid %d): its durable log failed, exiting (code %d) so that Ray restarts "
                             "it from %s: %s", os.getpid(), LOG_FAILED_EXIT, self.core.config.log.path,
                             self.core.failed)
                os._exit(LOG_FAILED_EXIT)  # a death Ray restarts (ray.actor.exit_actor would be a final one)

    @ray.method(concurrency_group=WORKERS)
    def acquire_permit(self, worker_id: str, timeout: float = 0.0, permit_id: str | None = None) -> Permit | None:
        return self.core.acquire_permit(worker_id, timeout, permit_id)

    @ray.method(concurrency_group=WORKERS)
    def acquire_permits(self, worker_id: str, permit_ids: list[str], timeout: float = 0.0) -> list[Permit]:
        return self.core.acquire_permits(worker_id, permit_ids, timeout)

    @ray.method(concurrency_group=WORKERS)
    def release_permit(self, permit_id: str, quarantine: str | None = None) -> bool:
        return self.core.release_permit(permit_id, quarantine)

    @ray.method(concurrency_group=WORKERS)
    def filter_group(self, permit_id: str, reason: str) -> bool:
        return self.core.filter_group(permit_id, reason)

    @ray.method(concurrency_group=WORKERS)
    def push_group(self, packed: bytes, permit_id: str) -> dict:
        return self.core.push_group(packed, permit_id)

    @ray.method(concurrency_group=WORKERS)
    def push_groups(self, packed: list[bytes], permit_ids: list[str]) -> list[dict]:
        return self.core.push_groups(packed, permit_ids)

    @ray.method(concurrency_group=WORKERS)
    def push_and_acquire(self, packed: list[bytes], permit_ids: list[str], worker_id: str,
                         next_permit_ids: list[str]) -> tuple[list[dict], list[Permit]]:
        return self.core.push_and_acquire(packed, permit_ids, worker_id, next_permit_ids)

    @ray.method(concurrency_group=LEARNER)
    def pull_batch(self, batch_size: int, timeout: float = 0.0, lease_id: str | None = None,
                   ack_lease_id: str | None = None, version: int | None = None) -> PullResult | None:
        return self.core.pull_batch(batch_size, timeout, lease_id, ack_lease_id, version)

    @ray.method(concurrency_group=LEARNER)
    def ack(self, lease_id: str, version: int | None = None) -> int:
        return self.core.ack(lease_id, version)

    @ray.method(concurrency_group=LEARNER)
    def nack(self, lease_id: str, failed: bool = False) -> int:
        return self.core.nack(lease_id, failed)

    @ray.method(concurrency_group=LEARNER)
    def set_version(self, version: int) -> None:
        self.core.set_version(version)

    @ray.method(concurrency_group=LEARNER)
    def set_eta(self, eta: int | None) -> None:
        self.core.set_eta(eta)

    @ray.method(concurrency_group=LEARNER)
    def recover(self, version: int) -> None:
        self.core.recover(version)

    @ray.method(concurrency_group=LEARNER)
    def stats(self) -> dict:
        return {**self.core.stats(), "restarts": self.restarts}

    @ray.method(concurrency_group=LEARNER)
    def health(self) -> dict:
        return {**self.core.health(), "restarts": self.restarts, "pid": os.getpid()}

    @ray.method(concurrency_group=LEARNER)
    def shutdown(self) -> None:
        self._stop.set()
        self.core.close()


def create_buffer_actor(config: BufferConfig, name: str | None = None, max_restarts: int = 0,
                        starts_file: str | os.PathLike | None = None, actor_class=BufferActor, **options):
    """Start the buffer actor (threaded, so long polls do not block other calls); returns its handle.
    `max_restarts` > 0 needs a durable log (`config.log.path`): a restart without one would come
    back empty, losing every group the buffer had accepted."""
    if max_restarts and config.log.path is None:
        raise ValueError("a buffer actor that Ray restarts needs a durable log (log.path) to replay; "
                         "without one a restart would lose the groups it held")
    actor_cls = ray.remote(num_cpus=0, concurrency_groups=_CONCURRENCY)(actor_class)
    if name is not None:
        options.setdefault("name", name)
    # Calls are not retried by Ray (max_task_retries=0): RayBufferClient resends them with the same
    # ids, so it decides what a retry means and reports a dead buffer clearly.
    options.update(max_restarts=max_restarts, max_task_retries=0)
    return actor_cls.options(**options).remote(config.model_dump(mode="json"),
                                                None if starts_file is None else str(starts_file))


class RayBufferClient:
    """`BufferClient`'s methods over a `BufferActor` handle. Each call waits up to
    `request_timeout_s` beyond its long-poll timeout. A call that fails because the actor is
    restarting (or gets no answer in time) is resent with the same arguments, ids included, until
    (retries + 1) request timeouts have passed; then, or when the actor is dead for good, it
    raises BufferUnavailable, as BufferClient does."""

    def __init__(self, actor, config: BufferConfig | None = None):
        self.actor = actor
        self.config = config or BufferConfig()
        self.reconnects = 0  # calls resent (BufferClient's name for it)

    def _call(self, method: str, *args, wait: float = 0.0):
        """The call's result; a buffer error inside the actor is raised as RemoteError with its
        reason, as BufferClient does."""
        settings = self.config.client
        timeout = settings.request_timeout_s + max(0.0, wait)
        started = time.monotonic()
        deadline = started + (settings.retries + 1) * timeout
        attempt = 0
        while True:
            if attempt:
                self.reconnects += 1
                time.sleep(min(settings.retry_backoff_s * attempt, 1.0))
            attempt += 1
            try:
                return ray.get(getattr(self.actor, method).remote(*args), timeout=timeout)
            except ray.exceptions.RayTaskError as exc:
                if not isinstance(exc.cause, LogFailed):
                    if isinstance(exc.cause, BufferError):
                        raise RemoteError(f"buffer error ({exc.cause.reason}): {exc.cause}", exc.cause.reason) from None
                    raise
                error = exc  # its log failed: the actor exits and Ray restarts it from the log, so resend
            except ray.exceptions.ActorUnavailableError as exc:  # restarting: Ray runs its constructor again
                error = exc
            except ray.exceptions.GetTimeoutError as exc:
                error = exc
            except ray.exceptions.RayActorError as exc:  # dead: restarts used up, or its constructor failed
                error = exc
                if time.monotonic() - started > _DEATH_GRACE_S or getattr(exc, "actor_init_failed", False):
                    raise BufferUnavailable(f"the buffer actor is dead and Ray will not restart it ({method!r} "
                                            f"failed): {_first_line(exc)}") from exc
            if time.monotonic() > deadline:
                raise BufferUnavailable(f"the buffer actor did not answer {method!r} within "
                                        f"{time.monotonic() - started:.1f}s ({attempt} attempts): "
                                        f"{_first_line(error)}") from error

    def acquire_permit(self, worker_id: str, timeout: float = 0.0) -> Permit | None:
        return self._call("acquire_permit", worker_id, float(timeout), new_id(), wait=timeout)

    def acquire_permits(self, worker_id: str, count: int, timeout: float = 0.0) -> list[Permit]:
        """Up to `count` permits in one call (ids chosen here: a resent call returns the same ones)."""
        return self._call("acquire_permits", worker_id, [new_id() for _ in range(count)], float(timeout),
                          wait=timeout)

    def release_permit(self, permit_id: str, quarantine: str | None = None) -> bool:
        return self._call("release_permit", permit_id, quarantine)

    def filter_group(self, permit_id: str, reason: str) -> bool:
        return self._call("filter_group", permit_id, reason)

    def push_group(self, group: Group, permit_id: str) -> dict:
        return self._call("push_group", pack_frames(encode_group(group)), permit_id)

    def push_groups(self, groups: list[Group], permit_ids: list[str]) -> list[dict]:
        """Several groups, each under its permit, all or nothing; a resent push is a duplicate."""
        return self._call("push_groups", [pack_frames(encode_group(g)) for g in groups], list(permit_ids))

    def push_and_acquire(self, groups: list[Group], permit_ids: list[str], worker_id: str,
                         count: int) -> tuple[list[dict], list[Permit]]:
        """`push_groups` and up to `count` next permits free right now, in one call."""
        if count <= 0:
            return self.push_groups(groups, permit_ids), []
        return self._call("push_and_acquire", [pack_frames(encode_group(g)) for g in groups], list(permit_ids),
                          worker_id, [new_id() for _ in range(count)])

    def pull_batch(self, batch_size: int, timeout: float = 0.0, ack_lease_id: str | None = None,
                   version: int | None = None) -> PulledBatch | None:
        result = self._call("pull_batch", int(batch_size), float(timeout), new_id(), ack_lease_id,
                            None if version is None else int(version), wait=timeout)
        if result is None:
            return None
        groups = [decode_group(unpack_frames(packed), pulled_limits(self.config.limits)) for packed in result.groups]
        return PulledBatch(result.lease_id, groups, result.dropped_stale, result.version, result.prompts_quarantined,
                           result.groups_filtered)

    def ack(self, lease_id: str, version: int | None = None) -> int:
        return self._call("ack", lease_id, None if version is None else int(version))

    def nack(self, lease_id: str, failed: bool = False) -> int:
        return self._call("nack", lease_id, failed)

    def set_version(self, version: int) -> None:
        self._call("set_version", int(version))

    def set_eta(self, eta: int | None) -> None:
        self._call("set_eta", None if eta is None else int(eta))

    def recover(self, version: int) -> None:
        self._call("recover", int(version))

    def stats(self) -> dict:
        return self._call("stats")

    def health(self) -> dict:
        return self._call("health")

    def call(self, method: str, *args, wait: float = 0.0):
        """Any other method of the actor (a checkpoint's snapshot and restore), with the same
        retries; `wait`: how much longer than a request it may take."""
        return self._call(method, *args, wait=wait)

    def close(self) -> None:
        """Nothing to close on the client side (the actor lives on); mirrors BufferClient."""


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0] if text else ''}"
