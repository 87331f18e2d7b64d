"""LoRA (`learner.lora`): the policy starts as the base model, trains its adapters only, and every
weight that leaves it (publication, the saved policy, the exact drift probe) is merged, so a plain
model computes what the adapted policy computes; the KL reference is the base model; checkpoints
hold the adapters and resume exactly; the adapters also leave as a folder PEFT loads; two gloo ranks
(replicas and FSDP) make the update of one rank. Float64 where runs are compared, so a difference
is the algorithm's, not float32 rounding's."""
from __future__ import annotations

import json

import pytest
import torch

from learner.checkpoint import ADAPTER_DIR, SHARDS_DIR
from learner.config import LearnerConfig
from learner.lora import initial_value
from learner.trainer import Learner
from learner_helpers import build_tiny_policy, engine_following, max_param_diff, params_of, sample_groups
from lm.causal_lm import load_causal_lm, response_log_probs
from lm.lora_weights import merged_weight, target_names
from lm.weight_sync import resolve_weights

LORA = {"rank": 4, "alpha": 8}
ATTENTION_AND_MLP = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


@pytest.fixture(scope="module")
def policy_dir(tmp_path_factory):
    folder = build_tiny_policy(tmp_path_factory.mktemp("lora_policy"), seed=5, vocab_size=49, intermediate_size=63)
    (folder / "tokenizer.json").write_text("{}")  # stands in for the base model's tokenizer
    return folder


@pytest.fixture(scope="module")
def groups(policy_dir):
    return sample_groups(policy_dir, n_groups=4, n=3, seed=6, logprob_noise=0.2)


def _config(policy_dir, **extra) -> LearnerConfig:
    settings = dict(model_path=str(policy_dir), lr=1e-2, dtype="float64", lora=LORA,
                    rollout_correction="decoupled_token_is")
    return LearnerConfig(**{**settings, **extra})


def _log_probs(model, groups) -> torch.Tensor:
    prompts = [s.prompt_ids for g in groups for s in g.samples]
    responses = [list(s.response_ids) for g in groups for s in g.samples]
    with torch.no_grad():
        return response_log_probs(model, prompts, responses)[0]


def _logits(model, groups) -> torch.Tensor:
    """Each sample's prompt and response through `model` (a PEFT model too) one at a time."""
    with torch.no_grad():
        return torch.cat([model(input_ids=torch.tensor([list(s.prompt_ids) + list(s.response_ids)])).logits[0]
                          for g in groups for s in g.samples])


def _plain_model(policy_dir, weights: dict[str, torch.Tensor]):
    model = load_causal_lm(policy_dir, dtype="float64")
    result = model.load_state_dict(weights, strict=False)
    assert not result.unexpected_keys and set(result.missing_keys) <= {"lm_head.weight"}  # tied
    return model


def test_the_adapters_start_as_the_base_model_train_alone_and_leave_merged(policy_dir, groups, ray_cluster):
    base = load_causal_lm(policy_dir, dtype="float64")
    learner = Learner(_config(policy_dir, policy_loss={"kl_coef": 0.5}))
    # every linear layer but the (tied) LM head: 7 per layer, 2 layers; the optimizer holds only them
    assert len(learner.adapters.names) == 14
    # r x (in + out) per layer: q and o 32 + 32, k and v 32 + 16 (2 kv heads of 8), the MLP's three 32 + 63
    assert sum(p.numel() for p in learner.params) == learner.adapters.parameter_count() == 2 * 4 * (
        2 * 64 + 2 * 48 + 3 * 95)
    frozen = {k: v for k, v in params_of(learner.model).items() if "lora_" not in k}
    # B = 0: the merged weights are the base's, bit for bit, and so are the log-probs
    assert max_param_diff(learner.policy_weights(), params_of(base)) == 0.0
    assert torch.equal(_log_probs(learner.model, groups), _log_probs(base, groups))

    first = learner.train_step(groups)
    assert first["actor/kl_loss"] == 0.0  # the reference is the base model, which the policy still is
    second = learner.train_step(groups)
    assert second["actor/kl_loss"] > 0.0
    after = params_of(learner.model)
    assert all(torch.equal(after[k], v) for k, v in frozen.items())  # the base never moves
    assert max_param_diff({k: v for k, v in after.items() if "lora_B" in k},
                          {k: torch.zeros_like(v) for k, v in after.items() if "lora_B" in k}) > 1e-3

    # What leaves is merged: a plain model with the published weights computes the policy's
    # log-probs; the adapters' names do not leave.
    assert learner.publish_weights()["version"] == 2
    published = resolve_weights(learner.published(timeout=60))
    assert not any("lora_" in k for k in published) and published.keys() == params_of(base).keys()
    plain = _plain_model(policy_dir, published)
    policy_log_probs = _log_probs(learner.model, groups)
    assert (_log_probs(plain, groups) - policy_log_probs).abs().max() < 1e-12
    assert (policy_log_probs - _log_probs(base, groups)).abs().max() > 1e-3
    with learner.adapters.disabled():  # the KL reference: the same modules without their adapters
        assert torch.equal(_log_probs(learner.model, groups), _log_probs(base, groups))
    learner.close_weight_sync()


