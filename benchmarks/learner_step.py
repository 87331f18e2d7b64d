"""Learner step cost by proximal log-prob path and by micro-batch layout (weight publication:
benchmarks/weight_sync.py).

    .venv/bin/python benchmarks/learner_step.py [--groups 8] [--n 4] [--response 64] [--steps 3]
    # the embedded default's shape (tiny model, 8 groups of 8, ~17 + 8 tokens):
    .venv/bin/python benchmarks/learner_step.py --groups 8 --n 8 --prompt 17 --response 8 --vocab 32 --hidden 128 --layers 2 --steps 30

Builds a small random Qwen2 policy as an HF folder, then in one run measures:
  * seconds per learner step with prox_logp=recompute (one extra no-grad pass), recompute with π_old
    taken from the update pass (`learner.prox_from_update_pass`, one minibatch: no extra pass),
    loglinear (AReaL's approximation, no extra pass) and bypass mode, and the ratios recompute /
    loglinear and from-update-pass / recompute;
  * seconds per recompute step with padded rows, packed rows under sdpa (a block-diagonal mask over
    the row) and packed rows under varlen (each sequence alone), and the ratio packed / padded: what
    `learner.packing: auto` decides by (packed on a GPU, padded on a CPU).
Prints the numbers and, as its last line, a JSON summary; asserts nothing about time.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from buffer.sample import Group, Sample  # noqa: E402
from learner.config import LearnerConfig  # noqa: E402
from learner.trainer import Learner  # noqa: E402


def build_policy(folder: Path, vocab: int, hidden: int, layers: int) -> Path:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=vocab, hidden_size=hidden, intermediate_size=hidden * 3,
                         num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=512, tie_word_embeddings=True)
    Qwen2ForCausalLM(config).save_pretrained(folder)
    return folder


def random_groups(groups: int, n: int, prompt_len: int, response_len: int, vocab: int, version: int) -> list[Group]:
    """Token ids and behaviour log-probs drawn at random: the step's cost does not depend on them."""
    rng = np.random.default_rng(0)
    out = []
    for g in range(groups):
        prompt = rng.integers(1, vocab, prompt_len)
        samples = [Sample(sample_id=f"{g}-{i}", group_id=f"g{g}", prompt_ids=prompt,
                          response_ids=rng.integers(1, vocab, response_len),
                          rollout_log_probs=-rng.exponential(3.0, response_len).astype(np.float32),
                          loss_mask=np.ones(response_len, np.uint8), reward=float(rng.random()),
                          weight_version=version)
                   for i in range(n)]
        out.append(Group(group_id=f"g{g}", samples=samples, prompt_index=g))
    return out


def time_steps(configs: dict[str, LearnerConfig], groups, steps: int) -> dict[str, tuple[float, float]]:
    """Median (step seconds, proximal-pass seconds) per config. The learners take turns, step by
    step, so a change in the machine's load hits every config alike."""
    learners = {name: Learner(cfg) for name, cfg in configs.items()}
    timings = {name: ([], []) for name in configs}
    for round_ in range(steps + 1):
        for name, learner in learners.items():
            learner.version = max(learner.version, 1)  # samples one version old: loglinear interpolates
            metrics = learner.train_step(groups)
            learner.version -= 1  # keep the batch's staleness fixed
            if round_:  # round 0 warms up
                timings[name][0].append(metrics["timing_s/step"])
                timings[name][1].append(metrics["timing_s/old_log_prob"])
    return {name: (statistics.median(t), statistics.median(p)) for name, (t, p) in timings.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--groups", type=int, default=8)
    parser.add_argument("--n", type=int, default=4)
    parser.add_argument("--prompt", type=int, default=32)
    parser.add_argument("--response", type=int, default=64)
    parser.add_argument("--vocab", type=int, default=2048)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda", "auto"), help="learner.device")
    args = parser.parse_args()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))

    with tempfile.TemporaryDirectory() as tmp:
        policy = build_policy(Path(tmp) / "policy", args.vocab, args.hidden, args.layers)
        groups = random_groups(args.groups, args.n, args.prompt, args.response, args.vocab, version=0)
        base = dict(model_path=str(policy), lr=1e-5, micro_batch_size=16, device=args.device)
        print(f"batch: {args.groups} groups x {args.n} = {args.groups * args.n} sequences, "
              f"{args.prompt}+{args.response} tokens; torch threads {torch.get_num_threads()}")
        configs = {name: LearnerConfig(**base, **overrides) for name, overrides in (
            ("recompute", {"prox_from_update_pass": False}), ("recompute_from_update", {}),
            ("loglinear", {"prox_logp": "loglinear"}),
            ("bypass", {"rollout_correction": "bypass_ppo_clip"}))}
        results = time_steps(configs, groups, args.steps)
        for name, (step_s, prox_s) in results.items():
            print(f"  step {name:21s}: {step_s:7.3f} s/step  (proximal pass {prox_s:.3f} s)")
        ratio = results["recompute"][0] / results["loglinear"][0]
        fused = results["recompute_from_update"][0] / results["recompute"][0]
        print(f"  recompute / loglinear step time: {ratio:.2f}x; π_old from the update pass / recompute: {fused:.2f}x")
        # micro-batches as the embedded default plans them: the token budget alone, no row cap
        layouts = {name: LearnerConfig(**{**base, "micro_batch_size": None}, **overrides) for name, overrides in (
            ("padded", {"packing": False}), ("packed_sdpa", {"packing": True}),
            ("packed_varlen", {"packing": True, "attn_implementation": "varlen"}))}
        by_layout = time_steps(layouts, groups, args.steps)
        for name, (step_s, _) in by_layout.items():
            print(f"  step {name:13s}: {step_s:7.3f} s/step")
        packed_vs_padded = by_layout["packed_sdpa"][0] / by_layout["padded"][0]
        varlen_vs_padded = by_layout["packed_varlen"][0] / by_layout["padded"][0]
        print(f"  packed (sdpa) / padded step time: {packed_vs_padded:.2f}x; packed (varlen) / padded: "
              f"{varlen_vs_padded:.2f}x")
    print(json.dumps({"benchmark": "learner_step", "device": args.device, "groups": args.groups, "n": args.n,
                      "step_s": {name: round(step_s, 4) for name, (step_s, _) in results.items()},
                      "proximal_pass_s": {name: round(prox_s, 4) for name, (_, prox_s) in results.items()},
                      "recompute_vs_loglinear": round(ratio, 3), "from_update_pass_vs_recompute": round(fused, 3),
                      "layout_step_s": {name: round(step_s, 4) for name, (step_s, _) in by_layout.items()},
                      "packed_vs_padded": round(packed_vs_padded, 3), "varlen_vs_padded": round(varlen_vs_padded, 3)}))


if __name__ == "__main__":
    main()
