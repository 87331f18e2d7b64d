"""deploy/ray/submit.sh for real: a local Ray cluster (`ray start --head` on 127.0.0.1 with its
dashboard, the job API, on 127.0.0.1), a short `etarl train` job submitted through the script,
and the job must succeed and leave its run folder behind.

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

REPO = Path(__file__).resolve().parents[2]
SUBMIT = REPO / "deploy" / "ray" / "submit.sh"
VENV_BIN = Path(sys.executable).parent

# A few steps of the tiny model, cheap evaluation; the same overrides a laptop smoke test would use.
TINY_RUN = ["run.steps=1", "buffer.gate.batch_size=2", "rollout.sampling.n=4", "eval.num_prompts=4",
            "eval.n_samples=0", "run.eval_every=0", "run.checkpoint_every=0", "run.progress=false"]


def free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


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
           "--include-dashboard", "true", "--num-cpus", "2", "--temp-dir", temp_dir, "--disable-usage-stats"]
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
        while time.monotonic() < deadline and _session_alive(proc.pid):
            time.sleep(0.5)
        if not _session_alive(proc.pid):
            break
    proc.wait(timeout=10)


def _session_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
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


@pytest.mark.slow
def test_a_short_training_job_succeeds_on_a_local_cluster(ray_head, tmp_path):
    run_dir = tmp_path / "run"
    result = run_submit("--address", ray_head, "--submission-id", f"etarl-test-{os.getpid()}", "--",
                        *TINY_RUN, f"run.run_dir={run_dir}", f"run.cache_dir={REPO / '.cache'}")
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-6000:]
    assert "succeeded" in output.lower()
    steps = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    assert max(r.get("step", 0) for r in steps) == 1


@pytest.mark.slow
def test_a_failing_job_makes_the_script_fail(ray_head):
    """The script judges the job by its final status: a config error in the job is a failure."""
    result = run_submit("--address", ray_head, "--submission-id", f"etarl-bad-{os.getpid()}", "--",
                        "no.such.key=1", timeout=240)
    output = result.stdout + result.stderr
    assert result.returncode != 0
    assert "unknown key" in output  # etarl's own config error, from the job's log
