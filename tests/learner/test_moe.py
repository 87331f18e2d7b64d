"""MoE policies in the learner: routing replay (none, r2, r3) and the routing-mismatch metric on
samples the transformers engine generated with its routing, and weight names as checkpoints and
engines have them (the learner's published version loaded into an engine gives its log-probs).

One random Qwen3-MoE (8 experts, top-2, built from a config) serves the whole module; its
routers are initialised wide so tokens spread over the experts."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from buffer.sample import Group, Sample
from learner.batch import BatchError
from learner.config import LearnerConfig
from learner.routing_replay import RoutingReplay, sequence_positions
from learner.trainer import Learner
from learner_helpers import build_tiny_policy
from lm.causal_lm import load_causal_lm, response_log_probs
from rollout_workers.agent_loop import Trajectory
from rollout_workers.data import Problem
from rollout_workers.engines.base import SamplingParams
from rollout_workers.engines.hf_engine import HFEngine

VOCAB, EXPERTS, TOP_K, LAYERS = 48, 8, 2, 2


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory):
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(0)
    config = Qwen3MoeConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=LAYERS,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_experts=EXPERTS, num_experts_per_tok=TOP_K,
        norm_topk_prob=True, max_position_embeddings=64, tie_word_embeddings=True, initializer_range=0.2)
    folder = tmp_path_factory.mktemp("moe")
    Qwen3MoeForCausalLM(config).save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def mixtral_dir(tmp_path_factory):
    """A random Mixtral of the same routing shape: its folder names each MoE block `block_sparse_moe`
    and each expert's matrices w1 (gate), w3 (up), w2 (down), as Mixtral's checkpoints do."""
    from transformers import MixtralConfig, MixtralForCausalLM

    torch.manual_seed(1)
    config = MixtralConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=16, num_hidden_layers=LAYERS, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, num_local_experts=EXPERTS, num_experts_per_tok=TOP_K,
        max_position_embeddings=64, initializer_range=0.2)
    folder = tmp_path_factory.mktemp("mixtral")
    MixtralForCausalLM(config).save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def engine(moe_dir):
    return HFEngine(moe_dir, dtype="float32", device="cpu")


@pytest.fixture(scope="module")
def groups(engine):
    """4 groups of 3 samples from the engine, with its routing; the last sample is a two-turn
    trajectory (the agent loop's record) whose tool tokens carry no routing, the one before it
    a generation interrupted and continued."""
    out = []
    for g in range(4):
        prompt = [3 + g + i for i in range(4 + g % 2)]
        completions = engine.generate(prompt, SamplingParams(n=3, max_new_tokens=6, seed=g))
        samples = [Sample(sample_id=f"s{g}-{i}", group_id=f"g{g}", prompt_ids=prompt, response_ids=c.token_ids,
                          rollout_log_probs=np.asarray(c.log_probs), loss_mask=np.ones(len(c.token_ids), np.uint8),
                          reward=float(i == g % 3), weight_version=0, routed_experts=c.routed_experts)
                   for i, c in enumerate(completions)]
        out.append(Group(group_id=f"g{g}", samples=samples, prompt_index=g))
    params = SamplingParams(n=1, max_new_tokens=4, seed=9)
    episode = Trajectory(problem=Problem(prompt="", answer=""), params=params, started_version=0,
                         prompt_ids=[5, 6, 7])
    episode.add_turn(engine.generate(episode.context, params)[0], [0] * 4)
    episode.add_observation([40, 41, 42])  # a tool's reply
    episode.add_turn(engine.generate(episode.context, params)[0], [0] * 4)
    episode.reward = 1.0
    multi_turn = episode.to_sample("g3", "w", {})
    assert multi_turn.loss_mask.tolist().count(0) == 3 and multi_turn.routed_experts.shape[1:] == (LAYERS, TOP_K)
    out[3].samples[-1] = multi_turn
    # interrupted after 2 tokens and continued (the worker's path when new weights arrive): each
    # part keeps the routing its generation had
    checks = iter(range(100))
    partial = engine.generate_batch([([9, 8, 7], params)], interrupt=lambda: next(checks) >= 1)[0][0]
    rest = engine.generate([9, 8, 7, *partial.token_ids], params)[0]
    assert partial.finish_reason == "interrupted" and len(partial.token_ids) == 2
    out[2].samples[-1] = Sample(
        sample_id="s2-2", group_id="g2", prompt_ids=[9, 8, 7], response_ids=partial.token_ids + rest.token_ids,
        rollout_log_probs=np.asarray(partial.log_probs + rest.log_probs), reward=1.0, weight_version=0,
        loss_mask=np.ones(len(partial.token_ids) + len(rest.token_ids), np.uint8),
        routed_experts=np.concatenate([partial.routed_experts, rest.routed_experts]))
    return out


def regroup(groups, change):
    """Copies of the groups with each sample's routing replaced by change(routing)."""
    return [Group(g.group_id, [Sample(**{**s.__dict__, "routed_experts": change(s.routed_experts)})
                               for s in g.samples], g.prompt_index) for g in groups]


def shifted(routing):
    """The routing of the next position: what an off-by-one replay would force."""
    return np.roll(routing, 1, axis=0)


def other_experts(routing):
    return ((routing.astype(np.int64) + 1) % EXPERTS).astype(np.uint8)


def learner(moe_dir, **overrides) -> Learner:
    return Learner(LearnerConfig(**{"model_path": str(moe_dir), "lr": 1e-2, **overrides}))


@pytest.mark.parametrize("packing", [True, False], ids=["packed", "padded"])
def test_the_engine_routing_is_the_learners_at_the_positions_that_sampled_each_token(moe_dir, groups, packing):
    """Same weights, same backend: at the proximal pass the learner's router picks the engine's
    experts for every policy token, multi-turn included, packed or padded (0 mismatch, and the
    log-probs agree); the routing of the neighbouring position is mostly another one."""
    metrics = learner(moe_dir, packing=packing, micro_batch_size=3).train_step(groups)
    assert metrics["moe/routing_mismatch"] == 0.0 and metrics["moe/routing_mismatch_any"] == 0.0
    assert [metrics[f"moe/routing_mismatch/layer_{i}"] for i in range(LAYERS)] == [0.0] * LAYERS
    assert abs(metrics["rollout_corr/kl"]) < 1e-6
    off = learner(moe_dir, packing=packing).train_step(regroup(groups, shifted))
    assert off["moe/routing_mismatch_any"] > 0.5


def test_r3_sends_response_tokens_through_the_engine_experts_with_the_learner_gate(moe_dir, groups):
    """Forced experts reach the expert MLPs at the positions that sampled policy tokens (the
    prompt's keep the router's own); their gate weights are the router's softmax at those experts,
    renormalised; the router still gets a gradient."""
    model = load_causal_lm(moe_dir)
    replay = RoutingReplay(model, "r3")
    seen = []
    handles = [block.experts.register_forward_pre_hook(lambda _m, args: seen.append(args[1:]))
               for block in (layer.mlp for layer in model.model.layers)]
    logits = []
    handles += [r.register_forward_hook(lambda _m, _a, out: logits.append(out[0]), prepend=True)
                for r in replay.routers]
    sample = groups[0].samples[0]
    prompt, response = sample.prompt_ids, sample.response_ids
    forced = torch.from_numpy(other_experts(sample.routed_experts).astype(np.int16))[None]
    with replay.plan([prompt], [response], packed=True, device="cpu", forced=forced,
                     force_mask=torch.ones(1, len(response))):
        log_probs, _ = response_log_probs(model, [prompt], [response])
        log_probs.sum().backward()
    for h in handles:
        h.remove()
    at = torch.arange(len(response)) + len(prompt) - 1  # the positions that sampled the tokens
    for layer, ((ids, gates), z) in enumerate(zip(seen[:LAYERS], logits[:LAYERS])):
        assert torch.equal(ids[at], forced[0, :, layer].long())
        probs = torch.softmax(z[at].float(), -1).gather(-1, ids[at])
        torch.testing.assert_close(gates[at], probs / probs.sum(-1, keepdim=True))
        own = torch.topk(z[: len(prompt) - 1], TOP_K, -1).indices
        assert torch.equal(ids[: len(prompt) - 1], own)  # prompt positions route freely
    assert all(r.weight.grad is not None and r.weight.grad.abs().sum() > 0 for r in replay.routers)


def test_r2_replays_the_learners_own_proximal_routing_and_r3_the_engines(moe_dir, groups):
    """Two minibatches (the second sees weights the first moved): r2 replays the routing the
    proximal pass recorded, whatever the engine reported; r3 replays the engine's; none lets the
    second minibatch reroute."""
    def step(mode, batch):
        return learner(moe_dir, routing_replay=mode, ppo_mini_batch_size=2).train_step(batch)["actor/pg_loss"]

    r2, r3, free = step("r2", groups), step("r3", groups[:3]), step("none", groups)
    assert abs(r2 - free) > 1e-4 and abs(r3 - step("none", groups[:3])) > 1e-4
    assert step("r2", regroup(groups, other_experts)) == pytest.approx(r2, rel=1e-6)
    assert abs(step("r3", regroup(groups[:3], other_experts)) - r3) > 1e-3


@pytest.mark.parametrize("packed", [True, False], ids=["packed", "padded"])
def test_r2_records_every_position_and_replays_it_after_the_routers_moved(moe_dir, groups, packed):
    """The proximal pass records each row's experts at every position, prompt and response (at the
    positions that sampled, the engine's); once the routers have moved (the step's first
    minibatch did), the replay sends every position through the recorded experts, where the
    routers alone would send some prompt tokens elsewhere."""
    model = load_causal_lm(moe_dir)
    replay = RoutingReplay(model, "r2")
    samples = [groups[0].samples[0], groups[1].samples[1]]  # prompts of 4 and 5 tokens
    prompts, responses = [s.prompt_ids for s in samples], [s.response_ids for s in samples]
    with torch.no_grad(), replay.plan(prompts, responses, packed, "cpu", record=True) as plan:
        response_log_probs(model, prompts, responses, packed=packed)
    recorded = plan.sequence_routing(EXPERTS)
    assert [tuple(r.shape) for r in recorded] == [(len(p) + len(r), LAYERS, TOP_K) for p, r in zip(prompts, responses)]
    assert recorded[0].dtype == torch.uint8
    for sample, routing in zip(samples, recorded):
        sampled = routing[len(sample.prompt_ids) - 1: -1].long().sort(-1).values
        assert torch.equal(sampled, torch.from_numpy(sample.routed_experts).long().sort(-1).values)

    torch.manual_seed(1)
    for router in replay.routers:
        router.weight.data.normal_(0.0, 0.5)
    seen = []
    handles = [layer.mlp.experts.register_forward_pre_hook(lambda _m, args: seen.append(args[1]))
               for layer in model.model.layers]
    at = sequence_positions([len(p) + len(r) for p, r in zip(prompts, responses)], packed)
    want = torch.cat(recorded).long()
    with torch.no_grad():
        response_log_probs(model, prompts, responses, packed=packed)
        free = [ids[at] for ids in seen]
        seen.clear()
        with replay.plan(prompts, responses, packed, "cpu", replayed=recorded):
            response_log_probs(model, prompts, responses, packed=packed)
    for h in handles:
        h.remove()
    assert all(torch.equal(ids[at], want[:, layer]) for layer, ids in enumerate(seen))
    prompt_rows = torch.cat([torch.arange(len(p)) + start for p, start in zip(prompts, [0, len(recorded[0])])])
    assert any(not torch.equal(ids[prompt_rows], want[prompt_rows, layer]) for layer, ids in enumerate(free))


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["allreduce", "fsdp"])
def test_two_gloo_ranks_replay_as_one_rank_does(moe_dir, groups, two_ranks, strategy):
    """Two learner ranks (Ray actors, gloo), replicated or FSDP-sharded: each rank replays its own
    rows' routing (r3) and answers for its share of the mismatch, and together they make one
    rank's update and report its metrics (the engine's routing is off, so the replay matters).
    float64: the comparison checks the algorithm, not float32 sum orders."""
    batch = regroup(groups, other_experts)
    config = dict(model_path=str(moe_dir), lr=1e-2, routing_replay="r3", ppo_mini_batch_size=2,
                  max_tokens_per_micro_batch=24, dtype="float64")
    want = Learner(LearnerConfig(**config))
    want_metrics = want.train_step(batch)
    group = two_ranks(LearnerConfig(**config, distributed={"world_size": 2, "strategy": strategy, "timeout_s": 60}))
    if strategy == "fsdp":  # rank 0 read the folder tensor by tensor, the fused experts from their matrices
        assert [r["whole_model_read"] for r in group._call_all("load_report")] == [0.0, 0.0]
    got = group.train_step(batch)
    state = group.state_dict()["model"]
    for key in ("actor/pg_loss", "actor/grad_norm", "moe/routing_mismatch", "moe/routing_mismatch_any"):
        assert got[key] == pytest.approx(want_metrics[key], rel=1e-9, abs=1e-12), key
    assert got["moe/routing_mismatch"] == 1.0  # every engine expert set moved by one
    for name, p in want.model.state_dict().items():
        torch.testing.assert_close(state[name], p, rtol=1e-9, atol=1e-10)


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral", "minimax", "minimax_m2", "gpt_oss"])
def test_a_fused_expert_tensor_is_read_from_its_experts_checkpoint_matrices(moe_dir, mixtral_dir, family, tmp_path):
    """What an FSDP rank 0 reads to fill the shards (`checkpoint_tensors`): transformers 5 fuses an
    MoE block's experts in memory, the folder names each expert's matrices (Mixtral's and MiniMax's:
    w1, w3, w2, in a block named `block_sparse_moe`, as are the block's router and bias); each fused
    tensor is put together from them, one at a time, equal to the model loaded whole; and written
    back under the folder's names. GPT-OSS's folder keeps the experts fused ([E, H, 2I], gate and up
    interleaved): read and written as they are."""
    import transformers

    from learner.distributed import unique_state_names
    from lm.causal_lm import checkpoint_tensors
    from lm.checkpoint_names import expert_naming, to_checkpoint_names
    from lm.weight_sync.payloads import folder_weight_shapes

    folder = {"qwen3_moe": moe_dir, "mixtral": mixtral_dir}.get(family, tmp_path)
    built = {"minimax": "MiniMax", "minimax_m2": "MiniMaxM2", "gpt_oss": "GptOss"}.get(family)
    if built:  # MiniMax: lightning attention beside full attention; GPT-OSS: its own rope by default
        config = getattr(transformers, f"{built}Config")(
            vocab_size=VOCAB, hidden_size=32, intermediate_size=16, num_hidden_layers=LAYERS, num_attention_heads=4,
            num_key_value_heads=2, head_dim=8, num_local_experts=EXPERTS, num_experts_per_tok=TOP_K,
            max_position_embeddings=64, rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
        getattr(transformers, f"{built}ForCausalLM")(config).save_pretrained(folder)
    model = load_causal_lm(folder)
    state = model.state_dict()
    names = unique_state_names(model)  # the tied lm_head is the embeddings
    source = checkpoint_tensors(folder, {name: tuple(state[name].shape) for name in names})
    fused = {name for name in names if name.endswith((".experts.gate_up_proj", ".experts.down_proj"))}
    block_sparse = family in ("mixtral", "minimax", "minimax_m2")  # every other `.mlp.` tensor renamed too
    renamed = {name for name in names if ".mlp." in name} - fused if block_sparse else set()
    assert len(fused) == 2 * LAYERS and (not block_sparse or "model.layers.0.mlp.gate.weight" in renamed)
    assert set(source.parts) == (set() if family == "gpt_oss" else fused) | renamed
    saved = to_checkpoint_names({name: state[name] for name in names}, naming=expert_naming(model.config))
    in_folder, may_lack = folder_weight_shapes(folder)  # a tied lm_head: the embeddings
    assert {k: tuple(v.shape) for k, v in saved.items()} == {k: v for k, v in in_folder.items() if k not in may_lack}
    for name in names:
        assert name in source and torch.equal(source[name], state[name]), name


def test_bad_routing_is_refused_naming_the_sample(moe_dir, groups, tmp_path):
    moe = learner(moe_dir)
    too_many = regroup(groups[:1], lambda r: np.concatenate([r, r], axis=2))  # [T, layers, 2k]
    with pytest.raises(BatchError, match=r"sample 's0-0', field 'routed_experts': \[layers, k\] is \[2, 4\]"):
        moe.train_step(too_many)
    beyond = regroup(groups[:1], lambda r: np.full_like(r, EXPERTS))
    with pytest.raises(BatchError, match=r"sample 's0-0'.*expert id 8 at token 0, layer 0 is not in \[0, 8\)"):
        moe.train_step(beyond)
    with pytest.raises(ValueError, match=r"sample 's0-0' carries no routing"):
        learner(moe_dir, routing_replay="r3").train_step(regroup(groups[:1], lambda r: None))
    dense_dir = build_tiny_policy(tmp_path / "dense")
    dense_groups = [Group(g.group_id, [Sample(**{**s.__dict__, "routed_experts": s.routed_experts[:, :1]})
                                       for s in g.samples], g.prompt_index) for g in groups[:1]]
    with pytest.raises(BatchError, match=r"sample 's0-0', field 'routed_experts': carries MoE routing .* dense"):
        Learner(LearnerConfig(model_path=str(dense_dir))).train_step(dense_groups)
    with pytest.raises(ValueError, match="routing_replay='r2' needs a mixture-of-experts policy; Qwen2ForCausalLM "
                                         "has no top-k routers"):
        Learner(LearnerConfig(model_path=str(dense_dir), routing_replay="r2"))


ROUTER_HOMES = {  # router class: (its transformers module, the config class that builds it)
    "Qwen3MoeTopKRouter": ("qwen3_moe", "Qwen3MoeConfig"), "Qwen2MoeTopKRouter": ("qwen2_moe", "Qwen2MoeConfig"),
    "Qwen3NextTopKRouter": ("qwen3_next", "Qwen3NextConfig"), "OlmoeTopKRouter": ("olmoe", "OlmoeConfig"),
    "FlexOlmoTopKRouter": ("flex_olmo", "FlexOlmoConfig"), "MixtralTopKRouter": ("mixtral", "MixtralConfig"),
    "MiniMaxTopKRouter": ("minimax", "MiniMaxConfig"), "Qwen3_5MoeTopKRouter": ("qwen3_5_moe", "Qwen3_5MoeTextConfig"),
    "Qwen3VLMoeTextTopKRouter": ("qwen3_vl_moe", "Qwen3VLMoeTextConfig"),
    "GptOssTopKRouter": ("gpt_oss", "GptOssConfig"),
    "DeepseekV3TopkRouter": ("deepseek_v3", "DeepseekV3Config"),
    "DeepseekV32TopkRouter": ("deepseek_v32", "DeepseekV32Config"), "Glm4MoeTopkRouter": ("glm4_moe", "Glm4MoeConfig"),
    "Glm4MoeLiteTopkRouter": ("glm4_moe_lite", "Glm4MoeLiteConfig"), "Dots1TopkRouter": ("dots1", "Dots1Config"),
    "KimiLinearTopkRouter": ("kimi_linear", "KimiLinearConfig"),
    "ExaoneMoeTopkRouter": ("exaone_moe", "ExaoneMoeConfig"),
    "SolarOpenTopkRouter": ("solar_open", "SolarOpenConfig"), "MiniMaxM2TopKRouter": ("minimax_m2", "MiniMaxM2Config"),
}


@pytest.mark.parametrize("norm_topk_prob", [True, False])
@pytest.mark.parametrize("name", sorted(ROUTER_HOMES))
def test_each_known_router_gets_its_own_gate_back_when_its_own_choice_is_replayed(name, norm_topk_prob):
    """The replay recomputes a forced expert's gate weight as the router does (`replayed_gate`): for
    every router class it knows, forcing the experts the router chose gives the weights its own
    forward gave them, renormalised or not (DeepSeek-V3's family: sigmoids chosen with a correction
    bias among the best groups, scaled); transformers' router code is what is checked."""
    import importlib

    import transformers

    from lm.moe import ROUTER_GATES, SIGMOID, SIGMOID_RENORMALISED, SOFTMAX_RENORMALISED, replayed_gate

    assert set(ROUTER_HOMES) == set(ROUTER_GATES), "every known router is checked here"
    module, config_name = ROUTER_HOMES[name]
    config = getattr(transformers, config_name)(
        hidden_size=16, num_experts=EXPERTS, num_local_experts=EXPERTS, n_routed_experts=EXPERTS,
        num_experts_per_tok=TOP_K, norm_topk_prob=norm_topk_prob, n_group=2, topk_group=1, routed_scaling_factor=2.5)
    router = getattr(importlib.import_module(f"transformers.models.{module}.modeling_{module}"), name)(config)
    torch.manual_seed(0)
    torch.nn.init.normal_(router.weight)
    bias = torch.randn(EXPERTS)  # moves the choice, not the gate
    if hasattr(router, "e_score_correction_bias"):
        router.e_score_correction_bias.copy_(bias)
    hidden = torch.randn(10, 16)  # the MoE blocks hand their routers [tokens, hidden]
    # MiniMax-M2's block hands its router the bias too
    logits, scores, ids = router(hidden, bias) if name == "MiniMaxM2TopKRouter" else router(hidden)
    torch.testing.assert_close(replayed_gate(router, logits, ids).to(scores.dtype), scores, rtol=1e-6, atol=1e-7)
    kind = ROUTER_GATES[name]
    renormalised = norm_topk_prob or kind in (SOFTMAX_RENORMALISED, SIGMOID_RENORMALISED)
    total = router.routed_scaling_factor if kind == SIGMOID else 1.0
    assert torch.allclose(scores.sum(-1), torch.full((10,), total)) == renormalised


def test_replay_names_the_routers_of_an_moe_it_cannot_replay():
    """Granite-MoE's router returns (expert ids, gate weights, logits), not the (logits, gate weights,
    expert ids) of the known routers: it is not a router here (its engine records no routing), and
    r3 on such a policy says so, naming it, instead of calling the MoE dense."""
    from transformers import GraniteMoeConfig, GraniteMoeForCausalLM

    from lm.moe import other_routers, routers

    config = GraniteMoeConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=16, num_hidden_layers=2,
                              num_attention_heads=2, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2)
    model = GraniteMoeForCausalLM(config)
    assert routers(model) == [] and other_routers(model) == ["GraniteMoeTopKRouter"]
    with pytest.raises(ValueError, match=r"routing_replay='r3' needs a mixture-of-experts policy; its routers "
                                         r"\['GraniteMoeTopKRouter'\] are not ones it replays \(known: Qwen2Moe"):
        RoutingReplay(model, "r3")


