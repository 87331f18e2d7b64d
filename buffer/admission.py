"""The η admission gate (AReaL's staleness rate limit, `offpolicy_corrections_five_sources.md`).

A worker may start a generation only while ⌊(N_r − 1)/B⌋ ≤ i + η, with N_r = accepted + running + 1,
i.e. while

    capacity = min(max_concurrent − running, (η + i + 1)·B − (accepted + running)) > 0

(B = batch size in groups, i = learner version, η = None: no staleness term). Each grant is a
`Permit` with a `ticket`, the data cursor: the worker generates for prompt number `ticket`.
Tickets of released or reclaimed permits, and of groups dropped as stale, are reissued first
(smallest first), so the run neither skips nor repeats a prompt. A permit ends in exactly one of:
`consume` (its group was accepted), `release` (generation failed or was rejected), `quarantine`
(its prompt failed the engine again and again: the ticket is never reissued), `filter` (its group
was generated and is uninformative, e.g. every sample scored alike: dynamic sampling; the ticket
ends untrained, not reissued), or reclaim after `lease_s` without any of those. Filtered groups are
never accepted, so the gate grants permits until B informative groups per version are.

Recovery: a run resumed at version v starts with accepted = v·B and the cursor at v·B, so it
never over-admits. The gate is plain state, not thread-safe: `buffer.core.BufferCore` locks it.
"""
from __future__ import annotations

import heapq
from dataclasses import dataclass

from buffer.errors import RequestError
from buffer.sample import new_id


@dataclass(frozen=True)
class Permit:
    permit_id: str
    ticket: int  # the prompt index this generation is for
    worker_id: str
    version: int  # the learner version when the permit was granted

    def to_dict(self) -> dict:
        return dict(self.__dict__)


