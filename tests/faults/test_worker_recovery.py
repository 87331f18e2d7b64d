"""A rollout worker whose weight load fails is retried, then restarted by its pool (a real Ray
actor whose process ends and which Ray starts again), and the run's work goes on: the worker is
back within its restart budget, loads the weights and pushes groups again."""
from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

from buffer.config import BufferConfig, GateConfig
from lm.causal_lm import load_causal_lm
from lm.weight_sync import save_weights_folder
from services.config import build_config
from services.worker_pool import WorkerPool

HERE = Path(__file__).resolve().parent


@pytest.mark.slow
def test_a_worker_whose_weight_load_fails_is_back_within_its_restart_budget(ray_cluster, tiny_model_dir, tmp_path):
    import ray

    import fault_helpers
    from fault_helpers import FlakyWeightStore
    from ray import cloudpickle

    # By value: the worker processes, which cannot import this test module, call its methods.
    cloudpickle.register_pickle_by_value(fault_helpers)
    from services.buffer_actor import RayBufferClient, create_buffer_actor

    buffer_cfg = BufferConfig(transport="ray", gate=GateConfig(batch_size=2, eta=None, permit_lease_s=30))
    client = RayBufferClient(create_buffer_actor(buffer_cfg), buffer_cfg)
    client.set_version(1)
    weights = {k: v.clone() for k, v in load_causal_lm(tiny_model_dir).state_dict().items()}
    good = {"version": 1, "kind": "folder", "path": str(save_weights_folder(weights, tmp_path / "v1", 1))}
    paths = [str(HERE), str(HERE.parent / "buffer"), str(HERE.parents[1])]
    # Two retries per process: the first process fails all 3 reads and asks for a restart.
    store = ray.remote(FlakyWeightStore).options(
        num_cpus=0, runtime_env={"env_vars": {"PYTHONPATH": ":".join(paths)}}).remote(good, 3)
    cfg = build_config({}, [f"run.model={tiny_model_dir}", "rollout.engine.kind=hf", "rollout.sampling.n=2",
                            "rollout.groups_per_batch=1", "rollout.weight_load_retries=2",
                            "rollout.error_backoff_s=0", "ray.worker_num_cpus=0", "ray.worker_max_restarts=2"])
    pool = WorkerPool(cfg, tiny_model_dir, client, store, threading.Event())
    pool.start()
    try:
        deadline = time.monotonic() + 300
        pushed = 0
        while time.monotonic() < deadline:
            pool.check()  # restarts the loop of the restarted actor
            pushed = client.stats()["pushed_groups"]
            if pushed >= 2 and pool.failures[0] >= 1:
                break
            time.sleep(0.2)
        assert pool.failures == [1], "one restart, within ray.worker_max_restarts"
        assert pushed >= 2, client.stats()
        (stats,) = pool.stats(timeout=30)
        assert stats["loaded_version"] == 1 and stats["weight_load_failures_total"] == 0, "a fresh process"
        assert client.stats()["permits_reclaimed"] == 0, "no permit was left behind for its lease to reclaim"
    finally:
        pool.stop()
        ray.kill(client.actor)
