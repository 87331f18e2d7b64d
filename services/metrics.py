"""etarl's Prometheus metrics: the one catalogue, the naming rule, and the exporter.

How metrics reach Prometheus (see docs/deploy.md for the why):

- Ray actors (rollout workers, the learner, the in-Ray buffer) do not export anything themselves.
  The controller already asks them for their stats every step; it hands those dicts to one
  `MetricsExporter` in the driver process, which serves them on one HTTP port, per worker
  labelled `worker="..."`. (Ray's own per-node export, `ray.util.metrics`, would rename every
  metric to `ray_etarl_...` and scatter one run over every node's agent.)
- Processes outside Ray (the standalone ZMQ buffer service, the controller itself) run a
  prometheus_client HTTP server from this module.

The exporter mirrors snapshots: components keep their own cumulative counters and the exporter
reports the latest values at scrape time (a counter that goes backwards after a restart is a
counter reset, which `rate()` handles).

Names: one namespace `etarl_`, base units (seconds, bytes, versions, tokens), counters end in
`_total`. The learner's step metrics keep verl's names in the training log; `prometheus_name`
maps them by a fixed rule (`rollout_corr/rollout_is_eff_sample_size` ->
`etarl_rollout_corr_rollout_is_eff_sample_size`, `timing_s/update_actor` ->
`etarl_timing_update_actor_seconds`).
"""
from __future__ import annotations

import logging
import math
import re
import sys
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

from prometheus_client import CollectorRegistry, generate_latest, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

log = logging.getLogger(__name__)

NAMESPACE = "etarl"
Kind = Literal["counter", "gauge", "histogram"]
Source = Literal["step", "buffer", "worker", "exporter"]

# The staleness histogram gets one bucket per version up to η; without a bound, up to this.
UNBOUNDED_STALENESS_BUCKETS = 16


@dataclass(frozen=True)
class MetricSpec:
    """One exported metric. `key` is the field it comes from in its source's dict."""

    name: str
    kind: Kind
    help: str
    source: Source
    key: str = ""
    labels: tuple[str, ...] = ()


# Keys of a step record not exported as step gauges: bookkeeping, and what a buffer metric carries.
STEP_BOOKKEEPING_KEYS = frozenset({"step", "version", "time", "buffer/restarts"})
_INVALID = re.compile(r"[^a-z0-9_]+")
_TIMING_PREFIX = "timing_s/"


def prometheus_name(key: str) -> str:
    """The fixed rule from a verl-style metric key to its Prometheus name.

    Lower-case; every run of characters outside [a-z0-9_] becomes one `_`; leading and trailing
    `_` dropped; `etarl_` in front. Keys under `timing_s/` are durations: their name becomes
    `etarl_timing_<phase>_seconds` (base unit in the suffix, as Prometheus wants).
    """
    if not isinstance(key, str) or not key.strip():
        raise ValueError(f"metric key must be a non-empty string, got {key!r}")
    seconds = key.startswith(_TIMING_PREFIX)
    if seconds:
        key = "timing/" + key[len(_TIMING_PREFIX):]
    body = _INVALID.sub("_", key.lower()).strip("_")
    if not body:
        raise ValueError(f"metric key {key!r} has no letters or digits to name a metric with")
    name = f"{NAMESPACE}_{body}"
    return f"{name}_seconds" if seconds and not name.endswith("_seconds") else name


def _step(key: str, help: str) -> MetricSpec:
    return MetricSpec(prometheus_name(key), "gauge", f"{help} (learner step metric `{key}`)", "step", key)


def _buffer(name: str, kind: Kind, key: str, help: str, labels: tuple[str, ...] = ()) -> MetricSpec:
    return MetricSpec(f"{NAMESPACE}_{name}", kind, help, "buffer", key, labels)


def _worker(name: str, kind: Kind, key: str, help: str) -> MetricSpec:
    return MetricSpec(f"{NAMESPACE}_{name}", kind, help, "worker", key, ("worker",))


