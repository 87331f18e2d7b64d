"""Policy losses: decoupled PPO (with dual clip), bypass PPO-clip and bypass REINFORCE, loss
aggregation, KL penalty and entropy bonus.

Public API:

- `PolicyLossConfig` (pydantic): clip_ratio_low 0.2, clip_ratio_high 0.2, clip_ratio_c 3.0,
  loss_agg_mode ("token-mean" | "token-sum" | "seq-mean-token-sum" | "seq-mean-token-mean" |
  "seq-mean-token-sum-norm"), loss_scale_factor, kl_coef, kl_estimator ("k1" | "k2" | "k3" |
  "abs" | "k1+" | "k3+", or verl's names kl, mse, low_var_kl), entropy_coeff.
- `compute_policy_loss(log_prob, old_log_prob, rollout_log_prob, advantages, response_mask,
  correction_config, loss_config, *, global_token_count=None, global_seq_count=None,
  precomputed_correction=None, batch_norm_sums=None, ref_log_prob=None, entropy=None,
  token_versions=None, current_version=None) -> (loss, metrics)`: the scalar loss to call `.backward()` on and a
  dict of floats (`actor/...`, `staleness/...`, and `rollout_corr/...` when the correction is
  computed here).
- `aggregate_loss(loss_mat, mask, mode, global_token_count=None, global_seq_count=None,
  loss_scale_factor=None)`, `count_tokens_and_sequences(mask)`, `kl_penalty(log_prob,
  ref_log_prob, estimator)`, `staleness_metrics(token_versions, current_version, mask)`.

Micro-batches and data parallelism: every mode divides a *sum* over the rows it is given by a
denominator. Pass the counts of the whole minibatch (summed over micro-batches and ranks, e.g.
from `count_tokens_and_sequences` on the rejection-modified mask) as `global_token_count` /
`global_seq_count`, and sum the micro-batch losses (do not average them): the gradient is then
the same however the minibatch is split. Without them each call normalises by its own counts.

Modes (bypass_mode and loss_type come from the `RolloutCorrectionConfig`):
- decoupled: per-token max(−A·r, −A·clip(r, 1−ε_low, 1+ε_high)) with r = π_θ/π_old (log ratio
  clamped to ±20), dual clip min(·, −c·A) for A < 0, times the detached IS weights π_old/π_rollout.
  The correction is computed here from (old_log_prob, rollout_log_prob), or taken from
  `precomputed_correction=(weights, modified_mask)` (slices of one `compute_rollout_correction`
  call over the whole batch: use that for batch-wide IS normalisation).
- bypass ppo_clip: the same clipped loss on r = π_θ/π_rollout, no IS weights; rejection and veto
  (computed on the detached π_θ vs π_rollout for every call) still mask.
- bypass reinforce: −stopgrad(w)·A·log π_θ, w = π_θ/π_rollout with the configured IS/RS/veto,
  recomputed under no_grad for every call.
- `loss_mode: gspo` (GSPO, verl's `compute_policy_loss_gspo`): the ratio is a sequence's, the
  geometric mean s = exp(mean_t log(π_θ/π_anchor)) over its kept tokens, carried per token in a
  straight-through form s_t = sg[s]·π_θ,t / sg[π_θ,t] (its value is s, its gradient flows through
  every token's log π_θ), clipped to [1 − ε_low, 1 + ε_high] (no dual clip) and aggregated
  seq-mean-token-mean whatever `loss_agg_mode` says. π_anchor is π_old in decoupled mode (times
  the IS weights, as above) and π_rollout in bypass ppo_clip mode; bypass reinforce has no ratio
  to clip and refuses it.
- `loss_mode: cispo` (CISPO, verl's `compute_policy_loss_cispo`): −sg[clip(r, 1 − ε_low,
  1 + ε_high)]·A·log π_θ per token, r = π_θ/π_anchor (anchors and IS weights as for gspo): the
  clip bounds each token's weight, never drops its gradient.
"""
from __future__ import annotations

