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

from buffer.errors import BufferUnavailable
from rollout_workers.rewards import reward_metrics
from services import checkpoint as ckpt
from services.config import TINY_MODEL, ConfigError, EtarlConfig, build_config, read_yaml
from services.inputs import check_run_inputs, ray_runtime_env
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


RAY_BUFFER_LOG = "buffer-actor.log"  # the Ray buffer actor's durable log, in the run folder
RAY_BUFFER_STARTS = "buffer-actor.starts"  # one line per start of the actor (its restart count)
_SUPERVISE_EVERY_S = 0.2
_BUFFER_START_TIMEOUT_S = 120.0
_BUFFER_STATE_CALL_S = 600.0  # a checkpoint's snapshot or restore of a full buffer may take a while


class BufferLost(RuntimeError):
    """The run's buffer died and could not be brought back without losing data; the message says
    why and what to change."""


class BufferHandle:
    """The buffer as this run uses it: a client (Ray actor or ZMQ), and for the Ray transport
    the actor itself (snapshot/restore for checkpoints); for ZMQ the supervised service process.

    Both survive a SIGKILL of the buffer's process, up to `buffer.max_restarts` times: Ray
    restarts the actor, a `BufferSupervisor` restarts the service child; either replays its
    durable log and the clients resend what was in flight with the same ids."""

    def __init__(self, cfg: EtarlConfig, run_dir: Path):
        import ray

        self.transport = cfg.buffer.transport
        self.max_restarts = cfg.buffer.max_restarts
        self.run_dir = run_dir
        self.actor = None
        self.supervisor = None
        self._restarts_logged = 0
        service_cfg = cfg.buffer.service_config()
        if self.transport == "ray":
            from services.buffer_actor import RayBufferClient, create_buffer_actor

            starts_file = None
            if self.max_restarts:
                # The log serves this run's restarts only: a new `etarl train` (or a resume, which
                # rebuilds the buffer from its checkpoint) starts it empty; the last one is kept as .prev.
                log_path = run_dir / RAY_BUFFER_LOG
                for leftover in (log_path.with_name(log_path.name + ".compact"),):
                    leftover.unlink(missing_ok=True)
                if log_path.exists():
                    log_path.replace(log_path.with_name(log_path.name + ".prev"))
                service_cfg = service_cfg.model_copy(
                    update={"log": service_cfg.log.model_copy(update={"path": log_path})})
                starts_file = run_dir / RAY_BUFFER_STARTS
            # Pinned to this node: a restarted actor must find its log in the run folder.
            from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

            here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)
            self.actor = create_buffer_actor(service_cfg, max_restarts=self.max_restarts, starts_file=starts_file,
                                             actor_class=_buffer_actor_class(), scheduling_strategy=here)
            self.client = RayBufferClient(self.actor, service_cfg)
        else:
            self.supervisor = BufferSupervisor(service_cfg, run_dir, self.max_restarts)
            self.client = ZmqBufferClient(self.supervisor.config)
            self.supervisor.start()
        self.client.health()

    @property
    def log_path(self) -> Path | None:
        if self.supervisor is not None:
            return self.supervisor.config.log.path
        return self.run_dir / RAY_BUFFER_LOG if self.max_restarts else None

    def restarts(self) -> int:
        """Restarts of the buffer so far (logged once each, as they are first seen)."""
        if self.supervisor is not None:
            return self.supervisor.restarts  # the supervisor logs its own
        count = int(self.client.health().get("restarts", 0))
        if count > self._restarts_logged:
            log.warning("the buffer actor's process died; Ray restarted it (restart %d of buffer.max_restarts=%d) "
                        "and it replayed its log %s: nothing accepted is lost", count, self.max_restarts,
                        self.log_path)
            self._restarts_logged = count
        return count

    def check(self) -> None:
        """Raise BufferLost if the buffer died and cannot come back (the supervisor's verdict)."""
        if self.supervisor is not None and self.supervisor.failure is not None:
            raise BufferLost(self.supervisor.failure)

    def lost(self, exc: BaseException) -> BufferLost:
        """The error that stops the run when the buffer stopped answering (`exc`)."""
        if self.supervisor is not None:
            return BufferLost(self.supervisor.failure or (
                f"the buffer service stopped answering ({exc}) although its process is running "
                f"(restarts so far: {self.supervisor.restarts}); see {self.supervisor.output}"))
        if not self.max_restarts:
            return BufferLost(f"the buffer actor died ({exc}) and buffer.max_restarts=0, so Ray does not restart "
                              f"it: the run stops. Set buffer.max_restarts > 0 to let it come back from its log "
                              f"in the run folder, or resume from the last checkpoint: etarl train --resume "
                              f"{self.run_dir}")
        return BufferLost(f"the buffer actor stopped answering ({exc}) after {self._restarts_logged} restart(s) "
                          f"(buffer.max_restarts={self.max_restarts} allows no more): the run stops. Resume from "
                          f"the last checkpoint: etarl train --resume {self.run_dir}")

    def snapshot(self) -> dict | None:
        return self.client.call("snapshot", wait=_BUFFER_STATE_CALL_S) if self.actor is not None else None

    def restore(self, records: list[dict]) -> dict:
        if self.actor is None:
            raise ConfigError("this checkpoint holds the buffer of a buffer.transport=ray run; resume it with "
                              "buffer.transport=ray")
        return self.client.call("restore", records, wait=_BUFFER_STATE_CALL_S)

    def close(self) -> None:
        import ray

        if self.actor is not None:
            try:
                ray.get(self.actor.shutdown.remote(), timeout=10)
            except Exception:  # the actor may be gone with Ray already
                pass
            ray.kill(self.actor)  # no_restart: a deliberate end is not a death to recover from
        if self.supervisor is not None:
            self.supervisor.stop()


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


