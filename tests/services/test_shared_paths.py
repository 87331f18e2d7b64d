"""Where a run's files go and whether every node sees them: the default run folder (local: runs/;
on a cluster: under ETARL_RUN_ROOT, or a clear stop), and the shared-path check on one node (the
embedded cluster: the driver checks its own node, no task, well under a second). The check on two
nodes that see different folders is in test_placement_ray.py (its two-node cluster)."""
from __future__ import annotations

import os
import time

import pytest

from services.config import ConfigError, build_config
from services.controller import RUN_ROOT_ENV, default_run_dir
from services.shared_paths import PROBE_DIR, check_shared_paths, run_paths


def test_the_default_run_folder_is_local_here_and_under_the_shared_root_on_a_cluster(monkeypatch, tmp_path):
    monkeypatch.delenv(RUN_ROOT_ENV, raising=False)
    assert default_run_dir(build_config({})).startswith("runs/")
    joined = build_config({"ray": {"address": "auto"}})
    with pytest.raises(ConfigError, match=r"run\.run_dir is unset .*ray\.address=auto.*ETARL_RUN_ROOT.*same path"):
        default_run_dir(joined)
    monkeypatch.setenv(RUN_ROOT_ENV, str(tmp_path / "shared-runs"))
    assert default_run_dir(joined).startswith(str(tmp_path / "shared-runs") + os.sep)


def test_one_node_checks_in_the_driver_under_a_second_and_names_what_it_cannot_read(ray_cluster, tmp_path):
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text("{}")
    (tmp_path / "train.jsonl").write_text("{}\n")
    cfg = build_config({"rollout": {"task": {"kind": "file", "path": str(tmp_path / "train.jsonl"),
                                             "heldout_path": str(tmp_path / "missing.jsonl")}}})
    paths = run_paths(cfg, tmp_path / "model")
    assert set(paths) == {"run.model", "rollout.task.path", "rollout.task.heldout_path"}
    started = time.perf_counter()
    with pytest.raises(ConfigError) as err:
        check_shared_paths(tmp_path / "run", paths)
    assert time.perf_counter() - started < 1.0
    message = str(err.value)
    assert f"rollout.task.heldout_path: {tmp_path / 'missing.jsonl'} is not readable" in message
    assert "run.model:" not in message and "mount the same shared file system" in message
    del paths["rollout.task.heldout_path"]
    started = time.perf_counter()
    (node,) = check_shared_paths(tmp_path / "run", paths)
    assert time.perf_counter() - started < 1.0
    assert not (tmp_path / "run" / PROBE_DIR).exists()  # the probe leaves nothing behind
