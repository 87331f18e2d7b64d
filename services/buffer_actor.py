"""The buffer as a Ray actor (transport "ray"): the same `BufferCore` as the ZMQ service.

`BufferActor` holds the core and a housekeeping thread (permit and lease expiry, log sync); it
is a threaded actor, so blocking calls (long-polled acquire and pull) wait without stopping
others. Groups cross the actor boundary as the same packed groups the ZMQ service uses, so both
transports validate and store identically. `RayBufferClient` has the methods of
`buffer.client.BufferClient`.
"""
from __future__ import annotations

import threading

import ray

from buffer.admission import Permit
from buffer.codec import decode_group, encode_group, pack_frames, unpack_frames
from buffer.config import BufferConfig
from buffer.core import BufferCore, PullResult
from buffer.errors import BufferError, RemoteError
from buffer.sample import Group, PulledBatch, new_id

_MAX_CONCURRENCY = 64
_TICK_S = 0.2


class BufferActor:
    def __init__(self, config: dict | BufferConfig):
        self.core = BufferCore(BufferConfig.model_validate(config))
        self._stop = threading.Event()
        threading.Thread(target=self._housekeeping, name="buffer-housekeeping", daemon=True).start()

    def _housekeeping(self) -> None:
        while not self._stop.wait(_TICK_S):
            self.core.tick()

    def acquire_permit(self, worker_id: str, timeout: float = 0.0, permit_id: str | None = None) -> Permit | None:
        return self.core.acquire_permit(worker_id, timeout, permit_id)

    def release_permit(self, permit_id: str) -> bool:
        return self.core.release_permit(permit_id)

    def push_group(self, packed: bytes, permit_id: str) -> dict:
        return self.core.push_group(packed, permit_id)

    def pull_batch(self, batch_size: int, timeout: float = 0.0, lease_id: str | None = None) -> PullResult | None:
        return self.core.pull_batch(batch_size, timeout, lease_id)

    def ack(self, lease_id: str) -> int:
        return self.core.ack(lease_id)

    def nack(self, lease_id: str) -> int:
        return self.core.nack(lease_id)

    def set_version(self, version: int) -> None:
        self.core.set_version(version)

    def recover(self, version: int) -> None:
        self.core.recover(version)

    def stats(self) -> dict:
        return self.core.stats()

    def health(self) -> dict:
        return self.core.health()

    def shutdown(self) -> None:
        self._stop.set()
        self.core.close()


def create_buffer_actor(config: BufferConfig, name: str | None = None, **options):
    """Start the buffer actor (threaded, so long polls do not block other calls); returns its handle."""
    actor_cls = ray.remote(num_cpus=0, max_concurrency=_MAX_CONCURRENCY)(BufferActor)
    if name is not None:
        options.setdefault("name", name)
    return actor_cls.options(**options).remote(config.model_dump(mode="json"))


class RayBufferClient:
    """`BufferClient`'s methods over a `BufferActor` handle. Retries are not needed (Ray delivers
    the call or raises); `request_timeout_s` bounds each call beyond its long-poll timeout."""

    def __init__(self, actor, config: BufferConfig | None = None):
        self.actor = actor
        self.config = config or BufferConfig()

    def _get(self, ref, wait: float = 0.0):
        """The call's result; a buffer error inside the actor is raised as RemoteError with its
        reason, as BufferClient does."""
        try:
            return ray.get(ref, timeout=self.config.client.request_timeout_s + max(0.0, wait))
        except ray.exceptions.RayTaskError as exc:
            if isinstance(exc.cause, BufferError):
                raise RemoteError(f"buffer error ({exc.cause.reason}): {exc.cause}", exc.cause.reason) from None
            raise

    def acquire_permit(self, worker_id: str, timeout: float = 0.0) -> Permit | None:
        return self._get(self.actor.acquire_permit.remote(worker_id, float(timeout), new_id()), timeout)

    def release_permit(self, permit_id: str) -> bool:
        return self._get(self.actor.release_permit.remote(permit_id))

    def push_group(self, group: Group, permit_id: str) -> dict:
        return self._get(self.actor.push_group.remote(pack_frames(encode_group(group)), permit_id))

    def pull_batch(self, batch_size: int, timeout: float = 0.0) -> PulledBatch | None:
        result = self._get(self.actor.pull_batch.remote(int(batch_size), float(timeout), new_id()), timeout)
        if result is None:
            return None
        groups = [decode_group(unpack_frames(packed), self.config.limits) for packed in result.groups]
        return PulledBatch(result.lease_id, groups, result.dropped_stale, result.version)

    def ack(self, lease_id: str) -> int:
        return self._get(self.actor.ack.remote(lease_id))

    def nack(self, lease_id: str) -> int:
        return self._get(self.actor.nack.remote(lease_id))

    def set_version(self, version: int) -> None:
        self._get(self.actor.set_version.remote(int(version)))

    def recover(self, version: int) -> None:
        self._get(self.actor.recover.remote(int(version)))

    def stats(self) -> dict:
        return self._get(self.actor.stats.remote())

    def health(self) -> dict:
        return self._get(self.actor.health.remote())

    def close(self) -> None:
        """Nothing to close on the client side (the actor lives on); mirrors BufferClient."""