from typing import Literal, Optional

import torch
from pydantic import BaseModel, ConfigDict, Field

from learner.correction import (
    SAFETY_BOUND,
    RolloutCorrectionConfig,
    check_mask,
    check_token_values,
    compute_rollout_correction,
    masked_mean,
    to_floats,
)

LossAggMode = Literal["token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-mean",
                      "seq-mean-token-sum-norm"]


class PolicyLossConfig(BaseModel):
    """PPO clip ranges, dual clip, aggregation, KL penalty and entropy bonus.

    clip_ratio_high defaults to 0.2 (symmetric), the clip range of the reference formulas; DAPO's
    clip-higher (0.28) is a one-field override for runs that lose entropy too fast.
    """

    model_config = ConfigDict(extra="forbid")

    clip_ratio_low: float = Field(0.2, gt=0, lt=1, description="ε_low: r is clipped below at 1 − ε_low")
    clip_ratio_high: float = Field(0.2, gt=0, description="ε_high: r is clipped above at 1 + ε_high")
    clip_ratio_c: float = Field(3.0, gt=1, description="dual-clip bound c for A < 0 (loss <= −c·A)")
    loss_agg_mode: LossAggMode = "token-mean"
    loss_scale_factor: Optional[float] = Field(
        None, gt=0, description="seq-mean-token-sum-norm's constant divisor (e.g. the max response "
        "length); None: the micro-batch's padded width, which depends on the split")
    kl_coef: float = Field(0.0, ge=0, description="weight of the KL penalty to the reference policy")
    kl_estimator: Literal["k1", "k2", "k3", "abs", "k1+", "k2+", "k3+", "abs+", "kl", "mse", "low_var_kl",
                          "kl+", "mse+", "low_var_kl+"] = Field(
        "k3", description="the KL penalty's per-token estimate (verl's kl_loss_type): k1 log r, k2 ½ log² r, k3 "
        "1/r − 1 + log r bounded at 10 as verl bounds it, abs |log r|; '+': that value with k2's gradient "
        "(straight through; k2+ is k2); kl, mse, low_var_kl are verl's names for k1, k2, k3")
    entropy_coeff: float = Field(0.0, ge=0, description="weight of the entropy bonus")
    loss_mode: Literal["vanilla", "gspo", "cispo"] = Field(
        "vanilla", description="vanilla: token-level (dual-clip) PPO; gspo: sequence-level ratio (geometric mean "
        "of the token ratios), sequence clipping, aggregated seq-mean-token-mean (verl's GSPO); cispo: "
        "−sg(clip(r, 1−clip_ratio_low, 1+clip_ratio_high))·A·log π_θ, every token keeps a gradient (verl's CISPO)")


# ---- aggregation -------------------------------------------------------------------------------
def count_tokens_and_sequences(response_mask: torch.Tensor) -> tuple[int, int]:
    """(valid tokens, sequences with at least one valid token): the denominators to sum over
    micro-batches and ranks and pass as global_token_count / global_seq_count."""
    mask = check_mask(response_mask)
    return int(mask.sum()), int(mask.any(-1).sum())


def _denominator(name: str, given, local: torch.Tensor) -> torch.Tensor:
    if given is None:
        return local.clamp_min(1)
    value = given if isinstance(given, torch.Tensor) else torch.tensor(float(given))
    if value.numel() != 1 or not bool(torch.isfinite(value)) or float(value) < 0:
        raise ValueError(f"{name} must be a finite count >= 0, got {given!r}")
    return value.to(device=local.device, dtype=local.dtype).reshape(()).clamp_min(1)


