"""The group store: bounded, groups kept whole, oldest first, leased until acknowledged.

Groups are kept packed (`buffer.codec.pack_frames`): the validated wire frames, re-sent as is.
`pull` takes the oldest groups by (weight_version, arrival); groups staler than η are dropped and
counted, never silently. A pulled batch is a lease: `ack` consumes it, `nack` or expiry puts its
groups back where they were. The sample ids of every group held are known, and of the last
`remembered_settled` groups that were consumed or dropped a digest is kept, so a retried push of a
group already accepted (even already consumed) is recognised and never stored twice. Memory for
settled groups is bounded (about 100 bytes each): a push retried after more than that many groups
settled meets its consumed permit and is refused (`unknown_permit`), still never stored twice.
Plain state, not thread-safe: `buffer.core.BufferCore` locks it.
"""
from __future__ import annotations

import hashlib
import heapq
from collections import OrderedDict
from dataclasses import dataclass

from buffer.codec import GroupIndex
from buffer.errors import RequestError


@dataclass(slots=True)
class StoredGroup:
    group_id: str
    weight_version: int  # the oldest version of its samples
    sample_ids: tuple[str, ...]
    sample_versions: tuple[int, ...]
    packed: bytes  # the group's wire frames, packed
    seq: int  # arrival order
    nbytes: int
    ticket: int  # the prompt number it answers (its permit's ticket)
    response_tokens: int  # its longest response
    handed_out: int = 0  # leases it was pulled under (an expired lease's late ack checks it)
    failures: int = 0  # of those, leases that expired or were nacked as failed (buffer.max_deliveries)
    blob: list | None = None  # where the durable log keeps its payload (segment, offset, length, crc)

    @property
    def order(self) -> tuple[int, int]:
        return (self.weight_version, self.seq)


@dataclass(slots=True)
class Lease:
    lease_id: str
    groups: list[StoredGroup]
    deadline: float
    version: int | None  # learner version at pull (staleness is measured against it)