def test_with_publish_adapter_the_adapters_alone_leave_and_an_engine_computes_the_policy(policy_dir, groups,
                                                                                      ray_cluster):
    """learner.lora.publish=adapter: a version is the adapters alone (rank x (in + out) a layer, not the
    model), and an engine told the LoRA settings (rollout.engine.lora) computes the policy with them."""
    from rollout_workers.config import EngineLora
    from rollout_workers.engines.hf_engine import HFEngine

    learner = Learner(_config(policy_dir, lora={**LORA, "publish": "adapter"}))
    engine = HFEngine(policy_dir, dtype="float64", lora=EngineLora(**LORA))
    learner.train_step(groups)
    assert learner.publish_weights()["version"] == 1
    published = resolve_weights(learner.published(timeout=60))
    live = params_of(learner.model)
    assert published.keys() == learner.adapters.shapes.keys()
    assert all(torch.equal(tensor, live[name]) for name, tensor in published.items())
    engine.load_weights(1, published)
    assert (_log_probs(engine.model, groups) - _log_probs(learner.model, groups)).abs().max() < 1e-12
    learner.close_weight_sync()


def test_target_modules_pick_layers_as_peft_does(policy_dir):
    model = load_causal_lm(policy_dir)
    names = target_names(model, "all-linear")
    assert len(names) == 14 and "lm_head" not in names
    assert target_names(model, ["q_proj", "v_proj"]) == [
        f"model.layers.{i}.self_attn.{p}" for i in (0, 1) for p in ("q_proj", "v_proj")]
    assert target_names(model, r".*\.1\.mlp\..*") == [f"model.layers.1.mlp.{p}" for p in ("gate_proj", "up_proj",
                                                                                              "down_proj")]
    assert target_names(model, ATTENTION_AND_MLP, exclude_modules=r".*\.0\..*") == names[7:]
    with pytest.raises(ValueError, match=r"picks none of Qwen2ForCausalLM's linear layers; their names end in "
                                         r"\['down_proj', 'gate_proj', 'k_proj'"):
        target_names(model, ["query_key_value"])
    with pytest.raises(ValueError, match="not a regular expression"):
        LearnerConfig(model_path=str(policy_dir), lora={"rank": 2, "target_modules": "q_proj["})
    with pytest.raises(ValueError, match="an empty list adapts nothing"):
        LearnerConfig(model_path=str(policy_dir), lora={"rank": 2, "target_modules": []})
    # A's start is PEFT's Kaiming-uniform bound 1/sqrt(in), fixed by the seed and the name alone
    a = initial_value("model.layers.0.self_attn.q_proj.lora_A.weight", (4, 32), seed=0)
    assert torch.equal(a, initial_value("model.layers.0.self_attn.q_proj.lora_A.weight", (4, 32), seed=0))
    assert not torch.equal(a, initial_value("model.layers.0.self_attn.q_proj.lora_A.weight", (4, 32), seed=1))
    assert 0.9 / 32**0.5 < float(a.abs().max()) <= 1 / 32**0.5
    assert not initial_value("model.layers.0.self_attn.q_proj.lora_B.weight", (32, 4), seed=0).any()


