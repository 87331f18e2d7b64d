"""The run: start (or join) Ray, the buffer, the weight store, the rollout workers and the learner
group, then train for `run.steps` steps while the workers generate.

One learner step, driven from here:
  pull B groups (oldest first; stale ones dropped and counted by the buffer) -> learner step ->
  ack the batch -> tell the gate the new version -> publish the new weights.
The workers run concurrently the whole time, bounded by the η gate.

Every step's metrics go to RUN_DIR/metrics.jsonl (plus the consumption audit: which tickets and
groups were trained on, and how stale), periodic held-out evaluations too; PNG plots are drawn at
the end. Checkpoints every `run.checkpoint_every` steps and at the end (or on Ctrl-C) hold the
policy, the optimizer and scheduler, the version, and the buffer's gate state (tickets, data
cursor) and contents, so `etarl train --resume RUN_DIR` continues without losing or repeating a
sample.
"""
from __future__ import annotations

import logging
import math
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import msgpack
import yaml

from services import checkpoint as ckpt
from services.config import TINY_MODEL, ConfigError, EtarlConfig, build_config, read_yaml
from services.plots import MetricLog, plot_run

log = logging.getLogger("etarl")

BUFFER_STATE_FILE = "buffer.msgpack"
QUIET_VLLM = os.environ.get("VLLM_LOGGING_LEVEL", "ERROR")  # vLLM's warnings drown the progress bar
CONFIG_FILE = "config.yaml"
_WORKER_BACK_AFTER_S = 5.0  # a restarted worker whose loop ran this long is back


# ------------------------------------------------------------------ the buffer, checkpointable


def _buffer_actor_class():
    """The buffer actor plus the two calls a checkpoint needs: a consistent snapshot of the gate
    (tickets, cursor, counters) and of the groups held, as the buffer's own log records, and
    their restore into a fresh buffer (the buffer's own log replay)."""
    from services.buffer_actor import BufferActor

    class CheckpointableBufferActor(BufferActor):
        def snapshot(self) -> list[dict]:
            # Generations in flight do not survive a resume: their tickets go back to be reissued.
            return self.core.snapshot_records(keep_in_flight=False, keep_consumed_ids=False)

        def restore(self, records: list[dict]) -> dict:
            self.core.restore(records)
            stats = self.core.stats()
            return {k: stats[k] for k in ("version", "groups_ready", "next_ticket", "free_tickets")}

    return CheckpointableBufferActor


class BufferHandle:
    """The buffer as this run uses it: a client (Ray actor or ZMQ), and for the Ray transport
    the actor itself (snapshot/restore for checkpoints); for ZMQ the service process."""

    def __init__(self, cfg: EtarlConfig, run_dir: Path):
        import ray

        self.transport = cfg.buffer.transport
        self.actor = None
        self.process = None
        if self.transport == "ray":
            from services.buffer_actor import RayBufferClient

            actor_cls = ray.remote(num_cpus=0, max_concurrency=64)(_buffer_actor_class())
            self.actor = actor_cls.remote(cfg.buffer.model_dump(mode="json"))
            self.client = RayBufferClient(self.actor, cfg.buffer)
        else:
            self.process, self.client = _start_zmq_buffer(cfg, run_dir)
        self.client.health()

    def snapshot(self) -> dict | None:
        import ray

        return ray.get(self.actor.snapshot.remote()) if self.actor is not None else None

    def restore(self, records: list[dict]) -> dict:
        import ray

        if self.actor is None:
            raise ConfigError("this checkpoint holds the buffer of a buffer.transport=ray run; resume it with "
                              "buffer.transport=ray")
        return ray.get(self.actor.restore.remote(records))

    def close(self) -> None:
        import ray

        if self.actor is not None:
            try:
                ray.get(self.actor.shutdown.remote(), timeout=10)
            except Exception:  # the actor may be gone with Ray already
                pass
            ray.kill(self.actor)
        if self.process is not None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()


