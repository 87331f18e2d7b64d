"""deploy/prometheus and deploy/grafana: promtool checks and unit-tests the rules; every metric the
rules and the dashboard name is one that services/metrics.py exports (checked against its
catalogue), every recording rule they use is defined, and the dashboard covers what it promises."""
from __future__ import annotations

import json
import re
import shutil
import subprocess

import pytest
import yaml

from prometheus_server import REPO, binary
from services.metrics import catalogue_names

PROM = REPO / "deploy" / "prometheus"
DASHBOARD = REPO / "deploy" / "grafana" / "etarl-dashboard.json"

# `etarl_...` metric names and `etarl:...` recording-rule names inside a PromQL expression.
METRIC = re.compile(r"\b(etarl_[a-zA-Z0-9_]+)")
RECORDED = re.compile(r"\b(etarl:[a-zA-Z0-9_:]+)")


def rules() -> list[dict]:
    return [r for g in yaml.safe_load((PROM / "rules.yml").read_text())["groups"] for r in g["rules"]]


def dashboard_exprs() -> list[tuple[str, str]]:
    dash = json.loads(DASHBOARD.read_text())
    return [(p["title"], t["expr"]) for p in dash["panels"] for t in p["targets"]]


def unknown_names(expr: str) -> set[str]:
    recorded = {r["record"] for r in rules() if "record" in r}
    return (set(METRIC.findall(expr)) - catalogue_names()) | (set(RECORDED.findall(expr)) - recorded)


def test_the_name_check_catches_an_unknown_metric():
    assert unknown_names("rate(etarl_samples_consumed_total[1m])") == set()
    assert unknown_names("rate(etarl_samples_eaten_total[1m]) + etarl:nothing:rate1m") == {
        "etarl_samples_eaten_total", "etarl:nothing:rate1m"}


def test_every_rule_names_exported_metrics():
    for rule in rules():
        assert METRIC.search(rule["expr"]) or RECORDED.search(rule["expr"]) or "up{" in rule["expr"], rule
        assert unknown_names(rule["expr"]) == set(), rule.get("alert") or rule.get("record")


def test_every_dashboard_query_names_exported_metrics():
    exprs = dashboard_exprs()
    assert len(exprs) >= 20
    for title, expr in exprs:
        assert METRIC.search(expr), (title, expr)
        assert unknown_names(expr) == set(), (title, expr)


def test_the_alerts_the_issue_asks_for_exist():
    alerts = {r["alert"]: r["expr"] for r in rules() if "alert" in r}
    assert "etarl_consumed_samples_over_eta_total" in alerts["EtarlStalenessAboveEta"]
    assert "< 0.3" in alerts["EtarlLowEffectiveSampleSize"]
    assert "kl" in alerts["EtarlHighRolloutKL"]
    assert "etarl_learner_last_step_timestamp_seconds" in alerts["EtarlLearnerStalled"]
    assert "etarl_worker_restarts_total" in alerts["EtarlWorkerRestarting"]
    assert "buffer_fill" in alerts["EtarlBufferFull"]


@pytest.mark.parametrize(("topic", "metric"), [
    ("reward", "etarl_reward_mean"), ("accuracy", "etarl_eval_accuracy"),
    ("throughput", "etarl_worker_tokens_generated_total"), ("staleness histogram", "etarl_consumed_staleness_versions_bucket"),
    ("buffer depth", "etarl_buffer_groups"), ("gate waits", "etarl_worker_gate_wait_seconds_total"),
    ("IS weights", "etarl_rollout_corr_rollout_is_max"), ("ESS", "etarl_rollout_corr_rollout_is_eff_sample_size"),
    ("KL", "etarl_rollout_corr_kl"), ("chi2", "etarl_rollout_corr_chi2_token"),
    ("weight sync", "etarl_timing_weight_sync_seconds"), ("per-worker versions", "etarl_worker_weight_version"),
])
def test_the_dashboard_shows(topic, metric):
    assert any(metric in expr for _, expr in dashboard_exprs()), topic


def test_dashboard_json_is_the_builders_output():
    import importlib.util

    spec = importlib.util.spec_from_file_location("build_dashboard", REPO / "deploy" / "grafana" / "build_dashboard.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert DASHBOARD.read_text() == module.render(), \
        "deploy/grafana/etarl-dashboard.json is stale: python deploy/grafana/build_dashboard.py > it"


def test_dashboard_is_importable_grafana_json():
    dash = json.loads(DASHBOARD.read_text())
    assert dash["uid"] and dash["title"] and dash["schemaVersion"] >= 36
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids))
    assert all(t["datasource"]["uid"] == "${datasource}" for p in dash["panels"] for t in p["targets"])
    assert any(v["type"] == "datasource" and v["name"] == "datasource" for v in dash["templating"]["list"])
    for p in dash["panels"]:  # panels lie on the 24-column grid without overlapping
        g = p["gridPos"]
        assert 0 <= g["x"] and g["x"] + g["w"] <= 24
    cells = [(p["gridPos"]["x"], p["gridPos"]["y"]) for p in dash["panels"]]
    assert len(cells) == len(set(cells))


def promtool(*args: str, cwd=PROM) -> subprocess.CompletedProcess:
    return subprocess.run([binary("promtool"), *args], cwd=cwd, capture_output=True, text=True, timeout=120)


def test_promtool_checks_the_config_and_the_rules():
    result = promtool("check", "config", "prometheus.yml")
    assert result.returncode == 0, result.stdout + result.stderr
    result = promtool("check", "rules", "rules.yml")
    assert result.returncode == 0 and "SUCCESS" in result.stdout, result.stdout + result.stderr


def test_promtool_unit_tests_pass():
    result = promtool("test", "rules", "rules_test.yml")
    assert result.returncode == 0, result.stdout + result.stderr


def test_promtool_unit_tests_catch_a_wrong_threshold(tmp_path):
    """The unit tests bite: the ESS threshold moved from 0.3 to 0.1 makes them fail."""
    shutil.copy(PROM / "rules_test.yml", tmp_path)
    text = (PROM / "rules.yml").read_text()
    assert "rollout_is_eff_sample_size:avg5m < 0.3" in text
    (tmp_path / "rules.yml").write_text(text.replace("rollout_is_eff_sample_size:avg5m < 0.3",
                                                     "rollout_is_eff_sample_size:avg5m < 0.1"))
    result = promtool("test", "rules", "rules_test.yml", cwd=tmp_path)
    assert result.returncode != 0 and "EtarlLowEffectiveSampleSize" in result.stdout + result.stderr