class BufferSupervisor:
    """The standalone buffer service (`python -m buffer serve`, through `services.buffer_child`)
    as a child process, kept alive.

    A thread polls the child; when it exits (SIGKILL, crash) it is started again on the same
    config, port and durable log, which it replays; the run's clients resend what was in flight.
    Each restart is counted and logged. It gives up, setting `failure` (the controller then stops
    the run), when the service has no durable log (a restart would come back empty, losing the
    groups it had accepted), or after `max_restarts` restarts."""

    def __init__(self, config, run_dir: Path, max_restarts: int):
        if config.port == 0:  # a restart must come back where the clients look
            import socket

            with socket.socket() as s:
                s.bind((config.host, 0))
                config = config.model_copy(update={"port": s.getsockname()[1]})
        self.config = config
        self.max_restarts = max_restarts
        self.config_file = run_dir / "buffer.yaml"
        self.config_file.write_text(yaml.safe_dump({"buffer": config.model_dump(mode="json")}))
        self.output = run_dir / "buffer.out"
        self.process: subprocess.Popen | None = None
        self.restarts = 0
        self.failure: str | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="buffer-supervisor", daemon=True)

    def start(self) -> None:
        self.process = self._spawn()
        if not self._wait_ready(self.process):
            code = self.process.poll()
            self.process.kill()
            raise RuntimeError(f"the buffer service did not start (exit code {code}); see {self.output}")
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=_BUFFER_START_TIMEOUT_S + 10)
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()

    def _spawn(self) -> subprocess.Popen:
        # Its own session: a Ctrl-C in the terminal stops the run after its step (which still needs
        # the buffer), not the buffer; the controller stops it last. services.buffer_child ends it
        # if the controller dies first (no orphan holding the port and writing the log).
        from services.buffer_child import PARENT_ENV

        env = {**os.environ, PARENT_ENV: str(os.getpid())}
        with open(self.output, "ab") as out:
            return subprocess.Popen([sys.executable, "-m", "services.buffer_child", "serve", "--config",
                                     str(self.config_file)], stdout=out, stderr=subprocess.STDOUT,
                                    start_new_session=True, env=env)

    def _wait_ready(self, process: subprocess.Popen) -> bool:
        """Whether the service answers a health check before it exits or the start-up time runs out."""
        from buffer.client import BufferClient
        from buffer.config import ClientConfig

        probe = BufferClient.from_config(self.config)
        probe.settings = ClientConfig(request_timeout_s=1.0, retries=0)
        deadline = time.monotonic() + _BUFFER_START_TIMEOUT_S
        try:
            while time.monotonic() < deadline and not self._stop.is_set():
                if process.poll() is not None:
                    return False
                try:
                    probe.health()
                    return True
                except Exception:
                    time.sleep(0.2)
            return False
        finally:
            probe.close()

    def _watch(self) -> None:
        while not self._stop.wait(_SUPERVISE_EVERY_S):
            code = self.process.poll()
            if code is None or self._stop.is_set():
                continue
            what = f"the buffer service (pid {self.process.pid}) exited with code {code}"
            if self.config.log.path is None:
                self.failure = (f"{what}, and it has no durable log (buffer.log.path is unset): a restart would "
                                f"lose every group it had accepted, so the run stops. Set buffer.log.path (e.g. "
                                f"buffer.log.path={self.output.parent / 'buffer.log'}) to let the controller "
                                f"restart it from its log")
            elif self.restarts >= self.max_restarts:
                self.failure = (f"{what} after {self.restarts} restart(s); buffer.max_restarts={self.max_restarts} "
                                f"allows no more, so the run stops (see {self.output}). Its log "
                                f"{self.config.log.path} holds everything it accepted")
            if self.failure is not None:
                log.error("%s", self.failure)
                return
            self.restarts += 1
            log.warning("%s; restarting it on %s from its log %s (restart %d of buffer.max_restarts=%d)", what,
                        self.config.endpoint, self.config.log.path, self.restarts, self.max_restarts)
            self.process = self._spawn()
            if self._wait_ready(self.process):
                log.warning("the buffer service is back (pid %d) after replaying its log", self.process.pid)
            elif self.process.poll() is None and not self._stop.is_set():
                self.process.kill()  # never answered: counts as another death on the next poll
                self.process.wait()


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
                       runtime_env=ray_runtime_env(cfg, env))
    else:
        # Inside a cluster (or a `ray job submit` job) the job's runtime environment applies (plus the
        # reward's module when it must travel).
        ray.init(address=cfg.ray.address, namespace=cfg.ray.namespace, log_to_driver=cfg.ray.log_to_driver,
                 runtime_env=ray_runtime_env(cfg))