class ZmqBufferClient:
    """A `buffer.client.BufferClient` that travels to Ray actors: pickled as its settings, it
    opens its own socket in the process that first uses it (sockets do not cross processes)."""

    def __init__(self, config):
        self._settings = config
        self._client = None

    def __getstate__(self):
        return {"_settings": self._settings, "_client": None}

    def __getattr__(self, name):
        if name.startswith("__") or name in ("_settings", "_client"):
            raise AttributeError(name)
        if self._client is None:
            from buffer.client import BufferClient

            self._client = BufferClient.from_config(self._settings)
        return getattr(self._client, name)


def _start_zmq_buffer(cfg: EtarlConfig, run_dir: Path):
    """The standalone buffer service as a child process (`python -m buffer serve`), and a client."""
    config_file = run_dir / "buffer.yaml"
    config_file.write_text(yaml.safe_dump({"buffer": cfg.buffer.model_dump(mode="json")}))
    process = subprocess.Popen([sys.executable, "-m", "buffer", "serve", "--config", str(config_file)],
                               stdout=open(run_dir / "buffer.out", "ab"), stderr=subprocess.STDOUT)
    client = ZmqBufferClient(cfg.buffer)
    deadline = time.monotonic() + 60
    while True:
        if process.poll() is not None:
            raise RuntimeError(f"the buffer service exited with code {process.returncode}; see {run_dir / 'buffer.out'}")
        try:
            client.health()
            return process, client
        except Exception:
            if time.monotonic() > deadline:
                process.kill()
                raise
            time.sleep(0.5)


# ------------------------------------------------------------------ the run


@dataclass
class RunResult:
    run_dir: Path
    steps_done: int
    version: int
    completed: bool
    interrupted: bool
    evals: list[dict] = field(default_factory=list)
    seconds: float = 0.0

    def summary(self) -> dict:
        first = self.evals[0] if self.evals else {}
        last = self.evals[-1] if self.evals else {}
        return {"run_dir": str(self.run_dir), "steps": self.steps_done, "version": self.version,
                "completed": self.completed, "interrupted": self.interrupted,
                "seconds": round(self.seconds, 1),
                "eval_accuracy_first": first.get("eval/accuracy"), "eval_accuracy_last": last.get("eval/accuracy")}


def resolve_model(cfg: EtarlConfig) -> Path:
    """run.model as an HF folder; `tiny` builds (once, cached) the warm-started tiny model."""
    from lm.causal_lm import check_model_dir

    if cfg.run.model == TINY_MODEL:
        from rollout_workers.tiny_model import ensure_tiny_model

        return ensure_tiny_model(Path(cfg.run.cache_dir) / "tiny-model", cfg.run.tiny_model, log=log.info)
    try:
        return check_model_dir(cfg.run.model)
    except FileNotFoundError as exc:
        raise ConfigError(f"run.model: {exc}") from None


def resume_config(run_dir: str | os.PathLike, config_file: str | None, overrides: list[str]) -> EtarlConfig:
    """The saved config of a run (or `config_file`), with overrides (e.g. run.steps=80)."""
    run_dir = Path(run_dir)
    source = Path(config_file) if config_file else run_dir / CONFIG_FILE
    tree = read_yaml(source)
    tree.setdefault("run", {})["run_dir"] = str(run_dir)
    return build_config(tree, overrides, source=str(source))


