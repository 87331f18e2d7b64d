"""services/metrics.py: the naming rule, the catalogue's conventions, and what the exporter serves
(parsed back with prometheus_client's own parser, and fetched over real HTTP)."""
from __future__ import annotations

import math
import urllib.request

import numpy as np
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from services.metrics import (
    BUFFER_METRICS,
    CATALOGUE,
    STEP_METRICS,
    WORKER_METRICS,
    MetricsExporter,
    catalogue_names,
    prometheus_name,
    staleness_buckets,
)


def samples(exporter: MetricsExporter) -> dict[tuple[str, tuple], float]:
    out = {}
    for family in text_string_to_metric_families(exporter.exposition()):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


@pytest.mark.parametrize(("key", "name"), [
    ("rollout_corr/rollout_is_eff_sample_size", "etarl_rollout_corr_rollout_is_eff_sample_size"),
    ("rollout_corr/kl", "etarl_rollout_corr_kl"),
    ("actor/pg_clipfrac", "etarl_actor_pg_clipfrac"),
    ("timing_s/update_actor", "etarl_timing_update_actor_seconds"),
    ("timing_s/step_seconds", "etarl_timing_step_seconds"),
    ("eval/pass@4", "etarl_eval_pass_4"),
    ("Reward/Mean--x", "etarl_reward_mean_x"),
])
def test_the_naming_rule(key, name):
    assert prometheus_name(key) == name


@pytest.mark.parametrize("key", ["", "   ", "///", None])
def test_the_naming_rule_refuses_keys_without_a_name(key):
    with pytest.raises(ValueError, match="metric key"):
        prometheus_name(key)


def test_catalogue_conventions():
    names = [spec.name for spec in CATALOGUE]
    assert len(names) == len(set(names))
    for spec in CATALOGUE:
        assert spec.name.startswith("etarl_")
        assert (spec.kind == "counter") == spec.name.endswith("_total"), spec.name
        assert not any(unit in spec.name for unit in ("_ms", "_millis", "_minutes", "_kb", "_mb")), spec.name
    for spec in STEP_METRICS:
        assert spec.name == prometheus_name(spec.key)  # step metrics follow the rule, no exceptions
    histograms = [s for s in CATALOGUE if s.kind == "histogram"]
    assert [h.name for h in histograms] == ["etarl_consumed_staleness_versions"]


def test_step_metrics_are_exported_by_the_rule_including_unknown_keys():
    exporter = MetricsExporter()
    exporter.record_step({
        "rollout_corr/kl": 0.02,
        "timing_s/weight_sync": np.float32(0.5),
        "actor/pg_clipfrac": torch.tensor(0.25),
        "custom/new_metric": 7,
        "note": "text is not a number",
        "vector": [1, 2],
        "rollout_corr/chi2_seq": float("nan"),
        "step": 3, "version": 9, "time": 1.7e9,
    }, version=9)
    got = samples(exporter)
    assert got[("etarl_rollout_corr_kl", ())] == pytest.approx(0.02)
    assert got[("etarl_timing_weight_sync_seconds", ())] == pytest.approx(0.5)
    assert got[("etarl_actor_pg_clipfrac", ())] == pytest.approx(0.25)
    assert got[("etarl_custom_new_metric", ())] == 7
    assert math.isnan(got[("etarl_rollout_corr_chi2_seq", ())])
    assert got[("etarl_learner_version", ())] == 9
    assert got[("etarl_learner_steps_total", ())] == 1
    assert not any(name.startswith(("etarl_note", "etarl_vector")) for name, _ in got)
    assert not {"etarl_step", "etarl_version", "etarl_time"} & {name for name, _ in got}  # own metrics instead


def test_a_step_key_cannot_overwrite_another_sources_metric():
    exporter = MetricsExporter()
    exporter.record_buffer_stats({"groups_ready": 3})
    exporter.record_step({"buffer/groups": 99})  # maps to etarl_buffer_groups, which the buffer owns
    assert samples(exporter)[("etarl_buffer_groups", ())] == 3


def test_buffer_restarts_are_a_counter_not_a_step_gauge():
    exporter = MetricsExporter()
    exporter.record_buffer_stats({"groups_ready": 0, "restarts": 2})
    exporter.record_step({"step": 1, "version": 1, "buffer/restarts": 2})
    got = samples(exporter)
    assert got[("etarl_buffer_restarts_total", ())] == 2
    assert ("etarl_buffer_restarts", ()) not in got


def test_staleness_histogram_has_one_bucket_per_version_from_the_buffers_counts():
    assert staleness_buckets(0) == (0,)
    assert staleness_buckets(3) == (0, 1, 2, 3)
    assert len(staleness_buckets(None)) == 17
    exporter = MetricsExporter()
    # The buffer counts consumed samples by staleness; string keys, as after a msgpack/JSON trip.
    exporter.record_buffer_stats({"eta": 3, "consumed_staleness": {"0": 2, "1": 1, "3": 1, "5": 2}})
    got = samples(exporter)
    buckets = {dict(labels)["le"]: v for (name, labels), v in got.items() if name.endswith("_bucket")}
    assert buckets == {"0.0": 2, "1.0": 3, "2.0": 3, "3.0": 4, "+Inf": 6}
    assert got[("etarl_consumed_staleness_versions_count", ())] == 6
    assert got[("etarl_consumed_staleness_versions_sum", ())] == 0 + 1 + 3 + 10
    assert got[("etarl_consumed_samples_over_eta_total", ())] == 2
    assert got[("etarl_staleness_bound_versions", ())] == 3