def aggregate_loss(
    loss_mat: torch.Tensor,
    mask: torch.Tensor,
    mode: LossAggMode = "token-mean",
    global_token_count=None,
    global_seq_count=None,
    loss_scale_factor: Optional[float] = None,
) -> torch.Tensor:
    """Reduce a [B, T] per-token loss to a scalar (rows without valid tokens contribute 0).

    token-mean: Σ_tokens / N_tokens. token-sum: Σ_tokens (verl's; the gradient grows with the batch's
    tokens). seq-mean-token-sum: Σ_seqs(Σ_tokens) / N_seqs.
    seq-mean-token-mean: Σ_seqs(mean over the sequence's tokens) / N_seqs.
    seq-mean-token-sum-norm (Dr.GRPO): Σ_tokens / (N_seqs · loss_scale_factor).
    """
    mask = check_mask(mask, loss_mat.shape)
    zero = torch.zeros((), dtype=loss_mat.dtype, device=loss_mat.device)
    masked = torch.where(mask, loss_mat, zero)
    if mode == "token-mean":
        return masked.sum() / _denominator("global_token_count", global_token_count, mask.sum().to(loss_mat.dtype))
    if mode == "token-sum":
        return masked.sum()
    n_seq = _denominator("global_seq_count", global_seq_count, mask.any(-1).sum().to(loss_mat.dtype))
    if mode == "seq-mean-token-sum":
        return masked.sum() / n_seq
    if mode == "seq-mean-token-mean":
        per_seq = masked.sum(-1) / mask.sum(-1).clamp_min(1).to(loss_mat.dtype)
        return per_seq.sum() / n_seq
    if mode == "seq-mean-token-sum-norm":
        horizon = loss_scale_factor if loss_scale_factor is not None else max(loss_mat.shape[-1], 1)
        return masked.sum() / (n_seq * horizon)
    raise ValueError(f"loss_agg_mode must be one of {LossAggMode.__args__}, got {mode!r}")


# ---- per-token losses --------------------------------------------------------------------------
def ppo_clip_token_loss(log_prob, anchor_log_prob, advantages, cfg: PolicyLossConfig):
    """Per-token dual-clip PPO loss on r = π_θ/π_anchor and the masks of where each clip binds."""
    log_ratio = (log_prob - anchor_log_prob).clamp(-SAFETY_BOUND, SAFETY_BOUND)
    ratio = torch.exp(log_ratio)
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1.0 - cfg.clip_ratio_low, 1.0 + cfg.clip_ratio_high)
    clip_loss = torch.maximum(unclipped, clipped)
    dual_bound = -advantages * cfg.clip_ratio_c
    negative = advantages < 0
    loss = torch.where(negative, torch.minimum(clip_loss, dual_bound), clip_loss)
    clipped_upper = clipped > unclipped
    clipped_lower = negative & (clip_loss > dual_bound)
    return loss, clipped_upper, clipped_lower, log_ratio


GSPO_LOG_RATIO_MAX = 10.0  # verl's clamp of the sequence log-ratio (numerical safety)


def gspo_token_loss(log_prob, anchor_log_prob, advantages, mask, cfg: PolicyLossConfig):
    """GSPO's per-token loss: the clipped sequence ratio in its straight-through form (see the
    module docstring), the mask of where the clip binds, and the token log-ratios."""
    log_ratio = log_prob - anchor_log_prob
    kept = mask.to(log_prob.dtype)
    seq_log_ratio = (log_ratio * kept).sum(-1) / kept.sum(-1).clamp_min(1)
    token_log_ratio = log_prob - log_prob.detach() + seq_log_ratio.detach().unsqueeze(-1)
    ratio = torch.exp(token_log_ratio.clamp(max=GSPO_LOG_RATIO_MAX))
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1.0 - cfg.clip_ratio_low, 1.0 + cfg.clip_ratio_high)
    return torch.maximum(unclipped, clipped), clipped > unclipped, log_ratio


def cispo_token_loss(log_prob, anchor_log_prob, advantages, cfg: PolicyLossConfig):
    """CISPO's per-token loss (arXiv 2506.13585, verl's `compute_policy_loss_cispo`): the ratio is
    clipped and detached, a weight on the REINFORCE term, so a clipped token still has a gradient.
    Returns the loss, the mask of where the clip binds, and the token log-ratios."""
    log_ratio = (log_prob - anchor_log_prob).clamp(-SAFETY_BOUND, SAFETY_BOUND)
    ratio = torch.exp(log_ratio)
    clipped = ratio.clamp(1.0 - cfg.clip_ratio_low, 1.0 + cfg.clip_ratio_high)
    return -clipped.detach() * advantages * log_prob, ratio != clipped, log_ratio


