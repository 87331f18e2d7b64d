"""ZMQ client of the buffer service: timeouts, reconnects and retries.

Every operation is safe to retry: permits and leases carry client-chosen ids (a retried acquire or
pull returns the same permit or lease), pushes are idempotent by sample_id, and release, ack,
nack and set_version are idempotent. A request that gets no reply in time is resent on a fresh
socket (a DEALER keeps no state worth saving); after `retries` resends it raises BufferUnavailable.
An error reply raises RemoteError with the server's reason and message.

`services.buffer_actor.RayBufferClient` has the same methods over a Ray actor.
"""
from __future__ import annotations

import threading
import time

import zmq

from buffer import auth
from buffer.admission import Permit
from buffer.codec import (decode_group, decode_message_header, encode_group, encode_message, pack_frames,
                          pulled_limits, unpack_frames)
from buffer.config import BufferConfig, ClientConfig, CurveConfig, SampleLimits
from buffer.errors import BufferUnavailable, LogFailed, ProtocolError, RemoteError
from buffer.sample import Group, PulledBatch, new_id


_ABANDON_CHECK_S = 0.25


class BufferClient:
    def __init__(self, endpoint: str, client: ClientConfig | None = None, curve: CurveConfig | None = None,
                 limits: SampleLimits | None = None, context: zmq.Context | None = None):
        self.endpoint = endpoint
        self.settings = client or ClientConfig()
        self.curve = curve or CurveConfig()
        self.limits = limits or SampleLimits()
        self._context = context or zmq.Context.instance()
        self._socket: zmq.Socket | None = None
        self._timeouts: dict[int, int] = {}  # socket option -> ms last set on self._socket
        self._lock = threading.Lock()
        self.reconnects = 0
        # Optional: a callable saying why the buffer is gone for good (None while it may answer),
        # asked before each attempt and every _ABANDON_CHECK_S of a wait (a supervisor that gave
        # up: the caller learns it at once, not after its timeouts and retries).
        self.abandon = None

    @classmethod
    def from_config(cls, config: BufferConfig, endpoint: str | None = None) -> "BufferClient":
        return cls(endpoint or config.endpoint, config.client, config.curve, config.limits)

    # ---- the buffer API ---------------------------------------------------------------------

    def acquire_permit(self, worker_id: str, timeout: float = 0.0) -> Permit | None:
        """A permit to generate one group, or None if the η gate stays closed for `timeout` seconds."""
        permits = self.acquire_permits(worker_id, 1, timeout)
        return permits[0] if permits else None

    def acquire_permits(self, worker_id: str, count: int, timeout: float = 0.0) -> list[Permit]:
        """Up to `count` permits in one round trip: waits up to `timeout` for the first, then takes
        as many more as the gate allows right now. Empty if the gate stays closed."""
        result, _ = self._call("acquire_permits", {"worker_id": worker_id, "timeout": float(timeout),
                                                   "permit_ids": [new_id() for _ in range(count)]}, wait=timeout)
        return [Permit(**p) for p in result]

    def release_permit(self, permit_id: str, quarantine: str | None = None) -> bool:
        """Give a permit back (generation failed or rejected); its ticket is reissued. With
        `quarantine` (why: the engine's error), its prompt is set aside for good. False if unknown."""
        args = {"permit_id": permit_id} if quarantine is None else {"permit_id": permit_id, "quarantine": quarantine}
        return self._call("release_permit", args)[0]

    def filter_group(self, permit_id: str, reason: str) -> bool:
        """End a permit whose group is uninformative (dynamic sampling: `reason`, e.g. every
        sample scored alike) instead of pushing it: its ticket ends untrained, not reissued.
        False if the permit is not held."""
        return self._call("filter_group", {"permit_id": permit_id, "reason": reason})[0]

    def push_group(self, group: Group, permit_id: str) -> dict:
        """Push a finished group under its permit. Returns {"samples": n, "duplicate": bool};
        a retried push of the same sample ids is a no-op with duplicate=True."""
        return self.push_groups([group], [permit_id])[0]

    def push_groups(self, groups: list[Group], permit_ids: list[str]) -> list[dict]:
        """Push several groups, each under its permit, in one round trip; all or nothing (an
        invalid group refuses the whole push and the error names it). A result per group."""
        return self._push(groups, permit_ids, {})["results"]

    def push_and_acquire(self, groups: list[Group], permit_ids: list[str], worker_id: str,
                         count: int) -> tuple[list[dict], list[Permit]]:
        """`push_groups`, and in the same round trip up to `count` next permits that are free right
        now (no waiting; empty if the gate is closed). If the push fails, no permit is taken."""
        if count <= 0:
            return self.push_groups(groups, permit_ids), []
        result = self._push(groups, permit_ids, {"worker_id": worker_id,
                                                 "next_permit_ids": [new_id() for _ in range(count)]})
        return result["results"], [Permit(**p) for p in result["permits"]]

    def _push(self, groups: list[Group], permit_ids: list[str], more_args: dict) -> dict:
        """The push_groups request: one packed group per payload frame."""
        payload = [pack_frames(encode_group(g)) for g in groups]
        return self._call("push_groups", {"permit_ids": list(permit_ids), **more_args}, payload)[0]

    def pull_batch(self, batch_size: int, timeout: float = 0.0, ack_lease_id: str | None = None,
                   version: int | None = None) -> PulledBatch | None:
        """The `batch_size` oldest groups under a lease, or None if fewer are ready within `timeout`.
        With `ack_lease_id` (and `version`), the previous batch is acked first, as `ack` does, in
        the same request: a refused ack raises and pulls nothing."""
        args = {"batch_size": int(batch_size), "timeout": float(timeout), "lease_id": new_id()}
        if ack_lease_id is not None:
            args["ack_lease_id"] = ack_lease_id
        if version is not None:
            args["version"] = int(version)
        result, frames = self._call("pull_batch", args, wait=timeout)
        if result is None:
            return None
        groups = [decode_group(unpack_frames(packed), pulled_limits(self.limits)) for packed in frames]
        return PulledBatch(result["lease_id"], groups, result["dropped_stale"], result["version"],
                           result.get("prompts_quarantined", 0), result.get("groups_filtered", 0))

    def ack(self, lease_id: str, version: int | None = None) -> int:
        """The batch was trained on: its groups are consumed. Returns the number of groups. With
        `version`, also the learner's new weight version (`set_version`), in the same request."""
        args = {"lease_id": lease_id} if version is None else {"lease_id": lease_id, "version": int(version)}
        return self._call("ack", args)[0]

    def nack(self, lease_id: str, failed: bool = False) -> int:
        """Hand a leased batch back; its groups are pulled again, oldest first. `failed`: the
        learner failed on it (counted per group; see buffer.max_deliveries)."""
        return self._call("nack", {"lease_id": lease_id, **({"failed": True} if failed else {})})[0]

    def set_version(self, version: int) -> None:
        """The learner's weight version. Call it before publishing those weights to workers."""
        self._call("set_version", {"version": int(version)})

    def set_eta(self, eta: int | None) -> None:
        """The staleness bound η from now on (the run's adaptive controller; None: unbounded)."""
        self._call("set_eta", {"eta": None if eta is None else int(eta)})

    def recover(self, version: int) -> None:
        """Resume a run at learner version v on a buffer with no durable state: accepted = v·B."""
        self._call("recover", {"version": int(version)})

    def stats(self) -> dict:
        return self._call("stats", {})[0]

    def health(self) -> dict:
        return self._call("health", {})[0]

    def snapshot(self, wait: float = 0.0) -> bytes:
        """The buffer's state for a checkpoint: its log records, msgpack-packed (what `python -m
        buffer serve --restore FILE` starts from). `wait`: seconds beyond the request timeout that
        a large buffer may take."""
        return bytes(self._call("snapshot", {}, wait=wait)[1][0])

    def close(self) -> None:
        with self._lock:
            self._reset_socket()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # ---- transport --------------------------------------------------------------------------

    def _connect(self) -> zmq.Socket:
        if self._socket is None:
            sock = self._context.socket(zmq.DEALER)
            sock.linger = 0
            if self.curve.enabled:
                auth.configure_client(sock, self.curve)
            sock.connect(self.endpoint)
            self._socket = sock
        return self._socket

    def _reset_socket(self) -> None:
        if self._socket is not None:
            self._socket.close(linger=0)
            self._socket = None
            self._timeouts = {}

    def _call(self, op: str, args: dict, payload=(), wait: float = 0.0):
        request_id = new_id()
        message = encode_message({"id": request_id, "op": op, "args": args}, payload)
        timeout_s = self.settings.request_timeout_s + max(0.0, wait)
        log_failed = None  # the last log_failed reply: raised if no attempt after it is answered
        with self._lock:
            for attempt in range(self.settings.retries + 1):
                self._raise_if_abandoned(op)
                if attempt:
                    self.reconnects += 1
                    time.sleep(self.settings.retry_backoff_s * attempt)
                sock = self._connect()
                # A send must not block forever (a full or unreachable peer): it counts as a lost attempt.
                self._set_timeout(sock, zmq.SNDTIMEO, timeout_s)
                try:
                    sock.send_multipart(message, copy=False)
                except zmq.Again:
                    self._reset_socket()
                    continue
                try:
                    reply = self._receive(sock, op, request_id, timeout_s)
                except RemoteError as err:
                    if err.reason != LogFailed.reason:
                        raise
                    # The service's disk failed: it exits and its supervisor restarts it from the
                    # log, where nothing of this request was kept; resending is safe (ids).
                    reply, log_failed = None, err
                if reply is not None:
                    return reply
                self._reset_socket()
        if log_failed is not None:
            raise log_failed
        raise BufferUnavailable(f"buffer at {self.endpoint} did not answer {op!r} within {timeout_s:.1f}s "
                                f"({self.settings.retries + 1} attempts)")

    def _set_timeout(self, sock: zmq.Socket, option: int, seconds: float) -> None:
        """setsockopt only when the value changes (it is a syscall-priced call on every request)."""
        ms = int(seconds * 1000) + 1
        if self._timeouts.get(option) != ms:
            sock.setsockopt(option, ms)
            self._timeouts[option] = ms

    def _raise_if_abandoned(self, op: str) -> None:
        why = self.abandon() if self.abandon is not None else None
        if why:
            raise BufferUnavailable(f"buffer at {self.endpoint} will not answer {op!r}: {why}")

    def _receive(self, sock: zmq.Socket, op: str, request_id: str, timeout_s: float):
        deadline, wait = time.monotonic() + timeout_s, timeout_s
        while wait > 0:
            # A blocking receive with a timeout: one call per reply (poll + recv costs two); in
            # slices when the caller may learn that the buffer is gone (`abandon`).
            self._set_timeout(sock, zmq.RCVTIMEO, wait if self.abandon is None else min(wait, _ABANDON_CHECK_S))
            try:
                frames = sock.recv_multipart(copy=False)
            except zmq.Again:
                if self.abandon is None:
                    return None
                self._raise_if_abandoned(op)
                wait = deadline - time.monotonic()
                continue
            header = decode_message_header(frames[0].buffer, ("id", "ok"))
            if header["id"] != request_id:
                wait = deadline - time.monotonic()
                continue  # a late reply to an earlier, timed-out attempt
            if not header["ok"]:
                error = header.get("error") or {}
                reason = error.get("reason", "remote_error")
                raise RemoteError(f"buffer error ({reason}): {error.get('message', '?')}", reason)
            if "result" not in header:
                raise ProtocolError("reply without result", "bad_reply")
            return header["result"], [f.buffer for f in frames[1:]]
        return None
