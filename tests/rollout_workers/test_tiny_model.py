"""The tiny-model kit: an ordinary HF folder (Qwen2 config, locally trained tokenizer), warm-started
to solve some held-out prompts but not all, built once per spec and reused."""
from __future__ import annotations

import os

import pytest
import torch

from lm.causal_lm import load_causal_lm, load_tokenizer
from rollout_workers.tasks import ALPHABET
from rollout_workers.tiny_model import TinyModelSpec, ensure_tiny_model, tiny_model_info


def test_tiny_model_is_an_hf_folder_with_its_tokenizer(tiny_model_dir):
    model = load_causal_lm(tiny_model_dir)
    tokenizer = load_tokenizer(tiny_model_dir)
    assert model.config.model_type == "qwen2" and model.config.hidden_size // model.config.num_attention_heads == 32  # vLLM CPU head size
    ids = tokenizer("347+589=", add_special_tokens=False)["input_ids"]
    assert len(ids) == 8 and tokenizer.unk_token_id not in ids  # one token per character
    assert tokenizer.decode(ids + [tokenizer.eos_token_id], skip_special_tokens=True) == "347+589="
    assert all(tokenizer.convert_tokens_to_ids(ch) != tokenizer.unk_token_id for ch in ALPHABET)
    assert len(tokenizer) <= model.config.vocab_size <= 64


def test_warm_start_solves_some_heldout_prompts_but_not_all(tiny_model_dir):
    info = tiny_model_info(tiny_model_dir)
    accuracy, (family,), levels = info["heldout_greedy_accuracy"], info["spec"]["families"], info["spec"]["difficulties"]
    for difficulty in levels:
        assert 0.0 < accuracy[f"{family}/{difficulty}"] < 1.0, accuracy  # room for RL to improve
    assert accuracy[f"{family}/{min(levels)}"] > accuracy[f"{family}/{max(levels)}"]  # harder levels are harder


def test_ensure_tiny_model_builds_once_per_spec(tiny_model_dir, tmp_path):
    spec = TinyModelSpec(**tiny_model_info(tiny_model_dir)["spec"])
    assert ensure_tiny_model(tiny_model_dir.parent, spec) == tiny_model_dir  # cached: no rebuild
    stamp = (tiny_model_dir / "config.json").stat().st_mtime_ns
    assert ensure_tiny_model(tiny_model_dir.parent, spec) == tiny_model_dir
    assert (tiny_model_dir / "config.json").stat().st_mtime_ns == stamp

    small = TinyModelSpec(hidden_size=64, num_heads=2, num_kv_heads=1, intermediate_size=128,
                          difficulties=[1], warm_start_steps=3, batch_size=8)
    logs = []
    folder = ensure_tiny_model(tmp_path, small, log=logs.append)
    assert folder.name == small.cache_key() != tiny_model_dir.name
    assert any("warm start step 2" in line for line in logs)
    assert load_causal_lm(folder).config.hidden_size == 64
    assert ensure_tiny_model(tmp_path, small, log=logs.append) == folder and len(list(tmp_path.iterdir())) == 2
    with pytest.raises(ValueError, match="extra"):
        TinyModelSpec(hidden=3)


@pytest.mark.parametrize(("experts", "pinned", "want"), [(0, None, "cores"), (0, "3", 3), (4, None, 1)],
                         ids=["dense", "dense-omp-pinned", "moe"])
def test_a_dense_build_takes_every_core_unless_pinned_and_a_moe_build_one(tmp_path, monkeypatch, experts, pinned, want):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)  # the suite pins 1
    if pinned:
        monkeypatch.setenv("OMP_NUM_THREADS", pinned)
    spec = TinyModelSpec(difficulties=[1], warm_start_steps=2, num_experts=experts)
    threads = []
    ensure_tiny_model(tmp_path, spec, log=lambda line: threads.append(torch.get_num_threads()))
    assert set(threads) == {len(os.sched_getaffinity(0)) if want == "cores" else want}
    assert torch.get_num_threads() == 1, "the session's one thread, back after the build"


def test_a_dense_build_is_the_same_model_on_one_core_and_on_all(tmp_path, monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)  # the suite pins 1
    spec = TinyModelSpec(difficulties=[1], warm_start_steps=5)
    every = ensure_tiny_model(tmp_path / "every", spec, log=lambda line: None)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0})
    one = ensure_tiny_model(tmp_path / "one", spec, log=lambda line: None)
    assert (one / "model.safetensors").read_bytes() == (every / "model.safetensors").read_bytes()


def test_the_kit_tokenizer_has_a_small_chat_template(tiny_model_dir):
    """Two turn markers appended after the characters (the model's vocabulary size is unchanged and
    no character moved), a turn ends with EOS, and the generation prompt opens the assistant turn."""
    from rollout_workers.tiny_model import ASSISTANT, USER

    tokenizer = load_tokenizer(tiny_model_dir)
    user, assistant = tokenizer.convert_tokens_to_ids([USER, ASSISTANT])
    assert (user, assistant) == (len(tokenizer) - 2, len(tokenizer) - 1)
    assert len(tokenizer) <= load_causal_lm(tiny_model_dir).config.vocab_size
    messages = [{"role": "user", "content": "12+3="}, {"role": "assistant", "content": "15"},
                {"role": "user", "content": "1+1="}]
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=False)
    eos = tokenizer.eos_token_id
    assert list(ids) == [user, *tokenizer("12+3=")["input_ids"], eos, assistant, *tokenizer("15")["input_ids"], eos,
                         user, *tokenizer("1+1=")["input_ids"], eos, assistant]
    assert tokenizer.decode(ids, skip_special_tokens=True) == "12+3=151+1="


def test_tiny_moe_is_the_kit_as_a_qwen3_mixture_of_experts():
    """run.model: tiny-moe builds TinyModelSpec.moe(): 8 experts, top-2, the kit's tokenizer and
    sizes; the dense spec's cache key (its folder) does not depend on the MoE fields."""
    from lm.moe import routing_shape
    from rollout_workers.tiny_model import build_model, build_tokenizer

    tokenizer = build_tokenizer()
    spec = TinyModelSpec().moe()
    model = build_model(spec, vocab_size=len(tokenizer), tokenizer=tokenizer)
    assert type(model).__name__ == "Qwen3MoeForCausalLM" and model.config.norm_topk_prob
    assert routing_shape(model) == (spec.num_layers, 2, 8)
    assert spec.cache_key() != TinyModelSpec().cache_key() == TinyModelSpec(experts_per_token=4).cache_key()
    assert spec.moe() is spec
