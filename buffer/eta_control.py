"""The adaptive staleness bound (`buffer.gate.eta: auto`): η from the measured drift per version.

What costs learning is not how many versions old a sample is but how far the policy moved in
those versions. A sample s versions old was drawn from a policy about s · d away from the one that
trains on it (d: the drift per learner version, k3, nats per token; `learner/drift.py`). The
bound η caps s, so η · d is the largest staleness drift the learner meets; the controller keeps it
within `drift_budget`: η = ⌊budget / d̂⌋, clamped to [eta_min, eta_max], with d̂ a smoothed d. The
backend mismatch does not count (η cannot shrink it; the rollout correction handles it).

Hysteresis so η does not flap: it goes down at once when η · d̂ exceeds the budget (the run is
moving faster than its bound allows), and up one version at a time, only after the larger η was
wanted for `RAISE_PATIENCE` observations in a row.

Pure state: no torch, no Ray, no clock. The run loop feeds `observe()` once per learner step with
the step's drift per version and sends the η it returns to the buffer (`set_eta`) when it changes.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

SMOOTHING = 0.3
"""Weight of a new observation in the running estimate d̂ (an exponential moving average)."""

RAISE_PATIENCE = 5
"""Consecutive observations that must want a larger η before it is raised by one."""


@dataclass
class EtaController:
    drift_budget: float
    eta_min: int
    eta_max: int
    eta: int = field(default=-1)  # the bound in force; starts at eta_min
    drift: float = math.nan  # d̂, the smoothed drift per version
    _wanting_more: int = 0

    def __post_init__(self):
        if not (self.drift_budget > 0 and 0 <= self.eta_min <= self.eta_max):
            raise ValueError(f"need drift_budget > 0 and 0 <= eta_min <= eta_max, got budget={self.drift_budget}, "
                             f"eta_min={self.eta_min}, eta_max={self.eta_max}")
        if self.eta < 0:
            self.eta = self.eta_min
        self.eta = min(max(self.eta, self.eta_min), self.eta_max)

    def observe(self, per_version_drift: float) -> int:
        """One learner step's drift per version (NaN when the batch could not measure it: the
        estimate and η stay). Returns the η to enforce now."""
        if not math.isfinite(per_version_drift):
            return self.eta
        measured = max(per_version_drift, 0.0)  # a negative slope is noise: the policy did not move back
        self.drift = measured if math.isnan(self.drift) else SMOOTHING * measured + (1 - SMOOTHING) * self.drift
        target = self.target()
        if target < self.eta:
            self.eta, self._wanting_more = target, 0
        elif target > self.eta:
            self._wanting_more += 1
            if self._wanting_more >= RAISE_PATIENCE:
                self.eta, self._wanting_more = self.eta + 1, 0
        else:
            self._wanting_more = 0
        return self.eta

    def observe_step(self, metrics: dict) -> int:
        """`observe` with a learner step's metrics: its `drift/per_version_k3`, or where the batch
        held one staleness only (no slope, NaN) its `drift/per_version_from_gap_k3`; so a full
        window at η = 1, where every token is one version stale, still measures the drift."""
        drift = metrics.get("drift/per_version_k3", math.nan)
        if not math.isfinite(drift):
            drift = metrics.get("drift/per_version_from_gap_k3", math.nan)
        return self.observe(drift)

    def target(self) -> int:
        """The largest η whose staleness drift η · d̂ stays within the budget, clamped."""
        if math.isnan(self.drift):
            return self.eta
        wanted = self.eta_max if self.drift <= 0 else math.floor(self.drift_budget / self.drift)
        return min(max(wanted, self.eta_min), self.eta_max)

    def over_budget(self) -> bool:
        """The drift exceeds the budget even at eta_min (at least one version of staleness): the
        run moves too fast for asynchrony (lower the lr, or go synchronous)."""
        return math.isfinite(self.drift) and max(self.eta_min, 1) * self.drift > self.drift_budget

    def gauges(self) -> dict[str, float]:
        return {"gate/eta": float(self.eta), "drift/smoothed_per_version_k3": self.drift,
                "drift/budget_k3": self.drift_budget, "drift/over_budget_at_eta_min": float(self.over_budget())}
