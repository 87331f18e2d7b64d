"""The η admission gate: the staleness bound, the capacity formula, tickets (no prompt skipped or
repeated; filtered and quarantined ones ended once), recovery and permit reclaim, under random
event sequences and real threads."""
import random
import threading
import time
from collections import Counter

import pytest
from buffer_helpers import make_group
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from buffer.admission import AdmissionGate
from buffer.codec import encode_group, group_index, unpack_frames
from buffer.config import BufferConfig, GateConfig
from buffer.core import BufferCore
from buffer.errors import RequestError


class GateMachine(RuleBasedStateMachine):
    """Many workers acquiring, pushing, failing and dying in any order while the learner advances."""

    @initialize(batch_size=st.integers(1, 4), eta=st.one_of(st.none(), st.integers(0, 3)),
                max_concurrent=st.integers(1, 12))
    def setup(self, batch_size, eta, max_concurrent):
        self.gate = AdmissionGate(batch_size, eta, max_concurrent, lease_s=10.0)
        self.now = 0.0
        self.consumed_tickets: list[int] = []
        self.eta_lowered = False  # since when the held window may exceed the new, smaller bound

    def _held(self):
        # By ticket, not by id: permit ids are random, and hypothesis must draw the same way on replay.
        return sorted(self.gate.permits, key=lambda pid: self.gate.permits[pid].ticket)

    @rule(worker=st.integers(0, 5))
    def acquire(self, worker):
        g = self.gate
        before = g.capacity()
        permit = g.try_acquire(f"w{worker}", self.now)
        if before > 0:
            assert permit is not None and permit.version == g.version
            if g.eta is not None:  # the η rule with the η in force, whatever η was before
                assert g.accepted + g.running <= (g.eta + g.version + 1) * g.batch_size
        else:
            assert permit is None

    @rule(eta=st.one_of(st.none(), st.integers(0, 3)))
    def eta_changes(self, eta):
        """Adaptive η (buffer.eta_control) moves the bound during a run: held permits stay, and a
        smaller bound admits nothing more until the window is back under it."""
        old = self.gate.eta
        self.gate.set_eta(eta)
        if eta is not None and (old is None or eta < old):
            self.eta_lowered = True

    @precondition(lambda self: self.gate.permits)
    @rule(data=st.data())
    def push(self, data):
        pid = data.draw(st.sampled_from(self._held()))
        self.consumed_tickets.append(self.gate.consume(pid).ticket)

    @precondition(lambda self: self.gate.permits)
    @rule(data=st.data())
    def release(self, data):
        assert self.gate.release(data.draw(st.sampled_from(self._held()))) is not None

    @precondition(lambda self: self.gate.permits)
    @rule(data=st.data(), filtered=st.booleans())
    def set_aside(self, data, filtered):
        """A group left untrained as uninformative (dynamic sampling), or a prompt quarantined."""
        pid = data.draw(st.sampled_from(self._held()))
        assert (self.gate.filter(pid) if filtered else self.gate.quarantine(pid)) is not None

    @rule(dt=st.floats(0.0, 15.0))
    def time_passes(self, dt):
        self.now += dt
        for permit in self.gate.reclaim_expired(self.now):
            assert permit.permit_id not in self.gate.permits

    @rule(step=st.integers(1, 2))
    def learner_advances(self, step):
        self.gate.set_version(self.gate.version + step)

    @rule()
    def push_with_unknown_permit_is_refused(self):
        with pytest.raises(RequestError):
            self.gate.consume("no-such-permit")

    @invariant()
    def staleness_bound(self):
        g = self.gate
        if g.eta is not None and not self.eta_lowered:
            assert g.accepted + g.running <= (g.eta + g.version + 1) * g.batch_size

    @invariant()
    def capacity_formula(self):
        g = self.gate
        expected = g.max_concurrent - g.running
        if g.eta is not None:
            expected = min(expected, (g.eta + g.version + 1) * g.batch_size - (g.accepted + g.running))
        assert g.capacity() == expected
        assert g.running <= g.max_concurrent

    @invariant()
    def every_ticket_exactly_once(self):
        g = self.gate
        tickets = (self.consumed_tickets + [p.ticket for p in g.permits.values()] + list(g.free_tickets)
                   + list(g.filtered) + list(g.quarantined))
        assert sorted(tickets) == list(range(g.next_ticket)), "a prompt was skipped or repeated"
        assert len(self.consumed_tickets) == g.accepted

    @invariant()
    def reissued_first(self):
        if self.gate.free_tickets:
            assert min(self.gate.free_tickets) < self.gate.next_ticket


TestGateMachine = GateMachine.TestCase
TestGateMachine.settings = settings(max_examples=120, stateful_step_count=40, deadline=None,
                                    suppress_health_check=[HealthCheck.too_slow])


def test_eta_zero_is_synchronous():
    gate = AdmissionGate(batch_size=2, eta=0, max_concurrent=10, lease_s=10)
    permits = [gate.try_acquire("w", 0) for _ in range(3)]
    assert permits[2] is None, "η = 0 admits exactly one batch per version"
    for p in permits[:2]:
        gate.consume(p.permit_id)
    assert gate.try_acquire("w", 0) is None
    gate.set_version(1)
    assert gate.capacity() == 2


