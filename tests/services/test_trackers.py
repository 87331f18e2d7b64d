"""metrics.trackers: the run's metric records also go to TensorBoard and W&B (real W&B, offline: its
server cannot be reached from here, so what it would upload is read back from the run's .wandb files),
each metric under etarl's step, a resumed run continuing both; a tracker that fails is dropped and the
run goes on; W&B that cannot start stops the run at start saying what to set."""
from __future__ import annotations

import logging

import pytest
from tracker_logs import tensorboard_scalars, wandb_runs

from services.config import ConfigError
from services.trackers import WANDB_ID_FILE, Trackers, open_trackers

@pytest.fixture
def wandb_offline(monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")


def test_records_go_to_tensorboard_and_wandb_under_their_steps_and_a_resume_continues_both(tmp_path, wandb_offline):
    config = {"run": {"steps": 5}}
    trackers = open_trackers(["tensorboard", "wandb"], tmp_path, "etarl-tests", "first", config, None)
    for step in (1, 2, 3):
        trackers.log({"step": step, "version": step, "reward/mean": step / 10, "audit/tickets": [1, 2],
                      "rollout_corr/kl": float("nan")})  # lists and NaN are not plotted
    trackers.log({"step": 1, "eval/accuracy": 0.5})  # an evaluation reported after later steps
    trackers.close()
    run_id = (tmp_path / WANDB_ID_FILE).read_text()

    # Resumed from the checkpoint of step 2: step 3 is trained (and logged) again.
    trackers = open_trackers(["tensorboard", "wandb"], tmp_path, "etarl-tests", "first", config, 2)
    for step in (3, 4):
        trackers.log({"step": step, "version": step, "reward/mean": step / 10 + 0.5})
    trackers.close()

    assert tensorboard_scalars(tmp_path, "reward/mean") == [(1, 0.1), (2, 0.2), (3, 0.8), (4, 0.9)]
    assert tensorboard_scalars(tmp_path, "eval/accuracy") == [(1, 0.5)]
    (first_id, project, first), (second_id, _, second) = wandb_runs(tmp_path)
    assert first_id == second_id == run_id and project == "etarl-tests"  # one W&B run, continued
    assert first == [{"step": s, "version": s, "reward/mean": s / 10} for s in (1, 2, 3)] + \
        [{"step": 1, "eval/accuracy": 0.5}]
    assert [(row["step"], row["reward/mean"]) for row in second] == [(3, 0.8), (4, 0.9)]


def test_a_tracker_that_fails_is_dropped_and_the_others_go_on(caplog):
    class Recording:
        def __init__(self, name, fail_at=None):
            self.name, self.fail_at, self.logged, self.closed = name, fail_at, [], []

        def log(self, scalars, step):
            if step == self.fail_at:
                raise ConnectionError("the server went away")
            self.logged.append((step, scalars))

        def close(self, failed):
            self.closed.append(failed)

    failing, steady = Recording("wandb", fail_at=2), Recording("tensorboard")
    trackers = Trackers([failing, steady])
    with caplog.at_level(logging.WARNING):
        for step in (1, 2, 3):
            trackers.log({"step": step, "reward/mean": 1.0})
    assert [step for step, _ in failing.logged] == [1] and failing.closed == [True]
    assert [step for step, _ in steady.logged] == [1, 2, 3]
    assert caplog.text.count("the wandb tracker failed at step 2 and is dropped") == 1
    trackers.close()
    trackers.close()  # again: nothing
    assert steady.closed == [False]


def test_wandb_without_a_key_stops_the_run_at_start_saying_what_to_set(tmp_path, monkeypatch, tiny_model_dir):
    monkeypatch.setenv("WANDB_MODE", "online")
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.netrc login either
    monkeypatch.setenv("WANDB_SILENT", "true")
    with pytest.raises(ConfigError, match=r"metrics.trackers: W&B has no API key: set WANDB_API_KEY \(or "
                                          r"WANDB_MODE=offline\) where the driver runs"):
        open_trackers(["tensorboard", "wandb"], tmp_path, "etarl", None, {}, None)

    # A run stops before Ray starts: nothing written to its folder, not even its config.
    from services.cli import EXIT_CONFIG_ERROR, main

    run_dir = tmp_path / "run"
    assert main(["train", f"run.model={tiny_model_dir}", f"run.run_dir={run_dir}", "metrics.trackers=[wandb]",
                 "run.progress=false"]) == EXIT_CONFIG_ERROR
    assert not run_dir.exists()


def test_a_users_own_wandb_run_is_left_alone_and_an_earlier_runs_tensorboard_log_is_moved_aside(tmp_path,
                                                                                               wandb_offline):
    import wandb

    (tmp_path / "tensorboard").mkdir()
    (tmp_path / "tensorboard" / "events.out.tfevents.earlier").write_text("an earlier run's")
    mine = wandb.init(project="mine", dir=str(tmp_path / "mine"), mode="offline")  # a notebook's, a sweep's
    try:
        trackers = open_trackers(["tensorboard", "wandb"], tmp_path, "etarl-tests", None, {}, None)
        trackers.log({"step": 1, "reward/mean": 0.5})
        trackers.close()
        assert wandb.run is mine and (tmp_path / WANDB_ID_FILE).read_text() != mine.id
        mine.log({"still": 1})  # not finished by etarl's close
    finally:
        mine.finish()
        wandb.teardown()
    assert [run_id for run_id, _, _ in wandb_runs(tmp_path)] == [(tmp_path / WANDB_ID_FILE).read_text()]
    assert (tmp_path / "tensorboard.prev" / "events.out.tfevents.earlier").exists()
    assert tensorboard_scalars(tmp_path, "reward/mean") == [(1, 0.5)]
