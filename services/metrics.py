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
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Literal

from prometheus_client import CollectorRegistry, start_http_server
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
# step reports is exported too, named by `prometheus_name`, as a gauge.
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
    _step("reward/mean", "mean reward of the consumed batch"),
    _step("eval/accuracy", "greedy accuracy on the held-out prompts"),
    _step("timing_s/step", "learner step seconds"),
    _step("timing_s/wait_data", "seconds the learner waited for a batch"),
    _step("timing_s/old_log_prob", "seconds recomputing the proximal log-probs"),
    _step("timing_s/update_actor", "seconds in the policy update"),
    _step("timing_s/weight_sync", "seconds publishing the new weights"),
)

# The buffer's stats() dict (buffer.core.BufferCore.stats), served by the buffer service itself or
# relayed by the controller. Labelled families take a dict {label value: number} under their key.
BUFFER_METRICS: tuple[MetricSpec, ...] = (
    _buffer("buffer_groups", "gauge", "groups", "groups waiting in the buffer"),
    _buffer("buffer_capacity_groups", "gauge", "capacity", "groups the buffer can hold"),
    _buffer("buffer_leased_groups", "gauge", "leased", "groups pulled but not yet acknowledged"),
    _buffer("buffer_version", "gauge", "version", "learner version the buffer's gate knows"),
    _buffer("gate_permits_running", "gauge", "running", "permits held by generating workers"),
    _buffer("gate_capacity_groups", "gauge", "gate_capacity", "permits the eta gate would grant now"),
    _buffer("gate_permits_granted_total", "counter", "granted", "permits granted"),
    _buffer("gate_permits_refused_total", "counter", "refused", "permit requests refused by the gate"),
    _buffer("gate_permits_released_total", "counter", "released", "permits returned unused"),
    _buffer("gate_permits_reclaimed_total", "counter", "reclaimed", "permits of dead holders reclaimed"),
    _buffer("groups_pushed_total", "counter", "pushed", "groups accepted into the buffer"),
    _buffer("groups_consumed_total", "counter", "consumed", "groups acknowledged by the learner"),
    _buffer("groups_dropped_total", "counter", "dropped", "groups dropped, by reason", ("reason",)),
    _buffer("buffer_bad_messages_total", "counter", "bad_messages", "malformed requests answered with an error"),
)

WORKER_METRICS: tuple[MetricSpec, ...] = (
    _worker("worker_weight_version", "gauge", "version", "weight version loaded by the worker"),
    _worker("worker_groups_generated_total", "counter", "groups", "groups generated and pushed"),
    _worker("worker_samples_produced_total", "counter", "samples", "samples generated and pushed"),
    _worker("worker_tokens_generated_total", "counter", "tokens", "response tokens generated"),
    _worker("worker_gate_wait_seconds_total", "counter", "gate_wait_s", "seconds blocked on the eta gate"),
    _worker("worker_weight_load_seconds_total", "counter", "weight_load_s", "seconds loading new weights"),
    _worker("worker_generation_seconds_total", "counter", "generate_s", "seconds generating"),
    _worker("worker_reward_failures_total", "counter", "reward_failures", "reward calls that failed or timed out"),
    _worker("worker_reward_mean", "gauge", "reward_mean", "mean reward of the worker's recent groups"),
)

