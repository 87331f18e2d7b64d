"""`BufferCore`: the η gate + the group store + the optional durable log, behind one lock.

Both transports wrap it: the ZMQ service (`buffer.server`) and the Ray actor
(`services.buffer_actor`). Groups arrive as wire frames (`buffer.codec`); the core validates them,
keeps them packed, and hands the packed groups out on pull. Every state change is written to the durable log
(when configured) before the caller gets an answer; on start the log is replayed, so permits,
tickets, versions, unconsumed groups and leases survive a crash (a learner that trained on a
leased batch acks it after the restart, so no group is delivered twice; a lease nobody acks comes
back when it expires).

Methods with a `timeout` block up to that long (long poll); the ZMQ server calls them with
timeout 0 and parks waiting requests itself.

The core fails stop with its log: a record that cannot be written or synced
(`buffer.durable_log.LogFailed`) fails its request, and every later call raises `LogFailed` too
(`failed` is set), so nothing is answered from a state the log may not hold; the owner (the ZMQ
service, the Ray actor) then exits and is restarted from the log.

`stats()` keys (gauges unless marked counter; counters count since this process started, except
the gate's, which are restored from the log):
  version                      learner weight version i
  eta, batch_size, max_concurrent, store_capacity_groups, store_max_bytes   settings
  capacity                     permits grantable now: the η formula, within the store's free room
  running                      permits held (generations in flight)
  enqueued                     acquire requests waiting for capacity
  accepted                     counter: groups accepted (recovery sets it to v·B)
  rejected                     counter: acquire requests that ended without a permit
  permits_released, permits_reclaimed            counters
  next_ticket, free_tickets    data cursor and tickets waiting to be reissued
  prompts_quarantined          counter: tickets set aside for good (their prompt fails the engine)
  groups_filtered              counter: tickets whose group was uninformative (dynamic sampling)
  groups_ready, groups_leased, samples_ready, bytes_held     store contents
  pushed_samples, pushed_groups, duplicate_pushes            counters
  consumed_samples, consumed_groups                          counters (acked)
  dropped_samples: {reason: n}, dropped_groups: {reason: n}  counters (reason "stale", or "poisoned":
                               its lease failed buffer.max_deliveries times: expired or nacked as failed)
  bad_messages: {reason: n}    counters: malformed messages and invalid samples
  request_errors: {reason: n}  counters: refused requests (unknown_permit, buffer_full, ...)
  gate_wait_seconds            counter: total time acquire requests waited
  gate_waits                   counter: acquire requests that waited
  consumed_staleness: {staleness: n}  counter: consumed samples by (pull version − weight_version)
  consumed_groups_by_length, dropped_groups_by_length: {le: n}  counters: groups consumed, and
                               dropped as stale, by their longest response (LENGTH_BUCKETS): the
                               stale-drop rate by length
  leases_expired, nacks        counters
  log_bytes, log_fsyncs, log_compactions        durable log (0 without a log)
  log_compaction_longest_lock_s  the longest a background compaction held the lock (its swap)
  log_compaction_running       a background compaction is under way (its count comes at its swap)
  log_compaction_windows       (start, end) wall-clock times of the recent compactions
"""
from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections import Counter
from dataclasses import dataclass

import msgpack

from buffer.admission import AdmissionGate, Permit
from buffer.codec import check_group, group_index, pack_frames, unpack_frames
from buffer.config import BufferConfig
from buffer.durable_log import Compaction, DurableLog
from buffer.errors import BufferError, LogFailed, ProtocolError, RequestError
from buffer.sample import new_id
from buffer.store import GroupStore, Lease

log = logging.getLogger(__name__)
_WAIT_SLICE_S = 0.25
# Upper bounds (tokens of a group's longest response) of the buckets that count settled groups
# by length: staleness is judged by a group's start version, so long generations are the ones dropped.
LENGTH_BUCKETS = (64, 256, 1024, 4096, 16384)


def length_bucket(tokens: int) -> str:
    """The Prometheus-style `le` label of a response length."""
    return next((str(b) for b in LENGTH_BUCKETS if tokens <= b), "+Inf")  # blocked callers re-check leases and deadlines at least this often


@dataclass
class PullResult:
    lease_id: str
    groups: list[bytes]  # packed groups (buffer.codec.unpack_frames)
    dropped_stale: int
    version: int
    prompts_quarantined: int = 0
    groups_filtered: int = 0


class _Counters:
    def __init__(self):
        self.pushed_samples = self.pushed_groups = self.duplicate_pushes = 0
        self.consumed_samples = self.consumed_groups = 0
        self.gate_wait_seconds = 0.0
        self.gate_waits = self.leases_expired = self.nacks = 0
        self.dropped_samples: Counter = Counter()
        self.dropped_groups: Counter = Counter()
        self.bad_messages: Counter = Counter()
        self.request_errors: Counter = Counter()
        self.consumed_staleness: Counter = Counter()
        self.settled_by_length = {"consumed": Counter(), "dropped": Counter()}  # length bucket -> groups


