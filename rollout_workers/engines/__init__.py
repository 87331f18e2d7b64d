"""Generation engines: the interface (base), vLLM (vllm_engine) and transformers (hf_engine)."""
from __future__ import annotations

import os


def make_engine(engine_config, model_dir: str | os.PathLike, seed: int = 0, version: int = 0,
                max_num_seqs: int | None = None):
    """A GenerationEngine from a `rollout_workers.config.EngineConfig`; `max_num_seqs`: the most
    requests a vLLM engine schedules at once (the worker's requests in flight)."""
    if engine_config.kind == "vllm":
        from rollout_workers.engines.vllm_engine import VLLMEngine

        return VLLMEngine(
            model_dir,
            dtype=engine_config.dtype,
            max_model_len=engine_config.max_model_len,
            kv_cache_bytes=engine_config.kv_cache_mib * 2**20,
            gpu_memory_utilization=engine_config.gpu_memory_utilization,
            seed=seed,
            version=version,
            tensor_parallel_size=engine_config.tensor_parallel_size,
            device=engine_config.device,
            enforce_eager=engine_config.enforce_eager,
            seed_requests=engine_config.seed_requests,
            max_num_seqs=max_num_seqs,
            weight_transfer=engine_config.weight_transfer,
            return_routing=engine_config.return_routing,
            lora=engine_config.lora,
        )
    if engine_config.kind == "hf":
        from rollout_workers.engines.hf_engine import HFEngine

        return HFEngine(model_dir, dtype=engine_config.dtype, version=version, device=engine_config.device,
                        memory_share=engine_config.gpu_memory_utilization, seed_requests=engine_config.seed_requests,
                        lora=engine_config.lora)
    raise ValueError(f"unknown engine kind {engine_config.kind!r}; expected 'vllm' or 'hf'")
