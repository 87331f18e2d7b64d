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

import contextlib
import logging
import math
import os
import signal
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import msgpack
import numpy as np

from buffer.core import with_failures
from buffer.errors import BufferUnavailable
from rollout_workers.agent_loop import ENV_ERROR, multi_turn_metrics
from rollout_workers.data import InvalidPrompts
from rollout_workers.rewards import REWARD_ERROR, reward_metrics
from services import checkpoint as ckpt
from services.buffer_handle import BufferHandle
from services.config import (TINY_MOE_MODEL, ConfigError, EtarlConfig, build_config, fill_sample_limits,
                             is_builtin_model, read_yaml, with_absolute_paths)
from services.inputs import check_resume_settings, check_run_inputs, with_epochs
from services.learner_failures import LearnerFailures
from services.placement import Placement, check_plan_before_start, start_ray
from services.plots import MetricLog, plot_run
from services.weights import WeightPublisher
from services.worker_pool import WorkerPool

log = logging.getLogger("etarl")

BUFFER_STATE_FILE = "buffer.msgpack"
EVAL_FINAL_WAIT_S = 900.0  # the evaluations still out when training ends: a worker stuck longer loses them
CONFIG_FILE = "config.yaml"
FAILURE_WARNING_EVERY_STEPS = 50  # how often a run whose reward or environment keeps failing says so again
# The step record's share of samples that scored a failure, the metadata key that says why, and what failed.
FAILURE_KINDS = (
    ("reward/failure_fraction", REWARD_ERROR, "the reward failed on {:.0%} of the batch's samples"),
    ("multi_turn/env_failure_fraction", ENV_ERROR, "the environment failed on {:.0%} of the batch's trajectories"),
)


class StartInterrupted(Exception):
    """Ctrl-C while the run was starting: nothing more is started, nothing was trained."""


class UnconfirmedAck(Exception):
    """A step trained on its batch, then the request that acks it failed (its __cause__): the buffer
    may or may not have logged the ack. `record` is the step's log record, marked so (the audit
    then counts its groups as consumed, whether the buffer still holds them or not)."""

    def __init__(self, record: dict):
        super().__init__("the buffer failed with the step's ack in flight")
        self.record = record


@dataclass
class RunResult:
    run_dir: Path
    steps_done: int
    version: int
    completed: bool
    interrupted: bool
    evals: list[dict] = field(default_factory=list)
    seconds: float = 0.0
    gpu_memory_gib: dict[str, float] = field(default_factory=dict)  # each role's peak reserved; {} on CPUs

    def summary(self) -> dict:
        first = self.evals[0] if self.evals else {}
        last = self.evals[-1] if self.evals else {}
        return {"run_dir": str(self.run_dir), "steps": self.steps_done, "version": self.version,
                "completed": self.completed, "interrupted": self.interrupted,
                "seconds": round(self.seconds, 1),
                "eval_accuracy_first": first.get("eval/accuracy"), "eval_accuracy_last": last.get("eval/accuracy"),
                **({"gpu_memory_gib": self.gpu_memory_gib} if self.gpu_memory_gib else {})}


def resolve_model(cfg: EtarlConfig) -> Path:
    """run.model as an HF folder; `tiny` (`tiny-moe`) builds (once, cached) the warm-started tiny model
    (as a mixture of experts)."""
    from lm.causal_lm import check_model_dir

    if is_builtin_model(cfg.run.model):
        from rollout_workers.tiny_model import ensure_tiny_model

        spec = cfg.run.tiny_model.moe() if cfg.run.model == TINY_MOE_MODEL else cfg.run.tiny_model
        return ensure_tiny_model(Path(cfg.run.cache_dir) / "tiny-model", spec, log=log.info)
    try:
        return check_model_dir(cfg.run.model)
    except FileNotFoundError as exc:
        raise ConfigError(f"run.model: {exc}") from None


RUN_ROOT_ENV = "ETARL_RUN_ROOT"  # where run folders go by default on a cluster: shared by every node


