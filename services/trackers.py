"""Experiment trackers (`metrics.trackers`, verl's `trainer.logger`): every record of the run's metric log,
a step's or an evaluation's, also goes to Weights & Biases and/or TensorBoard, under its step.

A tracker that cannot start stops the run before its first step, saying what to set; one that fails
later is logged once and dropped: metrics.jsonl stays the run's record, and a tracker never stops a run.
A resumed run continues its W&B run (the id is kept in the run folder) and its TensorBoard log (the
steps after the checkpoint are purged, as the metric log truncates them).
"""
from __future__ import annotations

import logging
import math
import numbers
import os
import secrets
import shutil
import threading
from pathlib import Path
from typing import Any, Protocol

from services.config import ConfigError

log = logging.getLogger("etarl")

WANDB_ID_FILE = "wandb_run_id"  # in the run folder: a resumed run logs to the same W&B run
TENSORBOARD_DIR = "tensorboard"
CLOSE_WAIT_S = 120.0  # for a tracker to send what it holds when the run ends


class Tracker(Protocol):
    name: str

    def log(self, scalars: dict[str, float], step: int) -> None: ...

    def close(self, failed: bool) -> None: ...


NOT_PLOTTED = ("step", "time")  # the x axis, and a record's wall-clock time


def scalars(record: dict) -> dict[str, float]:
    """The finite numbers of a metric record (not its step or time): what a tracker can plot."""
    return {key: float(value) for key, value in record.items()
            if key not in NOT_PLOTTED and isinstance(value, numbers.Real) and math.isfinite(value)}


def _end_wandb(wandb) -> None:
    """W&B's process-wide state and service process ended, unless another W&B run of this process (a
    caller's) still uses them: a later start begins afresh, with its own settings."""
    if wandb.run is None:
        wandb.teardown()


def wandb_with_a_key():
    """The wandb module, where it is installed and has an API key (or runs offline): a ConfigError now, not
    W&B's interactive prompt in a terminal."""
    try:
        import wandb
    except ImportError:
        raise ConfigError("metrics.trackers: wandb is not installed (pip install wandb)") from None
    offline = os.environ.get("WANDB_MODE", "").lower() in ("offline", "dryrun", "disabled")
    if not offline and not wandb.login(prompt=False, verify=False):
        _end_wandb(wandb)
        raise ConfigError("metrics.trackers: W&B has no API key: set WANDB_API_KEY (or WANDB_MODE=offline) where "
                          "the driver runs, or drop wandb from metrics.trackers")
    return wandb


def check_trackers(names: list[str]) -> None:
    """What the trackers need, checked before Ray and the actors start: wandb's key, tensorboard installed."""
    if "wandb" in names:
        wandb_with_a_key()
    if "tensorboard" in names:
        try:
            import torch.utils.tensorboard  # noqa: F401
        except ImportError:
            raise ConfigError("metrics.trackers: tensorboard is not installed (pip install tensorboard)") from None


class WandbTracker:
    """One W&B run per etarl run, every metric plotted against etarl's step (an evaluation is reported
    after later steps have been logged: W&B's own step counter would refuse it)."""

    name = "wandb"

    def __init__(self, run_dir: Path, project: str, experiment: str, config: dict, resumed: bool) -> None:
        wandb = wandb_with_a_key()
        id_file = run_dir / WANDB_ID_FILE
        run_id = id_file.read_text().strip() if resumed and id_file.is_file() else secrets.token_hex(4)
        try:
            # create_new: a W&B run the calling process has open (a notebook's, a sweep's) is left alone.
            # console="off": etarl's progress bar and logs stay on the terminal as they are.
            # quiet: W&B's run summary at the end is left out (etarl prints its own).
            self.run = wandb.init(project=project, name=experiment, id=run_id, resume="allow", dir=str(run_dir),
                                  config=config, reinit="create_new",
                                  settings=wandb.Settings(console="off", quiet=True))
        except Exception as err:  # noqa: BLE001 - wandb's errors have no common base
            _end_wandb(wandb)
            raise ConfigError(f"metrics.trackers: W&B did not start ({type(err).__name__}: {err}); drop wandb from "
                              "metrics.trackers, or set WANDB_MODE=offline to sync the run later") from None
        try:
            self.run.define_metric("step")
            self.run.define_metric("*", step_metric="step")
            id_file.write_text(run_id)
        except BaseException:
            self.close(failed=True)
            raise

    def log(self, scalars: dict[str, float], step: int) -> None:
        self.run.log({"step": step, **scalars})

    def close(self, failed: bool) -> None:
        import wandb

        try:
            self.run.finish(exit_code=1 if failed else 0)
        finally:
            _end_wandb(wandb)


