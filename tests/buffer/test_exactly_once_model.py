"""Exactly-once as a property: random sequences of pushes (and retried pushes), pulls, acks,
nacks, lease expiries and crash-restarts from the durable log. At every step each accepted group
is in exactly one place (ready, leased, consumed, or dropped as poisoned once its leases expired
`max_deliveries` = 2 times) and nothing is consumed twice or handed out after it was dropped."""
from collections import Counter

from buffer_helpers import make_group
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from buffer.codec import encode_group, group_index, unpack_frames
from buffer.config import BufferConfig, GateConfig, LogConfig, StoreConfig
from buffer.core import BufferCore


class Clock:
    now = 0.0

    def __call__(self):
        return self.now


class ExactlyOnce(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        import tempfile
        from pathlib import Path

        self.dir = tempfile.TemporaryDirectory()
        self.config = BufferConfig(gate=GateConfig(batch_size=2, eta=None, max_concurrent=64),
                                   store=StoreConfig(capacity_groups=8, lease_s=10),  # small: full stores happen
                                   log=LogConfig(path=Path(self.dir.name) / "b.log", fsync="interval"))
        self.clock = Clock()
        self.core = BufferCore(self.config, clock=self.clock)
        # Ids are random: rules draw from these dicts in insertion order, which replays the same.
        self.pushed: dict[str, object] = {}  # group id -> Group
        self.consumed: list[str] = []
        self.leases: dict[str, list[str]] = {}
        self.expiries: Counter = Counter()  # group id -> leases of it that expired (failed deliveries)
        self.dropped: set[str] = set()

    def teardown(self):
        self.core.close()
        self.dir.cleanup()

    @rule()
    def push(self):
        permit = self.core.acquire_permit("w")
        if permit is None:  # refused only for want of room: every slot holds a group or one being made
            assert self.core.capacity() <= 0 and self.core.store.room() - self.core.gate.running <= 0
            return
        group = make_group(permit.ticket, n=1, tokens=2)
        assert self.core.push_group(encode_group(group), permit.permit_id)["duplicate"] is False
        self.pushed[group.group_id] = group

    @precondition(lambda self: self.pushed)
    @rule(data=st.data())
    def retried_push(self, data):
        gid = data.draw(st.sampled_from(list(self.pushed)))
        assert self.core.push_group(encode_group(self.pushed[gid]), "stale-permit")["duplicate"]

    @rule(size=st.integers(1, 3))
    def pull(self, size):
        result = self.core.pull_batch(size)
        if result is not None:
            self.leases[result.lease_id] = [group_index(unpack_frames(p)[0])[0] for p in result.groups]
            assert all(self.expiries[g] < self.config.max_deliveries for g in self.leases[result.lease_id]), \
                "a poisoned group handed out again"

    @precondition(lambda self: self.leases)
    @rule(data=st.data())
    def ack(self, data):
        lease_id = data.draw(st.sampled_from(list(self.leases)))
        assert self.core.ack(lease_id) == len(self.leases[lease_id])
        self.consumed += self.leases.pop(lease_id)

    @precondition(lambda self: self.leases)
    @rule(data=st.data())
    def nack(self, data):
        lease_id = data.draw(st.sampled_from(list(self.leases)))
        assert self.core.nack(lease_id) == len(self.leases.pop(lease_id))

    @rule()
    def leases_expire(self):
        self.clock.now += 11
        self.core.tick()
        self.expiries.update(g for groups in self.leases.values() for g in groups)
        self.leases.clear()

    @rule()
    def crash_and_restart(self):
        self.core.close()  # a killed process loses nothing written (the OS has it); fsync is for power loss
        self.core = BufferCore(self.config, clock=self.clock)

    @invariant()
    def each_group_in_exactly_one_place(self):
        store = self.core.store
        ready = set(store.ready)
        leased = {g.group_id: lid for lid, lease in store.leases.items() for g in lease.groups}
        assert len(self.consumed) == len(set(self.consumed)), "consumed twice"
        assert not ready & set(leased) and not (ready | set(leased)) & set(self.consumed)
        placed = ready | set(leased) | set(self.consumed)
        assert not placed & self.dropped, "a dropped group came back"
        self.dropped |= set(self.pushed) - placed
        assert placed | self.dropped == set(self.pushed), "a group was invented"
        assert all(self.expiries[g] >= self.config.max_deliveries for g in self.dropped), "a group was lost"
        assert {lid: sorted(g) for lid, g in self.leases.items()} == \
            {lid: sorted(g.group_id for g in lease.groups) for lid, lease in store.leases.items()}


TestExactlyOnce = ExactlyOnce.TestCase
TestExactlyOnce.settings = settings(max_examples=40, stateful_step_count=30, deadline=None,
                                    suppress_health_check=[HealthCheck.too_slow])