def default_run_dir(cfg: EtarlConfig) -> str:
    """run.run_dir when unset: runs/<time> here for a local run; on a cluster (ray.address not
    local, as under `ray job submit`) under $ETARL_RUN_ROOT, a folder every node mounts at the same
    path (deploy/ray/submit.sh and the KubeRay manifests set it); unset there, the run stops now:
    a folder of the driver's own would leave checkpoints on whichever node the learner runs."""
    stamp = time.strftime("%Y%m%d-%H%M%S")
    if cfg.ray.address == "local":
        return f"runs/{stamp}"
    root = os.environ.get(RUN_ROOT_ENV)
    if not root:
        raise ConfigError(f"run.run_dir is unset and the run joins a cluster (ray.address={cfg.ray.address}): set "
                          f"run.run_dir, or {RUN_ROOT_ENV}, to a folder every node mounts at the same path (a "
                          "shared file system; docs/deploy.md, section 3)")
    return str(Path(root) / stamp)


def resume_config(run_dir: str | os.PathLike, config_file: str | None, overrides: list[str]) -> EtarlConfig:
    """The saved config of a run (or `config_file`), with overrides (e.g. run.steps=80)."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise ConfigError(f"run folder {str(run_dir)!r} does not exist")
    source = Path(config_file) if config_file else run_dir / CONFIG_FILE
    if not source.exists() and not config_file:
        raise ConfigError(f"{str(run_dir)!r} is not a run folder: it has no {CONFIG_FILE} (a run writes one "
                          "when it starts)")
    tree = read_yaml(source)
    tree.setdefault("run", {})["run_dir"] = str(run_dir)
    return build_config(tree, overrides, source=str(source))


class Controller:
    def __init__(self, cfg: EtarlConfig, resume: str | os.PathLike | None = None):
        self.cfg = cfg = with_absolute_paths(cfg)  # the saved config.yaml is read again from any folder
        self.resume_from = ckpt.latest_checkpoint(resume) if resume else None
        self.run_dir = Path(cfg.run.run_dir or default_run_dir(cfg)).resolve()
        earlier = [] if self.resume_from else ckpt.list_checkpoints(self.run_dir)
        if earlier:  # a second run in one folder would mix its checkpoints and metrics with the first's
            raise ConfigError(f"run.run_dir {self.run_dir} already holds a run (checkpoints up to {earlier[-1].name}): "
                              f"continue it with `etarl train --resume {self.run_dir}`, or give run.run_dir a new "
                              "folder")
        self._made_run_dir = not self.run_dir.exists()  # removed by stop() if the run wrote nothing to it
        try:
            self.run_dir.mkdir(parents=True, exist_ok=True)
        except OSError as exc:  # a read-only mount, a path through a file: said before anything starts
            raise ConfigError(f"run.run_dir {self.run_dir}: cannot create the run folder ({exc.strerror or exc})"
                              ) from None
        self.stop_requested = threading.Event()
        self.step = 0
        self.version = 0
        self.consumed_tickets: list[int] = []  # the audit: every ticket trained on, in order
        self.next_batch = None  # leased by the last step's end, trained on by the next step
        self.evals: list[dict] = []
        self._last_record: dict = {}  # the last step's metrics (the summary's GPU memory)
        self._warned_at_step: dict[str, int] = {}  # the console's failure warnings, by the record key they read
        self._quarantines_said = 0  # rollout/quarantined as last said on the console
        self._started = False
        self.buffer = self.learner = self.weights = self.evaluations = self.exporter = self.workers = None
        self.trackers = None  # W&B / TensorBoard (metrics.trackers)
        self.failed = False  # the run raised: a W&B run is marked failed
        self.placement = None
        self.eta_control = None  # buffer.gate.eta: auto

    # ---------------------------------------------------------------- start and stop

    def start(self) -> None:
        """Check the run's inputs and its placement plan (a run that cannot start stops here,
        before Ray or any actor starts), reserve the plan, then start the buffer, the weight
        store, the learner ranks and the workers, each with the resources the plan gives it
        (services/placement.py)."""
        cfg = self.cfg
        check_plan_before_start(cfg)
        self.model_dir = resolve_model(cfg)
        self.learner_failures = LearnerFailures(self.run_dir)
        self.learner_failures.recover()  # a batch the last process died on counts a failed delivery
        fill_sample_limits(cfg, self.model_dir)  # vocabulary and context: the buffer refuses what the model cannot take
        train_prompts = check_run_inputs(cfg, self.model_dir)
        self._stop_if_asked()
        restore = None  # a resumed buffer starts from the checkpoint's (BufferHandle)
        if self.resume_from is not None:
            check_resume_settings(cfg, self.resume_from)
            restore = self._checkpoint_buffer(self.resume_from)
        if cfg.run.epochs is not None:  # the steps, now that the usable prompts are counted
            self.cfg = cfg = with_epochs(cfg, train_prompts)
        if cfg.metrics.trackers:  # W&B's key before Ray starts (the trackers open once the layout is chosen)
            from services.trackers import check_trackers

            check_trackers(cfg.metrics.trackers)
        self._stop_if_asked()
        plan = start_ray(cfg)
        self._stop_if_asked()
        self.cfg = cfg = plan.config  # with the layout chosen for the GPUs found (services/placement.py)
        from services.shared_paths import check_shared_paths, run_paths

        check_shared_paths(self.run_dir, run_paths(cfg, self.model_dir))  # before any actor: a node that
        # sees another folder would fail the run at its first checkpoint
        if self.resume_from is None:  # a resume writes it once restored: a refused one leaves the run's as it was
            self._write_config()
        self._open_trackers()  # before any actor: a tracker that cannot start stops the run here
        self.placement = Placement(plan, cfg.ray.placement_timeout_s)
        from learner.distributed import LearnerGroup

        learner_cfg = cfg.learner_for_run(self.model_dir)
        self.buffer = BufferHandle(cfg, self.run_dir, restore)
        self.weights = WeightPublisher(cfg.rollout.num_workers)
        self._start_exporter()
        self.workers = WorkerPool(cfg, self.model_dir, self.buffer.worker_client, self.weights.store,
                                  self.stop_requested, self.placement.all_options("rollout"), self.exporter)
        if not plan.engines_share_gpus_with_learner():
            # engines load while the learner does; on a shared GPU after it, as vLLM sizes its
            # memory from what it finds free
            self.workers.prepare()
        self._stop_if_asked()
        self.learner = LearnerGroup(learner_cfg, rank_options=self.placement.all_options("learner"))
        self._stop_if_asked()
        state = None
        if self.resume_from is not None:
            state = self._restore(self.resume_from)
            self._write_config()
        if state is None:
            self.buffer.client.set_version(self.version)
        self._start_eta_control()
        self.weights.publish(self.learner)
        self.workers.start()  # their loops: permits and weights only now, after a restore
        if cfg.eval.enabled:  # on the workers' engines, between their requests (services/evaluation.py)
            from services.evaluation import WorkerEvaluations

            self.evaluations = WorkerEvaluations(cfg, self.workers.workers)
        self._started = True

    def resumed_complete(self) -> RunResult | None:
        """A resume of a run whose last checkpoint has its run.steps already: its result, said and
        returned before anything starts (a job that is restarted after it ended ends again, at once)."""
        if self.resume_from is None or self.cfg.run.epochs is not None:  # epochs: the steps are counted at start
            return None
        try:
            state = ckpt.read_state(self.resume_from)
        except (ValueError, FileNotFoundError):  # the resume's own checks say what is wrong with it
            return None
        if int(state["step"]) < self.cfg.run.steps:
            return None
        log.warning("%s is complete: its last checkpoint is at step %d and run.steps=%d, so there is nothing to "
                    "train (to go on, name more: etarl train --resume %s run.steps=N)", self.run_dir, state["step"],
                    self.cfg.run.steps, self.run_dir)
        return RunResult(self.run_dir, int(state["step"]), int(state["version"]), completed=True, interrupted=False,
                         evals=list(state.get("evals", [])))

    def _stop_if_asked(self) -> None:
        """A Ctrl-C during the start ends it between its stages (each takes seconds, the learner's
        and the engines' minutes at real size), instead of starting everything to stop at once."""
        if self.stop_requested.is_set():
            raise StartInterrupted

    def _write_config(self) -> None:
        (self.run_dir / CONFIG_FILE).write_text(self.cfg.to_yaml())

    def _start_eta_control(self) -> None:
        gate = self.cfg.buffer.gate
        if gate.adaptive:  # starts at the gate's η (eta_min, or the η a resumed run had)
            from buffer.eta_control import EtaController

            self.eta_control = EtaController(gate.drift_budget, gate.eta_min, gate.eta_max,
                                             eta=int(self.buffer.client.stats()["eta"]))

    def _restore(self, checkpoint: Path) -> dict:
        state = ckpt.read_state(checkpoint)
        self.learner.load_checkpoint(str(checkpoint))
        self.version = self.learner.version
        if self.version != state["version"]:
            raise RuntimeError(f"checkpoint {checkpoint}: learner version {self.version} != state {state['version']}")
        self.step = int(state["step"])
        self.consumed_tickets = list(state["consumed_tickets"])
        self.evals = list(state.get("evals", []))
        log.info("resumed from %s: step %d, version %d, buffer %s", checkpoint, self.step, self.version,
                 self.buffer.restored)
        return state

    def _checkpoint_buffer(self, checkpoint: Path) -> list[dict]:
        """The checkpoint's buffer records, with the failed deliveries of batches the learner died
        on after it (`services.learner_failures`): what the resumed buffer starts from, not its log,
        which went on after the checkpoint (batches trained on after it acked, later groups held)."""
        buffer_file = checkpoint / BUFFER_STATE_FILE
        if not buffer_file.is_file():  # zmq runs' checkpoints held none before 2026-12-03
            raise ConfigError(f"checkpoint {checkpoint} holds no buffer state ({BUFFER_STATE_FILE}): it cannot be "
                              "resumed without losing or repeating groups; start a new run from its policy/ folder "
                              "(run.model)")
        return with_failures(msgpack.unpackb(buffer_file.read_bytes(), raw=False), self.learner_failures.counts)

    def _open_trackers(self) -> None:
        metrics = self.cfg.metrics
        if not metrics.trackers:
            return
        from services.trackers import open_trackers

        resumed_at = int(ckpt.read_state(self.resume_from)["step"]) if self.resume_from is not None else None
        self.trackers = open_trackers(metrics.trackers, self.run_dir, metrics.project, metrics.experiment,
                                      self.cfg.model_dump(mode="json"), resumed_at)

    def _start_exporter(self) -> None:
        if self.cfg.metrics.port is None:
            return
        from services.metrics import MetricsExporter

        self.exporter = MetricsExporter(self.cfg.metrics.port, self.cfg.metrics.host)
        log.info("Prometheus metrics on http://%s:%d/metrics", self.cfg.metrics.host, self.exporter.port)

    def stop(self) -> None:
        if self.workers is not None:
            if self.buffer is not None and self.buffer.gone():
                # A worker ends its loop by handing its permits back, which a buffer gone for good
                # cannot take: it is not waited for (it would wait out its client's timeouts).
                self.workers.stop(grace_s=0.0)
            else:
                self.workers.stop()
            self.workers = None
        self.evaluations = None  # an evaluation in flight ends with its worker
        if self.learner is not None:
            self.learner.shutdown()
            self.learner = None
        if self.buffer is not None:
            self.buffer.close()
            self.buffer = None
        if self.exporter is not None:
            self.exporter.close()
            self.exporter = None
        if self.placement is not None:
            self.placement.release()
            self.placement = None
        if self.trackers is not None:
            self.trackers.close(failed=self.failed)
            self.trackers = None
        if self._made_run_dir:
            try:
                self.run_dir.rmdir()  # a run refused before it wrote anything leaves no empty folder
            except OSError:
                pass  # not empty: the run's record stays

    # ---------------------------------------------------------------- the loop

    def run(self) -> RunResult:
        started = time.perf_counter()
        cfg = self.cfg
        first_step = self.step
        metric_log = MetricLog(self.run_dir, resume_after_step=self.step if self.resume_from else None,
                               trackers=self.trackers)
        with _logs_above_the_bar():  # log lines above the progress bar, not inside it
            progress = _progress(cfg, self.step)
            try:
                if self.resume_from is None and cfg.eval.enabled:
                    self.evaluations.request(self.step, self.version)
                if cfg.run.wait_for_workers_s:
                    self._wait_for_workers(cfg.run.wait_for_workers_s)
                self._train_loop(metric_log, progress)
                self._give_back_next_batch()
                completed = self.step >= cfg.run.steps
                if cfg.eval.enabled:
                    if completed and not self.evals_at(self.step) and not self.evaluations.asked(self.step):
                        self.evaluations.request(self.step, self.version)
                    self._report_evals(metric_log, progress, timeout=EVAL_FINAL_WAIT_S)  # the run's last word waits
                if self.step > first_step:  # else the policy is the one the run started from
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
                         self.evals, time.perf_counter() - started, self._gpu_memory_peaks())

    def _wait_for_workers(self, timeout_s: float) -> None:
        log.info("waiting up to %.0f s for %d rollout workers' engines", timeout_s, self.cfg.rollout.num_workers)
        missing = self.workers.wait_until_joined(timeout_s)
        if missing and not self.stop_requested.is_set():  # a slow engine must not hold the run for good
            log.warning("starting without %s: not up after run.wait_for_workers_s=%.0f s; they join when they are",
                        ", ".join(missing), timeout_s)

    def _gpu_memory_peaks(self) -> dict[str, float]:
        """Each role's peak GPU memory reserved (GiB): the learner's (rank 0's) and each worker's
        in-process engine's; {} where the learner is on the CPU (nothing is asked then)."""
        learner = self._last_record.get("perf/max_memory_reserved_gb")
        if learner is None:
            return {}
        peaks = {"learner": round(learner, 2)}
        for stats in self.workers.stats(timeout=5.0):
            if "gpu_max_memory_reserved_bytes" in stats:
                peaks[stats["worker_id"]] = round(stats["gpu_max_memory_reserved_bytes"] / 2**30, 2)
        return peaks

    def _train_loop(self, metric_log: MetricLog, progress) -> None:
        cfg = self.cfg
        while self.step < cfg.run.steps and not self.stop_requested.is_set():
            try:
                record = self._train_step()
            except UnconfirmedAck as trained:  # the step's record first: its groups were trained on
                metric_log.write(trained.record)
                raise trained.__cause__ from None
            if record is None:  # stop requested while waiting for data
                break
            self._last_record = record
            if self._eval_due():  # asked now, reported when it comes (the learner does not wait for it)
                self.evaluations.request(self.step, self.version)
            metric_log.write(record)
            if self.evaluations is not None:
                self._report_evals(metric_log, progress)
            if self.exporter is not None:
                self.exporter.record_step(record, version=self.version)  # staleness: from the buffer's stats
                self.exporter.record_buffer_stats({**self.buffer.client.stats(), "restarts": record["buffer/restarts"]})
                for stats in self.workers.stats(timeout=5.0):
                    self.exporter.record_worker_stats(stats["worker_id"], stats)
            progress.set_postfix_str(_postfix(record, self.evals), refresh=False)  # drawn with the step's count
            progress.update(1)
            if cfg.run.checkpoint_every and self.step % cfg.run.checkpoint_every == 0 and self.step < cfg.run.steps:
                self.save_checkpoint()

    def _train_step(self) -> dict | None:
        cfg, client = self.cfg, self.buffer.client
        t0 = time.perf_counter()
        batch, self.next_batch = self.next_batch, None
        pushed_then, reports = None, 0  # groups pushed when this step's wait began (or was last reported)
        while True:
            if self.stop_requested.is_set():
                self.next_batch = batch  # given back when the loop ends
                return None
            self.buffer.check()
            self.workers.check()
            if batch is None:
                batch = client.pull_batch(cfg.batch_size, timeout=1.0)
                if batch is None and cfg.run.stall_report_s:
                    if pushed_then is None:  # the first empty pull of the step: its wait begins
                        pushed_then = client.stats()["pushed_groups"]
                    waited = time.perf_counter() - t0
                    if waited >= cfg.run.stall_report_s * (reports + 1):
                        pushed_then = self._report_wait(waited, pushed_then, reports)
                        reports += 1
                continue
            t_data = time.perf_counter()
            consumed_at = self.version  # staleness is measured against the version that trains on it
            staleness = [consumed_at - min(_policy_versions(s)) for g in batch.groups for s in g.samples]
            metrics = self._train_or_hand_back(batch)
            if metrics is not None:
                break
            batch = None  # refused and handed back: the next pull (the buffer drops it once poisoned)
        t_train = time.perf_counter()
        self.version = int(metrics.get("learner/version", self.version + 1))
        eta_gauges = self._adapt_eta(metrics)  # before the next pull: it drops what the new η rules out
        ack_error = None
        try:
            self.next_batch = self._end_step(batch)
        except Exception as error:  # noqa: BLE001 - raised again below, once the step's record is made
            ack_error = error
        sync = self.weights.publish(self.learner) if ack_error is None else {}  # goes out while the next step runs
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
            "buffer/restarts": (  # a failed buffer is not asked
                self.buffer.restarts() if ack_error is None else self._last_record.get("buffer/restarts", 0)),
            "rollout/quarantined": batch.prompts_quarantined, "rollout/filtered": batch.groups_filtered,
            "timing_s/wait_data": t_data - t0, "timing_s/train": t_train - t_data,
            **sync, "timing_s/step_total": t_end - t0,
            "throughput/samples_per_s": samples / (t_end - t0), "throughput/tokens_per_s": tokens / (t_end - t0),
            "audit/tickets": tickets, "audit/groups": [g.group_id for g in batch.groups],
            "audit/sample_versions": [s.weight_version for g in batch.groups for s in g.samples],
            **reward_metrics(batch.groups), **multi_turn_metrics(batch.groups), **eta_gauges,
        }
        if ack_error is not None:  # trained on, then the buffer failed with the ack in flight (logged or not)
            raise UnconfirmedAck({**record, "audit/ack_unconfirmed": True}) from ack_error
        self._warn_of_failures(batch, record)
        self._warn_of_quarantines(record)
        return record

    def _warn_of_failures(self, batch, record: dict) -> None:
        """A reward or an environment that raises, hangs or returns garbage scores a failure and the
        run goes on; the workers' logs, which say so, are not on this console: say it here, at the
        first step that has such samples and every FAILURE_WARNING_EVERY_STEPS steps while it goes on."""
        for share_key, error_key, what in FAILURE_KINDS:
            if not record.get(share_key, 0.0) or not self._warning_due(share_key):
                continue
            share = record[share_key]
            why = next((s.metadata[error_key] for g in batch.groups for s in g.samples if error_key in s.metadata),
                       "(no message)")
            log.warning("step %d: %s, which count as failures (%s in the metrics); e.g. %s", self.step,
                        what.format(share), share_key, why)

    def _warning_due(self, key: str) -> bool:
        """Whether a console warning about `key` may be said now (the first, or the last one is at
        least FAILURE_WARNING_EVERY_STEPS steps old); if so, it counts as said at this step."""
        last = self._warned_at_step.get(key)
        if last is not None and self.step - last < FAILURE_WARNING_EVERY_STEPS:
            return False
        self._warned_at_step[key] = self.step
        return True

    def _report_wait(self, waited_s: float, pushed_before: int, reports: int) -> int:
        """What a step that has waited `waited_s` for its batch is waiting on (run.stall_report_s):
        the buffer's counts, and whether any group came in since the wait began or the last of its
        `reports` (`pushed_before` groups pushed then; the count now is returned). A wait that said
        nothing looked like a hang."""
        stats = self.buffer.client.stats()
        pushed = int(stats["pushed_groups"])
        state = (f"{stats['groups_ready']} of the {self.cfg.batch_size} groups it takes are ready, {stats['running']} "
                 f"generation(s) running; {stats['prompts_quarantined']} prompt(s) quarantined and "
                 f"{stats['groups_filtered']} group(s) filtered so far")
        if pushed == pushed_before:
            log.warning("step %d has waited %.0f s for its batch and no group came in since %s: %s. The rollout "
                        "workers' logs say what their engines are doing (a first step also waits for them to start)",
                        self.step + 1, waited_s, "the last report" if reports else "it began", state)
        else:
            log.info("step %d has waited %.0f s for its batch; %d group(s) came in meanwhile: %s", self.step + 1,
                     waited_s, pushed - pushed_before, state)
        return pushed

    def _warn_of_quarantines(self, record: dict) -> None:
        """A prompt that fails generation on its own is quarantined (never reissued) and the run goes
        on; the worker that set it aside says why in its log, not on this console: say it here when
        the count rises, at most every FAILURE_WARNING_EVERY_STEPS steps, with the workers' last one."""
        count = int(record.get("rollout/quarantined", 0))
        if count <= self._quarantines_said or not self._warning_due("rollout/quarantined"):
            return
        self._quarantines_said = count
        last = [f"{s['worker_id']}: {s['last_quarantine']}" for s in self.workers.stats(timeout=5.0)
                if s.get("last_quarantine")]
        log.warning("%d prompt(s) quarantined so far: each failed generation on its own and is never reissued "
                    "(rollout/quarantined in the metrics); the last: %s", count,
                    "; ".join(last) or "(not this process's workers': their logs name each one)")

    def _train_or_hand_back(self, batch) -> dict | None:
        """The learner's step on `batch`. Whatever fails, the batch goes back to the buffer (nack:
        a delivery that ended without an ack, counted per group). A batch the learner refuses
        (`BatchError`, naming the sample) returns None and the run goes on: pulled again and
        refused again, the buffer drops it as poisoned at `buffer.max_deliveries`. Any other failure
        (the learner died) stops the run, as before; the run folder remembers the batch
        (services/learner_failures.py), so resumes drop it at `max_deliveries` instead of dying on
        it every time."""
        from learner.batch import BatchError

        self.learner_failures.training([g.group_id for g in batch.groups])  # still there if this process dies
        try:
            metrics = self.learner.train_step(batch.groups)
            self.learner_failures.trained()
            return metrics
        except Exception as exc:
            refused = isinstance(exc, BatchError) or isinstance(getattr(exc, "cause", None), BatchError)
            if refused:
                self.learner_failures.trained()  # the nack below counts it in the buffer
            try:
                self.buffer.client.nack(batch.lease_id, failed=True)
            except Exception as nack_error:  # its lease expires instead, which counts the same
                log.warning("could not hand back batch %s: %s", batch.lease_id, nack_error)
            if not refused or self.cfg.buffer.max_deliveries is None:
                raise
            log.error("the learner refused batch %s (handed back; the buffer drops it as poisoned once handed out "
                      "buffer.max_deliveries=%d times): %s", batch.lease_id, self.cfg.buffer.max_deliveries, exc)
            return None

    def _adapt_eta(self, metrics: dict) -> dict:
        """`buffer.gate.eta: auto`: feed the step's drift per version to the η controller and send
        the buffer a changed η. The gauges of the η in force (also under a fixed η)."""
        if self.eta_control is None:
            return {"gate/eta": self.cfg.eta if isinstance(self.cfg.eta, int) else math.nan}
        before = self.eta_control.eta
        eta = self.eta_control.observe_step(metrics)
        if eta != before:
            self.buffer.client.set_eta(eta)
            log.info("eta %d -> %d (drift per version %.4g nats/token k3, budget %.4g)", before, eta,
                     self.eta_control.drift, self.eta_control.drift_budget)
        return self.eta_control.gauges()

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

    def evals_at(self, step: int) -> bool:
        return any(e.get("step") == step for e in self.evals)

    def _eval_due(self) -> bool:
        every = self.cfg.run.eval_every
        return self.cfg.eval.enabled and bool(every) and self.step % every == 0

    def _report_evals(self, metric_log: MetricLog, progress, timeout: float = 0.0) -> None:
        """Log the evaluations that have finished (waiting up to `timeout` for the others): each as
        a record of the step that asked for it, with the version it evaluated."""
        for metrics in self.evaluations.collect(self.step, timeout=timeout):
            self.evals.append(metrics)
            self.evals.sort(key=lambda e: e["step"])
            shown = {k: v for k, v in metrics.items() if k not in ("step", "eval/reported_at_step", "eval/seconds")
                     and not k.endswith("/num_prompts")}
            progress.write(f"eval @ step {metrics['step']}: " + ", ".join(f"{k[5:]}={v:.3f}" for k, v in shown.items()))
            metric_log.write({"version": int(metrics["eval/version"]), **metrics})
            if self._last_record:  # the bar's eval_acc is the newest, also after the last step
                progress.set_postfix_str(_postfix(self._last_record, self.evals), refresh=False)

    def save_checkpoint(self) -> Path:
        staged = ckpt.staging_dir(self.run_dir, self.step)
        self.learner.save_checkpoint(str(staged))
        (staged / BUFFER_STATE_FILE).write_bytes(self.buffer.snapshot())
        state = {"step": self.step, "version": self.version, "consumed_tickets": self.consumed_tickets,
                 "evals": self.evals, "buffer_transport": self.cfg.buffer.transport}
        final = ckpt.commit(staged, state, keep=self.cfg.run.keep_checkpoints)
        log.info("checkpoint %s", final)
        return final


