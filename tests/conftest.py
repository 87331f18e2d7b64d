"""Fixtures shared across the suite: one torch thread per process, one local Ray cluster on
127.0.0.1 for the whole session, and the tiny warm-started model folder (built once)."""
from __future__ import annotations

import os
from pathlib import Path

import pytest

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("RAY_DEDUP_LOGS", "0")

REPO = Path(__file__).resolve().parents[1]
SHARED = REPO.parent / "shared"


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

    from services.local_ray import init_local_ray  # every Ray server on 127.0.0.1, as in `etarl train`

    if not ray.is_initialized():
        init_local_ray(
            num_cpus=2,
            log_to_driver=False,
            runtime_env={"env_vars": {"OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}},
        )
    yield ray
    ray.shutdown()


@pytest.fixture(scope="session")
def tiny_model_dir() -> Path:
    """The warm-started tiny model as an HF folder, built once per cache key and reused."""
    from rollout_workers.tiny_model import ensure_tiny_model

    return ensure_tiny_model(REPO / ".cache" / "tiny-model")


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
