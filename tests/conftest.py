"""Fixtures shared across the suite: one torch thread per process, one local Ray cluster on
127.0.0.1 for the whole session, and the tiny warm-started model folder (built once)."""
from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import pytest

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("RAY_DEDUP_LOGS", "0")
# Ray's own pollers run less often in the clusters the suite starts (the suite reads neither Ray's node
# metrics nor its log files through Ray): the dashboard agent's reporter (psutil over the node's
# processes, every 5 s), the log monitor's search for new files (every 0.1 s; 1 s here, each file
# still read every 0.1 s) and the metric exports. An idle cluster took 2.5 s of CPU a minute, 1.85 so.
for _name, _value in {"REPORTER_UPDATE_INTERVAL_MS": "60000", "METRICS_RECORD_INTERVAL_S": "60",
                      "RAY_metrics_report_interval_ms": "60000", "RAY_LOG_MONITOR_MANY_FILES_THRESHOLD": "0",
                      "LOG_NAME_UPDATE_INTERVAL_S": "1"}.items():
    os.environ.setdefault(_name, _value)
# vLLM's ZMQ sockets go to a folder of this session (removed at its end), not loose into /tmp:
# an engine whose process is killed (a fault test) never unlinks its own. Every process the
# session starts (Ray's workers, `etarl train` children) inherits it.
_VLLM_SOCKETS = None
if "VLLM_RPC_BASE_PATH" not in os.environ:
    _VLLM_SOCKETS = os.environ["VLLM_RPC_BASE_PATH"] = tempfile.mkdtemp(prefix="etarl-test-vllm-")

REPO = Path(__file__).resolve().parents[1]
SHARED = REPO.parent / "shared"


# Packages whose files share a package-scoped fixture (tests/rollout_workers: one vLLM-CPU engine,
# 36 s of CPU to start) run as one unit: back to back, on one worker, so the fixture is made once.
SHARED_FIXTURE_PACKAGES = ("tests/rollout_workers/",)


def work_unit(nodeid: str) -> str:
    """What runs as one piece on one worker: a test file, or a package of SHARED_FIXTURE_PACKAGES."""
    path = nodeid.split("::", 1)[0]
    return next((package for package in SHARED_FIXTURE_PACKAGES if path.startswith(package)), path)


def pytest_collection_modifyitems(config, items):
    """Units (files, shared-fixture packages) with a slow test (a whole run, an engine, gloo ranks)
    first, each unit's tests kept in order: scripts/test.sh deals whole units to its workers in this
    order, so the long ones start early, the many short ones fill the end, and the workers finish
    together."""
    slow_units = {work_unit(item.nodeid) for item in items if item.get_closest_marker("slow")}
    items.sort(key=lambda item: work_unit(item.nodeid) not in slow_units)  # stable


@pytest.hookimpl(optionalhook=True)  # a pytest-xdist hook: unknown without it
def pytest_xdist_make_scheduler(config, log):
    """xdist's --dist loadfile (scripts/test.sh), with work_unit's units instead of files."""
    if config.getoption("dist") != "loadfile":
        return None  # another --dist: xdist's own
    from xdist.scheduler import LoadFileScheduling

    class LoadUnitScheduling(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return work_unit(nodeid)

    return LoadUnitScheduling(config, log)


def pytest_sessionfinish(session, exitstatus):
    if _VLLM_SOCKETS is not None:
        shutil.rmtree(_VLLM_SOCKETS, ignore_errors=True)


@pytest.fixture(scope="session", autouse=True)
def _one_torch_thread():
    try:
        import torch

        torch.set_num_threads(1)
    except ImportError:
        pass


@pytest.fixture(scope="session")
def ray_cluster():
    """A local Ray cluster bound to loopback, shared by every test that asks for it."""
    import ray

    from services.local_ray import NO_PRESTART, init_local_ray  # every Ray server on 127.0.0.1, as in `etarl train`

    if not ray.is_initialized():
        init_local_ray(
            num_cpus=2,
            log_to_driver=False,
            runtime_env={"env_vars": {"OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}},
            # No idle workers kept ready (tasks start theirs on demand; an actor has its own anyway):
            # two idle ones took 1 s of CPU every 30 s for the whole session (2.5 s with them, 1.7 without).
            _system_config=NO_PRESTART,
        )
    yield ray
    ray.shutdown()


@pytest.fixture(scope="session")
def tiny_model_dir() -> Path:
    """The embedded default's warm-started tiny model (configs/default.yaml: the folder `etarl
    train` builds, and the e2e runs use) as an HF folder, built once per cache key and reused."""
    from rollout_workers.tiny_model import ensure_tiny_model
    from services.config import load_config

    return ensure_tiny_model(REPO / ".cache" / "tiny-model", load_config(None).run.tiny_model)


@pytest.fixture
def buffer_service(tmp_path):
    """A factory of real `python -m buffer serve` processes (services.chaos.BufferService: same
    port and log across restarts); all are stopped at the end of the test."""
    from services.chaos import BufferService

    started = []

    def start(**config) -> BufferService:
        service = BufferService(config, tmp_path).start()
        started.append(service)
        return service

    yield start
    for service in started:
        service.stop()
