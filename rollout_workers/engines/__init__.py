"""Generation engines: the interface (base), vLLM (vllm_engine) and transformers (hf_engine)."""
from __future__ import annotations

import os


def make_engine(engine_config, model_dir: str | os.PathLike, seed: int = 0, version: int = 0):
    """A GenerationEngine from a `rollout_workers.config.EngineConfig`."""
    if engine_config.kind == "vllm":
        from rollout_workers.engines.vllm_engine import VLLMEngine

        return VLLMEngine(
            model_dir,
            dtype=engine_config.dtype,
            multiprocess=engine_config.multiprocess,
            max_model_len=engine_config.max_model_len,
            kv_cache_bytes=engine_config.kv_cache_mib * 2**20,
            seed=seed,
            version=version,
            tensor_parallel_size=engine_config.tensor_parallel_size,
            device=engine_config.device,
        )
    if engine_config.kind == "hf":
        from rollout_workers.engines.hf_engine import HFEngine

        return HFEngine(model_dir, dtype=engine_config.dtype, version=version, device=engine_config.device)
    raise ValueError(f"unknown engine kind {engine_config.kind!r}; expected 'vllm' or 'hf'")