class TensorBoardTracker:
    """Scalars in RUN_DIR/tensorboard (`tensorboard --logdir RUN_DIR/tensorboard`)."""

    name = "tensorboard"

    def __init__(self, run_dir: Path, resume_after_step: int | None) -> None:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:
            raise ConfigError("metrics.trackers: tensorboard is not installed (pip install tensorboard)") from None
        folder = run_dir / TENSORBOARD_DIR
        if resume_after_step is None and folder.exists():  # an earlier run's, as metrics.jsonl.prev is
            shutil.rmtree(folder.with_name(TENSORBOARD_DIR + ".prev"), ignore_errors=True)
            folder.replace(folder.with_name(TENSORBOARD_DIR + ".prev"))
        purge = None if resume_after_step is None else resume_after_step + 1
        self.writer = SummaryWriter(log_dir=str(folder), purge_step=purge)

    def log(self, scalars: dict[str, float], step: int) -> None:
        for key, value in scalars.items():
            self.writer.add_scalar(key, value, step)
        self.writer.flush()  # a step takes seconds: a crash keeps what was logged, as metrics.jsonl does

    def close(self, failed: bool) -> None:
        self.writer.close()


class Trackers:
    """The run's trackers, fed each metric record; one that raises is logged and dropped."""

    def __init__(self, trackers: list[Tracker]) -> None:
        self.active = list(trackers)

    def log(self, record: dict[str, Any]) -> None:
        step = record.get("step")
        for tracker in list(self.active):
            try:
                tracker.log(scalars(record), int(step))
            except Exception as err:  # noqa: BLE001 - a tracker's failure is never the run's
                log.warning("the %s tracker failed at step %s and is dropped (metrics.jsonl has every step): %s: %s",
                            tracker.name, step, type(err).__name__, err)
                self.active.remove(tracker)
                self._close(tracker, failed=True)

    def close(self, failed: bool = False) -> None:
        """Close every tracker (again: nothing); `failed` marks a W&B run as failed."""
        while self.active:
            self._close(self.active.pop(), failed)

    @staticmethod
    def _close(tracker: Tracker, failed: bool) -> None:
        """tracker.close, waited for CLOSE_WAIT_S at most: W&B's finish can hang on an unreachable server,
        and a finished run must still end."""
        errors: list[BaseException] = []

        def close() -> None:
            try:
                tracker.close(failed)
            except Exception as err:  # noqa: BLE001
                errors.append(err)

        closing = threading.Thread(target=close, name=f"etarl-close-{tracker.name}", daemon=True)
        closing.start()
        closing.join(CLOSE_WAIT_S)
        if closing.is_alive():
            log.warning("the %s tracker did not close within %.0f s (its server unreachable?); left behind",
                        tracker.name, CLOSE_WAIT_S)
        elif errors:
            log.warning("the %s tracker did not close cleanly: %s: %s", tracker.name, type(errors[0]).__name__,
                        errors[0])


def open_trackers(names: list[str], run_dir: Path, project: str, experiment: str | None, config: dict,
                  resume_after_step: int | None) -> Trackers:
    """The trackers `names` asks for, started; a ConfigError (after closing those started) if one cannot."""
    opened: list[Tracker] = []
    try:
        for name in names:
            if name == "wandb":
                opened.append(WandbTracker(run_dir, project, experiment or run_dir.name, config,
                                           resumed=resume_after_step is not None))
            else:
                opened.append(TensorBoardTracker(run_dir, resume_after_step))
    except BaseException:
        Trackers(opened).close(failed=True)
        raise
    if opened:
        log.info("metrics also go to %s", ", ".join(
            f"W&B (project {project}, run {experiment or run_dir.name})" if t.name == "wandb"
            else f"TensorBoard ({run_dir / TENSORBOARD_DIR})" for t in opened))
    return Trackers(opened)
