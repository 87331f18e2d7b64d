"""Placement on real Ray clusters whose GPUs are declared, not real (this machine has none):
Ray assigns the declared GPUs as it would real ones (ids, CUDA_VISIBLE_DEVICES), and
`ray.cluster_utils.Cluster` runs several nodes on this machine, all on 127.0.0.1.

1. An embedded cluster with 4 GPUs (`etarl`'s own start, ray.num_gpus=4): 3 workers + 1 learner,
   then 2 learner ranks + 2 workers, get distinct GPUs; a tensor-parallel worker gets its 2 GPUs;
   the embedded default's plan for one GPU (colocated: one shared bundle) puts the engine and the
   learner on the same GPU, and so do two plain requests of half a GPU; `auto` resolves to the CPU
   with one warning (CUDA is missing here); a plan needing 5 GPUs is refused before any actor or
   placement group exists.
2. A head (driver, buffer) and two nodes of 2 GPUs each: a short real run with the transformers
   engine, 2 learner ranks spread over both nodes meeting through a TCPStore on rank 0's node
   address, evaluations on the rollout worker: every GPU actor on its own GPU, the run completes
   and passes the consumption audit. Then the shared-path check: it passes as the nodes are (one
   machine: one file system), and fails naming the node and the paths when the second GPU node
   mounts another folder at the shared root.
Each runs in a child process (tests/services/placement_probe.py): the test session holds a Ray
cluster of its own.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from security.test_ray_listens_on_loopback import is_loopback  # tests/ is on sys.path (its conftest)

REPO = Path(__file__).resolve().parents[2]
PROBE = Path(__file__).with_name("placement_probe.py")

pytestmark = pytest.mark.slow


def run_probe(*args: str) -> dict:
    out = subprocess.run([sys.executable, str(PROBE), *args], cwd=REPO, capture_output=True, text=True, timeout=500,
                         env={**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"})
    lines = [line for line in out.stdout.splitlines() if line.startswith("RESULT ")]
    assert out.returncode == 0 and lines, (out.stdout[-2000:], out.stderr[-4000:])
    return json.loads(lines[-1][len("RESULT "):])


@pytest.fixture(scope="module")
def four_gpus():
    return run_probe("four_gpus")


@pytest.fixture(scope="module")
def two_nodes(tmp_path_factory):
    return run_probe("two_nodes", str(tmp_path_factory.mktemp("two-nodes") / "run"))


def gpus_of(actors) -> list[str]:
    return [g for a in actors for g in a["gpu_ids"]]


@pytest.mark.parametrize(("scenario", "roles"), [
    ("three_workers_one_learner", ["rollout"] * 3 + ["learner"]),
    ("two_ranks_two_workers", ["rollout"] * 2 + ["learner"] * 2),
])
def test_every_actor_of_the_plan_gets_its_own_declared_gpu(four_gpus, scenario, roles):
    actors = four_gpus[scenario]
    assert [a["role"] for a in actors] == roles
    assert sorted(gpus_of(actors)) == ["0", "1", "2", "3"]  # one each, all four used
    for a in actors:
        assert a["cuda_visible_devices"] == ",".join(a["gpu_ids"])  # what CUDA would see: its own GPU only


def test_a_tensor_parallel_engine_gets_all_its_gpus(four_gpus):
    worker, learner = four_gpus["tensor_parallel"]
    assert worker["role"] == "rollout" and len(worker["gpu_ids"]) == 2
    assert worker["cuda_visible_devices"] == ",".join(worker["gpu_ids"])
    assert not set(worker["gpu_ids"]) & set(learner["gpu_ids"])


def test_auto_runs_on_the_cpu_with_one_warning_where_cuda_is_missing(four_gpus):
    for a in four_gpus["three_workers_one_learner"]:
        assert a["devices"] == ["cpu"]
        (warning,) = a["warnings"]  # two resolutions, one line
        assert f"Ray assigned GPU {a['gpu_ids'][0]}" in warning and "computing on the CPU" in warning


def test_the_default_plan_on_one_gpu_colocates_engine_and_learner_on_it(four_gpus):
    plan = four_gpus["colocated_plan"]
    assert plan["layout"]["name"] == "colocated"
    rollout, learner = plan["roles"]["rollout"], plan["roles"]["learner"]
    assert rollout["per_actor"]["GPU"] + learner["per_actor"]["GPU"] == 1 and 0 < rollout["per_actor"]["GPU"] < 1
    assert rollout["placement_group"] == learner["placement_group"]  # one bundle, shared
    assert rollout["placement_group"]["bundle"]["GPU"] == 1 and rollout["placement_group"]["shared_by"] == [
        "rollout", "learner"]
    engine, rank = four_gpus["colocated"]
    assert (engine["role"], rank["role"]) == ("rollout", "learner")
    assert len(engine["gpu_ids"]) == 1 and engine["gpu_ids"] == rank["gpu_ids"]  # the same GPU
    assert engine["cuda_visible_devices"] == rank["cuda_visible_devices"] == engine["gpu_ids"][0]
    assert engine["pid"] != rank["pid"]


def test_two_requests_of_half_a_gpu_share_one(four_gpus):
    first, second = four_gpus["fractional"]
    assert len(first["gpu_ids"]) == 1 and first["gpu_ids"] == second["gpu_ids"]
    assert first["cuda_visible_devices"] == second["cuda_visible_devices"] == first["gpu_ids"][0]


def test_a_plan_needing_five_gpus_is_refused_before_anything_starts(four_gpus):
    assert four_gpus["before_refusal"] == {"actors": [], "placement_groups": 0}
    message = four_gpus["refused"]
    assert message and "needs 5 GPUs" in message and "has 4" in message
    for key in ("rollout.num_workers", "learner.distributed.world_size", "rollout.engine.device=cpu"):
        assert key in message
    assert four_gpus["after_refusal"] == {"actors": [], "placement_groups": 0}


def test_two_nodes_every_gpu_actor_on_its_own_gpu(two_nodes):
    gpu_actors = [*two_nodes["workers"], *two_nodes["ranks"]]
    placed = [(a["node_id"], g) for a in gpu_actors for g in a["gpu_ids"]]
    assert len(placed) == 3 and len(set(placed)) == 3  # 1 worker + 2 ranks: evaluation needs no GPU
    assert {node for node, _ in placed} == set(two_nodes["gpu_nodes"])
    for a in gpu_actors:
        assert a["device"] == "cpu" and len(a["gpu_ids"]) == 1  # auto, CUDA missing here
    for a in two_nodes["workers"]:
        assert a["cuda_visible_devices"] == a["gpu_ids"][0]


def test_two_nodes_ranks_spread_and_meet_on_rank_0s_node_address(two_nodes):
    ranks = two_nodes["ranks"]
    assert len({r["node_id"] for r in ranks}) == 2
    host, port = two_nodes["rendezvous"][len("tcp://"):].rsplit(":", 1)
    assert host == ranks[0]["address"] == "127.0.0.1"
    rank0 = two_nodes["rank_listeners"][0]
    assert [host, int(port)] in rank0  # rank 0 serves the TCPStore on its node's address
    for listeners in two_nodes["rank_listeners"]:
        assert all(is_loopback(ip) for ip, _ in listeners), listeners  # never a wildcard


def test_two_nodes_buffer_and_driver_stay_on_the_head(two_nodes):
    assert two_nodes["buffer"]["node_id"] == two_nodes["driver_node"] == two_nodes["head_node"]
    assert two_nodes["buffer"]["gpu_ids"] == []
    assert two_nodes["head_node"] not in {a["node_id"] for a in [*two_nodes["workers"], *two_nodes["ranks"]]}


def test_two_nodes_run_completes_and_passes_the_audit(two_nodes):
    assert two_nodes["completed"] and two_nodes["steps"] == 3
    assert two_nodes["audit_ok"], two_nodes["audit"]
    assert two_nodes["consumed_groups"] == 3 * two_nodes["batch_size"]
    assert two_nodes["worst_staleness"] <= two_nodes["eta"]
    evals = two_nodes["evals"]
    assert [e["step"] for e in evals] == [0, 3]  # on the rollout worker's engine, at start and end
    assert [e["eval/version"] for e in evals] == [0, 3]  # the version each step asked for


def test_shared_paths_pass_when_every_node_sees_the_folders(two_nodes):
    checks = two_nodes["shared_paths"]
    assert len(checks["shared_nodes"]) == 3  # the head (the driver's node) and both GPU nodes
    assert checks["probe_left"] == []  # the probe cleans up after itself


def test_shared_paths_fail_naming_the_node_that_sees_another_folder(two_nodes):
    message = two_nodes["shared_paths"]["split"]
    assert message and "not every node sees the run's files" in message
    named = [node for node in two_nodes["shared_paths"]["split_node"] if node in message]
    assert len(named) == 1  # the node that mounts another folder, and only it
    assert "run.run_dir" in message and "probe file" in message and "rollout.task.path" in message
    assert "/shared/data/train.jsonl" in message and "mount the same shared file system" in message