def test_released_tickets_are_reissued_first_smallest_first():
    gate = AdmissionGate(batch_size=8, eta=None, max_concurrent=8, lease_s=10)
    p = [gate.try_acquire("w", 0) for _ in range(4)]
    gate.release(p[2].permit_id)
    gate.release(p[1].permit_id)
    assert [gate.try_acquire("w", 0).ticket for _ in range(3)] == [1, 2, 4]


def test_a_filtered_group_ends_its_ticket_and_frees_its_slot_for_an_informative_one():
    """Dynamic sampling under η = 0: a group left untrained is never accepted, so the version's B
    slots stay for informative groups; its ticket is not reissued."""
    gate = AdmissionGate(batch_size=2, eta=0, max_concurrent=10, lease_s=10)
    p = [gate.try_acquire("w", 0) for _ in range(2)]
    assert gate.try_acquire("w", 0) is None
    assert gate.filter(p[0].permit_id) == p[0] and gate.filter(p[0].permit_id) is None
    again = gate.try_acquire("w", 0)
    assert again.ticket == 2, "the filtered ticket 0 is not reissued; the cursor moves on"
    gate.consume(p[1].permit_id)
    gate.consume(again.permit_id)
    assert gate.accepted == 2 and gate.try_acquire("w", 0) is None and gate.filtered == {0}
    state = gate.state()
    restored = AdmissionGate(batch_size=2, eta=0, max_concurrent=10, lease_s=10)
    restored.load_state(state, now=0)
    assert restored.filtered == {0}


def test_reclaim_after_lease_returns_capacity_and_ticket():
    gate = AdmissionGate(batch_size=1, eta=0, max_concurrent=4, lease_s=5)
    dead = gate.try_acquire("dead-worker", now=0)
    assert gate.try_acquire("w", now=1) is None
    assert gate.reclaim_expired(now=4.9) == []
    assert gate.reclaim_expired(now=5.0) == [dead]
    again = gate.try_acquire("w", now=5)
    assert again.ticket == dead.ticket and gate.reclaimed == 1
    with pytest.raises(RequestError, match="not held"):
        gate.consume(dead.permit_id)


@pytest.mark.parametrize("eta", [0, 2, None])
def test_recovery_sets_accepted_to_v_times_b(eta):
    gate = AdmissionGate(batch_size=4, eta=eta, max_concurrent=100, lease_s=10)
    gate.try_acquire("stale-permit-of-old-run", 0)
    gate.recover(5)
    assert gate.accepted == 20 and gate.running == 0 and gate.version == 5
    assert gate.capacity() == (100 if eta is None else (eta + 1) * 4)
    assert gate.try_acquire("w", 0).ticket == 20, "the data cursor resumes after the consumed prompts"
    with pytest.raises(RequestError):
        gate.set_version(4)


def test_retried_acquire_returns_the_same_permit():
    gate = AdmissionGate(batch_size=1, eta=0, max_concurrent=4, lease_s=10)
    first = gate.try_acquire("w", 0, permit_id="p1")
    assert gate.try_acquire("w", 0, permit_id="p1") == first and gate.running == 1


def test_bound_holds_under_real_threads():
    """Workers race on the real core (acquire with timeouts, push, fail) while the learner advances
    the version; a monitor checks the bound under the core's lock throughout."""
    B, eta = 2, 1
    core = BufferCore(BufferConfig(gate=GateConfig(batch_size=B, eta=eta, max_concurrent=5)))
    stop = threading.Event()
    violations, pushed = [], Counter()

    def worker(seed):
        rng = random.Random(seed)
        while not stop.is_set():
            permit = core.acquire_permit(f"w{seed}", timeout=0.05)
            if permit is None:
                continue
            if rng.random() < 0.25:
                core.release_permit(permit.permit_id)
            else:
                core.push_group(encode_group(make_group(permit.ticket, version=core.gate.version)), permit.permit_id)
                pushed[permit.ticket] += 1

    def monitor():
        while not stop.is_set():
            with core._lock:
                g = core.gate
                if g.accepted + g.running > (eta + g.version + 1) * B or g.running > g.max_concurrent:
                    violations.append(g.state())
            time.sleep(0.001)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(4)] + [threading.Thread(target=monitor)]
    for t in threads:
        t.start()
    trained = Counter()
    for version in range(1, 15):
        batch = core.pull_batch(B, timeout=60)
        assert batch is not None
        trained.update(group_index(unpack_frames(packed)[0])[3] for packed in batch.groups)
        core.ack(batch.lease_id)
        core.set_version(version)
    stop.set()
    for t in threads:
        t.join()
    assert not violations
    assert all(n == 1 for n in trained.values()), "a prompt was trained on twice"
    # A prompt is generated again only after its group was dropped as stale (its ticket is reissued).
    dropped = core.stats()["dropped_groups"].get("stale", 0)
    assert sum(n - 1 for n in pushed.values()) == dropped, "a prompt was generated twice without a drop"
    assert core.gate.running == 0
    assert set(pushed) | set(core.gate.free_tickets) == set(range(core.gate.next_ticket)), "a prompt was skipped"