def test_a_checkpoint_holds_the_adapters_resumes_exactly_and_peft_loads_them(policy_dir, groups, tmp_path):
    from peft import PeftModel

    config = _config(policy_dir, lr_schedule="cosine", warmup_steps=1, total_steps=6, gradient_checkpointing=True)
    run = Learner(config)
    for _ in range(2):
        run.train_step(groups)
    run.save_checkpoint(tmp_path / "ckpt")
    at_stop = run.policy_weights()
    want = [run.train_step(groups) for _ in range(2)]

    resumed = Learner(config)
    resumed.load_checkpoint(tmp_path / "ckpt")
    got = [resumed.train_step(groups) for _ in range(2)]
    for w, g in zip(want, got):
        assert g["actor/lr"] == w["actor/lr"]
        assert g["actor/pg_loss"] == pytest.approx(w["actor/pg_loss"], rel=1e-12, abs=1e-15)
    assert max_param_diff(params_of(resumed.model), params_of(run.model)) < 1e-12

    # The shards hold what trains (adapters, their AdamW moments), not the frozen base weights
    # (nor the tied LM head, which DCP's own filter misses).
    import torch.distributed.checkpoint as dcp

    saved = dcp.FileSystemReader(str(tmp_path / "ckpt" / SHARDS_DIR)).read_metadata().state_dict_metadata
    assert {k for k in saved if k.startswith("model.")} == {f"model.{n}.{p}.weight" for n in run.adapters.names
                                                            for p in ("lora_A", "lora_B")}

    # policy/: the merged weights at the stop, a plain HF folder with the base's other files
    policy = tmp_path / "ckpt" / "policy"
    assert (policy / "tokenizer.json").read_text() == "{}"
    assert max_param_diff(params_of(load_causal_lm(policy, dtype="float64")), at_stop) == 0.0
    # lora_adapter/: PEFT's own loader puts the adapters on the base model and computes the policy
    adapter = tmp_path / "ckpt" / ADAPTER_DIR
    settings = json.loads((adapter / "adapter_config.json").read_text())
    assert (settings["r"], settings["lora_alpha"], settings["peft_type"]) == (4, 8, "LORA")
    assert sorted(settings["target_modules"]) == sorted(ATTENTION_AND_MLP)
    assert settings["base_model_name_or_path"] == str(policy_dir.resolve())
    with pytest.raises(FileNotFoundError, match="holds LoRA adapters .* take the merged policy/ beside it"):
        load_causal_lm(adapter)
    peft_model = PeftModel.from_pretrained(load_causal_lm(policy_dir, dtype="float64"), str(adapter)).eval()
    merged = load_causal_lm(policy, dtype="float64")
    assert (_logits(peft_model, groups) - _logits(merged, groups)).abs().max() < 1e-10
    assert (_logits(merged, groups) - _logits(load_causal_lm(policy_dir, dtype="float64"), groups)).abs().max() > 1e-3

    # another run's settings: refused, saying which
    with pytest.raises(ValueError, match=r"trained with LoRA \{'rank': 4, .*this run has LoRA \{'rank': 8"):
        Learner(_config(policy_dir, lora={"rank": 8})).load_checkpoint(tmp_path / "ckpt")
    with pytest.raises(ValueError, match="this run has none: resume with the run's learner.lora"):
        Learner(_config(policy_dir, lora=None)).load_checkpoint(tmp_path / "ckpt")


def test_an_adapter_subset_leaves_as_a_regular_expression_peft_reads(policy_dir, groups, tmp_path):
    """exclude_modules leaves a set no list of last names picks: the folder names the layers exactly."""
    from peft import PeftModel

    learner = Learner(_config(policy_dir, lora={**LORA, "exclude_modules": ["model.layers.0.mlp.up_proj"]}))
    learner.train_step(groups)
    learner.save_checkpoint(tmp_path / "ckpt")
    settings = json.loads((tmp_path / "ckpt" / ADAPTER_DIR / "adapter_config.json").read_text())
    assert isinstance(settings["target_modules"], str) and "model\\.layers\\.0\\.mlp\\.up_proj" not in \
        settings["target_modules"]
    peft_model = PeftModel.from_pretrained(load_causal_lm(policy_dir, dtype="float64"),
                                           str(tmp_path / "ckpt" / ADAPTER_DIR)).eval()
    assert (_logits(peft_model, groups) - _logits(learner.model, groups)).abs().max() < 1e-10


