"""deploy/ray/submit.sh for real: a local Ray cluster (`ray start --head` on 127.0.0.1 with its
dashboard, the job API, on 127.0.0.1), a short `etarl train` job submitted through the script,
and the job must succeed and leave its run folder behind. A real Prometheus server scrapes the
job's metrics exporter meanwhile; afterwards its HTTP API must hold the run's series with values
that match the run (one training run serves both checks: the machine is small).

The cluster gets its own --temp-dir, so other tests' `ray.init()` never find and join it, and is
stopped by ending its own `ray start --block` process (never `ray stop`, which would stop every
Ray on the machine)."""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from observability.prometheus_server import PrometheusServer  # tests/ is on sys.path (its conftest)
from services.chaos import free_port

REPO = Path(__file__).resolve().parents[2]
SUBMIT = REPO / "deploy" / "ray" / "submit.sh"
VENV_BIN = Path(sys.executable).parent

# A few steps of the tiny model, cheap evaluation; the same overrides a laptop smoke test would use.
STEPS, GROUPS, GROUP_SIZE = 2, 2, 4
ETA = 2  # the embedded default's bound
TINY_RUN = [f"run.steps={STEPS}", f"buffer.gate.batch_size={GROUPS}", f"rollout.sampling.n={GROUP_SIZE}",
            "eval.num_prompts=4", "eval.n_samples=0", "run.eval_every=0", "run.checkpoint_every=0",
            # the embedded default's tiny model: built once (cached) for the e2e runs as well
            "run.progress=false", f"run.cache_dir={REPO / '.cache'}",
            # The transformers engine: the script, the job and the scrapes are under test, and it
            # starts 25 s sooner than vLLM-CPU (vLLM's runs: tests/e2e).
            "rollout.engine.kind=hf"]


def env_with_venv() -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false", RAY_USAGE_STATS_ENABLED="0")
    env["PATH"] = f"{VENV_BIN}{os.pathsep}{env.get('PATH', '')}"  # `ray` and `etarl` of this venv
    env.pop("RAY_ADDRESS", None)
    return env


@pytest.fixture(scope="module")
def ray_head():
    if shutil.which("ray", path=str(VENV_BIN)) is None:
        pytest.skip("the `ray` CLI is not installed in this environment")
    temp_dir = tempfile.mkdtemp(prefix="etarl-ray-", dir="/tmp")  # short: Ray's socket paths are limited
    dashboard = free_port()
    cmd = [str(VENV_BIN / "ray"), "start", "--head", "--block", "--node-ip-address", "127.0.0.1",
           "--port", str(free_port()), "--dashboard-host", "127.0.0.1", "--dashboard-port", str(dashboard),
           "--include-dashboard", "true", "--num-cpus", "3", "--temp-dir", temp_dir, "--disable-usage-stats",
           # 3 logical CPUs: the default plan's worker, learner rank and evaluator (`etarl plan`).
           # The job agent's HTTP port is fixed (52365) by default: another Ray on this machine may hold it.
           "--dashboard-agent-listen-port", str(free_port())]
    log = open(Path(temp_dir) / "ray-start.log", "w+")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env_with_venv(), start_new_session=True)
    address = f"http://127.0.0.1:{dashboard}"
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                urllib.request.urlopen(f"{address}/api/version", timeout=2).close()
                break
            except urllib.error.HTTPError:  # it answers (401 under Ray's token auth): it is up
                break
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    log.seek(0)
                    pytest.fail(f"the Ray head did not come up:\n{log.read()[-3000:]}")
                time.sleep(1)
        yield address
    finally:
        stop_session(proc)
        log.close()
        shutil.rmtree(temp_dir, ignore_errors=True)


def stop_session(proc: subprocess.Popen) -> None:
    """SIGTERM to `ray start --block` and its session (GCS, raylet, dashboard, workers), a short
    grace period, then SIGKILL whatever of that session is left."""
    for sig, grace in ((signal.SIGTERM, 5), (signal.SIGKILL, 10)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            break
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline and _session_alive(proc):
            time.sleep(0.5)
        if not _session_alive(proc):
            break
    proc.wait(timeout=10)


def _session_alive(proc: subprocess.Popen) -> bool:
    proc.poll()  # reaps the leader once it exited: a zombie still counts as in its group for killpg
    try:
        os.killpg(proc.pid, 0)
        return True
    except ProcessLookupError:
        return False


def run_submit(*args: str, timeout: int = 420) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(SUBMIT), *args], cwd=REPO, env=env_with_venv(), capture_output=True,
                          text=True, timeout=timeout)


def test_help_describes_the_script():
    result = subprocess.run(["bash", str(SUBMIT), "--help"], capture_output=True, text=True, timeout=30)
    assert result.returncode == 0 and "ray job submit" not in result.stderr
    assert "etarl train" in result.stdout and "--address" in result.stdout


