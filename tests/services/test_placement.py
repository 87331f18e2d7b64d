"""The placement plan (services/placement.py) without Ray: what every role asks for, the fit check
against clusters of several nodes, its messages, `etarl plan`, and `etarl train` refusing a plan
that cannot fit before it starts anything. Device resolution outside Ray (lm/device.py)."""
from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest

from services.cli import EXIT_CONFIG_ERROR, main
from services.config import build_config
from rollout_workers.engines.vllm_check import installed_vllm
from services.placement import Cluster, Node, PlanError, check_plan, local_cluster, make_plan, resolve_layout

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
    assert asks(plan) == {"rollout": (3, 1.0, 0), "learner": (1, 1.0, 0), "buffer": (1, 0, 0),
                          "weight_store": (1, 0, 0)}  # evaluation runs on a rollout engine: no actor of its own
    assert not plan.engines_share_gpus_with_learner()


def test_with_gpus_engines_and_ranks_ask_for_the_gpus_they_use():
    cfg = config(**{"rollout.num_workers": 3, "rollout.engine.tensor_parallel_size": 2,
                    "learner.distributed.world_size": 2, "ray.worker_num_cpus": 2})
    plan = make_plan(cfg, cluster_has_gpus=True)
    assert asks(plan) == {"rollout": (3, 2.0, 2), "learner": (2, 1.0, 1), "buffer": (1, 0, 0),
                          "weight_store": (1, 0, 0)}
    assert plan.total() == {"CPU": 8.0, "GPU": 8}
    assert not plan.engines_share_gpus_with_learner()  # whole GPUs each: engines load while the learner does
    # device cpu: that role asks for none
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
    cfg = config(**{"rollout.num_workers": 4})  # 4 workers + learner
    check_plan(cfg, nodes((16, 5)))
    with pytest.raises(PlanError) as err:
        check_plan(cfg, nodes((16, 4)))
    message = str(err.value)
    assert "needs 5 GPUs (rollout 4 x 1, learner 1 x 1)" in message and "has 4" in message
    for key in ("rollout.num_workers", "learner.distributed.world_size", "more nodes",
                "learner.device=cpu"):
        assert key in message


def test_too_few_cpus_names_the_cpu_keys():
    with pytest.raises(PlanError, match=r"needs 2 CPUs .* has 1: .*ray\.worker_num_cpus.*ray\.learner_num_cpus"):
        check_plan(config(), nodes((1, 0)))


def test_a_cuda_device_on_a_cluster_without_gpus_is_refused():
    with pytest.raises(PlanError, match=r"needs 1 GPUs \(learner 1 x 1\) but the test cluster has 0"):
        check_plan(config(**{"learner.device": "cuda"}), nodes((8, 0)))


def test_a_tensor_parallel_engine_must_fit_on_one_node():
    cfg = config(**{"rollout.engine.tensor_parallel_size": 8, "learner.device": "cpu"})
    check_plan(cfg, nodes((8, 8)))
    with pytest.raises(PlanError) as err:
        check_plan(cfg, nodes((8, 4), (8, 4)))  # 8 GPUs in all, but 4 per node
    message = str(err.value)
    assert "one rollout actor needs 1 CPU, 8 GPU on one node" in message
    assert "largest: 8 CPU, 4 GPU" in message and "lower rollout.engine.tensor_parallel_size" in message
    assert "GPUs (" not in message  # the totals fit: only the node size is at fault


def test_bundles_that_fit_in_total_but_not_node_by_node_are_refused():
    cfg = config(**{"rollout.num_workers": 3, "rollout.engine.tensor_parallel_size": 2, "learner.device": "cpu"})
    check_plan(cfg, nodes((4, 4), (4, 2)))  # 2 engines on the first node, 1 on the second
    with pytest.raises(PlanError, match="in total but not node by node"):
        check_plan(cfg, nodes((4, 3), (4, 3)))  # 6 GPUs, but each node holds one 2-GPU engine


