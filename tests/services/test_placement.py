"""The placement plan (services/placement.py) without Ray: what every role asks for, the fit check
against clusters of several nodes, its messages, `etarl plan`, and `etarl train` refusing a plan
that cannot fit before it starts anything. Device resolution outside Ray (lm/device.py)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from services.cli import main
from services.config import build_config
from services.placement import Cluster, Node, PlanError, check_plan, local_cluster, make_plan

REPO = Path(__file__).resolve().parents[2]


def config(**overrides):
    return build_config({}, overrides)


def nodes(*shapes) -> Cluster:
    return Cluster("the test cluster", tuple(Node(f"n{i}", cpus, gpus) for i, (cpus, gpus) in enumerate(shapes)),
                   "more nodes")


def asks(plan) -> dict:
    return {r.name: (r.count, r.cpus, r.gpus) for r in plan.roles}


def test_without_gpus_in_the_cluster_nothing_asks_for_a_gpu():
    plan = check_plan(config(**{"rollout.num_workers": 3}), nodes((8, 0)))
    assert asks(plan) == {"rollout": (3, 1.0, 0), "learner": (1, 1.0, 0), "evaluator": (1, 1.0, 0),
                          "buffer": (1, 0, 0), "weight_store": (1, 0, 0)}


def test_with_gpus_engines_and_ranks_ask_for_the_gpus_they_use():
    cfg = config(**{"rollout.num_workers": 3, "rollout.engine.tensor_parallel_size": 2,
                    "learner.distributed.world_size": 2, "ray.worker_num_cpus": 2})
    plan = make_plan(cfg, cluster_has_gpus=True)
    assert asks(plan) == {"rollout": (3, 2.0, 2), "learner": (2, 1.0, 1), "evaluator": (1, 2.0, 2),
                          "buffer": (1, 0, 0), "weight_store": (1, 0, 0)}
    assert plan.total() == {"CPU": 10.0, "GPU": 10}
    # a transformers evaluator runs on one GPU whatever the samplers' tensor parallelism
    assert make_plan(cfg.model_copy(update={"eval": cfg.eval.model_copy(update={"engine": "hf"})}),
                     True).role("evaluator").gpus == 1
    # device cpu: that role asks for none; eval disabled: no evaluator
    cpu = config(**{"learner.device": "cpu", "rollout.engine.device": "cpu", "eval.enabled": False})
    assert asks(make_plan(cpu, True)) == {"rollout": (1, 1.0, 0), "learner": (1, 1.0, 0), "buffer": (1, 0, 0),
                                          "weight_store": (1, 0, 0)}


def test_the_plan_says_which_bundle_each_actor_gets():
    plan = make_plan(config(**{"learner.distributed.world_size": 4, "learner.distributed.placement": "spread"}), True)
    learner = plan.to_dict()["roles"]["learner"]
    assert learner["placement_group"] == {"strategy": "SPREAD", "bundles": 4, "bundle": {"CPU": 1.0, "GPU": 1}}
    assert plan.to_dict()["roles"]["buffer"]["placement"] == "driver-node"
    zmq = make_plan(config(**{"buffer.transport": "zmq"}), True)
    assert zmq.to_dict()["roles"]["buffer"]["placement"] == "driver-process"


def test_too_few_gpus_is_refused_naming_what_is_missing_and_the_keys():
    cfg = config(**{"rollout.num_workers": 3})  # 3 workers + learner + evaluator
    check_plan(cfg, nodes((16, 5)))
    with pytest.raises(PlanError) as err:
        check_plan(cfg, nodes((16, 4)))
    message = str(err.value)
    assert "needs 5 GPUs (rollout 3 x 1, learner 1 x 1, evaluator 1 x 1)" in message and "has 4" in message
    for key in ("rollout.num_workers", "learner.distributed.world_size", "eval.enabled=false", "more nodes",
                "learner.device=cpu"):
        assert key in message


def test_too_few_cpus_names_the_cpu_keys():
    with pytest.raises(PlanError, match=r"needs 3 CPUs .* has 2: .*ray\.worker_num_cpus.*ray\.learner_num_cpus"):
        check_plan(config(), nodes((2, 0)))


def test_a_cuda_device_on_a_cluster_without_gpus_is_refused():
    with pytest.raises(PlanError, match=r"needs 1 GPUs \(learner 1 x 1\) but the test cluster has 0"):
        check_plan(config(**{"learner.device": "cuda"}), nodes((8, 0)))


def test_a_tensor_parallel_engine_must_fit_on_one_node():
    cfg = config(**{"rollout.engine.tensor_parallel_size": 8, "learner.device": "cpu", "eval.enabled": False})
    check_plan(cfg, nodes((8, 8)))
    with pytest.raises(PlanError) as err:
        check_plan(cfg, nodes((8, 4), (8, 4)))  # 8 GPUs in all, but 4 per node
    message = str(err.value)
    assert "one rollout actor needs 1 CPU, 8 GPU on one node" in message
    assert "largest: 8 CPU, 4 GPU" in message and "lower rollout.engine.tensor_parallel_size" in message
    assert "GPUs (" not in message  # the totals fit: only the node size is at fault


def test_bundles_that_fit_in_total_but_not_node_by_node_are_refused():
    cfg = config(**{"rollout.num_workers": 3, "rollout.engine.tensor_parallel_size": 2, "learner.device": "cpu",
                    "eval.enabled": False})
    check_plan(cfg, nodes((4, 4), (4, 2)))  # 2 engines on the first node, 1 on the second
    with pytest.raises(PlanError, match="in total but not node by node"):
        check_plan(cfg, nodes((4, 3), (4, 3)))  # 6 GPUs, but each node holds one 2-GPU engine


def test_the_embedded_cluster_has_the_declared_gpus_and_enough_cpus():
    cfg = config(**{"ray.num_gpus": 4, "rollout.num_workers": 40})
    (node,) = local_cluster(cfg).nodes
    assert node.gpus == 4 and node.cpus >= 42  # logical CPUs grow to the plan unless ray.num_cpus says
    (node,) = local_cluster(config(**{"ray.num_gpus": 0, "ray.num_cpus": 2})).nodes
    assert (node.cpus, node.gpus) == (2, 0)


def test_etarl_plan_prints_the_plan_and_exits_0_when_it_fits(capsys):
    assert main(["plan", "ray.num_gpus=4", "ray.num_cpus=8", "rollout.num_workers=2"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["fits"] and report["problems"] == []
    assert report["total"] == {"CPU": 4.0, "GPU": 4}
    assert report["roles"]["rollout"]["count"] == 2 and report["roles"]["rollout"]["per_actor"] == {"CPU": 1.0,
                                                                                                   "GPU": 1}
    assert report["cluster"]["nodes"] == [{"name": "local", "CPU": 8.0, "GPU": 4.0}]


def test_etarl_plan_exits_2_with_the_reason_when_it_cannot_fit(capsys):
    assert main(["plan", "ray.num_gpus=4", "rollout.num_workers=4"]) == 2
    captured = capsys.readouterr()
    report = json.loads(captured.out)
    assert not report["fits"] and report["total"]["GPU"] == 6
    assert "needs 6 GPUs" in captured.err and "ray.num_gpus" in captured.err and "rollout.num_workers" in captured.err


def test_etarl_train_refuses_a_plan_that_cannot_fit_before_starting_anything(tmp_path):
    run_dir = tmp_path / "run"
    out = subprocess.run([sys.executable, "-m", "services.cli", "train", f"run.run_dir={run_dir}", "ray.num_gpus=4",
                          "rollout.num_workers=4", "run.progress=false"], cwd=REPO, capture_output=True, text=True,
                         timeout=300, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert out.returncode == 2, out.stderr[-3000:]
    assert "the run does not fit the cluster" in out.stderr and "needs 6 GPUs" in out.stderr
    assert "Ray instance" not in out.stderr  # no Ray started
    assert not (run_dir / "config.yaml").exists()  # nor the run


def test_device_outside_ray_follows_what_the_process_sees():
    import torch

    from lm.device import resolve_device

    assert resolve_device("cpu", "test").type == "cpu"
    assert resolve_device("auto", "test").type == ("cuda" if torch.cuda.is_available() else "cpu")
    if not torch.cuda.is_available():
        with pytest.raises(RuntimeError, match="device 'cuda', but CUDA is not available"):
            resolve_device("cuda", "test")
    with pytest.raises(ValueError, match="device must be one of"):
        resolve_device("cuda:1", "test")
