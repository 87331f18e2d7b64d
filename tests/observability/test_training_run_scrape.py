"""The whole path, for real: `etarl train` (tiny model, a few steps) serves its metrics while a
Prometheus server scrapes it; afterwards the test asks Prometheus's HTTP API for the series and
checks their values make sense for the run that produced them."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from prometheus_server import REPO, PrometheusServer, free_port

STEPS = 2
ETA = 4  # the embedded default's bound
TINY_RUN = [f"run.steps={STEPS}", "buffer.gate.batch_size=2", "rollout.sampling.n=4", "eval.num_prompts=4",
            "eval.n_samples=0", "run.eval_every=0", "run.checkpoint_every=0", "run.progress=false", "ray.num_cpus=2"]


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("train-scrape")
    port = free_port()
    server = PrometheusServer(tmp / "prom", {"etarl-controller": [f"127.0.0.1:{port}"]}, interval_ms=500)
    run_dir = tmp / "run"
    env = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    env.pop("RAY_ADDRESS", None)
    try:
        result = subprocess.run(
            [sys.executable, "-m", "services.cli", "train", *TINY_RUN, f"metrics.port={port}", f"run.run_dir={run_dir}"],
            cwd=REPO, env=env, capture_output=True, text=True, timeout=500)
        assert result.returncode == 0, (result.stdout + result.stderr)[-5000:]
        yield server, run_dir
    finally:
        server.close()


def last(server: PrometheusServer, metric: str) -> list[dict]:
    """The last scraped value of each series (the run is over; its series are stale now)."""
    return server.query(f"last_over_time({metric}[10m])")


def one(server: PrometheusServer, metric: str) -> float:
    rows = last(server, metric)
    assert len(rows) == 1, (metric, rows)
    return rows[0]["value"]


@pytest.mark.slow
def test_prometheus_scraped_the_training_run(finished_run):
    server, run_dir = finished_run
    log = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    steps = [r for r in log if "reward/mean" in r]
    assert len(steps) == STEPS

    # The learner: every step counted, the version the run ended at.
    assert one(server, "etarl_learner_steps_total") == STEPS
    assert one(server, "etarl_learner_version") == steps[-1]["version"]
    assert one(server, "etarl_reward_mean") == pytest.approx(steps[-1]["reward/mean"])
    assert 0.0 <= one(server, "etarl_reward_mean") <= 1.0

    # Rollout correction, from the learner's step metrics, by the naming rule.
    ess = one(server, "etarl_rollout_corr_rollout_is_eff_sample_size")
    assert 0.0 < ess <= 1.0 + 1e-6
    assert one(server, "etarl_rollout_corr_rollout_is_mean") > 0
    assert one(server, "etarl_timing_update_actor_seconds") > 0
    assert one(server, "etarl_timing_weight_sync_seconds") >= 0

    # The buffer: what was consumed, and how stale, in one bucket per version up to eta.
    consumed = one(server, "etarl_samples_consumed_total")
    assert consumed == STEPS * 2 * 4  # steps x groups per step x samples per group
    buckets = {r["metric"]["le"]: r["value"] for r in last(server, "etarl_consumed_staleness_versions_bucket")}
    assert set(buckets) == {f"{v}.0" for v in range(ETA + 1)} | {"+Inf"}
    assert buckets["+Inf"] == buckets[f"{ETA}.0"] == consumed  # nothing staler than eta
    assert one(server, "etarl_consumed_samples_over_eta_total") == 0
    assert one(server, "etarl_staleness_bound_versions") == ETA
    assert one(server, "etarl_samples_pushed_total") >= consumed


@pytest.mark.slow
def test_prometheus_scraped_the_workers(finished_run):
    server, _ = finished_run
    versions = {r["metric"]["worker"]: r["value"] for r in last(server, "etarl_worker_weight_version")}
    assert versions, "no per-worker series: the controller must relay its workers' stats"
    assert all(0 <= v <= STEPS for v in versions.values())
    tokens = last(server, "etarl_worker_tokens_generated_total")
    assert tokens and all(r["value"] > 0 for r in tokens)


@pytest.mark.slow
def test_the_rules_evaluated_on_the_run_without_error(finished_run):
    server, _ = finished_run
    rules = [r for g in server.api("rules")["groups"] for r in g["rules"]]
    assert all(r["health"] != "err" for r in rules), [(r["name"], r.get("lastError")) for r in rules]
    firing = [a["labels"]["alertname"] for a in server.api("alerts")["alerts"] if a["state"] == "firing"]
    assert "EtarlStalenessAboveEta" not in firing