def published_and_saved(policy, folder, groups, tmp_path):
    """Publish `policy`'s version, load it into a transformers engine of `folder`, save the policy and
    load that folder with transformers: the engine and the folder score as the learner does. The
    names and shapes (published, the engine's expected ones, the saved folder's)."""
    from lm.weight_sync import resolve_weights
    from lm.weight_sync.payloads import folder_weight_shapes

    policy.publish_weights()
    payload = policy.published(timeout=60)
    policy.close_weight_sync()
    weights = resolve_weights(payload)
    engine = HFEngine(folder, dtype="float32", device="cpu")
    engine.load_weights(payload["version"], weights)
    prompts = [s.prompt_ids for g in groups for s in g.samples]
    responses = [s.response_ids for g in groups for s in g.samples]
    with torch.no_grad():
        want, _ = response_log_probs(policy.model, prompts, responses)
        got, _ = response_log_probs(engine.model, prompts, responses)
        saved = load_causal_lm(policy.save_policy(tmp_path / "policy"))
        from_folder, _ = response_log_probs(saved, prompts, responses)
    assert float((want - got).abs().max()) < 1e-6
    assert float((want - from_folder).abs().max()) < 1e-6
    return ({k: tuple(v.shape) for k, v in weights.items()}, engine.expected_weights()[0],
            folder_weight_shapes(tmp_path / "policy")[0])