def _own(name: str, kind: Kind, help: str, labels: tuple[str, ...] = ()) -> MetricSpec:
    return MetricSpec(f"{NAMESPACE}_{name}", kind, help, "exporter", "", labels)


# The learner's per-step metrics that the dashboards and alerts rely on. Any other numeric key a
# step reports is exported too, named by `prometheus_name`, as a gauge, except the bookkeeping
# keys, which have their own metrics (etarl_learner_steps_total, etarl_learner_version,
# etarl_learner_last_step_timestamp_seconds).
STEP_METRICS: tuple[MetricSpec, ...] = (
    _step("rollout_corr/kl", "KL(pi_rollout || pi_old), k1 estimator"),
    _step("rollout_corr/k3_kl", "KL(pi_rollout || pi_old), k3 estimator"),
    _step("rollout_corr/chi2_token", "chi-squared divergence per token, E[rho^2] - 1"),
    _step("rollout_corr/chi2_seq", "chi-squared divergence per sequence"),
    _step("rollout_corr/rollout_is_mean", "mean IS weight"),
    _step("rollout_corr/rollout_is_std", "standard deviation of the IS weights"),
    _step("rollout_corr/rollout_is_min", "smallest IS weight"),
    _step("rollout_corr/rollout_is_max", "largest IS weight"),
    _step("rollout_corr/rollout_is_eff_sample_size", "effective sample size of the IS weights, as a fraction"),
    _step("rollout_corr/rollout_is_ratio_fraction_high", "fraction of IS ratios above the cap"),
    _step("rollout_corr/rollout_is_ratio_fraction_low", "fraction of IS ratios below the lower bound"),
    _step("rollout_corr/rollout_is_veto_fraction", "fraction of sequences vetoed"),
    _step("rollout_corr/rollout_is_catastrophic_token_fraction", "fraction of tokens below the veto threshold"),
    _step("rollout_corr/rollout_rs_masked_fraction", "fraction of tokens rejected by rejection sampling"),
    _step("rollout_corr/rollout_rs_seq_masked_fraction", "fraction of sequences with a rejected token"),
    _step("rollout_corr/log_ppl_abs_diff", "|log ppl(training) - log ppl(rollout)|"),
    _step("rollout_corr/ppl_ratio", "training ppl / rollout ppl"),
    _step("actor/pg_loss", "policy-gradient loss"),
    _step("actor/pg_clipfrac", "fraction of tokens where the PPO clip is active"),
    _step("actor/pg_clipfrac_lower", "fraction of tokens where the dual clip is active"),
    _step("actor/ppo_kl", "KL(pi_old || pi_theta) over the update"),
    _step("actor/entropy", "policy entropy per token"),
    _step("actor/grad_norm", "gradient norm before clipping"),
    _step("actor/lr", "learning rate"),
    _step("critic/vf_loss", "the critic's clipped value loss (advantage.estimator gae)"),
    _step("critic/vf_explained_var", "1 - Var(returns - values) / Var(returns): how much of the returns the "
          "critic's values foresee (gae)"),
    _step("reward/mean", "mean reward of the consumed batch"),
    _step("reward/failure_fraction", "share of the consumed batch's samples whose reward failed (raised, hung, "
          "returned garbage): they scored the failure reward"),
    _step("multi_turn/turns_mean", "policy turns per multi-turn trajectory in the consumed batch"),
    _step("multi_turn/env_seconds_mean", "seconds of environment calls per multi-turn trajectory"),
    _step("multi_turn/env_failure_fraction",
          "fraction of multi-turn trajectories whose environment hung, crashed or returned garbage"),
    _step("gate/eta", "the staleness bound eta in force (buffer.gate.eta, or the adaptive controller's choice)"),
    _step("drift/total_k3", "gap between the sampler and the learner's proximal policy, KL k3, nats per token"),
    _step("drift/backend_k3", "the gap's backend part: the gap of tokens the current version sampled (inference vs "
          "training backend at equal weights); NaN in a step without such tokens"),
    _step("drift/backend_intercept_k3", "the gap against staleness extrapolated to 0: a guess at the backend part "
          "where no token is fresh, biased low when the gap grows faster than linearly"),
    _step("drift/per_version_k3", "the gap's growth per version of staleness (how far one learner step moves)"),
    _step("drift/per_version_from_gap_k3", "the stale tokens' gap over their mean staleness: the drift per version "
          "eta auto uses when the batch holds one staleness only (no slope)"),
    _step("drift/smoothed_per_version_k3", "the adaptive eta controller's smoothed drift per version"),
    _step("drift/budget_k3", "buffer.gate.drift_budget: the staleness drift eta auto keeps within"),
    _step("drift/over_budget_at_eta_min", "1 when the drift exceeds the budget even at eta_min"),
    _step("eval/accuracy", "greedy accuracy on the held-out prompts"),
    _step("timing_s/step", "seconds of the learner's update step (proximal log-probs and update)"),
    _step("timing_s/step_total", "seconds of the whole step: wait for data, train, publish weights"),
    _step("timing_s/wait_data", "seconds the learner waited for a batch"),
    _step("timing_s/old_log_prob", "seconds recomputing the proximal log-probs"),
    _step("timing_s/update_actor", "seconds in the policy update"),
    _step("timing_s/update_critic", "seconds in the critic's update (gae)"),
    _step("timing_s/weight_sync", "seconds publishing the new weights"),
)

