"""Placement on real Ray clusters whose GPUs are declared, not real (this machine has none):
Ray assigns the declared GPUs as it would real ones (ids, CUDA_VISIBLE_DEVICES), and
`ray.cluster_utils.Cluster` runs several nodes on this machine, all on 127.0.0.1.

1. An embedded cluster with 4 GPUs (`etarl`'s own start, ray.num_gpus=4): 3 workers + 1 learner,
   then 2 learner ranks + 2 workers, get distinct GPUs; a tensor-parallel worker gets its 2 GPUs;
   `auto` resolves to the CPU with one warning (CUDA is missing here); a plan needing 5 GPUs is
   refused before any actor or placement group exists.
2. A head (driver, buffer) and two nodes of 2 GPUs each: a short real run with the transformers
   engine, 2 learner ranks spread over both nodes meeting through a TCPStore on rank 0's node
   address, and the evaluator in an actor: every GPU actor on its own GPU, the run completes and
   passes the consumption audit.
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


def test_a_plan_needing_five_gpus_is_refused_before_anything_starts(four_gpus):
    assert four_gpus["before_refusal"] == {"actors": [], "placement_groups": 0}
    message = four_gpus["refused"]
    assert message and "needs 5 GPUs" in message and "has 4" in message
    for key in ("rollout.num_workers", "learner.distributed.world_size", "eval.enabled=false"):
        assert key in message
    assert four_gpus["after_refusal"] == {"actors": [], "placement_groups": 0}


def test_two_nodes_every_gpu_actor_on_its_own_gpu(two_nodes):
    gpu_actors = [*two_nodes["workers"], two_nodes["evaluator"], *two_nodes["ranks"]]
    placed = [(a["node_id"], g) for a in gpu_actors for g in a["gpu_ids"]]
    assert len(placed) == 4 and len(set(placed)) == 4  # 1 worker + evaluator + 2 ranks = the 4 GPUs
    assert {node for node, _ in placed} == set(two_nodes["gpu_nodes"])
    for a in gpu_actors:
        assert a["device"] == "cpu" and len(a["gpu_ids"]) == 1  # auto, CUDA missing here
    for a in [*two_nodes["workers"], two_nodes["evaluator"]]:
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
    assert [e["step"] for e in two_nodes["evals"]] == [0, 3]  # the evaluator actor ran at start and end