def test_a_published_moe_version_loads_into_an_engine_with_the_learners_log_probs(moe_dir, groups, tmp_path):
    """The learner publishes (and saves) the experts one by one under the checkpoint's names, the
    names engines expect (vLLM's `expected_weights` are the checkpoint's); the transformers engine
    loads them into its fused experts and scores as the learner does."""
    from lm.weight_sync.payloads import folder_weight_shapes

    moe = learner(moe_dir, weight_sync={"channel": "folder", "folder": str(tmp_path / "versions")})
    moe.train_step(groups)
    published, expected, saved = published_and_saved(moe, moe_dir, groups, tmp_path)
    names, _ = folder_weight_shapes(moe_dir)
    assert set(published) == set(expected) == set(names) | {"lm_head.weight"}  # tied: sent, never saved
    assert {k: shape for k, shape in published.items() if k in names} == names
    assert set(saved) == set(names)


def test_a_mixtral_policy_replays_its_routing_and_leaves_under_mixtrals_checkpoint_names(mixtral_dir, groups,
                                                                                          tmp_path):
    """Mixtral's router (softmax, top-k, always renormalised) is replayed: forcing the engine's
    experts (r3) gives the update the routing asks for, not the learner's own choice. Its versions
    and saved policy leave under Mixtral's checkpoint names (`block_sparse_moe`, w1 / w3 / w2, as
    vLLM's Mixtral loader takes them), which the transformers engine and transformers load back."""
    from lm.weight_sync.payloads import folder_weight_shapes

    names, _ = folder_weight_shapes(mixtral_dir)
    assert "model.layers.0.block_sparse_moe.experts.0.w1.weight" in names
    assert "model.layers.0.block_sparse_moe.gate.weight" in names
    batch = regroup(groups, other_experts)
    config = dict(ppo_mini_batch_size=2, dtype="float64")
    replayed, own = learner(mixtral_dir, routing_replay="r3", **config), learner(mixtral_dir, **config)
    assert replayed.train_step(batch)["actor/grad_norm"] != pytest.approx(own.train_step(batch)["actor/grad_norm"])

    mixtral = learner(mixtral_dir, routing_replay="r3", weight_sync={"channel": "folder",
                                                                     "folder": str(tmp_path / "versions")})
    mixtral.train_step(groups)
    published, expected, saved = published_and_saved(mixtral, mixtral_dir, groups, tmp_path)
    assert published == expected == saved == names