KL_ESTIMATOR_NAMES = {"kl": "k1", "mse": "k2", "low_var_kl": "k3"}  # verl's, each also with a '+' 
K3_BOUND = 10.0  # verl bounds k3 (low_var_kl) at ±10: a token far from the reference adds 10, no gradient


def kl_penalty(log_prob: torch.Tensor, ref_log_prob: torch.Tensor, estimator: str = "k3") -> torch.Tensor:
    """Per-token estimate of KL(π_θ ‖ π_ref) from samples of π_θ, as verl's kl_penalty computes it,
    with r = π_θ/π_ref: k1 log r; k2 ½ log² r; k3 1/r − 1 + log r (unbiased, >= 0), log r within
    ±20 and the value within ±10 (only k3 is bounded: log-probs are finite, so are the others);
    abs |log r|. A trailing '+' (k1+, k3+, abs+) keeps the value and takes k2's gradient
    (straight through: k1's and k3's expected gradients are not KL's); k2+ is k2."""
    base, straight_through = estimator.removesuffix("+"), estimator.endswith("+")
    base = KL_ESTIMATOR_NAMES.get(base, base)
    log_r = log_prob - ref_log_prob
    if base == "k1":
        value = log_r
    elif base == "k2":
        value, straight_through = 0.5 * log_r.square(), False
    elif base == "k3":
        bounded = log_r.clamp(-SAFETY_BOUND, SAFETY_BOUND)
        value = (torch.exp(-bounded) - 1.0 + bounded).clamp(-K3_BOUND, K3_BOUND)
    elif base == "abs":
        value = log_r.abs()
    else:
        raise ValueError(f"kl_estimator must be one of k1, k2, k3, abs, each optionally with a '+' (or verl's "
                         f"kl, mse, low_var_kl), got {estimator!r}")
    if straight_through:
        k2 = 0.5 * log_r.square()
        return k2 - k2.detach() + value.detach()
    return value


def staleness_metrics(token_versions: torch.Tensor, current_version: int, response_mask: torch.Tensor) -> dict[str, torch.Tensor]:
    """Staleness (current version − generating version) over valid tokens: mean, max, min, and the
    fraction of tokens and of sequences generated by an older version. [B] versions mean one per
    sequence. A version newer than the learner's is an error (it cannot exist)."""
    mask = check_mask(response_mask)
    versions = torch.as_tensor(token_versions, device=mask.device)
    if versions.dim() == 1:
        versions = versions[:, None].expand_as(mask)
    if versions.shape != mask.shape:
        raise ValueError(f"token_versions has shape {tuple(versions.shape)}, expected [batch] or {tuple(mask.shape)}")
    if versions.is_floating_point():
        raise ValueError(f"token_versions must be integers, got {versions.dtype}")
    future = (versions > current_version) & mask
    if future.any():
        row, col = (int(i) for i in future.nonzero()[0])
        raise ValueError(f"token_versions holds version {int(versions[row, col])} at row {row}, token {col}, "
                         f"newer than the learner's version {current_version}")
    staleness = (current_version - versions).to(torch.float64)
    stale = (staleness > 0) & mask
    any_valid = mask.any()
    big = torch.tensor(float(current_version), dtype=torch.float64, device=mask.device)
    return {
        "staleness/mean": masked_mean(staleness, mask),
        "staleness/max": torch.where(any_valid, torch.where(mask, staleness, -big).max(), 0.0 * big),
        "staleness/min": torch.where(any_valid, torch.where(mask, staleness, big).min(), 0.0 * big),
        "staleness/stale_token_fraction": masked_mean(stale.to(torch.float64), mask),
        "staleness/stale_seq_fraction": masked_mean(stale.any(-1).to(torch.float64), mask.any(-1)),
    }