def _policy_versions(sample) -> list[int]:
    """The versions of a sample's policy tokens (loss mask 1: a multi-turn trajectory's environment
    tokens are not the policy's), or its weight_version when it has none."""
    versions = getattr(sample, "token_versions", None)
    if versions is None or len(versions) == 0:
        return [int(sample.weight_version)]
    mask = getattr(sample, "loss_mask", None)
    if mask is not None and len(mask) == len(versions):
        versions = versions[np.asarray(mask, dtype=bool)]
    return [int(v) for v in versions] or [int(sample.weight_version)]


def _progress(cfg: EtarlConfig, initial: int):
    from tqdm import tqdm

    return tqdm(total=cfg.run.steps, initial=initial, desc="etarl", unit="step", disable=not cfg.run.progress,
                dynamic_ncols=True, file=sys.stderr)


@contextlib.contextmanager
def _logs_above_the_bar():
    """The console's log lines (a checkpoint, a warning) printed above the progress bar, through
    tqdm, not into the bar's line; only where logging has a console handler to redirect."""
    from tqdm.contrib.logging import logging_redirect_tqdm

    if not any(isinstance(h, logging.StreamHandler) and h.stream in (sys.stdout, sys.stderr)
               for h in logging.root.handlers):
        yield
        return
    with logging_redirect_tqdm():
        yield


