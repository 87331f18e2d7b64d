"""Generation engines: the interface (base), vLLM (vllm_engine) and transformers (hf_engine)."""
