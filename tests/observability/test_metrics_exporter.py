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
    CATALOGUE,
    STEP_METRICS,
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
    exporter = MetricsExporter(eta=4)
    exporter.record_step({
        "rollout_corr/kl": 0.02,
        "timing_s/weight_sync": np.float32(0.5),
        "actor/pg_clipfrac": torch.tensor(0.25),
        "custom/new_metric": 7,
        "note": "text is not a number",
        "vector": [1, 2],
        "rollout_corr/chi2_seq": float("nan"),
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


def test_a_step_key_cannot_overwrite_another_sources_metric():
    exporter = MetricsExporter()
    exporter.record_buffer_stats({"groups": 3})
    exporter.record_step({"buffer/groups": 99})  # maps to etarl_buffer_groups, which the buffer owns
    assert samples(exporter)[("etarl_buffer_groups", ())] == 3


def test_staleness_histogram_has_one_bucket_per_version():
    assert staleness_buckets(0) == (0,)
    assert staleness_buckets(3) == (0, 1, 2, 3)
    assert len(staleness_buckets(None)) == 17
    exporter = MetricsExporter(eta=3)
    exporter.record_step({}, staleness=[0, 0, 1, 3])
    exporter.record_step({}, staleness=[2, 5])  # 5 > eta: lands in +Inf only, and shows as the max
    got = samples(exporter)
    buckets = {dict(labels)["le"]: v for (name, labels), v in got.items() if name.endswith("_bucket")}
    assert buckets == {"0.0": 2, "1.0": 3, "2.0": 4, "3.0": 5, "+Inf": 6}
    assert got[("etarl_consumed_staleness_versions_count", ())] == 6
    assert got[("etarl_consumed_staleness_versions_sum", ())] == 11
    assert got[("etarl_consumed_staleness_max_versions", ())] == 5
    assert got[("etarl_samples_consumed_total", ())] == 6


def test_unbounded_eta_exports_nan_bound():
    assert math.isnan(samples(MetricsExporter(eta=None))[("etarl_staleness_bound_versions", ())])


@pytest.mark.parametrize("eta", [-1, 1.5, True, "4"])
def test_bad_eta_is_refused(eta):
    with pytest.raises(ValueError, match="eta"):
        MetricsExporter(eta=eta)


def test_negative_staleness_is_refused_and_nothing_is_recorded():
    exporter = MetricsExporter(eta=2)
    with pytest.raises(ValueError, match="staleness"):
        exporter.record_step({"rollout_corr/kl": 1.0}, version=1, staleness=[0, -1])
    got = samples(exporter)
    assert got[("etarl_learner_steps_total", ())] == 0
    assert ("etarl_rollout_corr_kl", ()) not in got


def test_buffer_stats_become_counters_gauges_and_labelled_families():
    exporter = MetricsExporter()
    exporter.record_buffer_stats({"groups": 4, "capacity": 64, "pushed": 10, "dropped": {"stale": 2, "expired": 1},
                                  "running": 3, "not_in_the_catalogue": 5})
    got = samples(exporter)
    assert got[("etarl_buffer_groups", ())] == 4
    assert got[("etarl_buffer_capacity_groups", ())] == 64
    assert got[("etarl_groups_pushed_total", ())] == 10
    assert got[("etarl_gate_permits_running", ())] == 3
    assert got[("etarl_groups_dropped_total", (("reason", "stale"),))] == 2
    assert got[("etarl_groups_dropped_total", (("reason", "expired"),))] == 1
    assert not any("not_in_the_catalogue" in name for name, _ in got)
    assert ("etarl_groups_consumed_total", ()) not in got  # absent in the stats: not invented


def test_buffer_source_is_read_at_every_scrape_and_a_failing_source_keeps_the_last_values():
    state = {"groups": 1}
    exporter = MetricsExporter()
    exporter.set_buffer_source(lambda: dict(state))
    assert samples(exporter)[("etarl_buffer_groups", ())] == 1
    state["groups"] = 7
    assert samples(exporter)[("etarl_buffer_groups", ())] == 7

    def broken():
        raise ConnectionError("buffer down")

    exporter.set_buffer_source(broken)
    assert samples(exporter)[("etarl_buffer_groups", ())] == 7


def test_worker_stats_carry_a_worker_label_and_restarts_count():
    exporter = MetricsExporter()
    exporter.record_worker_stats("w0", {"version": 4, "tokens": 1200, "gate_wait_s": 1.5})
    exporter.record_worker_stats("w1", {"version": 3, "tokens": 800})
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
    exporter = MetricsExporter(eta=2)
    exporter.record_step({spec.key: 0.5 for spec in STEP_METRICS}, version=1, staleness=[0, 1])
    exporter.record_buffer_stats({"groups": 1, "capacity": 8, "leased": 0, "version": 1, "running": 1, "gate_capacity": 2,
                                  "granted": 3, "refused": 1, "released": 0, "reclaimed": 0, "pushed": 2,
                                  "consumed": 1, "dropped": {"stale": 0}, "bad_messages": 0})
    exporter.record_worker_stats("w0", {"version": 1, "groups": 1, "samples": 4, "tokens": 40, "gate_wait_s": 0.1,
                                        "weight_load_s": 0.2, "generate_s": 1.0, "reward_failures": 0,
                                        "reward_mean": 0.5})
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