# ---- the loss ----------------------------------------------------------------------------------
def compute_policy_loss(
    log_prob: torch.Tensor,
    old_log_prob: Optional[torch.Tensor],
    rollout_log_prob: Optional[torch.Tensor],
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    correction_config: RolloutCorrectionConfig,
    loss_config: PolicyLossConfig,
    *,
    global_token_count=None,
    global_seq_count=None,
    precomputed_correction: Optional[tuple[Optional[torch.Tensor], torch.Tensor]] = None,
    batch_norm_sums: Optional[torch.Tensor] = None,
    ref_log_prob: Optional[torch.Tensor] = None,
    entropy: Optional[torch.Tensor] = None,
    token_versions: Optional[torch.Tensor] = None,
    current_version: Optional[int] = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """The scalar policy loss (PPO / REINFORCE + KL − entropy) and its metrics. See the module
    docstring for the modes. `old_log_prob` may be None in bypass mode (π_old := π_rollout).
    `batch_norm_sums`: the whole minibatch's `is_batch_norm_sums` when the correction is computed
    here and batch-normalised (None: normalise over this call's rows)."""
    mask = check_mask(response_mask)
    log_prob = _upcast(check_token_values("log_prob", log_prob, mask))
    advantages = _upcast(check_token_values("advantages", advantages, mask)).detach()
    anchor, weights, loss_mask, metrics = _anchor_and_correction(
        log_prob, old_log_prob, rollout_log_prob, mask, correction_config, precomputed_correction, batch_norm_sums)

    stats: dict[str, torch.Tensor] = {}
    reinforce = correction_config.bypass_mode and correction_config.loss_type == "reinforce"
    gspo = loss_config.loss_mode == "gspo"
    agg_mode = "seq-mean-token-mean" if gspo else loss_config.loss_agg_mode
    if reinforce and loss_config.loss_mode != "vanilla":
        raise ValueError(f"loss_mode {loss_config.loss_mode} clips a ratio: bypass mode needs loss_type ppo_clip, "
                         "not reinforce")
    clipped = clipped_lower = None  # where the clip binds (upper; dual clip): none in REINFORCE, no dual in GSPO/CISPO
    if loss_config.loss_mode == "cispo":
        token_loss, clipped, log_ratio = cispo_token_loss(log_prob, anchor, advantages, loss_config)
    elif gspo:
        token_loss, clipped, log_ratio = gspo_token_loss(log_prob, anchor, advantages, loss_mask, loss_config)
    elif reinforce:
        w = weights if weights is not None else torch.ones_like(log_prob)
        token_loss = -w * advantages * log_prob
        log_ratio = log_prob.detach() - anchor  # verl reports it unclamped here
    else:
        token_loss, clipped, clipped_lower, log_ratio = ppo_clip_token_loss(log_prob, anchor, advantages, loss_config)
    if weights is not None and not correction_config.bypass_mode:  # decoupled: the IS weights scale every mode
        token_loss = token_loss * weights
    for key, where in (("actor/pg_clipfrac", clipped), ("actor/pg_clipfrac_lower", clipped_lower)):
        stats[key] = log_prob.new_zeros(()) if where is None else masked_mean(where.to(log_prob.dtype), loss_mask)
    stats["actor/ppo_kl"] = masked_mean(-log_ratio.detach(), loss_mask)

    def agg(x: torch.Tensor, over: torch.Tensor = loss_mask) -> torch.Tensor:
        return aggregate_loss(x, over, agg_mode, global_token_count, global_seq_count,
                              loss_config.loss_scale_factor)

    # Bypass mode rejects inside the loss, for its policy-gradient term only: the KL and entropy
    # terms keep the batch's mask (as verl's bypass loss and actor do). Decoupled mode rejects up
    # front, so every term sees the rejected mask.
    aux_mask = mask if correction_config.bypass_mode else loss_mask
    pg_loss = agg(token_loss)
    loss = pg_loss
    stats["actor/pg_loss"] = pg_loss.detach()
    if loss_config.kl_coef > 0:
        if ref_log_prob is None:
            raise ValueError("kl_coef > 0 needs ref_log_prob (the reference policy's log-probs)")
        ref = check_token_values("ref_log_prob", ref_log_prob, mask).to(log_prob.dtype).detach()
        kl_loss = agg(kl_penalty(log_prob, ref, loss_config.kl_estimator), aux_mask)
        loss = loss + loss_config.kl_coef * kl_loss
        stats["actor/kl_loss"] = kl_loss.detach()
    if entropy is not None or loss_config.entropy_coeff > 0:
        if entropy is None:
            raise ValueError("entropy_coeff > 0 needs entropy (per-token entropy of π_θ, [batch, tokens])")
        entropy = _upcast(check_token_values("entropy", entropy, mask))
        entropy_loss = agg(entropy, aux_mask)
        if loss_config.entropy_coeff > 0:
            loss = loss - loss_config.entropy_coeff * entropy_loss
        stats["actor/entropy"] = entropy_loss.detach()
    if token_versions is not None:
        if current_version is None:
            raise ValueError("token_versions needs current_version (the learner's weight version)")
        stats.update(staleness_metrics(token_versions, current_version, loss_mask))
    metrics.update(to_floats(stats))
    return loss, metrics


def _upcast(x: torch.Tensor) -> torch.Tensor:
    """Losses are summed in at least float32, whatever precision the model's log-probs have."""
    return x.float() if x.dtype in (torch.float16, torch.bfloat16) else x


def _anchor_and_correction(log_prob, old_log_prob, rollout_log_prob, mask, config, precomputed, batch_norm_sums):
    """(PPO anchor log-probs, IS weights or None, loss mask, rollout_corr metrics) for the mode."""
    metrics: dict[str, float] = {}
    if config.bypass_mode:
        if precomputed is not None:
            raise ValueError("precomputed_correction is for decoupled mode: in bypass mode the weights "
                             "depend on π_θ and are recomputed for every call")
        if rollout_log_prob is None:
            raise ValueError("bypass mode needs rollout_log_prob (it is the PPO anchor π_old)")
        anchor = check_token_values("rollout_log_prob", rollout_log_prob, mask)
        with torch.no_grad():  # w = π_θ/π_rollout is a coefficient, recomputed for every call
            weights, loss_mask, metrics = compute_rollout_correction(log_prob.detach(), rollout_log_prob, mask,
                                                                     config, batch_norm_sums)
    else:
        if old_log_prob is None:
            raise ValueError("decoupled mode needs old_log_prob (the proximal policy); set bypass_mode "
                             "to use the rollout log-probs instead")
        anchor = check_token_values("old_log_prob", old_log_prob, mask)
        if precomputed is not None:
            if batch_norm_sums is not None:
                raise ValueError("batch_norm_sums is for a correction computed here; precomputed_correction's "
                                 "weights were normalised when they were computed")
            weights, loss_mask = precomputed
            if (check_mask(loss_mask, mask.shape) & ~mask).any():
                raise ValueError("precomputed_correction's mask keeps tokens that response_mask excludes")
        elif rollout_log_prob is None:
            raise ValueError("decoupled mode needs rollout_log_prob to compute the correction "
                             "(or pass precomputed_correction)")
        else:
            weights, loss_mask, metrics = compute_rollout_correction(old_log_prob, rollout_log_prob, mask, config,
                                                                     batch_norm_sums)
    if weights is not None:
        if weights.shape != mask.shape:
            raise ValueError(f"IS weights have shape {tuple(weights.shape)}, expected {tuple(mask.shape)}")
        weights = weights.detach().to(log_prob.dtype)
    return anchor.to(log_prob.dtype).detach(), weights, check_mask(loss_mask), metrics