class Controller:
    def __init__(self, cfg: EtarlConfig, resume: str | os.PathLike | None = None):
        self.cfg = cfg
        if resume and cfg.buffer.transport == "zmq":
            # The service's log has moved on since the checkpoint (batches trained on after it are
            # acked there, later weights' groups are held), and `recover` would reissue the tickets
            # of the groups it holds: resuming would lose some groups and repeat others.
            raise ConfigError("resuming a run with buffer.transport=zmq is not supported: its checkpoints hold no "
                              "buffer state, and the buffer service's log has moved on since the checkpoint "
                              "(resuming would lose and repeat groups). Resume runs with buffer.transport=ray, "
                              "whose checkpoints hold the buffer, or start a new run")
        self.resume_from = ckpt.latest_checkpoint(resume) if resume else None
        run_dir = cfg.run.run_dir or f"runs/{time.strftime('%Y%m%d-%H%M%S')}"
        self.run_dir = Path(run_dir).resolve()
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.stop_requested = threading.Event()
        self.step = 0
        self.version = 0
        self.consumed_tickets: list[int] = []  # the audit: every ticket trained on, in order
        self.next_batch = None  # leased by the last step's end, trained on by the next step
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
        check_run_inputs(cfg, self.model_dir)
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
        else:
            raise ConfigError(f"checkpoint {checkpoint} holds no buffer state ({BUFFER_STATE_FILE})")
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
            self._train_loop(metric_log, progress)
            self._give_back_next_batch()
            completed = self.step >= cfg.run.steps
            if completed and cfg.eval.enabled and not self.evals_at(self.step):
                metric_log.write({"step": self.step, "version": self.version, **self._evaluate(None, progress)})
            self.save_checkpoint()
        except BufferUnavailable as exc:  # a client gave up: say why the buffer is gone and what to do
            lost = self.buffer.lost(exc)
            if self.buffer.supervisor is None:  # the supervisor logged its own verdict
                log.error("%s", lost)
            raise lost from exc
        finally:
            progress.close()
            metric_log.close()
        try:
            plot_run(self.run_dir)
        except Exception as exc:  # plots are a convenience; the log is the record
            log.warning("could not draw plots: %s", exc)
        return RunResult(self.run_dir, self.step, self.version, completed, self.stop_requested.is_set(),
                         self.evals, time.perf_counter() - started)

    def _train_loop(self, metric_log: MetricLog, progress) -> None:
        cfg = self.cfg
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
                self.exporter.record_buffer_stats({**self.buffer.client.stats(), "restarts": record["buffer/restarts"]})
                for stats in self.worker_stats(timeout=5.0):
                    self.exporter.record_worker_stats(stats["worker_id"], stats)
            progress.update(1)
            progress.set_postfix_str(_postfix(record, self.evals), refresh=False)
            if cfg.run.checkpoint_every and self.step % cfg.run.checkpoint_every == 0 and self.step < cfg.run.steps:
                self.save_checkpoint()

    def _train_step(self) -> dict | None:
        cfg, client = self.cfg, self.buffer.client
        t0 = time.perf_counter()
        batch, self.next_batch = self.next_batch, None
        while True:
            if self.stop_requested.is_set():
                self.next_batch = batch  # given back when the loop ends
                return None
            self.buffer.check()
            self._check_workers()
            if batch is not None:
                break
            batch = client.pull_batch(cfg.batch_size, timeout=1.0)
        t_data = time.perf_counter()
        consumed_at = self.version  # staleness is measured against the version that trains on it
        staleness = [consumed_at - min(_sample_versions(s)) for g in batch.groups for s in g.samples]
        metrics = self.learner.train_step(batch.groups)
        t_train = time.perf_counter()
        self.version = int(metrics.get("learner/version", self.version + 1))
        self.next_batch = self._end_step(batch)
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
            "buffer/dropped_stale_groups": batch.dropped_stale, "buffer/restarts": self.buffer.restarts(),
            "timing_s/wait_data": t_data - t0, "timing_s/train": t_train - t_data,
            "timing_s/weight_sync": sync_s, "timing_s/step_total": t_end - t0,
            "throughput/samples_per_s": samples / (t_end - t0), "throughput/tokens_per_s": tokens / (t_end - t0),
            "audit/tickets": tickets, "audit/groups": [g.group_id for g in batch.groups],
            "audit/sample_versions": [s.weight_version for g in batch.groups for s in g.samples],
            **reward_metrics(batch.groups),
            "_staleness": staleness,
        }
        return record

    def _end_step(self, batch):
        """One request: the batch is consumed, the gate learns the new version, and the next batch
        is leased if one is ready (else the next step waits for it). The version goes to the gate
        before the weights are published, or the workers' first groups at it would be refused as
        "ahead of the learner". A batch leased here across an evaluation or a checkpoint is safe:
        a checkpoint counts leased groups as not yet consumed, and a lease that expires meanwhile
        can still be acked, as no one else pulls."""
        client = self.buffer.client
        if self.step + 1 >= self.cfg.run.steps or self.stop_requested.is_set():
            client.ack(batch.lease_id, version=self.version)
            return None
        return client.pull_batch(self.cfg.batch_size, ack_lease_id=batch.lease_id, version=self.version)

    def _give_back_next_batch(self) -> None:
        """A batch leased for a step that will not run (stopped) goes back to the buffer."""
        if self.next_batch is not None:
            self.buffer.client.nack(self.next_batch.lease_id)
            self.next_batch = None

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
            except Exception as exc:
                cause = getattr(exc, "cause", exc)  # a RayTaskError carries the worker's exception
                if isinstance(cause, BufferUnavailable):  # the run stops on the buffer's account
                    raise BufferUnavailable(f"rollout worker-{index}: {cause}") from exc
                raise
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