class BufferCore:
    def __init__(self, config: BufferConfig, clock=time.monotonic):
        self.config = config
        self.limits = config.limits
        self.clock = clock
        g = config.gate
        self.gate = AdmissionGate(g.batch_size, g.initial_eta, g.max_concurrent, g.permit_lease_s,
                                  config.max_version_jump)
        self.store = GroupStore(config.store.capacity_groups, config.store.lease_s,
                                remembered_settled=config.store.remembered_settled_groups,
                                max_bytes=config.store.max_bytes)
        self.enqueued = 0
        self._pending_dropped = 0
        self._poisoned: dict[str, int] = {}  # group id -> its handed_out when marked poisoned (dropped at the next pull)
        self._settled: list[dict] = []  # ack and drop records since the last compaction (to archive)
        self._settle_n = 0  # the next settle number (an ack or drop record's `n`)
        self._lock = threading.RLock()
        self._changed = threading.Condition(self._lock)
        self._requests = threading.local()  # this thread's request depth (group commit at depth 0)
        self._compaction: threading.Thread | None = None
        self.counters = _Counters()
        self.log: DurableLog | None = None
        self.failed: LogFailed | None = None  # the log failed: every later call raises (fail stop)
        self.started_at = time.time()
        if config.log.path is not None:
            self.log = DurableLog(config.log)
            for record in self.log.replay():
                self._replay(record)
            self._mark_poisoned(self.store.ready.values())  # failures counted from the logged records
            # The doubling rule counts from what the live state needs, not from the disk at open:
            # segments a previous process filled with groups consumed since are reclaimed by the
            # next compaction instead of waiting for the disk to double again.
            self.log.base_bytes = self.log.size + sum(g.blob[2] for g in self.store.live_groups() if g.blob)

    # ---- the gate ---------------------------------------------------------------------------

    def acquire_permit(self, worker_id: str, timeout: float = 0.0, permit_id: str | None = None) -> Permit | None:
        """One permit, or None if the gate stays closed for `timeout` seconds."""
        permits = self.acquire_permits(worker_id, [permit_id or new_id()], timeout)
        return permits[0] if permits else None

    def acquire_permits(self, worker_id: str, permit_ids: list[str], timeout: float = 0.0) -> list[Permit]:
        """Up to len(permit_ids) permits: waits up to `timeout` for the first, then takes as many
        more as are free right now (a worker generating several groups in one engine batch)."""
        with self._request():
            permits = self.try_acquire_many(worker_id, permit_ids)
            if permits or timeout <= 0:
                self.finish_gate_wait(bool(permits))
                return permits
            start = self.clock()
            self.start_gate_wait()
            try:
                while not permits and (left := start + timeout - self.clock()) > 0:
                    self._changed.wait(min(left, _WAIT_SLICE_S))
                    permits = self.try_acquire_many(worker_id, permit_ids)
            finally:
                self.finish_gate_wait(bool(permits), start)
            return permits

    def try_acquire_many(self, worker_id: str, permit_ids: list[str]) -> list[Permit]:
        """Non-blocking: a permit per id, in order, while the gate has capacity. Ids of permits
        already granted return those permits (a retried request)."""
        with self._request():
            permits = []
            for permit_id in permit_ids:
                permit = self.try_acquire(worker_id, permit_id)
                if permit is None:
                    break
                permits.append(permit)
            return permits

    def try_acquire(self, worker_id: str, permit_id: str | None = None) -> Permit | None:
        """One non-blocking attempt; a known permit_id returns its permit (a retried request)."""
        if not isinstance(worker_id, str) or len(worker_id) > self.limits.max_string_chars:
            raise ProtocolError("worker_id must be a short string", "bad_args")
        with self._request():
            self._tick_locked()
            known = permit_id is not None and permit_id in self.gate.permits
            if not known and self._store_room() <= 0:
                return None  # no room for its group: wait, rather than generate a push refused as full
            permit = self.gate.try_acquire(worker_id, self.clock(), permit_id)
            if permit is not None and not known:
                # Not synced on its own: a grant lost in a machine crash is harmless (DurableLog.append)
                self._append({"op": "acquire", "permit": permit.to_dict()}, durable=False)
            return permit

    def _store_room(self) -> int:
        """Groups the store can still take beyond those held and those being generated."""
        return self.store.room() - self.gate.running

    def capacity(self) -> int:
        """Permits grantable now: the gate's η formula, and room in the store for their groups."""
        with self._request():
            return min(self.gate.capacity(), self._store_room())

    def start_gate_wait(self) -> None:
        """An acquire request starts waiting for capacity (the ZMQ server parks it)."""
        with self._request():
            self.enqueued += 1

    def finish_gate_wait(self, granted: bool, started: float | None = None) -> None:
        """Account one acquire request that is over, granted or not; `started` (core clock) is
        when a request that waited called `start_gate_wait`."""
        with self._request():
            if started is not None:
                self.enqueued -= 1
                self.counters.gate_wait_seconds += self.clock() - started
                self.counters.gate_waits += 1
            if not granted:
                self.gate.rejected += 1

    def release_permit(self, permit_id: str, quarantine: str | None = None) -> bool:
        """End a permit without a group: its ticket is reissued, or, with `quarantine` (the
        engine's error for a prompt that failed on its own again and again), set aside for good.
        False if the permit is not held."""
        if quarantine is not None:
            return self._end_for_good("quarantine", permit_id, quarantine)
        with self._request():
            if self.gate.release(permit_id) is None:
                return False
            self._append({"op": "release", "permit": permit_id})
            self._changed.notify_all()
            return True

    def filter_group(self, permit_id: str, reason: str) -> bool:
        """End a permit whose group was generated and is uninformative (dynamic sampling: `reason`,
        e.g. every sample scored alike): its ticket ends untrained and is not reissued. False if
        the permit is not held."""
        return self._end_for_good("filter", permit_id, reason)

    def _end_for_good(self, op: str, permit_id: str, reason: str) -> bool:
        """End a permit and its ticket for good (`op`: quarantine or filter), logged with why."""
        with self._request():
            permit = self._ending(op)(permit_id)
            if permit is None:
                return False
            reason = reason[: self.limits.max_string_chars]
            self._append({"op": op, "permit": permit_id, "ticket": permit.ticket, "reason": reason})
            if op == "quarantine":
                log.warning("buffer: ticket %d quarantined (its prompt is never reissued): %s", permit.ticket, reason)
            self._changed.notify_all()
            return True

    def _ending(self, op: str):
        """The gate's end of a permit for good, by its log op."""
        return {"quarantine": self.gate.quarantine, "filter": self.gate.filter}[op]

    def set_version(self, version: int) -> None:
        with self._request():
            if version != self.gate.version:
                self.gate.set_version(version)
                self._append({"op": "version", "version": version})
                self._changed.notify_all()

    def set_eta(self, eta: int | None) -> None:
        """The staleness bound in force from now on (the run's adaptive η controller sends it);
        logged, so a restart keeps it."""
        with self._request():
            if eta != self.gate.eta:
                self.gate.set_eta(eta)
                self._append({"op": "eta", "eta": eta})
                self._changed.notify_all()

    def recover(self, version: int) -> None:
        """Resume a run at learner version v with a fresh buffer: accepted = v·B (see AdmissionGate)."""
        with self._request():
            self.gate.recover(version)
            self._append({"op": "recover", "version": version})
            self._changed.notify_all()

    # ---- the store --------------------------------------------------------------------------

    def push_group(self, group, permit_id: str) -> dict:
        """Validate and accept one group under its permit. Idempotent by sample_id. `group` is a
        packed group (what the transports send) or the group's frames (`encode_group`).
        Returns {"samples": n, "duplicate": bool}."""
        return self.push_groups([group], [permit_id])[0]

    def push_groups(self, groups: list, permit_ids: list[str]) -> list[dict]:
        """`push_group` for several groups, all or nothing: if any group is invalid or its permit
        does not match, none is accepted and the error names the group. A group already accepted
        (the same sample ids) is a no-op reported as a duplicate."""
        if len(groups) != len(permit_ids):
            raise ProtocolError(f"{len(groups)} groups but {len(permit_ids)} permit ids", "bad_args")
        packed = [self._packed(g) for g in groups]
        with self._request():
            self._tick_locked()
            checked = [self._check_push(p, permit_id, position) for position, (p, permit_id)
                       in enumerate(zip(packed, permit_ids))]
            views, duplicate = [c[0] for c in checked], [c[1] for c in checked]
            fresh = [(v, permit_id, p) for v, permit_id, p, dup in zip(views, permit_ids, packed, duplicate) if not dup]
            _check_distinct(fresh)
            self.store.check_room(len(fresh), sum(memoryview(data).nbytes for _, _, data in fresh))
            for view, permit_id, data in fresh:
                self._accept(view, permit_id, data)
            self.counters.duplicate_pushes += sum(duplicate)
            if fresh:
                self._changed.notify_all()
            return [{"samples": len(v.sample_ids), "duplicate": dup} for v, dup in zip(views, duplicate)]

    def push_and_acquire(self, groups: list, permit_ids: list[str], worker_id: str,
                         next_permit_ids: list[str]) -> tuple[list[dict], list[Permit]]:
        """`push_groups`, then as many of the next permits as the gate allows right now (no
        waiting): a worker's push and its next acquire in one request. If the push fails, no
        permit is taken. Ids of permits already granted return those (a retried request)."""
        with self._request():
            results = self.push_groups(groups, permit_ids)
            return results, self.try_acquire_many(worker_id, next_permit_ids)

    def _packed(self, group):
        """A packed group as received (bytes or a view into a received message: kept without a
        copy), or the packed form of a group's frames."""
        packed = pack_frames(group) if isinstance(group, (list, tuple)) else group
        if memoryview(packed).nbytes > self.limits.max_message_bytes:
            raise ProtocolError(f"group of {memoryview(packed).nbytes} bytes exceeds max_message_bytes", "oversized")
        return packed

    def _check_push(self, packed: bytes, permit_id: str, position: int):
        """(the validated group, whether it was accepted before); raises for a bad group or,
        unless it is a duplicate, a bad permit."""
        try:
            view = check_group(unpack_frames(packed), self.limits, max_version=self.gate.version)
            if self.store.is_duplicate(view.group_id, view.sample_ids):
                return view, True
            permit = self.gate.permits.get(permit_id)
            if permit is None:
                self.gate.consume(permit_id)  # raises the unknown_permit error
            if permit.ticket != view.prompt_index:
                raise RequestError(f"group {view.group_id!r} has prompt_index {view.prompt_index} but permit "
                                   f"{permit_id!r} is for ticket {permit.ticket}", "ticket_mismatch")
            return view, False
        except BufferError as exc:
            if position:  # say which group of a multi-group push
                exc.args = (f"group {position} of the push: {exc}",)
            raise

    def _accept(self, view, permit_id: str, packed: bytes) -> None:
        seq = self.store.next_seq
        blob = self._append({"op": "push", "permit": permit_id, "seq": seq, "group": packed})
        self.gate.consume(permit_id)
        self.store.add(view.index(), packed, seq).blob = blob
        self.counters.pushed_groups += 1
        self.counters.pushed_samples += len(view.sample_ids)

    def pull_batch(self, batch_size: int, timeout: float = 0.0, lease_id: str | None = None,
                   ack_lease_id: str | None = None, version: int | None = None) -> PullResult | None:
        """The batch_size oldest fresh groups under a lease (a known lease_id returns that lease).
        With `ack_lease_id` (and `version`), first `ack(ack_lease_id, version)`: the learner's
        step end and its next batch in one request (a refused ack pulls nothing)."""
        most = min(self.limits.max_batch_groups, self.store.capacity_groups)
        if not 1 <= batch_size <= most:
            raise RequestError(f"batch_size {batch_size} must be in [1, {most}]", "bad_batch_size")
        if version is not None and ack_lease_id is None:
            raise ProtocolError("pull_batch: version is set with the ack of the previous batch (ack_lease_id)",
                                "bad_args")
        with self._request():
            if ack_lease_id is not None:
                self.ack(ack_lease_id, version)
            result = self.try_pull(batch_size, lease_id)
            deadline = self.clock() + timeout
            while result is None and (left := deadline - self.clock()) > 0:
                self._changed.wait(min(left, _WAIT_SLICE_S))
                result = self.try_pull(batch_size, lease_id)
            return result

    def try_pull(self, batch_size: int, lease_id: str | None = None) -> PullResult | None:
        with self._request():
            if lease_id is not None and lease_id in self.store.leases:
                return self._result(self.store.leases[lease_id], 0)  # a retried pull
            self._tick_locked()
            self._drop_stale()
            self._drop_poisoned()
            lease = self.store.lease(batch_size, lease_id or new_id(), self.clock(), self.gate.version)
            if lease is None:
                return None
            self._append({"op": "lease", **_lease_record(lease)})
            dropped, self._pending_dropped = self._pending_dropped, 0
            return self._result(lease, dropped)

    def _result(self, lease: Lease, dropped: int) -> PullResult:
        return PullResult(lease.lease_id, [g.packed for g in lease.groups], dropped, lease.version,
                          len(self.gate.quarantined), len(self.gate.filtered))

    def _drop_stale(self) -> None:
        dropped = self.store.drop_stale(self.gate.version, self.gate.eta)
        if not dropped:
            return
        self._settle_dropped(dropped, "stale")
        self._pending_dropped += len(dropped)
        self.counters.settled_by_length["dropped"].update(length_bucket(g.response_tokens) for g in dropped)
        self._maybe_compact()

    def _count_failure(self, groups, replaying: bool = False) -> None:
        """Groups back from a lease that failed (expired, or nacked as failed): one that failed
        `max_deliveries` times is poisoned, and dropped by the next pull rather than handed out
        again. Not at once: a late ack of the expired lease (a slow learner, not a crashed one)
        still consumes it until then. Replay counts the same from the logged `expire` and failed
        `nack` records (and a compaction's `failures`), so the count survives a restart."""
        for g in groups:
            g.failures += 1
        if not replaying:
            self._mark_poisoned(groups)

    def _mark_poisoned(self, groups) -> None:
        limit = self.config.max_deliveries
        for g in groups:
            if limit is not None and g.failures >= limit:
                self._poisoned[g.group_id] = g.handed_out

    def _drop_poisoned(self) -> None:
        """Drop the marked groups that are still ready and were not handed out since. The learner
        cannot say which group of a batch crashed it, so the whole batch goes; their tickets are
        reissued (a fresh generation of the prompt is pushed, and validated, anew)."""
        if not self._poisoned:
            return
        marked, self._poisoned = self._poisoned, {}
        poisoned = [g for gid, n in marked.items() if (g := self.store.ready.get(gid)) is not None and g.handed_out == n]
        if not poisoned:
            return
        for g in poisoned:
            self.store.remove_ready(g.group_id)
        self._settle_dropped(poisoned, "poisoned")
        log.error("buffer: %d group(s) dropped as poisoned, each failed the learner %d times (a batch that "
                  "crashes it, or that it refuses): %s; tickets %s reissued", len(poisoned), self.config.max_deliveries,
                  [g.group_id for g in poisoned], [g.ticket for g in poisoned])
        self._maybe_compact()

    def _settle_dropped(self, dropped, reason: str) -> None:
        """Settle groups taken out of the store as a logged drop (replay and the audit count them
        as dropped, not lost) and give their tickets back to the gate."""
        tickets = [g.ticket for g in dropped]
        self.store.settle(dropped)
        self._append_settled({"op": "drop", "reason": reason, "groups": [g.group_id for g in dropped],
                              "tickets": tickets})
        self.gate.return_dropped(tickets)
        self.counters.dropped_groups[reason] += len(dropped)
        self.counters.dropped_samples[reason] += sum(len(g.sample_ids) for g in dropped)

    def ack(self, lease_id: str, version: int | None = None) -> int:
        """The learner trained on the lease: its groups are consumed, exactly once. With `version`,
        the learner's new weight version is set right after (`set_version`): the end of a learner
        step in one request."""
        with self._request():
            if version is not None:
                self.gate.check_version(version)  # a refused version changes nothing, the ack included
            consumed = self._ack(lease_id)
            if version is not None:
                self.set_version(version)
            return consumed

    def _ack(self, lease_id: str) -> int:
        with self._request():
            lease = self.store.ack(lease_id, self.clock())
            if isinstance(lease, int):
                return lease  # acked before: a retried ack
            self.store.settle(lease.groups)
            self._append_settled({"op": "ack", "lease": lease_id, "groups": [g.group_id for g in lease.groups],
                                  "tickets": [g.ticket for g in lease.groups]})
            version = self.gate.version if lease.version is None else lease.version
            self.counters.settled_by_length["consumed"].update(length_bucket(g.response_tokens) for g in lease.groups)
            for g in lease.groups:
                self.counters.consumed_groups += 1
                self.counters.consumed_samples += len(g.sample_ids)
                for v in g.sample_versions:
                    self.counters.consumed_staleness[version - v] += 1
            self._changed.notify_all()
            self._maybe_compact()
            return len(lease.groups)

    def nack(self, lease_id: str, failed: bool = False) -> int:
        """Hand a lease's groups back (pulled again, in their old places). `failed`: the learner
        failed on the batch (crashed, or refused a sample), a delivery that counts towards
        `max_deliveries`; a plain hand-back (a stop, a reply that could not be sent) does not."""
        with self._request():
            lease = self.store.leases.get(lease_id)
            n = self.store.nack(lease_id)
            if n:
                self._append({"op": "nack", "lease": lease_id, **({"failed": True} if failed else {})})
                self.counters.nacks += 1
                if failed:
                    self._count_failure(lease.groups)
                self._changed.notify_all()
            return n

    # ---- housekeeping -----------------------------------------------------------------------

    def tick(self) -> bool:
        """Reclaim expired permits and leases, sync the log if due. True if waiters may proceed."""
        with self._request():
            changed = self._tick_locked()
            if changed:
                self._changed.notify_all()
            return changed

    def _tick_locked(self) -> bool:
        now = self.clock()
        reclaimed = self.gate.reclaim_expired(now)
        for permit in reclaimed:
            self._append({"op": "release", "permit": permit.permit_id})
        expired = self.store.expire_leases(now)
        self.counters.leases_expired += len(expired)
        for lease in expired:
            self._append({"op": "expire", "lease": lease.lease_id})
            self._count_failure(lease.groups)
        if self.log is not None:
            self.log.sync_if_due()
        return bool(reclaimed or expired)

    def next_deadline(self) -> float | None:
        """The earliest permit or lease expiry (monotonic clock)."""
        with self._request():
            deadlines = [d for d in (min(self.gate.deadlines.values(), default=None),
                                     self.store.next_lease_deadline()) if d is not None]
            return min(deadlines, default=None)

    def count_bad_message(self, error: BufferError) -> None:
        with self._lock:  # writes no record: counts a refusal even once the log has failed
            target = self.counters.request_errors if isinstance(error, RequestError) else self.counters.bad_messages
            target[error.reason] += 1

    def stats(self) -> dict:
        with self._request():
            c, gate, store = self.counters, self.gate, self.store
            return {
                "version": gate.version, "eta": gate.eta, "batch_size": gate.batch_size,
                "max_concurrent": gate.max_concurrent, "store_capacity_groups": store.capacity_groups,
                "store_max_bytes": store.max_bytes,
                "capacity": self.capacity(), "running": gate.running, "enqueued": self.enqueued,
                "accepted": gate.accepted, "rejected": gate.rejected,
                "permits_released": gate.released, "permits_reclaimed": gate.reclaimed,
                "next_ticket": gate.next_ticket, "free_tickets": len(gate.free_tickets),
                "prompts_quarantined": len(gate.quarantined), "groups_filtered": len(gate.filtered),
                "groups_ready": len(store.ready), "groups_leased": store.groups_leased,
                "samples_ready": store.samples_ready(),
                "bytes_held": store.bytes_held + sum(g.nbytes for lease in store.leases.values() for g in lease.groups),
                "pushed_samples": c.pushed_samples, "pushed_groups": c.pushed_groups,
                "duplicate_pushes": c.duplicate_pushes,
                "consumed_samples": c.consumed_samples, "consumed_groups": c.consumed_groups,
                "dropped_samples": dict(c.dropped_samples), "dropped_groups": dict(c.dropped_groups),
                "bad_messages": dict(c.bad_messages), "request_errors": dict(c.request_errors),
                "gate_wait_seconds": c.gate_wait_seconds, "gate_waits": c.gate_waits,
                "consumed_staleness": {str(k): v for k, v in sorted(c.consumed_staleness.items())},
                "consumed_groups_by_length": dict(c.settled_by_length["consumed"]),
                "dropped_groups_by_length": dict(c.settled_by_length["dropped"]),
                "leases_expired": c.leases_expired, "nacks": c.nacks,
                "log_bytes": self.log.disk_bytes if self.log else 0,
                "log_fsyncs": self.log.fsyncs if self.log else 0,
                "log_compactions": self.log.compactions if self.log else 0,
                "log_compaction_running": self._compaction is not None,
                "log_compaction_longest_lock_s": self.log.longest_compaction_lock_s if self.log else 0.0,
                "log_compaction_windows": list(self.log.compaction_windows) if self.log else [],
            }

    def health(self) -> dict:
        with self._request():
            return {"ok": True, "version": self.gate.version, "uptime_s": time.time() - self.started_at,
                    "groups_ready": len(self.store.ready), "running": self.gate.running,
                    "durable": self.log is not None}

    def close(self) -> None:
        self.wait_for_compaction()
        with self._lock:
            if self.log is not None:
                self.log.close(sync=self.failed is None)  # a failed log is left as a crash would

    # ---- durability -------------------------------------------------------------------------

    @contextlib.contextmanager
    def _request(self):
        """One request (or a call nested in one): state changes under the lock, and at the end of
        the outermost call the request's log records are committed together (one fsync at most)
        before the caller answers. A log error fails the request and stops the core (`_fail`)."""
        with self._lock:
            if self.failed is not None:
                raise LogFailed(f"the buffer has stopped: {self.failed}")
            depth = getattr(self._requests, "depth", 0)
            self._requests.depth = depth + 1
            try:
                yield
            except OSError as exc:  # only the log does I/O here
                raise self._fail(LogFailed(f"buffer log: {exc}")) from exc
            except LogFailed as exc:
                raise self._fail(exc)
            finally:
                self._requests.depth = depth
                if depth == 0 and self.log is not None and self.failed is None:
                    try:
                        self.log.commit()
                    except LogFailed as exc:  # not durable: the caller must not answer it as a success
                        raise self._fail(exc)

    def _fail(self, error: LogFailed) -> LogFailed:
        """Stop: the log failed (a write cut back or poisoned, an fsync failed). The in-memory
        state may be ahead of the log (an ack settles its groups before its record is written),
        so no later request may be answered from it; the owner restarts the buffer from the log.
        Waiting requests wake up and raise."""
        if self.failed is None:
            self.failed = error
            log.critical("buffer: stopping, its durable log failed: %s", error)
            self._changed.notify_all()
        return error

    def _append(self, record: dict, durable: bool = True) -> list | None:
        """Log a record; a group payload written to a segment returns its `blob` reference."""
        return self.log.append(record, durable) if self.log is not None else None

    def _append_settled(self, record: dict) -> None:
        """Log an ack or drop under the next settle number; compaction archives it."""
        record["n"] = self._settle_n
        self._settle_n += 1
        self._append(record)
        if self.log is not None:
            self._settled.append(record)

    def _replay(self, record: dict) -> None:
        """Apply one logged event to a freshly built core (no logging, no counters)."""
        op, now = record["op"], self.clock()
        if op == "acquire":
            self.gate.restore_permit(Permit(**record["permit"]), now)
        elif op == "release":
            self.gate.release(record["permit"])
        elif op in ("quarantine", "filter"):
            self._ending(op)(record["permit"])
        elif op == "push":
            if record["permit"] in self.gate.permits:
                self.gate.consume(record["permit"])
            stored = self.store.add(group_index(unpack_frames(record["group"])[0]), record["group"], record["seq"])
            stored.handed_out = record.get("handed_out", 0)
            stored.failures = record.get("failures", 0)
            stored.blob = record.get("blob")
        elif op == "lease":
            groups = [g for gid in record["groups"] if (g := self.store.remove_ready(gid)) is not None]
            self.store.hand_out(record["lease"], groups, now + self.store.lease_s, record["version"])
        elif op == "nack":
            lease = self.store.leases.get(record["lease"])
            if self.store.nack(record["lease"]) and record.get("failed"):
                self._count_failure(lease.groups, replaying=True)
        elif op == "expire":
            lease = self.store.leases.get(record["lease"])
            self.store.expire(record["lease"])
            if lease is not None:
                self._count_failure(lease.groups, replaying=True)
        elif op in ("ack", "drop"):
            self._replay_settled(record, now)
        elif op == "version":
            self.gate.version = max(self.gate.version, record["version"])
        elif op == "recover":
            self.gate.recover(record["version"])
        elif op == "eta":
            self.gate.set_eta(record["eta"])
        elif op == "snapshot":
            self.gate.load_state(record["gate"], now)
            self.store.next_seq = record["next_seq"]
            self.store.load_lease_memory(record.get("leases", {}))
            for group_id, digest in record.get("settled", []):
                self.store.remember_settled(group_id, digest)
            self._settle_n = max(self._settle_n, record.get("settle_n", 0))
        else:
            raise ValueError(f"buffer log {self.log.path}: unknown record op {op!r}")

    def _replay_settled(self, record: dict, now: float) -> None:
        if "tickets" not in record or "n" not in record:
            raise ValueError(f"buffer log {self.log.path}: an {record['op']!r} record without tickets: the log was "
                             "written by an older etarl; start the buffer with a new log")
        if record["op"] == "ack" and record.get("lease") in self.store.leases:
            self.store.settle(self.store.ack(record["lease"], now).groups)  # remembered: a retried ack is answered
        else:  # an ack of an expired lease, or a drop: the groups were ready
            self.store.settle([g for gid in record["groups"] if (g := self.store.remove_ready(gid)) is not None])
            self.store.forget_expired(record.get("lease"))
            if record["op"] == "drop":
                self.gate.return_dropped(record["tickets"])
            elif record.get("lease") is not None:
                self.store.remember_finished(record["lease"], len(record["groups"]))
        self._settle_n = max(self._settle_n, record["n"] + 1)
        self._settled.append(record)

    def _maybe_compact(self) -> None:
        """Compact the log in the background once it (with its payload segments) is big and twice
        its size after the last compaction (the doubling keeps it amortised O(1) per write). Only
        the snapshot (references) and the final swap hold the lock."""
        log = self.log
        if log is None or self._compaction is not None:
            return
        if log.disk_bytes < max(log.config.compact_min_bytes, 2 * log.base_bytes):
            return
        job = Compaction(log, self.snapshot_records(payload_refs=True), self._settled)
        self._settled = []
        self._compaction = threading.Thread(target=self._compact, args=(job,), name="buffer-compaction", daemon=True)
        self._compaction.start()

    def _compact(self, job: Compaction) -> None:
        try:
            job.run(self._lock)
        except Exception:  # the log stays as it was; its settled records are archived next time
            logging.getLogger(__name__).exception("buffer log %s: compaction failed", job.log.path)
            with self._lock:
                self._settled = job.settled + self._settled
        finally:
            with self._lock:
                self._compaction = None

    def wait_for_compaction(self, timeout: float | None = None) -> bool:
        """Wait for a background compaction to end; True if none is running."""
        thread = self._compaction
        if thread is not None:
            thread.join(timeout)
        return self._compaction is None

    def snapshot_records(self, keep_in_flight: bool = True, keep_settled_ids: bool = True,
                         payload_refs: bool = False) -> list[dict]:
        """The state as log records: one `snapshot` (gate, cursor, digests of settled groups), one
        `push` per live group, one `lease` per leased batch. `keep_in_flight=False` is a
        checkpoint's view: work in flight does not survive a resume, so the tickets of held permits
        go back to the reissue pool and leased groups are ready again (no `lease` records).
        `payload_refs` (compaction's view): a group whose payload is in a log segment is named by
        its `blob`, not copied."""
        with self._lock:
            gate = self.gate.state()
            if not keep_in_flight:
                gate["free_tickets"] = sorted(gate["free_tickets"] + [p["ticket"] for p in gate["permits"]])
                gate["permits"] = []
            live = self.store.live_groups()
            settled = list(self.store.settled.items()) if keep_settled_ids else []
            head = {"op": "snapshot", "gate": gate, "next_seq": self.store.next_seq, "settled": settled,
                    "leases": self.store.lease_memory(), "settle_n": self._settle_n}
            leased = {g.group_id for lease in self.store.leases.values() for g in lease.groups}
            # handed_out without the current lease: replaying its `lease` record counts it again
            pushes = [{"op": "push", "permit": None, "seq": g.seq,
                       **({"blob": g.blob} if payload_refs and g.blob else {"group": g.packed}),
                       "handed_out": g.handed_out - (g.group_id in leased),
                       **({"failures": g.failures} if g.failures else {})} for g in live]
            leases = [{"op": "lease", **_lease_record(lease)} for lease in self.store.leases.values()]
            return [head, *pushes, *(leases if keep_in_flight else [])]

    def checkpoint_state(self) -> bytes:
        """What a run's checkpoint holds of the buffer (`buffer.msgpack`, either transport): the
        checkpoint's view of `snapshot_records` (work in flight left out: its tickets are reissued
        after a resume), msgpack-packed; `restore(msgpack.unpackb(...))` loads it."""
        records = self.snapshot_records(keep_in_flight=False, keep_settled_ids=False)
        return msgpack.packb(records, use_bin_type=True)

    def restore(self, records: list[dict]) -> None:
        """Load `snapshot_records()` (of another buffer, e.g. from a checkpoint) into this fresh one;
        with a durable log, the log is rewritten to hold exactly that state."""
        with self._request():
            if self.store.groups_held or self.gate.running or self.gate.accepted or self.store.settled:
                raise RequestError("restore needs a fresh buffer (this one already holds state)", "not_fresh")
            for record in records:
                self._replay(record)
            self._mark_poisoned(self.store.ready.values())
            if self.log is not None:
                records = self.snapshot_records()
                by_seq = {g.seq: g for g in self.store.live_groups()}
                for record, blob in zip(records, self.log.rewrite(records)):
                    if blob is not None:
                        by_seq[record["seq"]].blob = blob
            self._changed.notify_all()


