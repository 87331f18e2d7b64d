"""Claim: rollout correction + policy loss cost <= 2% of one forward+backward pass of the model.

Measures, in one run and on one device, the median time of
  (a) one forward + backward pass of a tiny Qwen2-style causal LM (built in memory from a config)
      on a batch of 64 x 256 tokens, and
  (b) `compute_rollout_correction` + `compute_policy_loss` + the loss's backward to the log-probs,
      on [64, 256] log-probs, for a light and a heavy correction config,
and prints both times and their ratio.

    .venv/bin/python benchmarks/correction_overhead.py [--repeats 5] [--threads 1] [--device cpu]
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from learner.correction import RolloutCorrectionConfig, compute_rollout_correction  # noqa: E402
from learner.losses import PolicyLossConfig, compute_policy_loss, count_tokens_and_sequences  # noqa: E402

GOAL = 0.02


def tiny_qwen2(vocab: int, hidden: int, layers: int, device: str):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(vocab_size=vocab, hidden_size=hidden, intermediate_size=hidden * 11 // 4,
                         num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=1024, tie_word_embeddings=True)
    torch.manual_seed(0)
    return Qwen2ForCausalLM(config).to(device)


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def median_time(fn, repeats: int, device: str, warmup: int = 1) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        sync(device)
        start = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def model_step(model, input_ids):
    """One forward + backward: token log-probs of the batch under the model, mean NLL, backward."""
    def run():
        model.zero_grad(set_to_none=True)
        logits = model(input_ids=input_ids).logits[:, :-1].float()
        log_prob = torch.log_softmax(logits, -1).gather(-1, input_ids[:, 1:, None]).squeeze(-1)
        (-log_prob.mean()).backward()
    return run


def correction_step(old, rollout, mask, adv, cfg: RolloutCorrectionConfig, loss_cfg: PolicyLossConfig):
    """What the learner adds per step: the correction once, then the loss and its backward."""
    log_prob = (old + 0.01 * torch.randn_like(old)).requires_grad_()

    def run():
        log_prob.grad = None
        weights, kept, _ = compute_rollout_correction(old, rollout, mask, cfg)
        tokens, seqs = count_tokens_and_sequences(kept)
        loss, _ = compute_policy_loss(log_prob, old, rollout, adv, mask, cfg, loss_cfg,
                                      precomputed_correction=(weights, kept),
                                      global_token_count=tokens, global_seq_count=seqs,
                                      ref_log_prob=old, entropy=torch.ones_like(old))
        loss.backward()
    return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--vocab", type=int, default=512)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    device = args.device

    model = tiny_qwen2(args.vocab, args.hidden, args.layers, device)
    gen = torch.Generator().manual_seed(0)
    input_ids = torch.randint(0, args.vocab, (args.batch, args.tokens), generator=gen).to(device)
    n_params = sum(p.numel() for p in model.parameters())

    rollout = (-torch.rand(args.batch, args.tokens, generator=gen) * 4).to(device)
    old = rollout + 0.05 * torch.randn(args.batch, args.tokens, generator=gen).to(device)
    lengths = torch.randint(args.tokens // 4, args.tokens + 1, (args.batch,), generator=gen).to(device)
    mask = (torch.arange(args.tokens, device=device)[None, :] < lengths[:, None]).float()
    adv = torch.randn(args.batch, 1, generator=gen).to(device) * mask

    configs = {
        "decoupled_token_is": RolloutCorrectionConfig.decoupled_token_is(),
        "heavy (seq IS + norm + 3 RS options + veto)": RolloutCorrectionConfig(
            rollout_is="sequence", rollout_is_batch_normalize=True,
            rollout_rs="token_k1,seq_mean_k1,seq_max_k3", rollout_rs_threshold="0.2_5.0,1.01,0.5",
            rollout_token_veto_threshold=1e-4),
    }
    loss_cfg = PolicyLossConfig(kl_coef=0.01, entropy_coeff=0.001)

    step_s = median_time(model_step(model, input_ids), args.repeats, device)
    print(f"device={device} threads={args.threads} model: Qwen2 hidden={args.hidden} layers={args.layers} "
          f"vocab={args.vocab} ({n_params / 1e6:.2f}M params), batch {args.batch} x {args.tokens} tokens")
    print(f"forward+backward of the model:        median {step_s * 1e3:9.2f} ms over {args.repeats} repeats")
    worst = 0.0
    for name, cfg in configs.items():
        corr_s = median_time(correction_step(old, rollout, mask, adv, cfg, loss_cfg), max(args.repeats * 4, 10), device)
        ratio = corr_s / step_s
        worst = max(worst, ratio)
        print(f"correction + loss [{name}]: median {corr_s * 1e3:9.2f} ms   ratio {ratio * 100:6.3f}% of the step")
    print(f"worst ratio {worst * 100:.3f}% (goal <= {GOAL * 100:.0f}%): {'met' if worst <= GOAL else 'NOT met'}")


if __name__ == "__main__":
    main()
