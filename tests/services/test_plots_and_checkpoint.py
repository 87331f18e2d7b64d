"""The JSONL metric log, the plots drawn from it, and atomic checkpoints."""

import pytest

from services import checkpoint
from services.plots import PANELS, MetricLog, _expand, plot_run, read_metrics


def test_metric_log_round_trip_nan_as_null_and_truncate_on_resume(tmp_path):
    log = MetricLog(tmp_path)
    for step in range(1, 6):
        log.write({"step": step, "reward/mean": step / 10, "rollout_corr/kl": float("nan") if step == 3 else 0.01})
    log.close()
    records = read_metrics(tmp_path)
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5]
    assert records[2]["rollout_corr/kl"] is None
    # Resuming from the step-3 checkpoint drops steps 4 and 5 so they are not logged twice.
    MetricLog(tmp_path, resume_after_step=3).close()
    assert [r["step"] for r in read_metrics(tmp_path)] == [1, 2, 3]
    # A new run in the folder (the first ended before a checkpoint): its log starts empty, the old one kept aside.
    log = MetricLog(tmp_path)
    log.write({"step": 1, "reward/mean": 0.5})
    log.close()
    assert read_metrics(tmp_path) == [{"step": 1, "reward/mean": 0.5}]
    assert [r["step"] for r in read_metrics(tmp_path / "metrics.jsonl.prev")] == [1, 2, 3]


def test_read_metrics_tolerates_a_torn_last_line_only(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1}\n{"step": 2, "rew')
    assert read_metrics(tmp_path) == [{"step": 1}]
    path.write_text('{"step": 1}\n{"ste\n{"step": 3}\n')
    with pytest.raises(ValueError, match="metrics.jsonl:2"):
        read_metrics(tmp_path)
    with pytest.raises(FileNotFoundError, match="run directory"):
        read_metrics(tmp_path / "nope")


def test_plot_run_draws_a_png_per_panel_with_data(tmp_path):
    log = MetricLog(tmp_path)
    for step in range(1, 11):
        record = {"step": step, "reward/mean": 0.3 + step / 50, "staleness/mean": 1.5, "staleness/max": 3,
                  "rollout_corr/kl": 0.001 * step, "rollout_corr/rollout_is_eff_sample_size": 0.97,
                  "throughput/samples_per_s": 40.0}
        if step % 5 == 0:
            record.update({"eval/accuracy": 0.4 + step / 100, "eval/pass@4": 0.8,
                           "eval/by_source/gsm8k/accuracy": 0.5, "eval/by_source/gsm8k/pass@4": 0.9,
                           "eval/by_source/math/accuracy": 0.3})
        log.write(record)
    log.close()
    # the held-out panel: accuracy, pass@1, each pass@k, and each data source's accuracy
    assert _expand(read_metrics(tmp_path), PANELS[1][3]) == [
        "eval/accuracy", "eval/pass@1", "eval/pass@4", "eval/by_source/gsm8k/accuracy",
        "eval/by_source/math/accuracy"]
    written = plot_run(tmp_path)
    names = sorted(p.name for p in written)
    assert names == ["ess.png", "eval_accuracy.png", "kl.png", "reward.png", "staleness.png", "throughput.png"]
    for p in written:
        assert p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_checkpoint_commit_latest_and_pruning(tmp_path):
    for step in (10, 20, 30):
        staged = checkpoint.staging_dir(tmp_path, step)
        (staged / "policy").mkdir()
        (staged / "policy" / "model.safetensors").write_bytes(b"weights")
        (staged / "trainer.pt").write_bytes(b"optimizer")
        (staged / "buffer.msgpack").write_bytes(b"\x80")
        checkpoint.commit(staged, {"step": step, "version": step, "buffer_transport": "ray"}, keep=2)
    names = [p.name for p in checkpoint.list_checkpoints(tmp_path)]
    assert names == ["step_000020", "step_000030"]
    latest = checkpoint.latest_checkpoint(tmp_path)
    assert latest.name == "step_000030"
    assert checkpoint.read_state(latest)["version"] == 30
    # A half-written checkpoint (crash before commit) is never picked.
    checkpoint.staging_dir(tmp_path, 40)
    assert checkpoint.latest_checkpoint(tmp_path).name == "step_000030"


def test_resume_from_a_run_without_checkpoints_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        checkpoint.latest_checkpoint(tmp_path / "missing")
    with pytest.raises(FileNotFoundError, match="no complete checkpoint"):
        checkpoint.latest_checkpoint(tmp_path)