def _postfix(record: dict, evals: list[dict]) -> str:
    def fmt(key, name, spec=".3f"):
        value = record.get(key)
        return f"{name}={value:{spec}}" if isinstance(value, (int, float)) and math.isfinite(value) else None

    parts = [f"v={record['version']}", fmt("reward/mean", "reward"), fmt("staleness/mean", "stale", ".2f"),
             fmt("gate/eta", "eta", ".0f"), fmt("drift/per_version_k3", "drift/v", ".1e"),
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
        log.warning("stopping after the current step (Ctrl-C again to abort)" if controller._started else
                    "stopping the start: nothing more is started (Ctrl-C again to abort)")
        controller.stop_requested.set()

    if threading.current_thread() is threading.main_thread():
        previous = signal.signal(signal.SIGINT, on_sigint)
    done = controller.resumed_complete()
    if done is not None:
        return done
    try:
        started = time.perf_counter()
        try:
            controller.start()
        except StartInterrupted:
            log.warning("stopped while starting: nothing was trained, no checkpoint written")
            return RunResult(controller.run_dir, controller.step, controller.version, completed=False,
                             interrupted=True, seconds=time.perf_counter() - started)
        return controller.run()
    except BaseException:
        controller.failed = True
        raise
    finally:
        controller.stop()
        if previous is not None:
            signal.signal(signal.SIGINT, previous)


def engine_for_this_machine(cfg: EtarlConfig, named: set[str]) -> EtarlConfig:
    """`cfg` with the engine settings a run's layout chose for its own machine (the kind: vLLM on its
    GPUs; the weight-transfer backend: NCCL or IPC there) back to their defaults and not marked as
    the user's, unless `named` (the command line's dotted keys) has them: a run's saved config names
    them all, and this machine may lack what they need; here they are chosen again (the
    transformers engine where no vLLM is installed)."""
    engine = cfg.rollout.engine
    again = {key for key in ("kind", "weight_transfer") if f"rollout.engine.{key}" not in named}
    engine = type(engine)(**engine.model_dump(exclude=again, exclude_unset=True))
    return cfg.model_copy(update={"rollout": cfg.rollout.model_copy(update={"engine": engine})})


def evaluate_model(cfg: EtarlConfig, model: str | None = None, run_dir: str | None = None) -> dict:
    """`etarl eval`: the held-out metrics of a model folder, or of a run's latest checkpoint."""
    from services.evaluation import PolicyEvaluator
    from services.inputs import check_eval_inputs
    from services.placement import local_engine_kind

    if run_dir is not None:
        folder = ckpt.latest_checkpoint(run_dir) / "policy"
    elif model is not None:
        folder = Path(model)
    else:
        folder = resolve_model(cfg)
    if cfg.eval.engine is None:  # the rollout engine, as a run here would choose it for this folder
        kind, why = local_engine_kind(cfg.model_copy(update={"run": cfg.run.model_copy(update={"model": str(folder)})}))
        if why:
            log.info("etarl eval: %s", why)
        cfg = cfg.model_copy(update={"eval": cfg.eval.model_copy(update={"engine": kind})})
    check_eval_inputs(cfg, folder)
    try:
        evaluator = PolicyEvaluator.from_config(cfg, folder)  # reads the held-out rows before its engine
    except InvalidPrompts as err:
        raise ConfigError(f"rollout.task.heldout_path: {err}") from None
    task = cfg.rollout.task
    held_out = ", ".join(task.files("heldout_path").values()) if task.kind == "file" else f"the {task.kind} task"
    log.info("etarl eval: %s on %d held-out prompts of %s", folder, len(evaluator.prompts), held_out)
    try:
        return evaluator.evaluate_payload(None)
    finally:
        evaluator.close()  # the engine's processes end here, not in a destructor at exit