# The buffer's stats() dict (keys documented in buffer/core.py), served by the buffer service's
# exporter or relayed by the controller. Labelled families take a dict {label value: number}.
BUFFER_METRICS: tuple[MetricSpec, ...] = (
    _buffer("buffer_version", "gauge", "version", "learner version the buffer's gate knows"),
    _buffer("staleness_bound_versions", "gauge", "eta", "the eta bound; NaN when unbounded"),
    _buffer("gate_batch_size_groups", "gauge", "batch_size", "B, groups per learner step"),
    _buffer("gate_max_concurrent_permits", "gauge", "max_concurrent", "permits allowed at once"),
    _buffer("gate_capacity_permits", "gauge", "capacity", "permits the eta gate would grant now"),
    _buffer("gate_permits_running", "gauge", "running", "permits held by generating workers"),
    _buffer("gate_requests_waiting", "gauge", "enqueued", "permit requests waiting for the gate"),
    _buffer("gate_accepted_groups_total", "counter", "accepted", "groups admitted by the gate"),
    _buffer("gate_rejected_requests_total", "counter", "rejected", "permit requests that ended without a permit"),
    _buffer("gate_permits_released_total", "counter", "permits_released", "permits returned unused"),
    _buffer("gate_permits_reclaimed_total", "counter", "permits_reclaimed", "permits of dead holders reclaimed"),
    _buffer("gate_wait_seconds_total", "counter", "gate_wait_seconds", "seconds permit requests waited"),
    _buffer("gate_waits_total", "counter", "gate_waits", "permit requests that waited"),
    _buffer("buffer_groups", "gauge", "groups_ready", "groups waiting in the buffer"),
    _buffer("buffer_capacity_groups", "gauge", "store_capacity_groups", "groups the buffer can hold"),
    _buffer("buffer_leased_groups", "gauge", "groups_leased", "groups pulled but not yet acknowledged"),
    _buffer("buffer_samples", "gauge", "samples_ready", "samples waiting in the buffer"),
    _buffer("buffer_bytes", "gauge", "bytes_held", "bytes of sample data held"),
    _buffer("buffer_capacity_bytes", "gauge", "store_max_bytes",
            "bytes of packed groups the buffer may hold (store.max_bytes); pushes beyond are refused as store_full"),
    _buffer("samples_pushed_total", "counter", "pushed_samples", "samples accepted into the buffer"),
    _buffer("groups_pushed_total", "counter", "pushed_groups", "groups accepted into the buffer"),
    _buffer("duplicate_pushes_total", "counter", "duplicate_pushes", "retried pushes ignored as duplicates"),
    _buffer("samples_consumed_total", "counter", "consumed_samples", "samples the learner trained on (acked)"),
    _buffer("groups_consumed_total", "counter", "consumed_groups", "groups the learner trained on (acked)"),
    _buffer("samples_dropped_total", "counter", "dropped_samples", "samples dropped, by reason", ("reason",)),
    _buffer("groups_dropped_total", "counter", "dropped_groups", "groups dropped, by reason", ("reason",)),
    _buffer("groups_consumed_by_length_total", "counter", "consumed_groups_by_length",
            "groups trained on, by their longest response in tokens (le: bucket upper bound)", ("length_le",)),
    _buffer("groups_dropped_stale_by_length_total", "counter", "dropped_groups_by_length",
            "groups dropped as too stale, by their longest response in tokens (long generations start "
            "older)", ("length_le",)),
    _buffer("prompts_quarantined_total", "counter", "prompts_quarantined",
            "prompts set aside for good: they failed generation max_prompt_failures times on their own"),
    _buffer("groups_filtered_total", "counter", "groups_filtered",
            "groups generated and left untrained as uninformative (dynamic sampling: rollout.filter_groups)"),
    _buffer("buffer_bad_messages_total", "counter", "bad_messages", "malformed messages and invalid samples, by reason",
            ("reason",)),
    _buffer("buffer_request_errors_total", "counter", "request_errors", "refused requests, by reason", ("reason",)),
    _buffer("buffer_leases_expired_total", "counter", "leases_expired", "pulled batches returned by lease expiry"),
    _buffer("buffer_nacks_total", "counter", "nacks", "pulled batches handed back"),
    _buffer("buffer_log_bytes", "gauge", "log_bytes", "size of the durable log"),
    _buffer("buffer_log_fsyncs_total", "counter", "log_fsyncs", "fsyncs of the durable log"),
    _buffer("buffer_log_compactions_total", "counter", "log_compactions", "compactions of the durable log"),
    _buffer("buffer_log_compaction_longest_lock_seconds", "gauge", "log_compaction_longest_lock_s",
            "the longest a background compaction held the buffer's lock (its final swap)"),
    _buffer("buffer_restarts_total", "counter", "restarts",
            "restarts of the run's buffer after it died (each replays its durable log)"),
    _buffer("consumed_staleness_versions", "histogram", "consumed_staleness",
            "staleness of consumed samples (learner version at pull minus sample version), a bucket per version"),
    _buffer("consumed_samples_over_eta_total", "counter", "consumed_staleness",
            "consumed samples staler than eta (must stay 0)"),
)

