"""Generation on the tiny model: vLLM-CPU against transformers, measured in one run.

Prints
  - tokens/s of the vLLM engine (in-process, float32) and the transformers engine on the same
    workload (prompts x n samples, temperature 1), and their ratio;
  - the behaviour log-prob gap to a float32 transformers forward pass (the learner's view) for a
    float32 and a bfloat16 vLLM sampler: the backend mismatch the learner must correct;
  - weight-load latency: in place through an iterator (in-process engine core), through a
    safetensors folder (engine core in its own process), and transformers load_state_dict.

Usage: OMP_NUM_THREADS=1 python benchmarks/generation.py [--prompts 64] [--n 8] [--repeats 3]
"""
from __future__ import annotations

import argparse
import os
import statistics
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402

from lm.causal_lm import load_causal_lm, load_tokenizer, response_log_probs  # noqa: E402
from rollout_workers.config import TaskConfig  # noqa: E402
from rollout_workers.engines.base import SamplingParams  # noqa: E402
from rollout_workers.engines.hf_engine import HFEngine  # noqa: E402
from rollout_workers.engines.vllm_engine import VLLMEngine  # noqa: E402
from rollout_workers.tasks import train_prompts  # noqa: E402
from rollout_workers.tiny_model import ensure_tiny_model  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def tokens_per_second(engine, requests, repeats: int) -> tuple[float, int]:
    engine.generate_batch(requests[:2])  # warm-up (first-call compilation, allocations)
    rates, tokens = [], 0
    for _ in range(repeats):
        started = time.perf_counter()
        out = engine.generate_batch(requests)
        seconds = time.perf_counter() - started
        tokens = sum(len(c.token_ids) for completions in out for c in completions)
        rates.append(tokens / seconds)
    return statistics.median(rates), tokens


def log_prob_gap(engine, model, requests) -> dict[str, float]:
    """|rollout - learner| per token over sampled responses: mean, max, and mean |1 - ratio|."""
    out = engine.generate_batch(requests)
    prompts = [p for (p, params), completions in zip(requests, out) for _ in completions]
    responses = [c.token_ids for completions in out for c in completions]
    rollout = [c.log_probs for completions in out for c in completions]
    with torch.no_grad():
        learner, mask = response_log_probs(model, prompts, responses)
    diffs = torch.cat([torch.tensor(r) - learner[i, : len(r)] for i, r in enumerate(rollout)])
    return {
        "mean_abs": float(diffs.abs().mean()),
        "max_abs": float(diffs.abs().max()),
        "mean_abs_ratio_minus_1": float((diffs.exp() - 1).abs().mean()),
        "tokens": int(diffs.numel()),
    }


def load_latency(engine, state_dict, repeats: int) -> float:
    times = []
    for version in range(1, repeats + 1):
        started = time.perf_counter()
        engine.load_weights(version, state_dict)
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--n", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(1)

    model_dir = ensure_tiny_model(os.path.join(REPO, ".cache", "tiny-model"))
    tokenizer = load_tokenizer(model_dir)
    model = load_causal_lm(model_dir).eval()
    state_dict = {k: v.clone() for k, v in model.state_dict().items()}
    problems = train_prompts(TaskConfig(num_prompts=args.prompts)).problems
    params = SamplingParams(n=args.n, temperature=1.0, max_new_tokens=args.max_new_tokens,
                            stop_token_ids=(tokenizer.eos_token_id,), seed=0)
    requests = [(tokenizer(p.prompt, add_special_tokens=False)["input_ids"], params) for p in problems]
    print(f"tiny model {model_dir.name}: {sum(p.numel() for p in model.parameters())/1e6:.2f}M params; "
          f"workload {len(requests)} prompts x n={args.n}, max_new_tokens={args.max_new_tokens}, T=1")

    started = time.perf_counter()
    vllm_fp32 = VLLMEngine(model_dir, dtype="float32")
    vllm_start_s = time.perf_counter() - started
    vllm_rate, vllm_tokens = tokens_per_second(vllm_fp32, requests, args.repeats)
    one_group_rate, _ = tokens_per_second(vllm_fp32, requests[:1], args.repeats)
    gap_fp32 = log_prob_gap(vllm_fp32, model, requests)
    load_inproc_s = load_latency(vllm_fp32, state_dict, args.repeats)
    vllm_fp32.close()

    hf = HFEngine(model_dir)
    hf_rate, hf_tokens = tokens_per_second(hf, requests, args.repeats)
    gap_hf = log_prob_gap(hf, model, requests[:16])
    load_hf_s = load_latency(hf, state_dict, args.repeats)

    started = time.perf_counter()
    vllm_bf16 = VLLMEngine(model_dir, dtype="bfloat16", multiprocess=True)
    bf16_start_s = time.perf_counter() - started
    bf16_rate, _ = tokens_per_second(vllm_bf16, requests, args.repeats)
    gap_bf16 = log_prob_gap(vllm_bf16, model, requests)
    load_folder_s = load_latency(vllm_bf16, state_dict, args.repeats)
    vllm_bf16.close()

    print("\n== throughput (median of %d runs) ==" % args.repeats)
    print(f"vLLM-CPU fp32 in-process, all prompts in one batch: {vllm_rate:9.0f} tokens/s ({vllm_tokens} tokens)")
    print(f"vLLM-CPU fp32 in-process, one group of n={args.n}:      {one_group_rate:9.0f} tokens/s")
    print(f"vLLM-CPU bf16 multiprocess, all prompts:           {bf16_rate:9.0f} tokens/s")
    print(f"transformers fp32 generate (per prompt, KV cache): {hf_rate:9.0f} tokens/s ({hf_tokens} tokens)")
    print(f"ratio vLLM fp32 / transformers:                    {vllm_rate / hf_rate:9.2f}x")
    print(f"engine start-up: vLLM fp32 in-process {vllm_start_s:.1f}s, vLLM bf16 multiprocess {bf16_start_s:.1f}s")

    print("\n== behaviour log-prob gap to the fp32 transformers forward (learner) ==")
    for name, gap in (("vLLM fp32", gap_fp32), ("vLLM bf16", gap_bf16), ("transformers fp32", gap_hf)):
        print(f"{name:18s} mean |dlogp| {gap['mean_abs']:.2e}  max {gap['max_abs']:.2e}  "
              f"mean |ratio-1| {gap['mean_abs_ratio_minus_1']:.2e}  ({gap['tokens']} tokens)")
    print(f"ratio bf16 / fp32 mean |dlogp|: {gap_bf16['mean_abs'] / max(gap_fp32['mean_abs'], 1e-12):.0f}x")

    print("\n== weight-load latency (median) ==")
    print(f"vLLM in-process, reload_weights(iterator): {load_inproc_s * 1e3:8.1f} ms")
    print(f"vLLM multiprocess, reload_weights(folder):  {load_folder_s * 1e3:8.1f} ms (includes writing the folder)")
    print(f"transformers load_state_dict:             {load_hf_s * 1e3:8.1f} ms")
    print(f"ratio folder / iterator: {load_folder_s / load_inproc_s:.1f}x")


if __name__ == "__main__":
    main()