EXPORTER_METRICS: tuple[MetricSpec, ...] = (
    _own("learner_version", "gauge", "the learner's weight version (policy version i)"),
    _own("learner_steps_total", "counter", "learner steps completed"),
    _own("learner_last_step_timestamp_seconds", "gauge", "unix time of the last completed learner step"),
    _own("staleness_bound_versions", "gauge", "the eta bound; NaN when unbounded"),
    _own("consumed_staleness_versions", "histogram", "staleness of consumed samples, one bucket per version"),
    _own("consumed_staleness_max_versions", "gauge", "largest staleness in the last learner step's batch"),
    _own("samples_consumed_total", "counter", "samples the learner trained on"),
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


def _check_catalogue() -> None:
    seen: set[str] = set()
    for spec in CATALOGUE:
        assert spec.name.startswith(f"{NAMESPACE}_"), spec.name
        assert (spec.kind == "counter") == spec.name.endswith("_total"), spec.name
        assert spec.name not in seen, f"metric {spec.name} declared twice"
        seen.add(spec.name)


_check_catalogue()


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
    `port=None` serves nothing (tests and embedding read `collect()` or `exposition()`);
    `port=0` takes a free port, then `.port` says which.
    """

    def __init__(self, port: int | None = None, host: str = "127.0.0.1", *, eta: int | None = None):
        if eta is not None and (not isinstance(eta, int) or isinstance(eta, bool) or eta < 0):
            raise ValueError(f"eta must be a non-negative int or None, got {eta!r}")
        self._lock = threading.Lock()
        self._eta = eta
        self._buckets = staleness_buckets(eta)
        self._bucket_counts = [0] * (len(self._buckets) + 1)  # last: above the top bucket
        self._staleness_sum = 0.0
        self._step: dict[str, float] = {}
        self._buffer: dict[str, object] = {}
        self._buffer_source: Callable[[], Mapping[str, object]] | None = None
        self._workers: dict[str, dict[str, float]] = {}
        self._worker_up: dict[str, float] = {}
        self._restarts: dict[str, int] = {}
        self._version: float | None = None
        self._steps = 0
        self._last_step_at: float | None = None
        self._samples_consumed = 0
        self._last_max_staleness: float | None = None
        self._warned: set[str] = set()
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(_Collector(self))
        self._server = None
        self._thread = None
        self.port: int | None = None
        if port is not None:
            self._server, self._thread = start_http_server(port, addr=host, registry=self.registry)
            self.port = self._server.server_port

    # -- recording -----------------------------------------------------------------------
    def record_step(self, step_metrics: Mapping[str, object], *, version: int | None = None,
                    staleness: Iterable[int] = ()) -> None:
        """One learner step: its verl-style metrics dict, the new version, and the staleness
        (learner version at consumption minus sample version) of each sample it trained on."""
        values = {}
        for key, raw in step_metrics.items():
            value = _number(raw)
            if value is not None:
                values[prometheus_name(str(key))] = value
        observed = [int(s) for s in staleness]
        if any(s < 0 for s in observed):
            raise ValueError(f"staleness must be >= 0 (a sample from the future?), got {min(observed)}")
        with self._lock:
            for name, value in values.items():
                if name in _OTHER_NAMES:
                    self._warn_once(name, f"step metric maps to {name}, which another source owns; not exported")
                    continue
                self._step[name] = value
            self._steps += 1
            self._last_step_at = time.time()
            if version is not None:
                self._version = float(version)
            self._samples_consumed += len(observed)
            if observed:
                self._last_max_staleness = float(max(observed))
            for s in observed:
                self._bucket_counts[min(s, len(self._buckets))] += 1
                self._staleness_sum += s

    def record_buffer_stats(self, stats: Mapping[str, object]) -> None:
        """The latest `stats()` of the buffer (cumulative counters, current gauges)."""
        with self._lock:
            self._buffer = dict(stats)

    def set_buffer_source(self, stats_fn: Callable[[], Mapping[str, object]]) -> None:
        """Read the buffer's stats at every scrape (the standalone buffer service uses this)."""
        with self._lock:
            self._buffer_source = stats_fn

    def record_worker_stats(self, worker_id: str, stats: Mapping[str, object]) -> None:
        """The latest stats of one rollout worker."""
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
        from prometheus_client import generate_latest

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

    def _snapshot(self):
        source = self._buffer_source
        if source is not None:
            try:
                self.record_buffer_stats(source())
            except Exception as exc:  # a scrape must still answer with what it has
                log.warning("reading buffer stats for a scrape failed: %s", exc)
        with self._lock:
            return {
                "step": dict(self._step),
                "buffer": dict(self._buffer),
                "workers": {w: dict(v) for w, v in self._workers.items()},
                "worker_up": dict(self._worker_up),
                "restarts": dict(self._restarts),
                "version": self._version,
                "steps": self._steps,
                "last_step_at": self._last_step_at,
                "samples_consumed": self._samples_consumed,
                "max_staleness": self._last_max_staleness,
                "bucket_counts": list(self._bucket_counts),
                "staleness_sum": self._staleness_sum,
            }


_SPEC_BY_NAME = {spec.name: spec for spec in CATALOGUE}
_OTHER_NAMES = frozenset(spec.name for spec in CATALOGUE if spec.source != "step")


def _family(spec: MetricSpec):
    cls = CounterMetricFamily if spec.kind == "counter" else GaugeMetricFamily
    return cls(spec.name, spec.help, labels=spec.labels)


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
            family = GaugeMetricFamily(spec.name, spec.help)
            family.add_metric([], value)
            yield family

    @staticmethod
    def _buffer_families(stats: dict[str, object]):
        for spec in BUFFER_METRICS:
            if spec.key not in stats:
                continue
            raw = stats[spec.key]
            family = _family(spec)
            if spec.labels:
                if not isinstance(raw, Mapping):
                    continue
                for label, value in sorted(raw.items()):
                    number = _number(value)
                    if number is not None:
                        family.add_metric([str(label)], number)
            else:
                number = _number(raw)
                if number is None:
                    continue
                family.add_metric([], number)
            yield family

    @staticmethod
    def _worker_families(workers: dict[str, dict[str, float]]):
        for spec in WORKER_METRICS:
            family = _family(spec)
            present = False
            for worker_id, stats in sorted(workers.items()):
                if spec.key in stats:
                    family.add_metric([worker_id], stats[spec.key])
                    present = True
            if present:
                yield family

    def _own_families(self, snap: dict):
        exporter = self._exporter
        spec = _SPEC_BY_NAME
        if snap["version"] is not None:
            family = _family(spec["etarl_learner_version"])
            family.add_metric([], snap["version"])
            yield family
        steps = _family(spec["etarl_learner_steps_total"])
        steps.add_metric([], snap["steps"])
        yield steps
        if snap["last_step_at"] is not None:
            family = _family(spec["etarl_learner_last_step_timestamp_seconds"])
            family.add_metric([], snap["last_step_at"])
            yield family
        bound = _family(spec["etarl_staleness_bound_versions"])
        bound.add_metric([], math.nan if exporter._eta is None else float(exporter._eta))
        yield bound
        consumed = _family(spec["etarl_samples_consumed_total"])
        consumed.add_metric([], snap["samples_consumed"])
        yield consumed
        yield self._staleness_histogram(snap)
        if snap["max_staleness"] is not None:
            family = _family(spec["etarl_consumed_staleness_max_versions"])
            family.add_metric([], snap["max_staleness"])
            yield family
        restarts = _family(spec["etarl_worker_restarts_total"])
        for worker_id in sorted(set(snap["restarts"]) | set(snap["worker_up"])):
            restarts.add_metric([worker_id], snap["restarts"].get(worker_id, 0))
        yield restarts
        up = _family(spec["etarl_worker_up"])
        for worker_id, value in sorted(snap["worker_up"].items()):
            up.add_metric([worker_id], value)
        yield up

    def _staleness_histogram(self, snap: dict):
        spec = _SPEC_BY_NAME["etarl_consumed_staleness_versions"]
        counts = snap["bucket_counts"]
        cumulative, buckets = 0, []
        for bound, count in zip(self._exporter._buckets, counts):
            cumulative += count
            buckets.append((floatToGoString(bound), cumulative))
        buckets.append(("+Inf", cumulative + counts[-1]))
        family = HistogramMetricFamily(spec.name, spec.help)
        family.add_metric([], buckets, snap["staleness_sum"])
        return family