# A rollout worker's stats() dict (rollout_workers/worker.py), relayed by the controller.
WORKER_METRICS: tuple[MetricSpec, ...] = (
    _worker("worker_weight_version", "gauge", "loaded_version", "weight version loaded by the worker"),
    _worker("worker_groups_generated_total", "counter", "groups_total", "groups generated and pushed"),
    _worker("worker_samples_produced_total", "counter", "samples_total", "samples generated and pushed"),
    _worker("worker_tokens_generated_total", "counter", "tokens_total", "response tokens generated"),
    _worker("worker_generation_seconds_total", "counter", "generation_s", "seconds generating"),
    _worker("worker_gate_wait_seconds_total", "counter", "gate_blocked_s", "seconds blocked on the eta gate"),
    _worker("worker_weight_load_seconds_total", "counter", "weight_load_s", "seconds loading new weights"),
    _worker("worker_weight_loads_total", "counter", "weight_loads_total", "weight versions loaded"),
    _worker("worker_failed_generations_total", "counter", "failed_generations_total", "generations that failed"),
    _worker("worker_interrupted_generations_total", "counter", "interrupted_generations_total",
            "generations interrupted by new weights and continued"),
    _worker("worker_permits_released_total", "counter", "permits_released_total", "permits given back unused"),
    _worker("worker_permits_refused_total", "counter", "permits_refused_total",
            "permit requests the buffer's per-client cap refused (the worker went on with what it held)"),
    _worker("worker_prompt_failures_total", "counter", "prompt_failures_total",
            "generations of one prompt on its own that failed (after its engine batch failed)"),
    _worker("worker_prompts_quarantined_total", "counter", "prompts_quarantined_total",
            "prompts this worker quarantined"),
    _worker("worker_groups_filtered_total", "counter", "groups_filtered_total",
            "groups this worker left untrained as uninformative (rollout.filter_groups)"),
    _worker("worker_uninformative_groups_pushed_total", "counter", "uninformative_pushed_total",
            "uninformative groups pushed anyway after rollout.filter_groups.max_in_a_row filtered in a row"),
    _worker("worker_weight_load_failures_total", "counter", "weight_load_failures_total",
            "weight loads that failed (retried, then the worker restarts)"),
    _worker("worker_weight_loads_rejected_total", "counter", "weight_loads_rejected_total",
            "weight versions refused by content (digest mismatch, NaN/inf): the engine kept its weights"),
    _worker("worker_reward_calls_total", "counter", "reward_calls_total",
            "responses scored by the reward (a call each; a batch-form reward: a group a call)"),
    _worker("worker_reward_failures_total", "counter", "reward_failures_total",
            "responses whose reward failed (scored failure_reward)"),
    _worker("worker_reward_timeouts_total", "counter", "reward_timeouts_total",
            "responses whose reward call timed out"),
    _worker("worker_reward_mean", "gauge", "reward_mean", "mean reward of the worker's recent samples"),
    _worker("worker_turns_total", "counter", "turns_total", "policy turns generated in multi-turn trajectories"),
    _worker("worker_env_calls_total", "counter", "env_calls_total", "environment calls (resets and steps)"),
    _worker("worker_env_seconds_total", "counter", "env_seconds_total", "seconds in environment calls"),
    _worker("worker_env_failures_total", "counter", "env_failures_total",
            "environment calls that hung, crashed, raised or returned garbage (each ended its trajectory)"),
    _worker("worker_env_timeouts_total", "counter", "env_timeouts_total",
            "environment calls that took longer than rollout.multi_turn.step_timeout_s"),
    _worker("worker_tokens_per_second", "gauge", "tokens_per_s", "tokens per second of generation time"),
    _worker("worker_gpu_max_memory_allocated_bytes", "gauge", "gpu_max_memory_allocated_bytes",
            "peak GPU memory of the worker's in-process engine's tensors (the transformers engine; vLLM's is "
            "its gpu_memory_utilization share)"),
    _worker("worker_gpu_max_memory_reserved_bytes", "gauge", "gpu_max_memory_reserved_bytes",
            "peak GPU memory its allocator reserved: what the GPU sees taken"),
)