def test_a_bfloat16_base_keeps_float32_adapters(policy_dir, groups):
    """learner.dtype=bfloat16 with LoRA: the frozen model in half the memory, the adapters and their
    AdamW state in float32 (their small updates land), each adapter's input cast to float32 and its
    update back to the layer's bfloat16 output."""
    learner = Learner(_config(policy_dir, dtype="bfloat16"))
    assert {p.dtype for p in learner.params} == {torch.float32}
    assert learner.model.get_submodule("model.layers.0.mlp.up_proj").weight.dtype == torch.bfloat16
    before = params_of(learner.model)
    assert learner.train_step(groups)["actor/grad_norm"] > 0
    after = params_of(learner.model)
    assert {k for k in after if not torch.equal(after[k], before[k])} == {k for k in after if "lora_" in k}
    assert {t.dtype for state in learner.optimizer.state.values() for t in state.values() if t.dim()} == \
        {torch.float32}
    merged = learner.policy_weights()["model.layers.0.mlp.up_proj.weight"]  # rounded once, to the base's dtype
    layer = learner.model.get_submodule("model.layers.0.mlp.up_proj")
    assert merged.dtype == torch.bfloat16 and torch.equal(merged, (
        layer.weight.float() + learner.adapters.scale * layer.lora_B.weight @ layer.lora_A.weight).to(torch.bfloat16))


def test_mixed_precision_and_selective_checkpointing_train_the_adapters(policy_dir, groups):
    learner = Learner(_config(policy_dir, dtype="float32", mixed_precision="bfloat16",
                              gradient_checkpointing="selective", packing=True, attn_implementation="varlen"))
    before = params_of(learner.model)
    metrics = learner.train_step(groups)
    assert torch.isfinite(torch.tensor(metrics["actor/grad_norm"])) and metrics["actor/grad_norm"] > 0
    after = params_of(learner.model)
    moved = [k for k in after if not torch.equal(after[k], before[k])]
    assert moved and all("lora_" in k for k in moved)


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["allreduce", "fsdp"])
def test_two_gloo_ranks_train_the_adapters_as_one_rank_does(policy_dir, groups, two_ranks, tmp_path, strategy):
    """The adapters' gradients are summed over ranks (replicas: one all-reduce of the adapters
    only; FSDP: its reduce-scatter), so two ranks make one rank's update; under FSDP each adapter
    starts from the same value wherever its shards land, the published version is merged from the
    shards, and a checkpoint of the two ranks resumes one unsharded rank."""
    overrides = dict(max_tokens_per_micro_batch=16, ppo_mini_batch_size=2, policy_loss={"kl_coef": 0.2})
    single = Learner(_config(policy_dir, **overrides))
    group = two_ranks(_config(policy_dir, **overrides, distributed={"world_size": 2, "strategy": strategy,
                                                                    "timeout_s": 60}))
    for _ in range(2):
        want, got = single.train_step(groups), group.train_step(groups)
        for key in ("actor/pg_loss", "actor/grad_norm", "actor/kl_loss"):
            assert got[key] == pytest.approx(want[key], rel=1e-9, abs=1e-12), key
    assert max_param_diff(params_of(single.model), group.state_dict()["model"]) < 1e-10
    assert group.publish_weights()["version"] == 2
    published = resolve_weights(group.published(timeout=120))
    assert max_param_diff(published, single.policy_weights()) < 1e-10
    group.save_checkpoint(str(tmp_path / "ckpt"))
    resumed = Learner(_config(policy_dir, **overrides))
    resumed.load_checkpoint(tmp_path / "ckpt")
    assert max_param_diff(params_of(resumed.model), params_of(single.model)) < 1e-10
    assert max_param_diff(params_of(load_causal_lm(tmp_path / "ckpt" / "policy", dtype="float64")),
                          single.policy_weights()) < 1e-10


