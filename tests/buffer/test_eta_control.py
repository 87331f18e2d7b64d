"""The adaptive staleness bound: the pure controller (drift in, η out) and the gate and store
taking a changing η (random event sequences: every grant and every pull obeys the η in force at
that moment; a restart keeps the last η)."""
from __future__ import annotations

import math

import pytest
from buffer_helpers import make_group
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from buffer.codec import encode_group, group_index, unpack_frames
from buffer.config import BufferConfig, GateConfig, LogConfig
from buffer.core import BufferCore
from buffer.eta_control import RAISE_PATIENCE, EtaController


def test_eta_is_the_largest_bound_whose_drift_fits_the_budget():
    control = EtaController(drift_budget=0.02, eta_min=1, eta_max=8, eta=8)
    assert control.observe(0.005) == 4, "floor(0.02 / 0.005): lowered at once"
    control = EtaController(drift_budget=0.02, eta_min=1, eta_max=8, eta=8)
    assert control.observe(0.05) == 1, "clamped to eta_min"
    assert control.over_budget(), "0.05 per version is beyond the budget even at eta_min"
    control = EtaController(drift_budget=0.02, eta_min=1, eta_max=8, eta=1)
    assert control.observe(0.0) == 1 and control.target() == 8, "no drift: eta_max, but raised slowly"


def test_eta_rises_one_version_at_a_time_after_patience_and_falls_at_once():
    control = EtaController(drift_budget=0.02, eta_min=1, eta_max=8)
    assert control.eta == 1
    seen = [control.observe(0.004) for _ in range(3 * RAISE_PATIENCE)]  # target 5
    assert seen[RAISE_PATIENCE - 2] == 1 and seen[RAISE_PATIENCE - 1] == 2, "one step after the patience"
    assert seen[-1] == 4 and all(b - a in (0, 1) for a, b in zip(seen, seen[1:])), seen
    assert control.observe(0.1) == 1, "a jump in drift lowers it at once"  # smoothed: 0.3*0.1+0.7*0.004
    assert not math.isnan(control.drift)


def test_a_batch_without_a_slope_leaves_eta_alone():
    control = EtaController(drift_budget=0.02, eta_min=0, eta_max=4, eta=3)
    assert control.observe(math.nan) == 3 and math.isnan(control.drift)
    assert control.observe(-0.01) == 3, "raised only after the patience"
    assert control.drift == 0.0 and control.target() == 4, "a negative slope counts as no drift"


def test_a_full_window_at_eta_one_still_lets_eta_open():
    """Every token one version stale: no slope, so the step's gap per version of staleness is
    what the controller reads; with a small one η opens toward eta_max, as a slope would let it."""
    control = EtaController(drift_budget=0.02, eta_min=1, eta_max=8)
    step = {"drift/per_version_k3": math.nan, "drift/per_version_from_gap_k3": 0.004}
    seen = [control.observe_step(step) for _ in range(2 * RAISE_PATIENCE)]
    assert control.drift == pytest.approx(0.004) and seen[-1] == 3, seen
    assert control.observe_step({"drift/per_version_k3": 0.05, "drift/per_version_from_gap_k3": 0.001}) == 1, \
        "a slope, where there is one, comes first"
    assert control.observe_step({}) == 1, "a step that measured nothing leaves eta alone"


def test_bad_settings_are_refused():
    with pytest.raises(ValueError, match="eta_min <= eta_max"):
        EtaController(drift_budget=0.02, eta_min=4, eta_max=2)
    with pytest.raises(ValueError, match="drift_budget > 0"):
        EtaController(drift_budget=0.0, eta_min=0, eta_max=2)
    with pytest.raises(ValueError, match="eta_min"):
        GateConfig(eta="auto", eta_min=5, eta_max=2)
    assert GateConfig(eta="auto", eta_min=2).initial_eta == 2 and GateConfig(eta=3).initial_eta == 3


class ChangingEta(RuleBasedStateMachine):
    """The real core under random acquires, releases, pushes, pulls with acks, version bumps and
    η changes. Checked at each event against the η in force then: a grant only while
    accepted + running < (η + i + 1)·B, and no pulled group staler than η."""

    B = 2

    def __init__(self):
        super().__init__()
        self.core = BufferCore(BufferConfig(gate=GateConfig(batch_size=self.B, eta=2, max_concurrent=64)))
        self.held: list = []

    @rule()
    def acquire(self):
        g = self.core.gate
        before, limit = g.accepted + g.running, g.staleness_limit()
        permit = self.core.acquire_permit("w")
        if permit is not None:
            assert limit is None or before + 1 <= limit, (before, limit, g.eta)
            self.held.append(permit)
        else:
            assert limit is not None and before >= limit or g.running >= g.max_concurrent

    @precondition(lambda self: self.held)
    @rule(data=st.data(), lag=st.integers(0, 3))
    def push(self, data, lag):
        """A group whose generation started `lag` versions ago (a slow worker)."""
        permit = self.held.pop(data.draw(st.integers(0, len(self.held) - 1)))
        version = max(0, min(permit.version, self.core.gate.version - lag))
        self.core.push_group(encode_group(make_group(permit.ticket, version=version)), permit.permit_id)

    @precondition(lambda self: self.held)
    @rule()
    def release(self):
        self.core.release_permit(self.held.pop().permit_id)

    @rule()
    def learner_step(self):
        result = self.core.pull_batch(self.B)
        if result is None:
            return
        eta, version = self.core.gate.eta, self.core.gate.version
        for packed in result.groups:
            oldest = min(group_index(unpack_frames(packed)[0]).weight_versions)
            assert eta is None or version - oldest <= eta, (version, oldest, eta)
        self.core.ack(result.lease_id, version=version + 1)

    @rule(eta=st.integers(0, 4))
    def change_eta(self, eta):
        self.core.set_eta(eta)
        assert self.core.gate.eta == eta

    @invariant()
    def capacity_is_never_negative_after_a_grant(self):
        g = self.core.gate
        assert g.running <= g.max_concurrent


TestChangingEta = ChangingEta.TestCase
TestChangingEta.settings = settings(max_examples=60, stateful_step_count=40, deadline=None,
                                    suppress_health_check=[HealthCheck.too_slow])


def test_the_eta_in_force_survives_a_restart_and_a_compaction(tmp_path):
    config = BufferConfig(gate=GateConfig(batch_size=1, eta="auto", eta_min=1, eta_max=6),
                          log=LogConfig(path=tmp_path / "b.log", compact_min_bytes=0))
    core = BufferCore(config)
    assert core.gate.eta == 1, "auto starts at eta_min"
    core.set_eta(4)
    core.close()
    assert BufferCore(config).gate.eta == 4, "replayed from the log"
    again = BufferCore(config)
    for version in range(1, 6):  # pushes and acks until a compaction rewrote the log
        permit = again.acquire_permit("w")
        again.push_group(encode_group(make_group(permit.ticket, version=version - 1)), permit.permit_id)
        again.ack(again.pull_batch(1).lease_id, version=version)
    assert again.wait_for_compaction(timeout=60) and again.stats()["log_compactions"] >= 1
    again.close()
    assert BufferCore(config).gate.eta == 4, "kept in the snapshot"