EXPORTER_METRICS: tuple[MetricSpec, ...] = (
    _own("buffer_up", "gauge", "1 while the buffer answers for its stats"),
    _own("learner_version", "gauge", "the learner's weight version (policy version i)"),
    _own("learner_steps_total", "counter", "learner steps completed"),
    _own("learner_last_step_timestamp_seconds", "gauge", "unix time of the last completed learner step"),
    _own("worker_restarts_total", "counter", "rollout worker restarts", ("worker",)),
    _own("worker_up", "gauge", "1 while the controller hears from the worker", ("worker",)),
)

CATALOGUE: tuple[MetricSpec, ...] = STEP_METRICS + BUFFER_METRICS + WORKER_METRICS + EXPORTER_METRICS


def exposed_names(spec: MetricSpec) -> tuple[str, ...]:
    """The series names a scrape shows for one metric (histograms expose three)."""
    if spec.kind == "histogram":
        return (f"{spec.name}_bucket", f"{spec.name}_count", f"{spec.name}_sum")
    return (spec.name,)


def catalogue_names() -> frozenset[str]:
    """Every series name etarl exports by name (dynamic step gauges aside)."""
    return frozenset(n for spec in CATALOGUE for n in exposed_names(spec))


def _number(value: object) -> float | None:
    """A float for ints, floats, bools and numpy/torch scalars; None for anything else."""
    if isinstance(value, (bool, int, float)):
        return float(value)
    item = getattr(value, "item", None)  # numpy and torch 0-d values
    if callable(item) and getattr(value, "ndim", None) == 0:
        try:
            out = item()
        except (TypeError, ValueError, RuntimeError):
            return None
        return float(out) if isinstance(out, (bool, int, float)) else None
    return None


