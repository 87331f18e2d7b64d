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
import secrets
from pathlib import Path
from typing import Any, Protocol

from services.config import ConfigError

log = logging.getLogger("etarl")

WANDB_ID_FILE = "wandb_run_id"  # in the run folder: a resumed run logs to the same W&B run
TENSORBOARD_DIR = "tensorboard"


class Tracker(Protocol):
    name: str

    def log(self, scalars: dict[str, float], step: int) -> None: ...

    def close(self, failed: bool) -> None: ...


def scalars(record: dict) -> dict[str, float]:
    """The finite numbers of a metric record (not its step): what a tracker can plot."""
    return {key: float(value) for key, value in record.items()
            if key != "step" and isinstance(value, numbers.Real) and math.isfinite(value)}


class WandbTracker:
    """One W&B run per etarl run, every metric plotted against etarl's step (an evaluation is reported
    after later steps have been logged: W&B's own step counter would refuse it)."""

    name = "wandb"

    def __init__(self, run_dir: Path, project: str, experiment: str, config: dict, resumed: bool) -> None:
        try:
            import wandb
        except ImportError:
            raise ConfigError("metrics.trackers: wandb is not installed (pip install wandb)") from None
        id_file = run_dir / WANDB_ID_FILE
        run_id = id_file.read_text().strip() if resumed and id_file.is_file() else secrets.token_hex(4)
        try:
            # console="off": etarl's progress bar and logs stay on the terminal as they are
            self.run = wandb.init(project=project, name=experiment, id=run_id, resume="allow", dir=str(run_dir),
                                  config=config, settings=wandb.Settings(console="off"))
        except Exception as err:  # noqa: BLE001 - wandb's errors have no common base: any stops the start
            raise ConfigError(f"metrics.trackers: W&B did not start ({type(err).__name__}: {err}); set WANDB_API_KEY "
                              "(or WANDB_MODE=offline) where the driver runs, or drop wandb from metrics.trackers") \
                from None
        id_file.write_text(run_id)
        self.run.define_metric("step")
        self.run.define_metric("*", step_metric="step")

    def log(self, scalars: dict[str, float], step: int) -> None:
        self.run.log({"step": step, **scalars})

    def close(self, failed: bool) -> None:
        import wandb

        self.run.finish(exit_code=1 if failed else 0)
        wandb.teardown()  # its service process ends with the run, not with the interpreter


class TensorBoardTracker:
    """Scalars in RUN_DIR/tensorboard (`tensorboard --logdir RUN_DIR/tensorboard`)."""

    name = "tensorboard"

    def __init__(self, run_dir: Path, resume_after_step: int | None) -> None:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:
            raise ConfigError("metrics.trackers: tensorboard is not installed (pip install tensorboard)") from None
        purge = None if resume_after_step is None else resume_after_step + 1
        self.writer = SummaryWriter(log_dir=str(run_dir / TENSORBOARD_DIR), purge_step=purge)

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
        step, values = int(record.get("step", 0)), scalars(record)
        for tracker in list(self.active):
            try:
                tracker.log(values, step)
            except Exception as err:  # noqa: BLE001 - a tracker's failure is never the run's
                log.warning("the %s tracker failed at step %d and is dropped (metrics.jsonl has every step): %s: %s",
                            tracker.name, step, type(err).__name__, err)
                self.active.remove(tracker)
                self._close(tracker, failed=True)

    def close(self, failed: bool = False) -> None:
        """Close every tracker (again: nothing); `failed` marks a W&B run as failed."""
        while self.active:
            self._close(self.active.pop(), failed)

    @staticmethod
    def _close(tracker: Tracker, failed: bool) -> None:
        try:
            tracker.close(failed)
        except Exception as err:  # noqa: BLE001
            log.warning("the %s tracker did not close cleanly: %s: %s", tracker.name, type(err).__name__, err)


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
