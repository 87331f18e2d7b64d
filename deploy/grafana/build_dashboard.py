"""Build deploy/grafana/etarl-dashboard.json, the one Grafana dashboard of an etarl run.

    python deploy/grafana/build_dashboard.py > deploy/grafana/etarl-dashboard.json

Edit the panels here, not in the JSON; tests/observability checks that the JSON is this script's
output and that every query names a metric services/metrics.py exports.
"""
from __future__ import annotations

import json
import sys

DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}
WIDTH, HEIGHT = 12, 8  # two panels per row on Grafana's 24-column grid

# (title, unit, description, [(PromQL, legend)], extra panel settings)
PANELS = [
    ("Reward and held-out accuracy", "short",
     "Mean reward of each consumed batch, held-out greedy accuracy, and each worker's recent reward.",
     [("etarl_reward_mean", "batch reward"), ("etarl_eval_accuracy", "eval accuracy (greedy)"),
      ("etarl_worker_reward_mean", "worker {{worker}}")], {}),
    ("Throughput", "ops", "Rates over one minute.",
     [("sum(rate(etarl_worker_samples_produced_total[1m]))", "samples produced /s"),
      ("rate(etarl_samples_pushed_total[1m])", "samples pushed /s"),
      ("rate(etarl_samples_consumed_total[1m])", "samples consumed /s"),
      ("sum(rate(etarl_worker_tokens_generated_total[1m]))", "tokens generated /s")], {}),
    ("Staleness of consumed samples (versions)", "short",
     "How many consumed samples were 0, 1, ..., eta versions old over the time range (cumulative buckets).",
     [("sum by (le) (increase(etarl_consumed_staleness_versions_bucket[$__range]))", "{{le}}")],
     {"type": "bargauge", "format": "heatmap", "instant": True}),
    ("Staleness: mean, p99 and the bound", "short",
     "No consumed sample may be staler than eta (alert EtarlStalenessAboveEta).",
     [("rate(etarl_consumed_staleness_versions_sum[5m]) / rate(etarl_consumed_staleness_versions_count[5m])", "mean"),
      ("histogram_quantile(0.99, sum by (le) (rate(etarl_consumed_staleness_versions_bucket[5m])))", "p99"),
      ("etarl_staleness_bound_versions", "eta"),
      ("increase(etarl_consumed_samples_over_eta_total[10m])", "samples over eta (must be 0)")], {}),
    ("Buffer depth and the gate", "short", "",
     [("etarl_buffer_groups", "groups waiting"), ("etarl_buffer_capacity_groups", "capacity"),
      ("etarl_buffer_leased_groups", "leased"), ("etarl_gate_permits_running", "permits running"),
      ("etarl_gate_capacity_permits", "gate capacity"), ("etarl_gate_requests_waiting", "requests waiting")], {}),
    ("Gate waits (seconds blocked per second)", "percentunit",
     "1.0 means a worker spent the whole minute waiting for the eta gate.",
     [("rate(etarl_worker_gate_wait_seconds_total[1m])", "{{worker}}"),
      ("rate(etarl_gate_wait_seconds_total[1m])", "all requests (buffer)")], {}),
    ("IS weights", "short", "ESS below 0.3 fires EtarlLowEffectiveSampleSize.",
     [("etarl_rollout_corr_rollout_is_mean", "mean"), ("etarl_rollout_corr_rollout_is_std", "std"),
      ("etarl_rollout_corr_rollout_is_min", "min"), ("etarl_rollout_corr_rollout_is_max", "max"),
      ("etarl_rollout_corr_rollout_is_eff_sample_size", "ESS (fraction)")], {}),
    ("KL and chi-squared (rollout vs training policy)", "short", "",
     [("etarl_rollout_corr_kl", "KL (k1)"), ("etarl_rollout_corr_k3_kl", "KL (k3)"),
      ("etarl_rollout_corr_chi2_token", "chi2 token"), ("etarl_rollout_corr_chi2_seq", "chi2 seq"),
      ("etarl_actor_ppo_kl", "PPO KL")], {}),
    ("Rejected and clipped fractions", "percentunit", "",
     [("etarl_rollout_corr_rollout_rs_masked_fraction", "RS masked tokens"),
      ("etarl_rollout_corr_rollout_is_veto_fraction", "vetoed sequences"),
      ("etarl_rollout_corr_rollout_is_ratio_fraction_high", "IS above cap"),
      ("etarl_actor_pg_clipfrac", "PPO clip"), ("etarl_actor_pg_clipfrac_lower", "dual clip")], {}),
    ("Learner step phases", "s", "",
     [("etarl_timing_step_total_seconds", "whole step"), ("etarl_timing_wait_data_seconds", "wait for data"),
      ("etarl_timing_step_seconds", "learner update step"),
      ("etarl_timing_old_log_prob_seconds", "proximal log-probs"), ("etarl_timing_update_actor_seconds", "update"),
      ("etarl_timing_update_critic_seconds", "critic update (gae)"),
      ("etarl_timing_weight_sync_seconds", "weight sync")], {}),
    ("Critic (PPO with gae)", "short",
     "The value loss, and how much of the returns' spread the values foresee (1: all, 0: no better than their mean). "
     "Empty unless learner.advantage.estimator is gae.",
     [("etarl_critic_vf_loss", "value loss"), ("etarl_critic_vf_explained_var", "explained variance")], {}),
    ("Weight sync and load seconds", "s", "The learner's publish time per step; each worker's load time per version.",
     [("etarl_timing_weight_sync_seconds", "learner publish"),
      ("rate(etarl_worker_weight_load_seconds_total[5m]) / clamp_min(rate(etarl_learner_steps_total[5m]), 1e-9)",
       "load per version {{worker}}")], {}),
    ("Weight versions: learner and each worker", "short", "A worker far below the learner loads slowly or is stuck.",
     [("etarl_learner_version", "learner"), ("etarl_worker_weight_version", "{{worker}}")], {}),
    ("Dropped groups and refused requests", "ops", "Filtered: groups left untrained as uninformative (rollout.filter_groups).",
     [("sum by (reason) (rate(etarl_groups_dropped_total[5m]))", "dropped {{reason}}"),
      ("rate(etarl_groups_filtered_total[5m])", "filtered (all samples alike)"),
      ("sum by (reason) (rate(etarl_buffer_request_errors_total[5m]))", "refused {{reason}}"),
      ("sum by (reason) (rate(etarl_buffer_bad_messages_total[5m]))", "bad message {{reason}}")], {}),
    ("Drift: backend vs staleness, and eta", "short",
     "The sampler-learner gap (k3) split into its backend part and its growth per version; eta auto keeps "
     "eta x drift per version within the budget.",
     [("etarl_drift_total_k3", "total gap"), ("etarl_drift_backend_k3", "backend"),
      ("etarl_drift_per_version_k3", "per version"), ("etarl_drift_smoothed_per_version_k3", "per version (smoothed)"),
      ("etarl_drift_budget_k3", "budget"), ("etarl_gate_eta", "eta")], {}),
    ("Stale drops by response length", "percentunit",
     "Fraction of groups of each length dropped as too stale (staleness is judged by a group's start version).",
     [("rate(etarl_groups_dropped_stale_by_length_total[15m]) / (rate(etarl_groups_dropped_stale_by_length_total[15m])"
       " + rate(etarl_groups_consumed_by_length_total[15m]))", "<= {{length_le}} tokens")], {}),
    ("Failing prompts and weight loads", "short", "Quarantined prompts fail generation on their own; see the worker logs.",
     [("etarl_prompts_quarantined_total", "quarantined prompts"),
      ("increase(etarl_worker_prompt_failures_total[15m])", "prompt failures/15m {{worker}}"),
      ("increase(etarl_worker_weight_load_failures_total[15m])", "weight load failures/15m {{worker}}")], {}),
    ("Worker and buffer health", "short", "",
     [("etarl_worker_up", "up {{worker}}"), ("increase(etarl_worker_restarts_total[15m])", "restarts/15m {{worker}}"),
      ("etarl_buffer_up", "buffer up")], {}),
]