def staleness_buckets(eta: int | None) -> tuple[int, ...]:
    """Upper bounds of the staleness histogram: one bucket per version, 0..η."""
    top = UNBOUNDED_STALENESS_BUCKETS if eta is None else eta
    return tuple(range(top + 1))


class MetricsExporter:
    """Serves etarl's metrics on http://host:port/metrics from the snapshots it is given.

    Thread-safe: the controller records from its loop while the HTTP thread scrapes.
    `port=None` serves nothing (read `exposition()`); `port=0` takes a free port, then `.port`
    says which. Bind to 127.0.0.1 unless a pod network must reach it (KubeRay: 0.0.0.0).
    """

    def __init__(self, port: int | None = None, host: str = "127.0.0.1"):
        self._lock = threading.Lock()
        self._step: dict[str, float] = {}
        self._buffer: dict[str, object] = {}
        self._buffer_up: float | None = None
        self._workers: dict[str, dict[str, float]] = {}
        self._worker_up: dict[str, float] = {}
        self._restarts: dict[str, int] = {}
        self._version: float | None = None
        self._steps = 0
        self._last_step_at: float | None = None
        self._warned: set[str] = set()
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(_Collector(self))
        self._server = None
        self.port: int | None = None
        if port is not None:
            self._server, _ = start_http_server(port, addr=host, registry=self.registry)
            self.port = self._server.server_port

    # -- recording -----------------------------------------------------------------------
    def record_step(self, step_metrics: Mapping[str, object], *, version: int | None = None) -> None:
        """One finished learner step: its verl-style metrics dict and the learner's new version.
        Numbers (and numpy/torch scalars) are exported; other values are skipped."""
        values = {}
        for key, raw in step_metrics.items():
            value = None if key in STEP_BOOKKEEPING_KEYS else _number(raw)
            if value is not None:
                values[prometheus_name(str(key))] = value
        with self._lock:
            for name, value in values.items():
                if name in _OTHER_NAMES:
                    self._warn_once(name, f"a step metric maps to {name}, which another source owns; not exported")
                    continue
                self._step[name] = value
            self._steps += 1
            self._last_step_at = time.time()
            if version is not None:
                self._version = float(version)

    def record_buffer_stats(self, stats: Mapping[str, object]) -> None:
        """The latest `stats()` of the buffer (cumulative counters, current gauges)."""
        with self._lock:
            self._buffer = dict(stats)
            self._buffer_up = 1.0

    def record_buffer_down(self) -> None:
        """The buffer did not answer for its stats; its last values stay, `etarl_buffer_up` is 0."""
        with self._lock:
            self._buffer_up = 0.0

    def record_worker_stats(self, worker_id: str, stats: Mapping[str, object]) -> None:
        """The latest stats of one rollout worker (cumulative counters, current gauges)."""
        if not isinstance(worker_id, str) or not worker_id:
            raise ValueError(f"worker_id must be a non-empty string, got {worker_id!r}")
        values = {k: v for k, v in ((k, _number(v)) for k, v in stats.items()) if v is not None}
        with self._lock:
            self._workers[worker_id] = values
            self._worker_up[worker_id] = 1.0

    def record_worker_down(self, worker_id: str) -> None:
        """The controller lost contact with a worker (dead or restarting)."""
        with self._lock:
            self._worker_up[worker_id] = 0.0

    def record_worker_restart(self, worker_id: str) -> None:
        with self._lock:
            self._restarts[worker_id] = self._restarts.get(worker_id, 0) + 1

    # -- reading ---------------------------------------------------------------------------
    def exposition(self) -> str:
        """The text a scrape would get."""
        return generate_latest(self.registry).decode()

    def close(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None

    def _warn_once(self, key: str, message: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            log.warning(message)

    def _snapshot(self) -> dict:
        with self._lock:
            return {
                "step": dict(self._step),
                "buffer": dict(self._buffer),
                "buffer_up": self._buffer_up,
                "workers": {w: dict(v) for w, v in self._workers.items()},
                "worker_up": dict(self._worker_up),
                "restarts": dict(self._restarts),
                "version": self._version,
                "steps": self._steps,
                "last_step_at": self._last_step_at,
            }


_SPEC_BY_NAME = {spec.name: spec for spec in CATALOGUE}
_OTHER_NAMES = frozenset(spec.name for spec in CATALOGUE if spec.source != "step")


def _family(spec: MetricSpec, value: float | None = None):
    cls = CounterMetricFamily if spec.kind == "counter" else GaugeMetricFamily
    family = cls(spec.name, spec.help, labels=spec.labels)
    if value is not None:
        family.add_metric([], value)
    return family


def _staleness_counts(raw: object) -> dict[int, float]:
    """The buffer's {staleness: count} (keys may be strings after a JSON/msgpack trip)."""
    if not isinstance(raw, Mapping):
        return {}
    counts = {}
    for key, value in raw.items():
        number = _number(value)
        try:
            staleness = int(key)
        except (TypeError, ValueError):
            continue
        if number is not None and staleness >= 0:
            counts[staleness] = number
    return counts


def _staleness_families(stats: Mapping[str, object]):
    """The histogram with a bucket per version (0..η) and the count of samples above η."""
    if "consumed_staleness" not in stats:
        return
    counts = _staleness_counts(stats["consumed_staleness"])
    eta = stats.get("eta")
    eta = eta if isinstance(eta, int) and not isinstance(eta, bool) and eta >= 0 else None
    cumulative, buckets = 0.0, []
    for bound in staleness_buckets(eta):
        cumulative += counts.get(bound, 0.0)
        buckets.append((floatToGoString(bound), cumulative))
    total = sum(counts.values())
    buckets.append(("+Inf", total))
    histogram = HistogramMetricFamily(_SPEC_BY_NAME["etarl_consumed_staleness_versions"].name,
                                      _SPEC_BY_NAME["etarl_consumed_staleness_versions"].help)
    histogram.add_metric([], buckets, sum(s * n for s, n in counts.items()))
    yield histogram
    over = sum(n for s, n in counts.items() if s > eta) if eta is not None else 0.0
    yield _family(_SPEC_BY_NAME["etarl_consumed_samples_over_eta_total"], over)


class _Collector(Collector):
    """Builds every family from the exporter's snapshot at scrape time."""

    def __init__(self, exporter: MetricsExporter):
        self._exporter = exporter

    def collect(self):
        snap = self._exporter._snapshot()
        yield from self._step_families(snap["step"])
        yield from self._buffer_families(snap["buffer"])
        yield from self._worker_families(snap["workers"])
        yield from self._own_families(snap)

    @staticmethod
    def _step_families(step: dict[str, float]):
        for name, value in sorted(step.items()):
            spec = _SPEC_BY_NAME.get(name) or MetricSpec(name, "gauge", "learner step metric", "step")
            yield _family(spec, value)

    @staticmethod
    def _buffer_families(stats: dict[str, object]):
        yield from _staleness_families(stats)
        for spec in BUFFER_METRICS:
            if spec.key not in stats or spec.key == "consumed_staleness":
                continue
            raw = stats[spec.key]
            if spec.labels:
                if not isinstance(raw, Mapping):
                    continue
                family = _family(spec)
                for label, value in sorted(raw.items()):
                    number = _number(value)
                    if number is not None:
                        family.add_metric([str(label)], number)
                yield family
            elif raw is None and spec.key == "eta":
                yield _family(spec, math.nan)  # unbounded
            elif (number := _number(raw)) is not None:
                yield _family(spec, number)

    @staticmethod
    def _worker_families(workers: dict[str, dict[str, float]]):
        for spec in WORKER_METRICS:
            rows = [(w, stats[spec.key]) for w, stats in sorted(workers.items()) if spec.key in stats]
            if rows:
                family = _family(spec)
                for worker_id, value in rows:
                    family.add_metric([worker_id], value)
                yield family

    @staticmethod
    def _own_families(snap: dict):
        spec = _SPEC_BY_NAME
        if snap["buffer_up"] is not None:
            yield _family(spec["etarl_buffer_up"], snap["buffer_up"])
        if snap["version"] is not None:
            yield _family(spec["etarl_learner_version"], snap["version"])
        yield _family(spec["etarl_learner_steps_total"], snap["steps"])
        if snap["last_step_at"] is not None:
            yield _family(spec["etarl_learner_last_step_timestamp_seconds"], snap["last_step_at"])
        restarts = _family(spec["etarl_worker_restarts_total"])
        for worker_id in sorted(set(snap["restarts"]) | set(snap["worker_up"])):
            restarts.add_metric([worker_id], snap["restarts"].get(worker_id, 0))
        yield restarts
        up = _family(spec["etarl_worker_up"])
        for worker_id, value in sorted(snap["worker_up"].items()):
            up.add_metric([worker_id], value)
        yield up


def serve_buffer_metrics(argv: list[str] | None = None) -> int:
    """The standalone buffer service's exporter: a small process (or Kubernetes sidecar) that asks
    the service for its stats every --interval seconds and serves them under etarl's names; a
    scrape never waits on the service (a dead one shows as etarl_buffer_up 0).

        python -m services.metrics --buffer tcp://127.0.0.1:5557 --port 9401 [--config buffer.yaml]

    `--config` supplies the CURVE client keys when the service requires them.
    """
    import argparse
    import signal

    from buffer.client import BufferClient
    from buffer.config import BufferConfig, ClientConfig

    parser = argparse.ArgumentParser(prog="python -m services.metrics", description=serve_buffer_metrics.__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--buffer", help="the service's endpoint (default: the config's)")
    parser.add_argument("--config", help="buffer config YAML, or a run config with a `buffer:` section")
    parser.add_argument("--port", type=int, default=9401, help="serve /metrics here (0: any free port)")
    parser.add_argument("--host", default="127.0.0.1", help="bind address (0.0.0.0 only inside a pod network)")
    parser.add_argument("--interval", type=float, default=2.0, help="seconds between reads of the stats")
    args = parser.parse_args(argv)
    try:
        config = BufferConfig.from_yaml(args.config) if args.config else BufferConfig()
        # Short timeouts: a scrape must answer (with the last stats) before Prometheus gives up on it.
        client = BufferClient(args.buffer or config.endpoint, ClientConfig(request_timeout_s=2.0, retries=1),
                              config.curve, config.limits)
        exporter = MetricsExporter(port=args.port, host=args.host)
    except (OSError, ValueError) as exc:
        print(f"etarl buffer exporter: {exc}", file=sys.stderr)
        return 2
    # The handler only sets a flag: Event.set takes a lock that a second signal, arriving inside
    # the first handler's set(), would wait on for ever (seen in the buffer service).
    stopping = []
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stopping.append(True))
    print(f"serving the metrics of {client.endpoint} on http://{args.host}:{exporter.port}/metrics", flush=True)
    while True:
        try:
            exporter.record_buffer_stats(client.stats())
        except Exception as exc:  # unreachable or refusing: keep serving the last values
            exporter.record_buffer_down()
            log.warning("the buffer at %s did not answer for its stats: %s", client.endpoint, exc)
        deadline = time.monotonic() + args.interval
        while not stopping and time.monotonic() < deadline:
            time.sleep(0.05)
        if stopping:
            break
    exporter.close()
    client.close()
    return 0


if __name__ == "__main__":
    sys.exit(serve_buffer_metrics())
