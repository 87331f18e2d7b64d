"""Rollout correction and decoupled PPO on a tiny model's log-probs, end to end on CPU.

A tiny Qwen2-style model plays the learner (float32, current weights). The "rollout backend" is a
bfloat16 copy of slightly older weights (a stale, lower-precision sampler), so its log-probs differ
from the learner's the way vLLM's do. For a few presets the script computes the correction, GRPO
advantages and the policy loss, backpropagates, and prints the metrics.

    .venv/bin/python examples/correction_demo.py            # model built in memory
    .venv/bin/python examples/correction_demo.py --model DIR  # any HF causal-LM folder
"""
from __future__ import annotations

import argparse
import copy
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from learner.advantages import AdvantageConfig, compute_advantages  # noqa: E402
from learner.correction import RolloutCorrectionConfig, compute_rollout_correction  # noqa: E402
from learner.losses import PolicyLossConfig, compute_policy_loss, count_tokens_and_sequences  # noqa: E402
from lm.causal_lm import load_causal_lm, response_log_probs  # noqa: E402

PRESETS = ["decoupled_token_is", "decoupled_seq_is_rs", "decoupled_geo_rs_token_tis", "decoupled_k3_rs_token_tis",
           "bypass_ppo_clip", "bypass_pg_is"]
SHOWN = ["rollout_corr/kl", "rollout_corr/k3_kl", "rollout_corr/chi2_token", "rollout_corr/ppl_ratio",
         "rollout_corr/rollout_is_mean", "rollout_corr/rollout_is_eff_sample_size",
         "rollout_corr/rollout_is_ratio_fraction_high", "rollout_corr/rollout_rs_masked_fraction",
         "rollout_corr/rollout_is_veto_fraction", "actor/pg_loss", "actor/pg_clipfrac", "actor/ppo_kl",
         "actor/kl_loss", "staleness/mean"]


def tiny_model():
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=256, hidden_size=64, intermediate_size=176, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)
    return Qwen2ForCausalLM(config)


def stale_bf16_copy(model, noise: float):
    """Older weights (a small perturbation) run in bfloat16: the sampler's view of the policy."""
    older = copy.deepcopy(model)
    with torch.no_grad():
        for p in older.parameters():
            p.add_(noise * p.abs().mean() * torch.randn_like(p))
    return older.to(torch.bfloat16)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="HF causal-LM folder (default: a tiny model built in memory)")
    parser.add_argument("--groups", type=int, default=4)
    parser.add_argument("--group-size", type=int, default=4)
    parser.add_argument("--staleness-noise", type=float, default=0.3)
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)

    model = load_causal_lm(args.model) if args.model else tiny_model()
    vocab = model.config.vocab_size
    sampler = stale_bf16_copy(model, args.staleness_noise)

    # Groups of responses to the same prompt, of different lengths, with 0/1 outcome rewards.
    prompts, responses, group_ids = [], [], []
    for g in range(args.groups):
        prompt = torch.randint(3, vocab, (int(torch.randint(4, 9, ())),)).tolist()
        for _ in range(args.group_size):
            prompts.append(prompt)
            responses.append(torch.randint(3, vocab, (int(torch.randint(6, 17, ())),)).tolist())
            group_ids.append(f"prompt-{g}")
    rewards = torch.randint(0, 2, (len(prompts),)).float()
    versions = torch.tensor([7 - (i % 3) for i in range(len(prompts))])  # generated 0-2 versions ago

    with torch.no_grad():
        rollout_lp, mask = response_log_probs(sampler, prompts, responses)  # behaviour policy μ
        old_lp, _ = response_log_probs(model, prompts, responses)  # proximal policy π_old
        ref_lp = old_lp.clone()  # the reference policy for the KL penalty (here: the start)
    advantages = compute_advantages(rewards, group_ids, mask, AdvantageConfig(estimator="grpo"))
    loss_config = PolicyLossConfig(kl_coef=0.001, entropy_coeff=0.0)
    print(f"{len(prompts)} responses in {args.groups} groups, {int(mask.sum())} response tokens; "
          f"sampler = bf16 copy of weights perturbed by {args.staleness_noise}")

    for name in PRESETS:
        config = RolloutCorrectionConfig.preset(name)
        model.zero_grad(set_to_none=True)
        log_prob, _ = response_log_probs(model, prompts, responses)  # π_θ, with gradient
        extra, metrics = {}, {}
        if not config.bypass_mode:
            # Decoupled: the correction does not depend on θ; compute it once for the whole batch.
            weights, kept, metrics = compute_rollout_correction(old_lp, rollout_lp, mask, config)
            extra["precomputed_correction"] = (weights, kept)
            tokens, seqs = count_tokens_and_sequences(kept)
            extra.update(global_token_count=tokens, global_seq_count=seqs)
        loss, loss_metrics = compute_policy_loss(
            log_prob, old_lp, rollout_lp, advantages, mask, config, loss_config,
            ref_log_prob=ref_lp, token_versions=versions, current_version=7,
            **extra)
        loss.backward()
        metrics.update(loss_metrics)
        grad_norm = torch.sqrt(sum((p.grad ** 2).sum() for p in model.parameters() if p.grad is not None))
        print(f"\n== {name}: loss {loss.item():+.5f}, grad norm {grad_norm.item():.4f}")
        for key in SHOWN:
            if key in metrics:
                print(f"   {key:45s} {metrics[key]: .5f}")


if __name__ == "__main__":
    main()