def panel(index: int, title: str, unit: str, description: str, queries, extra: dict) -> dict:
    kind = extra.get("type", "timeseries")
    targets = [{"datasource": DATASOURCE, "refId": chr(ord("A") + i), "expr": expr, "legendFormat": legend}
               for i, (expr, legend) in enumerate(queries)]
    for target in targets:
        target.update({k: v for k, v in extra.items() if k in ("format", "instant")})
    options = ({"orientation": "vertical", "displayMode": "gradient", "showUnfilled": True,
                "reduceOptions": {"calcs": ["lastNotNull"], "fields": "", "values": False}}
               if kind == "bargauge" else
               {"legend": {"displayMode": "list", "placement": "bottom", "showLegend": True},
                "tooltip": {"mode": "multi", "sort": "none"}})
    return {
        "id": index + 1, "type": kind, "title": title, "description": description, "datasource": DATASOURCE,
        "gridPos": {"h": HEIGHT, "w": WIDTH, "x": (index % 2) * WIDTH, "y": (index // 2) * HEIGHT},
        "fieldConfig": {"defaults": {"unit": unit}, "overrides": []},
        "options": options, "targets": targets,
    }


def build() -> dict:
    return {
        "uid": "etarl-overview", "title": "etarl: asynchronous RL", "tags": ["etarl"], "timezone": "browser",
        "schemaVersion": 39, "version": 1, "editable": True, "refresh": "10s",
        "time": {"from": "now-1h", "to": "now"},
        "templating": {"list": [{"name": "datasource", "type": "datasource", "query": "prometheus",
                                 "label": "Prometheus", "current": {}, "hide": 0, "refresh": 1}]},
        "annotations": {"list": []},
        "panels": [panel(i, *spec) for i, spec in enumerate(PANELS)],
    }


def render() -> str:
    return json.dumps(build(), indent=2) + "\n"


if __name__ == "__main__":
    sys.stdout.write(render())