class GroupStore:
    def __init__(self, capacity_groups: int, lease_s: float, remembered_leases: int = 4096,
                 remembered_settled: int = 100_000, max_bytes: int | None = None):
        self.capacity_groups = capacity_groups
        self.max_bytes = max_bytes  # packed bytes held (ready + leased); None: no byte budget
        self.lease_s = lease_s
        self._heap: list[tuple[int, int, str]] = []  # (weight_version, seq, group_id) of ready groups
        self.ready: dict[str, StoredGroup] = {}
        self.leases: dict[str, Lease] = {}
        self.sample_group: dict[str, str] = {}  # sample id -> group id, of the groups held
        self.held_ids: set[str] = set()  # ids of the groups held (ready or leased)
        self.settled: OrderedDict[str, int] = OrderedDict()  # consumed or dropped group id -> ids_digest
        self._remembered_settled = remembered_settled
        self.finished_leases: OrderedDict[str, int] = OrderedDict()  # acked lease ids -> groups (idempotent ack)
        # expired lease ids -> {group id: its handed_out count then}: ackable while none was handed out again
        self._expired: OrderedDict[str, dict[str, int]] = OrderedDict()
        self._remembered = remembered_leases
        self.next_seq = 0
        self.bytes_held = 0  # of ready groups
        self.bytes_leased = 0

    # ---- sizes ------------------------------------------------------------------------------

    @property
    def groups_leased(self) -> int:
        return sum(len(lease.groups) for lease in self.leases.values())

    @property
    def groups_held(self) -> int:
        return len(self.ready) + self.groups_leased

    def samples_ready(self) -> int:
        return sum(len(g.sample_ids) for g in self.ready.values())

    # ---- push -------------------------------------------------------------------------------

    def is_duplicate(self, group_id: str, sample_ids: list[str]) -> bool:
        """True if this group was accepted before (a retried push); RequestError if it overlaps
        an accepted group without being it."""
        if group_id in self.settled:
            if self.settled[group_id] == ids_digest(sample_ids):
                return True
        else:
            owners = {self.sample_group.get(sid) for sid in sample_ids}
            if owners == {group_id}:
                return True
            if owners == {None} and group_id not in self.held_ids:
                return False
        raise RequestError(f"group {group_id!r} overlaps an accepted group (reused group id or sample ids "
                           "with different content)", "conflicting_push")

    @property
    def bytes_live(self) -> int:
        """Packed bytes of the groups held, ready and leased (what the byte budget counts)."""
        return self.bytes_held + self.bytes_leased

    def room(self) -> int:
        """Groups the store can still take (capacity minus ready and leased); 0 once the byte
        budget is spent, so no permit is granted for a group that could not be stored."""
        if self.max_bytes is not None and self.bytes_live >= self.max_bytes:
            return 0
        return self.capacity_groups - self.groups_held

    def check_room(self, groups: int = 1, nbytes: int = 0) -> None:
        """Refuse a push of `groups` groups of `nbytes` packed bytes that the store cannot hold (it
        never drops what it accepted to make room)."""
        if groups and groups > self.capacity_groups - self.groups_held:
            raise RequestError(f"buffer full ({self.groups_held} of {self.capacity_groups} groups, {groups} more "
                               "pushed)", "buffer_full")
        if groups and self.max_bytes is not None and self.bytes_live + nbytes > self.max_bytes:
            raise RequestError(f"store full: {self.bytes_live} of store.max_bytes={self.max_bytes} bytes held, and "
                               f"the push brings {nbytes} more; retry once the learner has consumed some",
                               "store_full")

    def add(self, index: GroupIndex, packed: bytes, seq: int | None = None) -> StoredGroup:
        seq = self.next_seq if seq is None else seq
        self.next_seq = max(self.next_seq, seq + 1)
        stored = StoredGroup(index.group_id, min(index.weight_versions), tuple(index.sample_ids),
                             tuple(index.weight_versions), packed, seq, len(packed), index.prompt_index,
                             index.response_tokens)
        for sid in index.sample_ids:
            self.sample_group[sid] = index.group_id
        self.held_ids.add(index.group_id)
        self._make_ready(stored)
        return stored

    def settle(self, groups: list[StoredGroup]) -> None:
        """Groups consumed or dropped: their sample ids give way to a digest, kept for the last
        `remembered_settled` groups (a retried push of one of them is a duplicate)."""
        for g in groups:
            for sid in g.sample_ids:
                self.sample_group.pop(sid, None)
            self.held_ids.discard(g.group_id)
            self.remember_settled(g.group_id, ids_digest(g.sample_ids))

    def remember_settled(self, group_id: str, digest: int) -> None:
        self.settled[group_id] = digest
        while len(self.settled) > self._remembered_settled:
            self.settled.popitem(last=False)

    def _make_ready(self, g: StoredGroup) -> None:
        self.ready[g.group_id] = g
        self.bytes_held += g.nbytes
        heapq.heappush(self._heap, (g.weight_version, g.seq, g.group_id))

    def _peek(self) -> tuple[int, int, str] | None:
        """The oldest ready group's heap entry; entries of groups removed by id are skipped lazily."""
        while self._heap:
            version, seq, gid = self._heap[0]
            g = self.ready.get(gid)
            if g is not None and g.seq == seq:
                return self._heap[0]
            heapq.heappop(self._heap)
        return None

    def _pop_oldest(self) -> StoredGroup | None:
        if self._peek() is None:
            return None
        return self.remove_ready(heapq.heappop(self._heap)[2])

    def remove_ready(self, group_id: str) -> StoredGroup | None:
        g = self.ready.pop(group_id, None)
        if g is not None:
            self.bytes_held -= g.nbytes
        return g

    # ---- pull / ack / nack ------------------------------------------------------------------

    def drop_stale(self, version: int, eta: int | None) -> list[StoredGroup]:
        """Remove ready groups with version − weight_version > η (they are at the front)."""
        dropped = []
        if eta is None:
            return dropped
        while (top := self._peek()) is not None and version - top[0] > eta:
            dropped.append(self._pop_oldest())
        return dropped

    def lease(self, batch_size: int, lease_id: str, now: float, version: int) -> Lease | None:
        """The batch_size oldest ready groups under a new lease, or None if fewer are ready."""
        if len(self.ready) < batch_size:
            return None
        return self.hand_out(lease_id, [self._pop_oldest() for _ in range(batch_size)], now + self.lease_s, version)

    def hand_out(self, lease_id: str, groups: list[StoredGroup], deadline: float, version: int | None) -> Lease:
        """Put groups (taken from ready) under a lease."""
        for g in groups:
            g.handed_out += 1
        self.bytes_leased += sum(g.nbytes for g in groups)
        lease = Lease(lease_id, groups, deadline, version)
        self.leases[lease_id] = lease
        return lease

    def ack(self, lease_id: str, now: float) -> Lease | int:
        """Consume a lease. Returns it, or the group count of an already acked lease.
        A lease that expired can still be acked while none of its groups was handed out again."""
        lease = self.leases.pop(lease_id, None)
        if lease is not None:
            self.bytes_leased -= sum(g.nbytes for g in lease.groups)
            self.remember_finished(lease_id, len(lease.groups))
            return lease
        if lease_id in self.finished_leases:
            return self.finished_leases[lease_id]
        if lease_id in self._expired:
            handed = self._expired[lease_id]
            if all(gid in self.ready and self.ready[gid].handed_out == n for gid, n in handed.items()):
                groups = [self.remove_ready(gid) for gid in handed]
                del self._expired[lease_id]
                self.remember_finished(lease_id, len(groups))
                return Lease(lease_id, groups, now, None)
            raise RequestError(f"lease {lease_id!r} expired and its groups were handed out again (or dropped); "
                               "do not train on it twice", "lease_expired")
        raise RequestError(f"unknown lease {lease_id!r}", "unknown_lease")

    def remember_finished(self, lease_id: str, n: int) -> None:
        """An acked lease: a retried ack of it is answered with its group count."""
        self.finished_leases[lease_id] = n
        while len(self.finished_leases) > self._remembered:
            self.finished_leases.popitem(last=False)

    def forget_expired(self, lease_id: str | None) -> None:
        self._expired.pop(lease_id, None)

    def nack(self, lease_id: str) -> int:
        """Put a lease's groups back in their old places; 0 if the lease is not held (idempotent)."""
        lease = self.leases.pop(lease_id, None)
        if lease is None:
            return 0
        self.bytes_leased -= sum(g.nbytes for g in lease.groups)
        for g in lease.groups:
            self._make_ready(g)
        return len(lease.groups)

    def expire_leases(self, now: float) -> list[Lease]:
        expired = [lease for lease in self.leases.values() if lease.deadline <= now]
        for lease in expired:
            self.expire(lease.lease_id)
        return expired

    def expire(self, lease_id: str) -> None:
        """A lease ran out: its groups are ready again, and the lease is remembered, so a late ack
        still consumes them while none was handed out again."""
        lease = self.leases.get(lease_id)
        if lease is None:
            return
        self.nack(lease_id)
        self._expired[lease_id] = {g.group_id: g.handed_out for g in lease.groups}
        while len(self._expired) > self._remembered:
            self._expired.popitem(last=False)

    def lease_memory(self) -> dict:
        """The ended leases an ack may still name (acked: answered again; expired: consumed if its
        groups are still ready), for a snapshot: a compaction or restart must not forget them."""
        return {"finished": dict(self.finished_leases), "expired": dict(self._expired)}

    def load_lease_memory(self, memory: dict) -> None:
        self.finished_leases = OrderedDict(memory.get("finished", {}))
        self._expired = OrderedDict((k, dict(v)) for k, v in memory.get("expired", {}).items())

    def next_lease_deadline(self) -> float | None:
        return min((lease.deadline for lease in self.leases.values()), default=None)

    def live_groups(self) -> list[StoredGroup]:
        """Ready and leased groups, oldest first (for log compaction)."""
        groups = list(self.ready.values()) + [g for lease in self.leases.values() for g in lease.groups]
        return sorted(groups, key=lambda g: g.order)


def ids_digest(sample_ids) -> int:
    """A stable 64-bit digest of a group's sample ids (the same in every process)."""
    return int.from_bytes(hashlib.blake2b("\n".join(sample_ids).encode(), digest_size=8).digest(), "little")