class AdmissionGate:
    def __init__(self, batch_size: int, eta: int | None, max_concurrent: int, lease_s: float,
                 max_version_jump: int | None = None):
        if batch_size < 1 or max_concurrent < 1 or (eta is not None and eta < 0) or lease_s <= 0:
            raise ValueError(f"bad gate settings: B={batch_size}, eta={eta}, max_concurrent={max_concurrent}, lease_s={lease_s}")
        self.batch_size = batch_size
        self.eta = eta
        self.max_concurrent = max_concurrent
        self.lease_s = lease_s
        self.max_version_jump = max_version_jump  # None: any
        self.version = 0
        self.accepted = 0
        self.rejected = 0
        self.released = 0
        self.reclaimed = 0
        self.next_ticket = 0
        self.free_tickets: list[int] = []  # min-heap of tickets to reissue first
        self.permits: dict[str, Permit] = {}
        self.deadlines: dict[str, float] = {}
        self.quarantined: set[int] = set()  # tickets whose prompt the engine cannot take
        self.filtered: set[int] = set()  # tickets whose group was uninformative (dynamic sampling)

    @property
    def running(self) -> int:
        return len(self.permits)

    def staleness_limit(self) -> int | None:
        """(η + i + 1)·B: the most accepted + running the bound allows now; None when unbounded."""
        if self.eta is None:
            return None
        return (self.eta + self.version + 1) * self.batch_size

    def capacity(self) -> int:
        cap = self.max_concurrent - self.running
        limit = self.staleness_limit()
        if limit is not None:
            cap = min(cap, limit - (self.accepted + self.running))
        return cap

    def try_acquire(self, worker_id: str, now: float, permit_id: str | None = None) -> Permit | None:
        """Grant a permit if capacity > 0. A known permit_id returns the same permit (a retried request)."""
        if permit_id is not None and permit_id in self.permits:
            return self.permits[permit_id]
        if self.capacity() <= 0:
            return None
        ticket = heapq.heappop(self.free_tickets) if self.free_tickets else self._new_ticket()
        permit = Permit(permit_id or new_id(), ticket, worker_id, self.version)
        self.restore_permit(permit, now)
        return permit

    def _new_ticket(self) -> int:
        self.next_ticket += 1
        return self.next_ticket - 1

    def restore_permit(self, permit: Permit, now: float) -> None:
        """Hold `permit` (a new grant, or one replayed from the durable log) with a fresh lease."""
        self.permits[permit.permit_id] = permit
        self.deadlines[permit.permit_id] = now + self.lease_s
        self.next_ticket = max(self.next_ticket, permit.ticket + 1)
        if permit.ticket in self.free_tickets:
            self.free_tickets.remove(permit.ticket)
            heapq.heapify(self.free_tickets)

    def release(self, permit_id: str) -> Permit | None:
        """The generation failed or was rejected: the permit ends and its ticket will be reissued."""
        permit = self._drop(permit_id)
        if permit is not None:
            self.released += 1
            heapq.heappush(self.free_tickets, permit.ticket)
        return permit

    def quarantine(self, permit_id: str) -> Permit | None:
        """The permit's prompt failed generation `max_prompt_failures` times on its own: the
        permit ends and its ticket is set aside for good (never reissued)."""
        return self._end_for_good(permit_id, self.quarantined)

    def filter(self, permit_id: str) -> Permit | None:
        """The permit's group was generated and is uninformative (dynamic sampling): the permit
        ends and its ticket with it, never trained on and never reissued (the prompt comes again
        under a new ticket when the prompt set wraps around)."""
        return self._end_for_good(permit_id, self.filtered)

    def _end_for_good(self, permit_id: str, ended: set[int]) -> Permit | None:
        permit = self._drop(permit_id)
        if permit is not None:
            ended.add(permit.ticket)
        return permit

    def consume(self, permit_id: str) -> Permit:
        """The permit's group was accepted into the buffer: running → accepted."""
        permit = self._drop(permit_id)
        if permit is None:
            raise RequestError(f"permit {permit_id!r} is not held (never granted, already used, released or "
                               "reclaimed after its lease)", "unknown_permit")
        self.accepted += 1
        return permit

    def return_dropped(self, tickets: list[int]) -> None:
        """Accepted groups the store dropped as stale will never be trained on. Their slots go back
        to the gate, or every drop would shrink capacity for good and (η + 1)·B drops would close it
        while the buffer is empty; their tickets are reissued, so the prompts are generated again
        (a run neither skips nor repeats a prompt). The η bound itself is enforced again at pull time."""
        self.accepted = max(0, self.accepted - len(tickets))
        for ticket in tickets:
            heapq.heappush(self.free_tickets, ticket)

    def reclaim_expired(self, now: float) -> list[Permit]:
        """Permits whose holder neither pushed nor released within the lease: their tickets return."""
        expired = [pid for pid, deadline in self.deadlines.items() if deadline <= now]
        out = []
        for pid in expired:
            permit = self.release(pid)
            self.released -= 1
            self.reclaimed += 1
            out.append(permit)
        return out

    def _drop(self, permit_id: str) -> Permit | None:
        self.deadlines.pop(permit_id, None)
        return self.permits.pop(permit_id, None)

    def set_eta(self, eta: int | None) -> None:
        """A new bound, in force from the next event: a smaller η admits less (and the store drops
        at pull what is now too stale), a larger one opens capacity at once."""
        if eta is not None and (not isinstance(eta, int) or eta < 0):
            raise RequestError(f"eta must be an int >= 0 or None, got {eta!r}", "bad_eta")
        self.eta = eta

    def check_version(self, version: int) -> None:
        """The learner's version never goes back (RequestError 'version_regression') nor jumps more
        than max_version_jump ahead ('version_jump')."""
        if version < self.version:
            raise RequestError(f"version {version} is older than the current version {self.version}", "version_regression")
        self._check_jump(version)

    def _check_jump(self, version: int) -> None:
        if self.max_version_jump is not None and version - self.version > self.max_version_jump:
            raise RequestError(f"version {version} is more than max_version_jump={self.max_version_jump} ahead of "
                               f"the current version {self.version}", "version_jump")

    def set_version(self, version: int) -> None:
        self.check_version(version)
        self.version = version

    def recover(self, version: int) -> None:
        """Resume at learner version v: v·B groups were consumed, so accepted = v·B and the data cursor
        continues at v·B. Outstanding permits of the old run are forgotten."""
        if version < 0:
            raise RequestError(f"cannot recover to negative version {version}", "bad_version")
        if self.version or self.accepted or self.permits:  # a fresh gate may resume at any version
            self._check_jump(version)
        self.version = version
        self.accepted = version * self.batch_size
        self.next_ticket = version * self.batch_size
        self.free_tickets = []
        self.permits.clear()
        self.deadlines.clear()

    def state(self) -> dict:
        """Everything needed to rebuild the gate (durable log snapshot)."""
        return {
            "version": self.version, "accepted": self.accepted, "rejected": self.rejected,
            "released": self.released, "reclaimed": self.reclaimed, "next_ticket": self.next_ticket,
            "free_tickets": sorted(self.free_tickets), "permits": [p.to_dict() for p in self.permits.values()],
            "quarantined": sorted(self.quarantined), "filtered": sorted(self.filtered), "eta": self.eta,
        }

    def load_state(self, state: dict, now: float) -> None:
        for key in ("version", "accepted", "rejected", "released", "reclaimed", "next_ticket"):
            setattr(self, key, int(state[key]))
        self.free_tickets = list(state["free_tickets"])
        heapq.heapify(self.free_tickets)
        self.quarantined = set(state.get("quarantined", []))
        self.filtered = set(state.get("filtered", []))
        self.eta = state.get("eta", self.eta)
        self.permits.clear()
        self.deadlines.clear()
        for p in state["permits"]:
            self.restore_permit(Permit(**p), now)