def test_under_fsdp_the_adapters_leave_whole_when_the_engines_take_adapters(policy_dir, groups, two_ranks):
    """learner.lora.publish=adapter on two FSDP ranks: each adapter is gathered whole from its shards and
    only the adapters leave, equal to one rank's after the same step."""
    overrides = dict(max_tokens_per_micro_batch=16, ppo_mini_batch_size=2, lora={**LORA, "publish": "adapter"})
    single = Learner(_config(policy_dir, **overrides))
    group = two_ranks(_config(policy_dir, **overrides, distributed={"world_size": 2, "strategy": "fsdp",
                                                                    "timeout_s": 60}))
    single.train_step(groups)
    group.train_step(groups)
    assert group.publish_weights()["version"] == 1
    published = resolve_weights(group.published(timeout=120))
    live = params_of(single.model)
    assert published.keys() == single.adapters.shapes.keys()
    assert max_param_diff(published, {name: live[name] for name in published}) < 1e-10


def test_an_moe_policy_adapts_its_linear_layers_and_publishes_checkpoint_names(tmp_path):
    """transformers 5 fuses an MoE block's experts into 3-D parameters and its router is no
    `nn.Linear`: both stay frozen (as under PEFT's all-linear), the attention is adapted, routing
    replay runs beside the adapters, and what leaves is named per expert, as engines load it."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(0)
    config = Qwen3MoeConfig(vocab_size=48, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
                            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                            num_experts=4, num_experts_per_tok=2, max_position_embeddings=64, tie_word_embeddings=True)
    Qwen3MoeForCausalLM(config).save_pretrained(tmp_path)
    learner = Learner(LearnerConfig(model_path=str(tmp_path), lr=1e-2, lora={"rank": 2}, routing_replay="r2"))
    assert learner.adapters.names == [f"model.layers.{i}.self_attn.{p}" for i in (0, 1)
                                      for p in ("q_proj", "k_proj", "v_proj", "o_proj")]
    assert learner.train_step(sample_groups(tmp_path, n_groups=2, n=2))["actor/grad_norm"] > 0
    published = learner._publishable()
    assert "model.layers.1.mlp.experts.3.down_proj.weight" in published and not any("lora_" in k for k in published)
    assert torch.equal(published["model.layers.0.mlp.gate.weight"],
                       load_causal_lm(tmp_path).state_dict()["model.layers.0.mlp.gate.weight"])


@pytest.mark.slow
def test_a_lora_learner_streams_merged_buckets_into_an_engine(policy_dir, groups, ray_cluster):
    """The broadcast channel with `stream_buckets` (its default with LoRA on a GPU, where a whole
    merged version would be a model copy on the GPU): each bucket is merged and sent as the gloo
    stream reaches it, and the engine (a transformers engine in this process, receiving as a
    worker does) ends with the merged weights in the publish dtype."""
    import ray

    from lm.weight_sync import WeightStore
    from rollout_workers.engines.hf_engine import HFEngine

    board = ray.remote(WeightStore).options(num_cpus=0, max_concurrency=16).remote()
    learner = Learner(_config(policy_dir, dtype="float32", weight_sync={
        "channel": "broadcast", "dtype": "bfloat16", "bucket_mb": 0.01, "address": "127.0.0.1", "timeout_s": 60,
        "stream_buckets": True}, distributed={"publish_bucket_mb": 0.02}))
    assert learner._streams_buckets()
    engine = HFEngine(policy_dir, dtype="bfloat16")
    with engine_following(board, engine) as errors:
        try:
            learner.attach_weight_board(board)
            learner.train_step(groups)
            timings = learner.publish_weights()  # returns once the engine has the version
            assert timings["version"] == 1 and timings["engines"] == 1 and timings["blocked_s"] > 0
            assert engine.version == 1, errors
            got, live = engine.model.state_dict(), learner.model.state_dict()
            assert got.keys() == learner.policy_weights().keys()
            for name in got:  # the frozen weights in bfloat16; an adapted one merged in float32, rounded once
                want = live[name].to(torch.bfloat16)
                layer = name.removesuffix(".weight")
                if layer in learner.adapters.names:
                    want = merged_weight(live[name], live[layer + ".lora_A.weight"], live[layer + ".lora_B.weight"],
                                         learner.adapters.scale, torch.bfloat16)
                    assert not torch.equal(want, live[name].to(torch.bfloat16))  # the adapters moved
                assert torch.equal(got[name], want), name
        finally:
            learner.close_weight_sync()
    assert not errors
