"""A real Prometheus server scrapes a real MetricsExporter over HTTP, evaluates etarl's rules
(an alert fires for real), and answers every query of the Grafana dashboard."""
from __future__ import annotations

import json
import math
import re
import time

import pytest

from prometheus_server import REPO, PrometheusServer
from services.metrics import MetricsExporter

DASHBOARD = REPO / "deploy" / "grafana" / "etarl-dashboard.json"
ETA = 2


@pytest.fixture(scope="module")
def scraped(tmp_path_factory):
    exporter = MetricsExporter(port=0)
    exporter.record_buffer_stats({"eta": ETA, "groups_ready": 5, "store_capacity_groups": 64, "pushed_samples": 12,
                                  "dropped_groups": {"stale": 1}, "consumed_staleness": {"0": 1, "1": 2, "2": 1}})
    for worker, version in (("w0", 3), ("w1", 2)):
        exporter.record_worker_stats(worker, {"loaded_version": version, "tokens_total": 1000, "samples_total": 16,
                                              "gate_blocked_s": 0.5})
    exporter.record_step({"rollout_corr/rollout_is_eff_sample_size": 0.8, "timing_s/step": 1.25,
                          "actor/pg_clipfrac": 0.1}, version=3)
    server = PrometheusServer(tmp_path_factory.mktemp("prom"), {"etarl-controller": [f"127.0.0.1:{exporter.port}"]})
    try:
        server.wait_for("etarl_learner_version")
        yield exporter, server
    finally:
        server.close()
        exporter.close()


def value(server, expr: str) -> float:
    (row,) = server.query(expr)
    return row["value"]


def test_the_series_arrive_with_their_values(scraped):
    _, server = scraped
    assert server.targets_up() == {"etarl-controller": "up"}
    assert value(server, "etarl_learner_version") == 3
    assert value(server, "etarl_rollout_corr_rollout_is_eff_sample_size") == pytest.approx(0.8)
    assert value(server, "etarl_timing_step_seconds") == pytest.approx(1.25)
    assert value(server, "etarl_staleness_bound_versions") == ETA
    assert value(server, 'etarl_groups_dropped_total{reason="stale"}') == 1
    versions = {r["metric"]["worker"]: r["value"] for r in server.query("etarl_worker_weight_version")}
    assert versions == {"w0": 3, "w1": 2}


def test_the_staleness_histogram_has_a_bucket_per_version(scraped):
    _, server = scraped
    buckets = {r["metric"]["le"]: r["value"] for r in server.query("etarl_consumed_staleness_versions_bucket")}
    assert buckets == {"0.0": 1, "1.0": 3, "2.0": 4, "+Inf": 4}  # cumulative, one bucket per version up to eta
    assert value(server, "etarl_consumed_staleness_versions_count") == 4


def test_an_alert_fires_when_a_consumed_sample_is_staler_than_eta(scraped):
    exporter, server = scraped
    assert not [a for a in server.api("alerts")["alerts"] if a["labels"]["alertname"] == "EtarlStalenessAboveEta"]
    exporter.record_buffer_stats({"eta": ETA, "consumed_staleness": {"0": 1, "1": 2, "2": 1, str(ETA + 1): 1}})
    server.wait_for("etarl_consumed_samples_over_eta_total", lambda rows: rows and rows[0]["value"] == 1)
    end = time.monotonic() + 30
    while time.monotonic() < end:
        firing = [a for a in server.api("alerts")["alerts"] if a["labels"]["alertname"] == "EtarlStalenessAboveEta"]
        if firing and firing[0]["state"] == "firing":
            break
        time.sleep(0.5)
    assert firing and firing[0]["state"] == "firing", firing
    assert firing[0]["labels"]["severity"] == "critical"


def test_every_rule_loads_and_evaluates_without_error(scraped):
    _, server = scraped
    groups = server.api("rules")["groups"]
    rules = [r for g in groups for r in g["rules"]]
    assert len(rules) >= 15
    assert all(r["health"] in ("ok", "unknown") for r in rules), [(r["name"], r.get("lastError")) for r in rules]


def dashboard_queries() -> list[tuple[str, str]]:
    dash = json.loads(DASHBOARD.read_text())
    return [(p["title"], t["expr"]) for p in dash["panels"] for t in p.get("targets", [])]


def test_every_dashboard_query_runs_on_prometheus(scraped):
    """Grafana's own variables replaced by what Grafana would send; the query must parse and run."""
    _, server = scraped
    for title, expr in dashboard_queries():
        concrete = re.sub(r"\$__(range|rate_interval|interval)", "1m", expr)
        server.api("query", query=concrete)  # raises on a PromQL error
    assert not math.isnan(value(server, "sum(rate(etarl_worker_tokens_generated_total[1m])) or vector(0)"))
