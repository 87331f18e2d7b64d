"""The pool's wait for its workers before a run's first step (run.wait_for_workers_s), against the
run's real weight board (a Ray actor): it ends as soon as every worker has joined the weight
channel, names the ones that have not when its time is up, and ends at once on a stop."""
from __future__ import annotations

import threading
import time

from lm.weight_sync import WeightStore
from services.config import build_config
from services.worker_pool import WorkerPool


def _pool_of_two(ray, stop: threading.Event) -> WorkerPool:
    board = ray.remote(WeightStore).options(num_cpus=0, max_concurrency=4).remote()
    pool = WorkerPool(build_config({}, ["rollout.num_workers=2"]), None, None, board, stop)
    pool.workers = ["worker-0 not started", "worker-1 not started"]  # the board's joins stand in for their engines
    return pool


def test_the_wait_for_workers_ends_when_all_joined_or_names_those_missing(ray_cluster):
    ray = ray_cluster
    pool = _pool_of_two(ray, threading.Event())
    board = pool.weight_store
    ray.get(board.join.remote("worker-0", "s0", -1))
    assert pool.wait_until_joined(0.3, poll_s=0.05) == ["worker-1"]

    joiner = threading.Timer(0.5, lambda: ray.get(board.join.remote("worker-1", "s1", -1)))
    joiner.start()
    try:
        started = time.monotonic()
        assert pool.wait_until_joined(120, poll_s=0.05) == []
        assert time.monotonic() - started < 120  # it ended on the join, not on its time
        assert set(ray.get(board.members.remote())) == {"worker-0", "worker-1"}
    finally:
        joiner.cancel()
        joiner.join()


def test_a_stop_ends_the_wait_for_workers(ray_cluster):
    stop = threading.Event()
    pool = _pool_of_two(ray_cluster, stop)
    missing = []
    waiter = threading.Thread(target=lambda: missing.extend(pool.wait_until_joined(600, poll_s=0.05)), daemon=True)
    waiter.start()
    stop.set()
    waiter.join(timeout=60)  # far less than its 600 s: the stop, not the time, ends it
    assert not waiter.is_alive() and missing == ["worker-0", "worker-1"]