def test_a_deepseek_v3_policy_replays_its_routing(tmp_path, groups):
    """DeepSeek-V3's router (sigmoid scores, a correction bias and group limits in the choice, the
    gate renormalised and scaled) is recorded by the transformers engine and replayed: r3 forces
    the engine's experts, including ones outside the groups the router would allow, so the update
    differs from its own routing's; r2 replays the router's own choice with the gate it computes,
    so with one minibatch the update equals no replay's. Its versions and saved policy score as the
    learner does."""
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    from lm.weight_sync.payloads import folder_weight_shapes

    torch.manual_seed(2)
    config = DeepseekV3Config(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=LAYERS,
        n_routed_experts=EXPERTS, num_experts_per_tok=TOP_K, first_k_dense_replace=0, n_group=2, topk_group=1,
        n_shared_experts=1, num_attention_heads=2, num_key_value_heads=2, kv_lora_rank=8, q_lora_rank=None,
        qk_rope_head_dim=4, v_head_dim=8, qk_nope_head_dim=4, max_position_embeddings=64, initializer_range=0.2)
    folder = tmp_path / "deepseek"
    DeepseekV3ForCausalLM(config).save_pretrained(folder)
    # its engine records the router's own choice: both experts of a token in the one group it allows
    completion = HFEngine(folder, dtype="float32", device="cpu").generate([3, 4, 5], SamplingParams(
        n=1, max_new_tokens=6, seed=0))[0]
    routing = completion.routed_experts
    assert routing.shape == (len(completion.token_ids), LAYERS, TOP_K)
    assert (routing[..., 0] // (EXPERTS // 2) == routing[..., 1] // (EXPERTS // 2)).all()
    batch = regroup(groups, other_experts)
    norms = {mode: learner(folder, routing_replay=mode, dtype="float64").train_step(batch)["actor/grad_norm"]
             for mode in ("none", "r2", "r3")}  # one minibatch: r2's update pass sees the proximal pass's weights
    assert norms["r2"] == pytest.approx(norms["none"], rel=1e-9)
    assert norms["r3"] != pytest.approx(norms["none"])
    # its weights leave under the checkpoint's names (per-expert, the router's correction bias beside its
    # weight), which its engine expects and transformers loads
    deepseek = learner(folder, routing_replay="r3", weight_sync={"channel": "folder",
                                                                 "folder": str(tmp_path / "versions")})
    deepseek.train_step(groups)
    published, expected, saved = published_and_saved(deepseek, folder, groups, tmp_path)
    assert published == expected == saved == folder_weight_shapes(folder)[0]
    assert "model.layers.0.mlp.gate.e_score_correction_bias" in saved


@pytest.mark.parametrize("checkpointing", [True, "selective"])
def test_replay_holds_through_the_recomputed_forward_of_gradient_checkpointing(moe_dir, groups, checkpointing):
    """Checkpointed layers re-run their routers in the backward pass (selective: all but the
    matmuls): the replay still forces the engine's experts there, so the update is the one without
    checkpointing."""
    batch = regroup(groups, other_experts)
    config = dict(routing_replay="r3", ppo_mini_batch_size=2, dtype="float64")
    plain, checkpointed = learner(moe_dir, **config), learner(moe_dir, gradient_checkpointing=checkpointing, **config)
    assert checkpointed.train_step(batch)["actor/grad_norm"] == pytest.approx(
        plain.train_step(batch)["actor/grad_norm"], rel=1e-9)
    for name, p in plain.model.state_dict().items():
        torch.testing.assert_close(checkpointed.model.state_dict()[name], p, rtol=1e-9, atol=1e-12)