def test_the_embedded_cluster_has_the_declared_gpus_and_enough_cpus():
    cfg = config(**{"ray.num_gpus": 4, "rollout.num_workers": 40})
    (node,) = local_cluster(cfg).nodes
    assert node.gpus == 4 and node.cpus >= 41  # logical CPUs grow to the plan unless ray.num_cpus says
    (node,) = local_cluster(config(**{"ray.num_gpus": 0, "ray.num_cpus": 2})).nodes
    assert (node.cpus, node.gpus) == (2, 0)


def test_etarl_plan_prints_the_plan_and_exits_0_when_it_fits(capsys):
    assert main(["plan", "ray.num_gpus=4", "ray.num_cpus=8", "rollout.num_workers=2"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["fits"] and report["problems"] == []
    assert report["total"] == {"CPU": 3.0, "GPU": 3}  # the learner rank you left alone: 1
    assert report["roles"]["rollout"]["count"] == 2 and report["roles"]["rollout"]["per_actor"] == {"CPU": 1.0,
                                                                                                   "GPU": 1}
    assert report["cluster"]["nodes"] == [{"name": "local", "CPU": 8.0, "GPU": 4.0}]


def test_etarl_plan_exits_2_with_the_reason_when_it_cannot_fit(capsys):
    assert main(["plan", "ray.num_gpus=4", "rollout.num_workers=4"]) == 2
    captured = capsys.readouterr()
    report = json.loads(captured.out)
    assert not report["fits"] and report["total"]["GPU"] == 5
    assert "needs 5 GPUs" in captured.err and "ray.num_gpus" in captured.err and "rollout.num_workers" in captured.err


def test_etarl_train_refuses_a_plan_that_cannot_fit_before_starting_anything(tmp_path):
    run_dir = tmp_path / "run"
    out = subprocess.run([sys.executable, "-m", "services.cli", "train", f"run.run_dir={run_dir}", "ray.num_gpus=4",
                          "rollout.num_workers=4", "run.progress=false"], cwd=REPO, capture_output=True, text=True,
                         timeout=300, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert out.returncode == 2, out.stderr[-3000:]
    assert "the run does not fit the cluster" in out.stderr and "needs 5 GPUs" in out.stderr
    assert "Ray instance" not in out.stderr  # no Ray started
    assert not (run_dir / "config.yaml").exists()  # nor the run


def test_the_run_summary_names_each_roles_gpu_memory_only_on_gpus():
    import torch

    from lm.device import gpu_memory_peaks
    from services.controller import RunResult

    assert gpu_memory_peaks(torch.device("cpu")) == {}  # a CPU learner: the controller asks nothing
    result = RunResult(Path("run"), 3, 3, True, False)
    assert "gpu_memory_gib" not in result.summary()
    result.gpu_memory_gib = {"learner": 3.5, "worker-0": 1.25}
    assert result.summary()["gpu_memory_gib"] == {"learner": 3.5, "worker-0": 1.25}
    if torch.cuda.is_available():
        assert set(gpu_memory_peaks(torch.device("cuda", 0))) == {"max_memory_allocated", "max_memory_reserved"}


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


# ------------------------------------------------------------------ the layout chosen for the GPUs found


def layout_for(shape, params=None, *overrides):
    """The embedded default (counts unset) on `shape` nodes, a model of `params` parameters."""
    cfg, layout = resolve_layout(build_config({}, list(overrides)) if overrides else load_config(None, []),
                                 nodes(*shape), params)
    plan = make_plan(cfg, True).check(nodes(*shape))
    return cfg, layout, plan


from services.config import load_config  # noqa: E402


def test_one_gpu_colocates_an_engine_and_a_learner_rank_with_gpu_defaults():
    cfg, layout, plan = layout_for([(4, 1)])
    assert layout.name == "colocated" and any("one GPU" in r for r in layout.reasons)
    rollout, learner = plan.role("rollout"), plan.role("learner")
    assert (rollout.count, learner.count) == (1, 1) and rollout.placement == learner.placement == "colocated"
    assert rollout.gpus == cfg.rollout.engine.gpu_memory_utilization == 0.3 and learner.gpus == 0.7
    assert plan.bundles() == [{"CPU": 2.0, "GPU": 1.0}]  # one bundle, both actors in it
    assert plan.engines_share_gpus_with_learner()  # so the engine starts after the learner has loaded
    # the GPU defaults, visible in the config
    assert cfg.rollout.engine.dtype == "bfloat16"
    assert (cfg.learner.dtype, cfg.learner.mixed_precision, cfg.learner.gradient_checkpointing) == (
        "float32", "bfloat16", False)  # the tiny model's activations are a few MiB: nothing recomputed
    assert cfg.learner.weight_sync.dtype == "bfloat16"  # versions go out in the engine's dtype


def test_two_gpus_one_each_and_the_cpu_defaults_stay_without_gpus():
    cfg, layout, plan = layout_for([(8, 2)])
    assert layout.name == "separate" and asks(plan)["rollout"][::2] == (1, 1) and asks(plan)["learner"][::2] == (1, 1)
    assert cfg.rollout.engine.gpu_memory_utilization == 0.85
    cpu, layout = resolve_layout(load_config(None, []), nodes((8, 0)))
    assert layout.name == "cpu" and cpu == load_config(None, [])  # unchanged: float32, no autocast
    assert (cpu.rollout.engine.dtype, cpu.learner.mixed_precision, cpu.learner.gradient_checkpointing) == (
        "float32", None, False)
    # the engine on the CPU (vLLM-CPU on a GPU box): the learner has the GPU, the engine keeps CPU defaults
    cfg, layout, plan = layout_for([(8, 1)], None, "rollout.engine.device=cpu")
    assert layout.name == "separate" and asks(plan)["learner"][::2] == (1, 1) and asks(plan)["rollout"][2] == 0
    assert (cfg.rollout.engine.dtype, cfg.rollout.engine.gpu_memory_utilization) == ("float32", None)
    assert (cfg.learner.mixed_precision, cfg.learner.gradient_checkpointing) == ("bfloat16", False)


QWEN_1_5B = {"model_type": "qwen2", "hidden_size": 1536, "num_hidden_layers": 28, "intermediate_size": 8960,
             "num_attention_heads": 12, "num_key_value_heads": 2, "vocab_size": 151936}
QWEN_7B = {**QWEN_1_5B, "hidden_size": 3584, "intermediate_size": 18944, "num_attention_heads": 28,
           "num_key_value_heads": 4, "vocab_size": 152064}


@pytest.mark.parametrize(("config", "params", "shape", "gpu_gib", "overrides", "mode"), [
    # one H200: 23 GiB of state and a 16,384-token step without checkpointing (58 GiB measured, 81.5 GiB
    # peak) fit the learner's 70 % (98 GiB) beside the engine's 30 %
    (QWEN_1_5B, 1.544e9, [(16, 1)], 140.4, (), False),
    # one H100: the learner's 56 GiB hold the state and a full-checkpointing step only (selective's
    # measured 51.9 GiB peak would leave 4 GiB)
    (QWEN_1_5B, 1.544e9, [(16, 1)], 79.6, (), True),
    # two H100s, a GPU each: selective fits (52 of 80 GiB), no checkpointing does not
    (QWEN_1_5B, 1.544e9, [(16, 2)], 79.6, (), "selective"),
    # halving the token budget halves the activations: no checkpointing fits an H100 alone
    (QWEN_1_5B, 1.544e9, [(16, 2)], 79.6, ("learner.max_tokens_per_micro_batch=8192",), False),
    # 7B on a node of 8 H100s, 4 FSDP ranks: 28 GiB of state per rank, selective's 52 GiB do not fit beside it
    (QWEN_7B, 7.6e9, [(64, 8)], 79.6, (), True),
    # the user's choice is kept; a mixture of experts is not estimated (full)
    (QWEN_1_5B, 1.544e9, [(16, 1)], 140.4, ("learner.gradient_checkpointing=selective",), "selective"),
    ({**QWEN_1_5B, "num_experts": 8, "num_experts_per_tok": 2}, 1.544e9, [(16, 1)], 140.4, (), True),
])
def test_gradient_checkpointing_recomputes_least_where_the_step_fits(tmp_path, config, params, shape, gpu_gib,
                                                                     overrides, mode):
    """On one H200 at 1.5B, B = 32, the learner's step ran 27,057 tokens/s without checkpointing and
    24,307 selective; full recomputes the most. The plan takes the least recomputation whose
    estimated step fits the learner's GPU memory beside its state, and says why."""
    (tmp_path / "config.json").write_text(json.dumps(config))
    cfg, layout = resolve_layout(build_config({}, [f"run.model={tmp_path}", *overrides]), nodes(*shape), params,
                                 gpu_gib)
    assert cfg.learner.gradient_checkpointing == mode
    if not overrides or "gradient_checkpointing" not in overrides[0]:
        (why,) = [r for r in layout.reasons if r.startswith("gradient_checkpointing=")]
        assert ("mixture of experts" in why) == ("num_experts" in config)
    else:
        assert not any(r.startswith("gradient_checkpointing=") for r in layout.reasons)


def test_a_cuda_learner_packs_through_flash_varlen_where_the_model_and_its_settings_allow(tmp_path):
    cfg, layout, _ = layout_for([(4, 1)])
    assert cfg.learner.attn_implementation == "varlen" and "learner.attn_implementation=varlen" in layout.reasons[-1]
    # declared GPUs without CUDA (this suite): the learner computes on a CPU, sdpa stays
    cfg, _ = resolve_layout(load_config(None, []), nodes((4, 1)), cuda=False)
    assert cfg.learner.attn_implementation is None
    # what flash cannot take: float32 compute, padded micro-batches; what the user named is kept
    for overrides, attn in ((["learner.mixed_precision=null"], None), (["learner.packing=false"], None),
                            (["learner.attn_implementation=sdpa"], "sdpa"),
                            (["learner.dtype=bfloat16", "learner.mixed_precision=null"], "varlen")):
        assert layout_for([(4, 1)], None, *overrides)[0].learner.attn_implementation == attn, overrides
    # a model folder: varlen unless its config has a sliding window (or cannot be read)
    for name, fields, attn in (("qwen2", {"sliding_window": 32768, "use_sliding_window": False}, "varlen"),
                               ("mistral", {"sliding_window": None}, "varlen"),
                               ("gemma", {"sliding_window": 4096}, None),
                               ("qwen2-window", {"sliding_window": 4096, "use_sliding_window": True}, None),
                               ("unreadable", None, None)):
        folder = tmp_path / name
        folder.mkdir()
        if fields is not None:
            (folder / "config.json").write_text(json.dumps(fields))
        cfg, _ = resolve_layout(build_config({}, [f"run.model={folder}"]), nodes((4, 1)))
        assert cfg.learner.attn_implementation == attn, name


@pytest.mark.parametrize(("shape", "params", "engines", "tp", "ranks", "strategy"), [
    ([(64, 8)], 1.5e9, 4, 1, 4, "allreduce"),       # 8 GPUs: half and half
    ([(64, 8)], 7e9, 4, 1, 4, "fsdp"),              # 112 GB of float32 state: sharded
    ([(64, 8)], 30e9, 2, 2, 4, "fsdp"),             # 60 GB of bf16 weights: 2-GPU engines
    ([(64, 8), (64, 8)], 7e9, 8, 1, 8, "fsdp"),     # 2 x 8: the ranks pack one node, the engines the other
    ([(64, 8), (64, 8)], 70e9, 1, 8, 8, "fsdp"),    # 140 GB of weights: one 8-GPU engine
    ([(64, 4), (64, 4)], 70e9, 1, 4, 4, "fsdp"),    # tensor parallelism stops at a node's GPUs
])
def test_many_gpus_split_by_the_documented_rule(shape, params, engines, tp, ranks, strategy):
    cfg, layout, plan = layout_for(shape, params)
    assert layout.name == "separate"
    assert (cfg.rollout.num_workers, cfg.rollout.engine.tensor_parallel_size) == (engines, tp)
    assert (cfg.learner.distributed.world_size, cfg.learner.distributed.strategy) == (ranks, strategy)
    assert cfg.learner.distributed.backend == "nccl"
    assert plan.total()["GPU"] <= sum(g for _, g in shape)
    assert any(f"learner ranks = {sum(g for _, g in shape)} // 2" in r for r in layout.reasons)


def test_the_parameter_count_of_a_model_folder_is_its_tensors_elements_whatever_their_dtype(tmp_path):
    """The layout's sizes come from the folder's safetensors headers: a float32 folder (a learner's
    policy/, config.json naming `dtype` as transformers 5 writes it) counts its elements, not its
    bytes over two (it was taken for twice the model), and so do bfloat16 shards; a folder without
    weights, or a built-in model, has no count (tensor_parallel_size 1, said)."""
    import torch
    from safetensors.torch import save_file

    from services.placement import model_parameters

    tensors = {"model.embed_tokens.weight": torch.zeros(100, 16), "model.norm.weight": torch.zeros(16),
               "lm_head.weight": torch.zeros(100, 16)}
    elements = 100 * 16 * 2 + 16
    learner_saved = tmp_path / "float32"
    learner_saved.mkdir()
    (learner_saved / "config.json").write_text(json.dumps({"model_type": "qwen2", "dtype": "float32"}))
    save_file(tensors, str(learner_saved / "model.safetensors"))
    assert model_parameters(str(learner_saved)) == elements
    sharded = tmp_path / "bf16"
    sharded.mkdir()
    (sharded / "config.json").write_text(json.dumps({"model_type": "qwen2", "torch_dtype": "bfloat16"}))
    names = sorted(tensors)
    for i, part in enumerate((names[:1], names[1:])):
        save_file({n: tensors[n].bfloat16() for n in part}, str(sharded / f"model-0000{i + 1}-of-00002.safetensors"))
    assert model_parameters(str(sharded)) == elements
    config_only = tmp_path / "config_only"
    config_only.mkdir()
    (config_only / "config.json").write_text(json.dumps({"model_type": "qwen2"}))
    assert model_parameters(str(config_only)) is None and model_parameters("tiny") is None


def test_a_critic_counts_in_the_learner_state_that_decides_sharding():
    """1.5B: 24 GB of float32 training state fits half an 80 GB GPU; PPO with gae trains a critic of
    about the policy's size beside it: 48 GB does not, so its ranks shard."""
    cfg, _, _ = layout_for([(64, 8)], 1.5e9)
    assert cfg.learner.distributed.strategy == "allreduce"
    cfg, layout, _ = layout_for([(64, 8)], 1.5e9, "learner.advantage.estimator=gae")
    assert cfg.learner.distributed.strategy == "fsdp"
    assert any("learner state 45 GiB (float32 weights, gradients, AdamW; the critic's float32 weights" in r
               for r in layout.reasons)


def test_a_lora_policy_counts_its_frozen_weights_only():
    """7B: 104 GB of float32 training state shards; with LoRA the optimizer holds the adapters
    only, and the 26 GB of frozen float32 weights fit half a GPU: the ranks keep whole replicas."""
    cfg, _, _ = layout_for([(64, 8)], 7e9, "learner.lora.rank=64")
    assert cfg.learner.distributed.strategy == "allreduce"
    cfg, layout, _ = layout_for([(64, 8)], 7e9, "learner.lora.rank=64", "learner.advantage.estimator=gae")
    assert cfg.learner.distributed.strategy == "fsdp"
    assert any("learner state 130 GiB (the policy's frozen float32 LoRA base; the critic's float32 weights, "
               "gradients, AdamW) > half a GPU" in r for r in layout.reasons)
    cfg, layout, _ = layout_for([(64, 8)], 30e9, "learner.lora.rank=64", "learner.dtype=bfloat16")
    assert any("learner state 56 GiB (the policy's frozen bfloat16 LoRA base) > half a GPU" in r
               for r in layout.reasons)


def test_a_gpu_machine_without_vllm_for_gpus_gets_the_transformers_engine_unless_the_user_named_one():
    cpu_only = frozenset({"cpu"})  # as where only vllm-cpu is installed
    cfg, layout = resolve_layout(load_config(None, []), nodes((4, 1)), vllm_builds=cpu_only)
    assert cfg.rollout.engine.kind == "hf" and any("no vLLM for GPUs" in r for r in layout.reasons)
    assert dict(layout.changes)["rollout.engine.kind"] == "hf"
    assert make_plan(cfg, True).check(nodes((4, 1))).role("rollout").placement == "colocated"
    # 8 GPUs: the transformers engine has no tensor parallelism, so none is chosen for it
    cfg, _ = resolve_layout(load_config(None, []), nodes((64, 8)), 30e9, vllm_builds=frozenset())
    assert (cfg.rollout.engine.kind, cfg.rollout.engine.tensor_parallel_size) == ("hf", 1)
    assert cfg.rollout.num_workers == 4
    # named: kept (the worker says what to install); declared GPUs on a CPU machine: vLLM-CPU stays
    cfg, _ = resolve_layout(build_config({}, ["rollout.engine.kind=vllm"]), nodes((4, 1)), vllm_builds=cpu_only)
    assert cfg.rollout.engine.kind == "vllm"
    cfg, _ = resolve_layout(build_config({}, ["rollout.engine.tensor_parallel_size=2"]), nodes((8, 4)),
                            vllm_builds=cpu_only)
    assert (cfg.rollout.engine.kind, cfg.rollout.engine.tensor_parallel_size) == ("vllm", 2)  # vLLM's alone
    cfg, _ = resolve_layout(load_config(None, []), nodes((4, 1)), cuda=False, vllm_builds=cpu_only)
    assert cfg.rollout.engine.kind == "vllm"
    # a GPU build alone is no engine for a CPU run: the transformers engine there too
    cfg, layout = resolve_layout(load_config(None, []), nodes((4, 1)), cuda=False, vllm_builds=frozenset({"gpu"}))
    assert cfg.rollout.engine.kind == "hf" and any("no vLLM for CPUs" in r for r in layout.reasons)
    # CPU runs keep vLLM-CPU; the metadata check says what this machine has (vllm-cpu: no GPU build)
    cfg, layout = resolve_layout(load_config(None, []), nodes((8, 0)), vllm_builds=cpu_only)
    assert layout.name == "cpu" and cfg.rollout.engine.kind == "vllm" and not layout.changes
    from importlib.metadata import distributions

    names = {d.metadata["Name"].lower() for d in distributions()}
    if "vllm-cpu" in names and "vllm" not in names:
        assert installed_vllm() == "cpu"


def test_a_machine_without_vllm_runs_the_transformers_engine_and_refuses_a_run_that_names_vllm(monkeypatch, capsys):
    """No vLLM installed at all (pip install etarl without an extra): the run that names no engine
    gets the transformers engine and says why (`etarl config` shows it); naming vllm is refused
    before anything starts, with what to install."""
    import services.placement as placement

    monkeypatch.setattr(placement, "installed_vllm", lambda: None)  # as on a machine without vLLM
    cfg = load_config(None, [])
    plan = placement.plan_for(cfg, local_cluster(cfg))
    assert plan.config.rollout.engine.kind == "hf"
    assert any("no vLLM for CPUs is installed here" in r for r in plan.layout.reasons)
    assert main(["config"]) == 0
    out = capsys.readouterr().out
    assert "#   no vLLM for CPUs is installed here" in out and "kind: hf" in out
    cfg = load_config(None, ["rollout.engine.kind=vllm"])
    with pytest.raises(PlanError, match="vLLM is not installed here: .*rollout.engine.kind=hf"):
        placement.plan_for(cfg, local_cluster(cfg))


def test_a_mixture_of_experts_on_a_cpu_engine_gets_the_transformers_engine_and_naming_vllm_is_refused(
        tiny_model_dir, tmp_path, monkeypatch):
    """vLLM-CPU serves an MoE wrongly after its first weight update (its engine refuses one): a run
    of tiny-moe or of an MoE folder on CPUs gets the transformers engine and says why, before any
    actor starts; naming vllm there is refused (exit 2), not a worker's traceback; on GPUs vLLM
    stays. `etarl eval` makes the same choice for the folder it evaluates."""
    import shutil

    import services.placement as placement
    from services.controller import evaluate_model

    moe_folder = tmp_path / "moe"
    shutil.copytree(tiny_model_dir, moe_folder)
    config = json.loads((moe_folder / "config.json").read_text())
    (moe_folder / "config.json").write_text(json.dumps({**config, "num_experts": 8, "num_experts_per_tok": 2}))
    for model in ("tiny-moe", str(moe_folder)):
        cfg, layout = resolve_layout(load_config(None, [f"run.model={model}"]), nodes((8, 0)))
        assert cfg.rollout.engine.kind == "hf" and dict(layout.changes)["rollout.engine.kind"] == "hf"
        assert any("a mixture-of-experts policy on a CPU engine" in r for r in layout.reasons)
        with pytest.raises(PlanError, match="rollout.engine.kind=vllm on a CPU .* a mixture of experts"):
            resolve_layout(load_config(None, [f"run.model={model}", "rollout.engine.kind=vllm"]), nodes((8, 0)))
        cfg, _ = resolve_layout(load_config(None, [f"run.model={model}"]), nodes((4, 1)))  # an engine on a GPU
        assert cfg.rollout.engine.kind == "vllm"
    cfg, layout = resolve_layout(load_config(None, [f"run.model={tiny_model_dir}"]), nodes((8, 0)))
    assert cfg.rollout.engine.kind == "vllm" and not layout.changes  # dense: vLLM-CPU serves it
    cache = tmp_path / "cache"
    assert main(["train", "run.model=tiny-moe", "rollout.engine.kind=vllm", f"run.cache_dir={cache}"]) == EXIT_CONFIG_ERROR
    assert not (cache / "tiny-model").exists(), "refused before its model was built"

    made = []  # etarl eval: the engine the evaluator is given, for the folder it evaluates
    monkeypatch.setattr(placement, "_cuda_here", lambda: False)
    monkeypatch.setattr("services.evaluation.PolicyEvaluator.from_config",
                        classmethod(lambda cls, c, folder: made.append((c.eval.engine, folder)) or _NoEvaluation()))
    evaluate_model(load_config(None, []), model=str(moe_folder))
    evaluate_model(load_config(None, []), model=str(tiny_model_dir))
    evaluate_model(load_config(None, ["eval.engine=vllm"]), model=str(tiny_model_dir))
    assert [kind for kind, _ in made] == ["hf", "vllm", "vllm"]


def test_etarl_eval_of_a_run_saved_with_vllm_takes_the_transformers_engine_where_no_vllm_is_installed(
        tiny_model_dir, tmp_path, monkeypatch, caplog):
    """A run's saved config names the engine its layout chose (vLLM on its GPUs, NCCL weight
    transfer); `etarl eval --run` on a machine without vLLM evaluates its checkpoint with the
    transformers engine and says why, where it used to fail starting vLLM, and the weight transfer
    is chosen here again. What the command line names is kept."""
    import shutil

    import services.placement as placement

    run = tmp_path / "run"
    step = run / "checkpoints" / "step_000010"
    shutil.copytree(tiny_model_dir, step / "policy")
    (step / "state.json").write_text("{}")
    (run / "config.yaml").write_text(load_config(None, [f"run.model={tiny_model_dir}",
                                                        "rollout.engine.kind=vllm",
                                                        "rollout.engine.weight_transfer=nccl"]).to_yaml())
    made = []
    monkeypatch.setattr(placement, "_cuda_here", lambda: False)
    monkeypatch.setattr(placement, "installed_vllm", lambda: None)
    monkeypatch.setattr("services.evaluation.PolicyEvaluator.from_config",
                        classmethod(lambda cls, c, folder: made.append((c.eval.engine, folder, c.rollout.engine.weight_transfer))
                                    or _NoEvaluation()))
    with caplog.at_level(logging.INFO, logger="etarl"):
        assert main(["eval", "--run", str(run)]) == 0
    assert made == [("hf", step / "policy", "auto")]
    assert "no vLLM for CPUs is installed here: the transformers engine" in caplog.text
    assert main(["eval", "--run", str(run), "rollout.engine.kind=vllm", "rollout.engine.weight_transfer=gloo"]) == 0
    assert made[-1][0::2] == ("vllm", "gloo")  # named here: kept (and the engine, starting, says what is missing)


class _NoEvaluation:
    """Stands in for an evaluator where only the engine chosen for it is checked."""

    prompts = ()

    def evaluate_payload(self, payload):
        return {}

    def close(self):
        pass


@pytest.mark.parametrize(("shape", "overrides", "backend"), [
    ([(4, 1)], [], "ipc"),                                   # vLLM on the learner's GPU: IPC handles
    ([(8, 2)], [], "nccl"),                                  # vLLM on its own GPU
    ([(4, 1)], ["rollout.engine.kind=hf"], "gloo"),          # the transformers engine receives gloo only
    ([(8, 2)], ["rollout.engine.device=cpu"], "gloo"),       # vLLM-CPU beside a GPU learner
    ([(8, 2)], ["learner.device=cpu"], "gloo"),
    ([(8, 2)], ["rollout.engine.weight_transfer=gloo"], "gloo"),  # named on the engine's side: kept
    ([(8, 2)], ["ray.layout=colocated"], "gloo"),            # two pairs: engine 1 is not on rank 0's GPU
])
def test_the_plan_gives_both_ends_of_the_weight_broadcast_one_backend(shape, overrides, backend):
    cfg, _ = resolve_layout(build_config({}, ["learner.weight_sync.channel=broadcast", *overrides]), nodes(*shape))
    assert (cfg.learner.weight_sync.backend, cfg.rollout.engine.weight_transfer) == (backend, backend)
    # declared GPUs on a CPU machine: gloo; a backend the user named: kept
    cfg, _ = resolve_layout(build_config({}, ["learner.weight_sync.channel=broadcast"]), nodes(*shape), cuda=False)
    assert cfg.learner.weight_sync.backend == "gloo"
    named = build_config({}, ["learner.weight_sync.channel=broadcast", "learner.weight_sync.backend=nccl"])
    assert resolve_layout(named, nodes((8, 2)))[0].learner.weight_sync.backend == "nccl"
    # auto written out is still the plan's to choose
    auto = build_config({}, ["learner.weight_sync.channel=broadcast", "learner.weight_sync.backend=auto", *overrides])
    assert resolve_layout(auto, nodes(*shape))[0].learner.weight_sync.backend == backend


def test_what_the_user_names_is_kept_and_a_run_that_fits_only_colocated_is_colocated():
    cfg, layout, _ = layout_for([(64, 8)], 7e9, "rollout.num_workers=6", "rollout.engine.dtype=float32")
    assert (cfg.rollout.num_workers, cfg.learner.distributed.world_size, cfg.rollout.engine.dtype) == (6, 1, "float32")
    assert layout.name == "separate"
    # 2 engines + 2 ranks on 2 GPUs fit only in pairs: colocated, not refused
    cfg, layout, plan = layout_for([(8, 2)], None, "rollout.num_workers=2", "learner.distributed.world_size=2")
    assert layout.name == "colocated" and plan.bundles() == [{"CPU": 2.0, "GPU": 1.0}] * 2
    # a layout the user pins that cannot be is refused, naming the keys
    with pytest.raises(PlanError, match="learner.distributed.world_size=1 .*rollout.num_workers=2"):
        make_plan(config(**{"ray.layout": "colocated", "rollout.num_workers": 2}), True)


def test_etarl_plan_prints_the_layout_and_why_and_etarl_config_shows_the_gpu_defaults(capsys):
    assert main(["plan", "ray.num_gpus=1", "ray.num_cpus=4"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["fits"] and report["layout"]["name"] == "colocated" and report["layout"]["why"]
    assert report["layout"]["set"]["rollout.engine.dtype"] == "bfloat16"
    assert main(["config", "ray.num_gpus=1"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("# layout colocated")
    import yaml

    shown = yaml.safe_load(out)
    assert shown["rollout"]["engine"]["dtype"] == "bfloat16" and shown["learner"]["mixed_precision"] == "bfloat16"
    assert shown["ray"]["layout"] == "colocated"