def test_unbounded_eta_exports_nan_bound_and_sixteen_buckets():
    exporter = MetricsExporter()
    exporter.record_buffer_stats({"eta": None, "consumed_staleness": {"40": 1}})
    got = samples(exporter)
    assert math.isnan(got[("etarl_staleness_bound_versions", ())])
    assert got[("etarl_consumed_samples_over_eta_total", ())] == 0
    buckets = {dict(labels)["le"]: v for (name, labels), v in got.items() if name.endswith("_bucket")}
    assert len(buckets) == 18 and buckets["16.0"] == 0 and buckets["+Inf"] == 1


def test_malformed_staleness_entries_are_skipped():
    exporter = MetricsExporter()
    exporter.record_buffer_stats({"eta": 1, "consumed_staleness": {"0": 1, "x": 5, "-1": 3, "1": "many"}})
    assert samples(exporter)[("etarl_consumed_staleness_versions_count", ())] == 1


def test_buffer_stats_become_counters_gauges_and_labelled_families():
    exporter = MetricsExporter()
    exporter.record_buffer_stats({"groups_ready": 4, "store_capacity_groups": 64, "pushed_samples": 10,
                                  "dropped_groups": {"stale": 2}, "request_errors": {"buffer_full": 1},
                                  "running": 3, "not_in_the_catalogue": 5, "version": None})
    got = samples(exporter)
    assert got[("etarl_buffer_groups", ())] == 4
    assert got[("etarl_buffer_capacity_groups", ())] == 64
    assert got[("etarl_samples_pushed_total", ())] == 10
    assert got[("etarl_gate_permits_running", ())] == 3
    assert got[("etarl_groups_dropped_total", (("reason", "stale"),))] == 2
    assert got[("etarl_buffer_request_errors_total", (("reason", "buffer_full"),))] == 1
    assert not any("not_in_the_catalogue" in name for name, _ in got)
    assert ("etarl_groups_consumed_total", ()) not in got  # absent from the stats: not invented
    assert ("etarl_buffer_version", ()) not in got  # not a number: skipped


def test_buffer_up_follows_the_last_read():
    exporter = MetricsExporter()
    assert not any(name == "etarl_buffer_up" for name, _ in samples(exporter))  # no buffer known yet
    exporter.record_buffer_stats({"groups_ready": 7})
    assert samples(exporter)[("etarl_buffer_up", ())] == 1
    exporter.record_buffer_down()
    got = samples(exporter)
    assert got[("etarl_buffer_up", ())] == 0
    assert got[("etarl_buffer_groups", ())] == 7  # the last values stay


def test_worker_stats_carry_a_worker_label_and_restarts_count():
    exporter = MetricsExporter()
    exporter.record_worker_stats("w0", {"loaded_version": 4, "tokens_total": 1200, "gate_blocked_s": 1.5,
                                        "worker_id": "w0", "last_error": ""})
    exporter.record_worker_stats("w1", {"loaded_version": 3, "tokens_total": 800})
    exporter.record_worker_restart("w1")
    exporter.record_worker_restart("w1")
    exporter.record_worker_down("w1")
    got = samples(exporter)
    assert got[("etarl_worker_weight_version", (("worker", "w0"),))] == 4
    assert got[("etarl_worker_weight_version", (("worker", "w1"),))] == 3
    assert got[("etarl_worker_tokens_generated_total", (("worker", "w0"),))] == 1200
    assert got[("etarl_worker_gate_wait_seconds_total", (("worker", "w0"),))] == 1.5
    assert got[("etarl_worker_restarts_total", (("worker", "w1"),))] == 2
    assert got[("etarl_worker_restarts_total", (("worker", "w0"),))] == 0
    assert got[("etarl_worker_up", (("worker", "w1"),))] == 0
    assert got[("etarl_worker_up", (("worker", "w0"),))] == 1


@pytest.mark.parametrize("worker_id", ["", None, 3])
def test_worker_stats_need_a_worker_id(worker_id):
    with pytest.raises(ValueError, match="worker_id"):
        MetricsExporter().record_worker_stats(worker_id, {"version": 1})


def test_every_exported_name_is_in_the_catalogue():
    exporter = MetricsExporter()
    exporter.record_step({spec.key: 0.5 for spec in STEP_METRICS}, version=1)
    stats = {spec.key: ({"stale": 1} if spec.labels else 1) for spec in BUFFER_METRICS}
    stats.update(eta=2, consumed_staleness={"0": 3, "1": 1})
    exporter.record_buffer_stats(stats)
    exporter.record_worker_stats("w0", {spec.key: 1.0 for spec in WORKER_METRICS})
    exporter.record_worker_restart("w0")
    exposed = {name for name, _ in samples(exporter)}
    assert exposed == catalogue_names()  # all of it, and nothing else


def test_http_server_binds_loopback_and_serves_the_text_format():
    exporter = MetricsExporter(port=0)
    try:
        assert exporter.port and exporter._server.server_address[0] == "127.0.0.1"
        exporter.record_step({"rollout_corr/kl": 0.125}, version=2)
        with urllib.request.urlopen(f"http://127.0.0.1:{exporter.port}/metrics", timeout=5) as resp:
            body = resp.read().decode()
        assert "etarl_rollout_corr_kl 0.125" in body
        assert "# TYPE etarl_learner_steps_total counter" in body
    finally:
        exporter.close()