def with_failures(records: list[dict], failures: dict[str, int]) -> list[dict]:
    """`snapshot_records()` whose groups count at least `failures[group_id]` failed deliveries:
    what a resumed run adds for the batches its learner died on after the checkpoint (the
    checkpoint cannot know them; services/learner_failures.py). `restore` then drops a group that
    reached `max_deliveries` at the next pull."""
    if not failures:
        return records
    out = []
    for record in records:
        if record.get("op") == "push" and "group" in record:
            group_id = group_index(unpack_frames(record["group"])[0]).group_id
            if failures.get(group_id, 0) > record.get("failures", 0):
                record = {**record, "failures": failures[group_id]}
        out.append(record)
    return out


def _check_distinct(pushes: list) -> None:
    """One push must not name a group, a sample or a permit twice (each would be accepted twice)."""
    sample_ids = [sid for view, _, _ in pushes for sid in view.sample_ids]
    if (len({view.group_id for view, _, _ in pushes}) < len(pushes) or len(set(sample_ids)) < len(sample_ids)
            or len({permit_id for _, permit_id, _ in pushes}) < len(pushes)):
        raise RequestError("one push names the same group, sample or permit twice", "duplicate_in_push")


def _lease_record(lease: Lease) -> dict:
    return {"lease": lease.lease_id, "groups": [g.group_id for g in lease.groups], "version": lease.version}
