"""The rollout workers of a run: start them as Ray actors, keep them running, stop them.

A worker that Ray restarts after a crash gets its loop started again; one that fails more often
than `ray.worker_max_restarts`, or returns an error, stops the run loudly. Stats come from the
workers that answer; a dead or restarting one is shown down, never stopping the run.
"""
from __future__ import annotations

import logging
import time

from buffer.errors import BufferUnavailable

log = logging.getLogger("etarl")

_WORKER_BACK_AFTER_S = 5.0  # a restarted worker whose loop ran this long is back


def worker_id(index: int) -> str:
    """Worker `index`'s name: its samples, metrics and weight-channel membership carry it."""
    return f"worker-{index}"


class WorkerPool:
    """`worker_options[i]`: worker i's Ray options from the run's placement plan (its CPUs, its
    engine's GPUs, its placement-group bundle; services/placement.py). None (tests): each worker
    asks for ray.worker_num_cpus CPUs and no GPU, so its engine runs on the CPU."""

    def __init__(self, cfg, model_dir, buffer_client, weight_store, stop_requested,
                 worker_options: list[dict] | None = None, exporter=None):
        if worker_options is None:
            worker_options = [{"num_cpus": cfg.ray.worker_num_cpus}] * cfg.rollout.num_workers
        if len(worker_options) != cfg.rollout.num_workers:
            raise ValueError(f"{len(worker_options)} workers placed, rollout.num_workers={cfg.rollout.num_workers}")
        self.cfg = cfg
        self.worker_options = worker_options
        self.stop_requested = stop_requested  # the run's: a worker that ends then is not a failure
        self.model_dir = model_dir
        self.buffer_client = buffer_client
        self.weight_store = weight_store
        self.exporter = exporter
        self.workers: list = []
        self.refs: list = []
        self.failures: list[int] = []
        self.resubmitted_at: list[float | None] = []  # set while a restarted worker comes back

    def prepare(self) -> None:
        """Start the worker actors and their engines, tokenizers and rewards, without their loops:
        nothing of the buffer or the weight channel is touched (a resumed run's restore comes
        first). The controller calls it before its learner loads, so that both load at once."""
        import ray
        from rollout_workers.worker import RolloutWorker

        cfg = self.cfg
        rollout_cfg = cfg.rollout.model_copy(update={"model_path": str(self.model_dir)})
        actor = ray.remote(RolloutWorker)
        for index, placed in enumerate(self.worker_options):
            handle = actor.options(
                name=None, max_restarts=cfg.ray.worker_max_restarts, max_task_retries=0, max_concurrency=4, **placed,
            ).remote(rollout_cfg, worker_id(index))
            handle.prepare.remote()  # its failure is raised by the loop (`start`), which the pool watches
            self.workers.append(handle)

    def start(self) -> None:
        """Start every worker's loop (`prepare` first where it was not called)."""
        if not self.workers:
            self.prepare()
        self.refs = [self._run(w) for w in self.workers]
        self.failures = [0] * len(self.workers)
        self.resubmitted_at = [None] * len(self.workers)

    def check(self) -> None:
        """Restart the loop of a worker that Ray restarted after a crash; a worker that fails more
        often than ray.worker_max_restarts, or returns an error, stops the run loudly. While Ray
        restarts the actor, calls to it fail at once (ActorUnavailableError): those retries are
        not new deaths; the worker counts as back once its loop has run for a few seconds."""
        import ray

        done, pending = ray.wait(self.refs, num_returns=len(self.refs), timeout=0)
        now = time.monotonic()
        for ref in pending:
            index = self.refs.index(ref)
            since = self.resubmitted_at[index]
            if since is not None and now - since > _WORKER_BACK_AFTER_S:
                self.resubmitted_at[index] = None
        for ref in done:
            index = self.refs.index(ref)
            try:
                ray.get(ref)
            except ray.exceptions.RayActorError as exc:
                self._restart_loop(index, exc, now)
                continue
            except Exception as exc:
                cause = getattr(exc, "cause", exc)  # a RayTaskError carries the worker's exception
                if isinstance(cause, BufferUnavailable):  # the run stops on the buffer's account
                    raise BufferUnavailable(f"rollout worker-{index}: {cause}") from exc
                raise
            if not self.stop_requested.is_set():
                raise RuntimeError(f"rollout worker-{index} stopped on its own")

    def wait_until_joined(self, timeout_s: float, poll_s: float = 0.5) -> list[str]:
        """Wait (at most `timeout_s`) until every worker has joined the weight channel: its engine
        is up and each newer version waits for it. The workers still missing (empty: none); a
        worker that fails for good stops the run here as in a step."""
        import ray

        names = {worker_id(index) for index in range(len(self.workers))}
        deadline = time.monotonic() + timeout_s
        while True:
            missing = sorted(names - set(ray.get(self.weight_store.members.remote())))
            if not missing or time.monotonic() >= deadline or self.stop_requested.is_set():
                return missing
            self.check()
            self.stop_requested.wait(poll_s)

    def _restart_loop(self, index: int, exc, now: float) -> None:
        import ray

        restarting = self.resubmitted_at[index] is not None
        if not restarting or not isinstance(exc, ray.exceptions.ActorUnavailableError):
            self.failures[index] += 1
            if self.failures[index] > self.cfg.ray.worker_max_restarts:
                raise RuntimeError(f"rollout worker-{index} died {self.failures[index]} times") from exc
            log.warning("rollout worker-%d died (%s); Ray restarts it, its permits come back", index,
                        type(exc).__name__)
            if self.exporter is not None:
                self.exporter.record_worker_restart(worker_id(index))
        self.resubmitted_at[index] = now
        self.refs[index] = self._run(self.workers[index])

    def _run(self, worker):
        return worker.run_in_actor.remote(self.buffer_client, self.weight_store)

    def stats(self, timeout: float = 30.0) -> list[dict]:
        """Stats of the workers that answer. A dead or restarting worker (Ray restarts it; its
        vLLM engine takes a while) is skipped and shown down, never stopping the run."""
        import ray

        stats = []
        for index, ref in enumerate([w.stats.remote() for w in self.workers]):
            try:
                stats.append(ray.get(ref, timeout=timeout))
            except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
                if self.exporter is not None:
                    self.exporter.record_worker_down(worker_id(index))
        return stats

    def stop(self, grace_s: float = 30.0) -> None:
        """Ask every worker to end its loop, wait up to `grace_s` for them, then end the actors."""
        import ray

        if not self.workers:
            return
        for w in self.workers:
            try:
                w.stop.remote()
            except Exception:
                pass
        if grace_s > 0 and self.refs:  # (none: stopped before its loops started)
            ray.wait(self.refs, num_returns=len(self.refs), timeout=grace_s)
        for w in self.workers:
            ray.kill(w)
        self.workers = []