def start_ray(cfg: EtarlConfig) -> None:
    import ray

    if ray.is_initialized():
        return
    env = {"OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "VLLM_LOGGING_LEVEL": QUIET_VLLM}
    if cfg.ray.address == "local":
        # Logical CPUs: enough for every actor; the real cores are shared by all of them.
        needed = cfg.rollout.num_workers + cfg.learner.distributed.world_size
        num_cpus = cfg.ray.num_cpus or max(os.cpu_count() or 1, needed)
        from services.local_ray import init_local_ray  # every Ray server on 127.0.0.1

        init_local_ray(num_cpus=num_cpus, namespace=cfg.ray.namespace, log_to_driver=cfg.ray.log_to_driver,
                       runtime_env={"env_vars": env})
    else:
        # Inside a cluster (or a `ray job submit` job) the job's runtime environment applies.
        ray.init(address=cfg.ray.address, namespace=cfg.ray.namespace, log_to_driver=cfg.ray.log_to_driver)


class Controller:
    def __init__(self, cfg: EtarlConfig, resume: str | os.PathLike | None = None):
        self.cfg = cfg
        self.resume_from = ckpt.latest_checkpoint(resume) if resume else None
        run_dir = cfg.run.run_dir or f"runs/{time.strftime('%Y%m%d-%H%M%S')}"
        self.run_dir = Path(run_dir).resolve()
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.stop_requested = threading.Event()
        self.step = 0
        self.version = 0
        self.consumed_tickets: list[int] = []  # the audit: every ticket trained on, in order
        self.evals: list[dict] = []
        self._started = False
        self.buffer = self.learner = self.weight_store = self.evaluator = self.exporter = None
        self.workers: list = []
        self.worker_refs: list = []

    # ---------------------------------------------------------------- start and stop

    def start(self) -> None:
        import ray

        cfg = self.cfg
        (self.run_dir / CONFIG_FILE).write_text(cfg.to_yaml())
        os.environ["VLLM_LOGGING_LEVEL"] = QUIET_VLLM  # the evaluator's engine runs in this process
        self.model_dir = resolve_model(cfg)
        start_ray(cfg)
        from learner.distributed import LearnerGroup
        from lm.weight_sync import WeightStore

        learner_cfg = cfg.learner.model_copy(update={"model_path": str(self.model_dir)})
        self.buffer = BufferHandle(cfg, self.run_dir)
        self.weight_store = ray.remote(num_cpus=0)(WeightStore).remote()
        self.learner = LearnerGroup(learner_cfg, ray_options={"num_cpus": cfg.ray.learner_num_cpus})
        state = None
        if self.resume_from is not None:
            state = self._restore(self.resume_from)
        if state is None:
            self.buffer.client.set_version(self.version)
        self._publish()
        self._start_exporter()
        self._start_workers()
        self._started = True

    def _restore(self, checkpoint: Path) -> dict:
        state = ckpt.read_state(checkpoint)
        self.learner.load_checkpoint(str(checkpoint))
        self.version = self.learner.version
        if self.version != state["version"]:
            raise RuntimeError(f"checkpoint {checkpoint}: learner version {self.version} != state {state['version']}")
        self.step = int(state["step"])
        self.consumed_tickets = list(state["consumed_tickets"])
        self.evals = list(state.get("evals", []))
        buffer_file = checkpoint / BUFFER_STATE_FILE
        if buffer_file.is_file():
            restored = self.buffer.restore(msgpack.unpackb(buffer_file.read_bytes(), raw=False))
        elif self.cfg.buffer.transport == "zmq" and self.cfg.buffer.log.path is not None:
            # The service replayed its own durable log; the gate restarts its count at v·B.
            self.buffer.client.recover(self.version)
            restored = "the buffer service's durable log"
        else:
            raise ConfigError(f"checkpoint {checkpoint} holds no buffer state ({BUFFER_STATE_FILE}); a run with "
                              "buffer.transport=zmq resumes from the service's durable log (set buffer.log.path)")
        log.info("resumed from %s: step %d, version %d, buffer %s", checkpoint, self.step, self.version, restored)
        return state

    def _publish(self) -> float:
        import ray

        start = time.perf_counter()
        payload = self.learner.publish_weights()
        ray.get(self.weight_store.publish.remote(payload))
        return time.perf_counter() - start

    def _start_exporter(self) -> None:
        if self.cfg.metrics.port is None:
            return
        from services.metrics import MetricsExporter

        self.exporter = MetricsExporter(self.cfg.metrics.port, self.cfg.metrics.host)
        log.info("Prometheus metrics on http://%s:%d/metrics", self.cfg.metrics.host, self.exporter.port)

    def _start_workers(self) -> None:
        import ray
        from rollout_workers.worker import RolloutWorker

        cfg = self.cfg
        rollout_cfg = cfg.rollout.model_copy(update={"model_path": str(self.model_dir)})
        actor = ray.remote(RolloutWorker)
        for index in range(cfg.rollout.num_workers):
            worker_id = f"worker-{index}"
            handle = actor.options(
                name=None, num_cpus=cfg.ray.worker_num_cpus, max_restarts=cfg.ray.worker_max_restarts,
                max_task_retries=0, max_concurrency=4,
            ).remote(rollout_cfg, worker_id, self.buffer.client, self.weight_store)
            self.workers.append(handle)
        self.worker_refs = [w.run.remote() for w in self.workers]
        self.worker_failures = [0] * len(self.workers)
        self.worker_resubmitted_at: list[float | None] = [None] * len(self.workers)  # set while restarting

    def stop(self) -> None:
        import ray

        if self.workers:
            for w in self.workers:
                try:
                    w.stop.remote()
                except Exception:
                    pass
            ray.wait(self.worker_refs, num_returns=len(self.worker_refs), timeout=30)
            for w in self.workers:
                ray.kill(w)
            self.workers = []
        if self.evaluator is not None:
            self.evaluator.close()
            self.evaluator = None
        if self.learner is not None:
            self.learner.shutdown()
            self.learner = None
        if self.buffer is not None:
            self.buffer.close()
            self.buffer = None
        if self.exporter is not None:
            self.exporter.close()
            self.exporter = None

    # ---------------------------------------------------------------- the loop

    def run(self) -> RunResult:
        started = time.perf_counter()
        cfg = self.cfg
        metric_log = MetricLog(self.run_dir, resume_after_step=self.step if self.resume_from else None)
        progress = _progress(cfg, self.step)
        try:
            if self.resume_from is None and cfg.eval.enabled:
                self._evaluate(metric_log, progress)
            while self.step < cfg.run.steps and not self.stop_requested.is_set():
                record = self._train_step()
                if record is None:  # stop requested while waiting for data
                    break
                if self._eval_due():
                    record.update(self._evaluate(None, progress))
                staleness = record.pop("_staleness")
                metric_log.write(record)
                if self.exporter is not None:
                    self.exporter.record_step(record, version=self.version)  # staleness: from the buffer's stats
                    self.exporter.record_buffer_stats(self.buffer.client.stats())
                    for stats in self.worker_stats(timeout=5.0):
                        self.exporter.record_worker_stats(stats["worker_id"], stats)
                progress.update(1)
                progress.set_postfix_str(_postfix(record, self.evals), refresh=False)
                if cfg.run.checkpoint_every and self.step % cfg.run.checkpoint_every == 0 and self.step < cfg.run.steps:
                    self.save_checkpoint()
            completed = self.step >= cfg.run.steps
            if completed and cfg.eval.enabled and not self.evals_at(self.step):
                metric_log.write({"step": self.step, "version": self.version, **self._evaluate(None, progress)})
            self.save_checkpoint()
        finally:
            progress.close()
            metric_log.close()
        try:
            plot_run(self.run_dir)
        except Exception as exc:  # plots are a convenience; the log is the record
            log.warning("could not draw plots: %s", exc)
        return RunResult(self.run_dir, self.step, self.version, completed, self.stop_requested.is_set(),
                         self.evals, time.perf_counter() - started)

    def _train_step(self) -> dict | None:
        cfg, client = self.cfg, self.buffer.client
        t0 = time.perf_counter()
        batch = None
        while batch is None:
            if self.stop_requested.is_set():
                return None
            self._check_workers()
            batch = client.pull_batch(cfg.batch_size, timeout=1.0)
        t_data = time.perf_counter()
        consumed_at = self.version  # staleness is measured against the version that trains on it
        staleness = [consumed_at - min(_sample_versions(s)) for g in batch.groups for s in g.samples]
        metrics = self.learner.train_step(batch.groups)
        t_train = time.perf_counter()
        self.version = int(metrics.get("learner/version", self.version + 1))
        client.ack(batch.lease_id)
        # The gate learns the version before workers can load it, or their first groups at the
        # new version would be refused as "ahead of the learner" and their work thrown away.
        client.set_version(self.version)
        sync_s = self._publish()
        self.step += 1
        t_end = time.perf_counter()
        tickets = [int(g.prompt_index) for g in batch.groups]
        self.consumed_tickets += tickets
        samples = sum(len(g.samples) for g in batch.groups)
        tokens = sum(len(s.response_ids) for g in batch.groups for s in g.samples)
        record = {
            "step": self.step, "version": self.version, "time": time.time(),
            **{k: v for k, v in metrics.items() if isinstance(v, (int, float))},
            "staleness/max": max(staleness), "staleness/mean": sum(staleness) / len(staleness),
            "buffer/dropped_stale_groups": batch.dropped_stale,
            "timing_s/wait_data": t_data - t0, "timing_s/train": t_train - t_data,
            "timing_s/weight_sync": sync_s, "timing_s/step_total": t_end - t0,
            "throughput/samples_per_s": samples / (t_end - t0), "throughput/tokens_per_s": tokens / (t_end - t0),
            "audit/tickets": tickets, "audit/groups": [g.group_id for g in batch.groups],
            "audit/sample_versions": [s.weight_version for g in batch.groups for s in g.samples],
            "_staleness": staleness,
        }
        return record

    def _check_workers(self) -> None:
        """Restart the loop of a worker that Ray restarted after a crash; a worker that fails more
        often than ray.worker_max_restarts, or returns an error, stops the run loudly. While Ray
        restarts the actor, calls to it fail at once (ActorUnavailableError): those retries are
        not new deaths; the worker counts as back once its loop has run for a few seconds."""
        import ray

        done, pending = ray.wait(self.worker_refs, num_returns=len(self.worker_refs), timeout=0)
        now = time.monotonic()
        for ref in pending:
            index = self.worker_refs.index(ref)
            since = self.worker_resubmitted_at[index]
            if since is not None and now - since > _WORKER_BACK_AFTER_S:
                self.worker_resubmitted_at[index] = None
        for ref in done:
            index = self.worker_refs.index(ref)
            try:
                ray.get(ref)
            except ray.exceptions.RayActorError as exc:
                restarting = self.worker_resubmitted_at[index] is not None
                if not restarting or not isinstance(exc, ray.exceptions.ActorUnavailableError):
                    self.worker_failures[index] += 1
                    if self.worker_failures[index] > self.cfg.ray.worker_max_restarts:
                        raise RuntimeError(f"rollout worker-{index} died {self.worker_failures[index]} times") from exc
                    log.warning("rollout worker-%d died (%s); Ray restarts it, its permits come back", index,
                                type(exc).__name__)
                    if self.exporter is not None:
                        self.exporter.record_worker_restart(f"worker-{index}")
                self.worker_resubmitted_at[index] = now
                self.worker_refs[index] = self.workers[index].run.remote()
                continue
            if not self.stop_requested.is_set():
                raise RuntimeError(f"rollout worker-{index} stopped on its own")

    def worker_stats(self, timeout: float = 30.0) -> list[dict]:
        """Stats of the workers that answer. A dead or restarting worker (Ray restarts it; its
        vLLM engine takes a while) is skipped and shown down, never stopping the run."""
        import ray

        stats = []
        for index, ref in enumerate([w.stats.remote() for w in self.workers]):
            try:
                stats.append(ray.get(ref, timeout=timeout))
            except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
                if self.exporter is not None:
                    self.exporter.record_worker_down(f"worker-{index}")
        return stats

    def evals_at(self, step: int) -> bool:
        return any(e.get("step") == step for e in self.evals)

    def _eval_due(self) -> bool:
        every = self.cfg.run.eval_every
        return self.cfg.eval.enabled and bool(every) and self.step % every == 0

    def _evaluate(self, metric_log: MetricLog | None, progress) -> dict:
        from services.evaluation import PolicyEvaluator

        if self.evaluator is None:
            self.evaluator = PolicyEvaluator.from_config(self.cfg, self.model_dir)
        import ray

        payload = ray.get(self.weight_store.latest.remote())
        metrics = self.evaluator.evaluate_payload(payload)
        self.evals.append({"step": self.step, **metrics})
        progress.write(f"eval @ step {self.step}: " + ", ".join(f"{k[5:]}={v:.3f}" for k, v in metrics.items()
                                                                  if k != "eval/num_prompts"))
        if metric_log is not None:
            metric_log.write({"step": self.step, "version": self.version, **metrics})
        return metrics

    def save_checkpoint(self) -> Path:
        staged = ckpt.staging_dir(self.run_dir, self.step)
        self.learner.save_checkpoint(str(staged))
        snapshot = self.buffer.snapshot()
        if snapshot is not None:
            (staged / BUFFER_STATE_FILE).write_bytes(msgpack.packb(snapshot, use_bin_type=True))
        state = {"step": self.step, "version": self.version, "consumed_tickets": self.consumed_tickets,
                 "evals": self.evals, "buffer_transport": self.cfg.buffer.transport}
        final = ckpt.commit(staged, state, keep=self.cfg.run.keep_checkpoints)
        log.info("checkpoint %s", final)
        return final


def _sample_versions(sample) -> list[int]:
    versions = getattr(sample, "token_versions", None)
    if versions is None or len(versions) == 0:
        return [int(sample.weight_version)]
    return [int(v) for v in versions]


def _progress(cfg: EtarlConfig, initial: int):
    from tqdm import tqdm

    return tqdm(total=cfg.run.steps, initial=initial, desc="etarl", unit="step", disable=not cfg.run.progress,
                dynamic_ncols=True, file=sys.stderr)


def _postfix(record: dict, evals: list[dict]) -> str:
    def fmt(key, name, spec=".3f"):
        value = record.get(key)
        return f"{name}={value:{spec}}" if isinstance(value, (int, float)) and math.isfinite(value) else None

    parts = [f"v={record['version']}", fmt("reward/mean", "reward"), fmt("staleness/mean", "stale", ".2f"),
             fmt("rollout_corr/kl", "kl", ".2e"), fmt("rollout_corr/rollout_is_eff_sample_size", "ess"),
             fmt("throughput/samples_per_s", "samples/s", ".1f")]
    if evals:
        parts.append(f"eval_acc={evals[-1].get('eval/accuracy', float('nan')):.3f}")
    return " ".join(p for p in parts if p)


def run_training(cfg: EtarlConfig, resume: str | os.PathLike | None = None) -> RunResult:
    """Run (or resume) a training run; Ctrl-C stops cleanly after the current step with a
    checkpoint (a second Ctrl-C aborts at once)."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    controller = Controller(cfg, resume)
    previous = None

    def on_sigint(signum, frame):
        if controller.stop_requested.is_set():
            raise KeyboardInterrupt
        log.warning("stopping after the current step (Ctrl-C again to abort)")
        controller.stop_requested.set()

    if threading.current_thread() is threading.main_thread():
        previous = signal.signal(signal.SIGINT, on_sigint)
    try:
        controller.start()
        return controller.run()
    finally:
        controller.stop()
        if previous is not None:
            signal.signal(signal.SIGINT, previous)


def evaluate_model(cfg: EtarlConfig, model: str | None = None, run_dir: str | None = None) -> dict:
    """`etarl eval`: the held-out metrics of a model folder, or of a run's latest checkpoint."""
    from services.evaluation import PolicyEvaluator

    if run_dir is not None:
        folder = ckpt.latest_checkpoint(run_dir) / "policy"
    elif model is not None:
        folder = Path(model)
    else:
        folder = resolve_model(cfg)
    evaluator = PolicyEvaluator.from_config(cfg, folder)
    return evaluator.evaluate_payload(None)
