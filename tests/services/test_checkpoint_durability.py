"""A checkpoint is durable before LATEST names it: every file and folder is fsynced, then the
folder is renamed, then LATEST is replaced durably; an incomplete checkpoint is refused.

os.fsync is wrapped (not replaced: it still runs) to record which path each fsync hit, because
what is checked is the order of the calls, which the file system cannot show after the fact."""
import os

import pytest

from services import checkpoint


def _stage_complete(run_dir, step):
    staged = checkpoint.staging_dir(run_dir, step)
    (staged / "policy").mkdir()
    (staged / "policy" / "model.safetensors").write_bytes(b"w" * 64)
    (staged / "policy" / "config.json").write_text("{}")
    (staged / "trainer.pt").write_bytes(b"o" * 32)
    (staged / "buffer.msgpack").write_bytes(b"\x80")
    return staged


@pytest.fixture
def calls(monkeypatch):
    """Every fsync (as the path of its fd) and every os.replace, in order."""
    seen = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd):
        seen.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        return real_fsync(fd)

    def replace(src, dst, **kw):
        seen.append(("replace", os.fspath(src), os.fspath(dst)))
        return real_replace(src, dst, **kw)

    monkeypatch.setattr(checkpoint.os, "fsync", fsync)
    monkeypatch.setattr(checkpoint.os, "replace", replace)
    return seen


def test_commit_fsyncs_every_file_and_folder_before_the_rename_and_latest(tmp_path, calls):
    run_dir = tmp_path.resolve()
    staged = _stage_complete(run_dir, 20)
    (staged / "policy" / "nested").mkdir()
    (staged / "policy" / "nested" / "extra.bin").write_bytes(b"x")
    expected_files = {str(p) for p in staged.rglob("*") if p.is_file()} | {str(staged / "state.json")}
    expected_dirs = {str(staged), str(staged / "policy"), str(staged / "policy" / "nested")}

    final = checkpoint.commit(staged, {"step": 20, "version": 20, "buffer_transport": "ray"})

    root = str(run_dir / "checkpoints")
    rename = calls.index(("replace", str(staged), str(final)))
    before = {path for kind, path, *_ in calls[:rename] if kind == "fsync"}
    missed = (expected_files | expected_dirs) - before
    assert not missed, f"not fsynced before the rename: {sorted(missed)}"
    # Files before their folders (a folder's fsync covers only its entries).
    order = [path for kind, path, *_ in calls[:rename] if kind == "fsync"]
    for f in expected_files:
        assert order.index(f) < order.index(os.path.dirname(f))
    assert order.index(str(staged / "policy")) < order.index(str(staged))

    latest_tmp, latest = root + "/LATEST.tmp", root + "/LATEST"
    latest_rename = calls.index(("replace", latest_tmp, latest))
    assert rename < latest_rename
    between = [c for c in calls[rename + 1:latest_rename] if c[0] == "fsync"]
    assert ("fsync", root) in between, "the checkpoints folder is not fsynced after the rename"
    assert ("fsync", str(run_dir)) in between, "the run folder (holding checkpoints/) is not fsynced"
    assert ("fsync", latest_tmp) in between, "LATEST's new content is not fsynced before its rename"
    assert ("fsync", root) in calls[latest_rename + 1:], "the folder is not fsynced after LATEST moved"
    assert (final / "policy" / "nested" / "extra.bin").read_bytes() == b"x"
    assert checkpoint.latest_checkpoint(run_dir) == final


@pytest.mark.parametrize("part", ["policy/model.safetensors", "trainer.pt", "buffer.msgpack"])
def test_a_checkpoint_missing_a_part_is_refused_and_latest_stays(tmp_path, part):
    good = checkpoint.commit(_stage_complete(tmp_path, 10), {"step": 10, "version": 1, "buffer_transport": "ray"})
    staged = _stage_complete(tmp_path, 20)
    (staged / part).unlink()
    with pytest.raises(ValueError, match=f"incomplete.*missing {part.split('/')[0]}"):
        checkpoint.commit(staged, {"step": 20, "version": 2, "buffer_transport": "ray"})
    assert checkpoint.latest_checkpoint(tmp_path) == good
    assert not (tmp_path / "checkpoints" / "step_000020").exists()


def test_an_empty_part_is_refused(tmp_path):
    staged = _stage_complete(tmp_path, 10)
    for part in ("trainer.pt", "buffer.msgpack"):  # each transport's buffer writes one (a ZMQ service's snapshot too)
        (staged / part).write_bytes(b"")
        with pytest.raises(ValueError, match=f"missing {part}"):
            checkpoint.commit(staged, {"step": 10, "version": 1, "buffer_transport": "zmq"})
        (staged / part).write_bytes(b"o")
    assert checkpoint.commit(staged, {"step": 10, "version": 1, "buffer_transport": "zmq"}).name == "step_000010"


def test_the_part_names_agree_with_their_writers():
    from learner.checkpoint import SHARDS_DIR
    from learner.trainer import POLICY_DIR, TRAINER_STATE_FILE
    from services.controller import BUFFER_STATE_FILE

    assert (checkpoint.POLICY_PART, checkpoint.TRAINER_PART, checkpoint.BUFFER_PART, checkpoint.SHARDS_PART) == (
        POLICY_DIR, TRAINER_STATE_FILE, BUFFER_STATE_FILE, SHARDS_DIR)


def test_sharded_training_state_without_its_metadata_is_refused(tmp_path):
    staged = _stage_complete(tmp_path, 10)
    (staged / "trainer_shards").mkdir()
    (staged / "trainer_shards" / "__0_0.distcp").write_bytes(b"shard")  # a rank wrote, the save did not finish
    with pytest.raises(ValueError, match="missing trainer_shards/.metadata"):
        checkpoint.commit(staged, {"step": 10, "version": 1, "buffer_transport": "zmq"})
    (staged / "trainer_shards" / ".metadata").write_bytes(b"m")
    assert checkpoint.commit(staged, {"step": 10, "version": 1, "buffer_transport": "zmq"}).name == "step_000010"