@pytest.fixture(scope="module")
def submitted_run(ray_head, tmp_path_factory):
    """One short training job through submit.sh, scraped by Prometheus while it runs."""
    tmp = tmp_path_factory.mktemp("submitted-run")
    port = free_port()
    server = PrometheusServer(tmp / "prom", {"etarl-controller": [f"127.0.0.1:{port}"]}, interval_ms=500)
    try:
        result = run_submit("--address", ray_head, "--submission-id", f"etarl-test-{os.getpid()}", "--",
                            *TINY_RUN, f"run.run_dir={tmp / 'run'}", f"metrics.port={port}")
        yield result, server, tmp / "run"
    finally:
        server.close()


@pytest.mark.slow
def test_a_short_training_job_succeeds_on_a_local_cluster(submitted_run):
    result, _, run_dir = submitted_run
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-6000:]
    assert "succeeded" in output.lower()
    steps = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    assert max(r.get("step", 0) for r in steps) == STEPS


def last(server: PrometheusServer, metric: str) -> list[dict]:
    """The last scraped value of each series (the run is over; its series are stale now)."""
    return server.query(f"last_over_time({metric}[10m])")


def one(server: PrometheusServer, metric: str) -> float:
    rows = last(server, metric)
    assert len(rows) == 1, (metric, rows)
    return rows[0]["value"]


@pytest.mark.slow
def test_prometheus_scraped_the_learner_and_the_buffer(submitted_run):
    result, server, run_dir = submitted_run
    assert result.returncode == 0, (result.stdout + result.stderr)[-3000:]
    log = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    steps = [r for r in log if "reward/mean" in r]
    assert len(steps) == STEPS

    # The learner: every step counted, the version the run ended at, its reward.
    assert one(server, "etarl_learner_steps_total") == STEPS
    assert one(server, "etarl_learner_version") == steps[-1]["version"]
    assert one(server, "etarl_reward_mean") == pytest.approx(steps[-1]["reward/mean"])

    # Rollout correction, from the learner's step metrics, by the naming rule.
    assert 0.0 < one(server, "etarl_rollout_corr_rollout_is_eff_sample_size") <= 1.0 + 1e-6
    assert one(server, "etarl_rollout_corr_rollout_is_mean") > 0
    assert one(server, "etarl_timing_update_actor_seconds") > 0
    assert one(server, "etarl_timing_weight_sync_seconds") >= 0

    # The buffer: what was consumed, and how stale, one bucket per version up to eta.
    consumed = one(server, "etarl_samples_consumed_total")
    assert consumed == STEPS * GROUPS * GROUP_SIZE
    buckets = {r["metric"]["le"]: r["value"] for r in last(server, "etarl_consumed_staleness_versions_bucket")}
    assert set(buckets) == {f"{v}.0" for v in range(ETA + 1)} | {"+Inf"}
    assert buckets["+Inf"] == buckets[f"{ETA}.0"] == consumed  # nothing staler than eta
    assert one(server, "etarl_consumed_samples_over_eta_total") == 0
    assert one(server, "etarl_staleness_bound_versions") == ETA
    assert one(server, "etarl_samples_pushed_total") >= consumed


@pytest.mark.slow
def test_prometheus_scraped_each_worker(submitted_run):
    _, server, _ = submitted_run
    versions = {r["metric"]["worker"]: r["value"] for r in last(server, "etarl_worker_weight_version")}
    assert versions, "no per-worker series: the controller must relay its workers' stats"
    assert all(0 <= v <= STEPS for v in versions.values())
    tokens = last(server, "etarl_worker_tokens_generated_total")
    assert tokens and all(r["value"] > 0 for r in tokens)


@pytest.mark.slow
def test_the_rules_evaluated_on_the_run_without_error(submitted_run):
    _, server, _ = submitted_run
    rules = [r for g in server.api("rules")["groups"] for r in g["rules"]]
    assert rules and all(r["health"] != "err" for r in rules), [(r["name"], r.get("lastError")) for r in rules]
    firing = [a["labels"]["alertname"] for a in server.api("alerts")["alerts"] if a["state"] == "firing"]
    assert "EtarlStalenessAboveEta" not in firing


@pytest.mark.slow
def test_a_failing_job_makes_the_script_fail(ray_head):
    """The script judges the job by its final status: a config error in the job is a failure."""
    result = run_submit("--address", ray_head, "--submission-id", f"etarl-bad-{os.getpid()}", "--",
                        "no.such.key=1", timeout=240)
    output = result.stdout + result.stderr
    assert result.returncode != 0
    assert "unknown key" in output  # etarl's own config error, from the job's log
