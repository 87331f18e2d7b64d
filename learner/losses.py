"""Policy losses: decoupled PPO (with dual clip), bypass PPO-clip and bypass REINFORCE, loss
aggregation, KL penalty and entropy bonus.

Public API:

- `PolicyLossConfig` (pydantic): clip_ratio_low 0.2, clip_ratio_high 0.2, clip_ratio_c 3.0,
  loss_agg_mode ("token-mean" | "token-sum" | "seq-mean-token-sum" | "seq-mean-token-mean" |
  "seq-mean-token-sum-norm"), loss_scale_factor, kl_coef, kl_estimator ("k1" | "k2" | "k3" |
  "abs" | "k1+" | "k3+", or verl's names kl, mse, low_var_kl), entropy_coeff, loss_mode (vanilla |
  gspo | cispo | sapo | gpg | dro | dppo_tv | dppo_kl | geo_mean | clip_cov | kl_cov) and those
  modes' parameters under verl's names (tau_pos, tau_neg, dro_beta, clip_cov_ratio/_lb/_ub,
  kl_cov_ratio, ppo_kl_coef).
- `compute_policy_loss(log_prob, old_log_prob, rollout_log_prob, advantages, response_mask,
  correction_config, loss_config, *, global_token_count=None, global_seq_count=None,
  precomputed_correction=None, batch_norm_sums=None, ref_log_prob=None, entropy=None,
  token_versions=None, current_version=None, generator=None) -> (loss, metrics)`: the scalar
  loss to call `.backward()` on and a dict of floats (`actor/...`, `staleness/...`, and
  `rollout_corr/...` when the correction is computed here).
- `aggregate_loss(loss_mat, mask, mode, global_token_count=None, global_seq_count=None,
  loss_scale_factor=None)`, `count_tokens_and_sequences(mask)`, `kl_penalty(log_prob,
  ref_log_prob, estimator)`, `staleness_metrics(token_versions, current_version, mask)`,
  `policy_token_loss(log_prob, anchor_log_prob, advantages, mask, cfg) -> TokenLoss`,
  `check_loss_mode_fits(loss_mode, correction_config)`.
- `value_loss(values_pred, old_values, returns, mask, cliprange_value, mode, global_token_count=None,
  global_seq_count=None) -> (loss, clipfrac)`: the critic's clipped value loss (PPO with gae).

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
- The other modes are verl's losses of the same names, with the same anchors and IS weights
  (`policy_token_loss` and the functions it calls say each one's formula): sapo (a soft gate on r,
  seq-mean-token-mean like verl's), gpg, dro, dppo_tv, dppo_kl, geo_mean (GMPO: a sequence's loss,
  weighted by the geometric mean of its IS weights, averaged over sequences), clip_cov and kl_cov
  (their covariance is over the call's tokens: a micro-batch's, as in verl, so unlike the other
  modes they depend on the split). Bypass REINFORCE is a loss of its own and refuses every mode
  but vanilla.
"""
from __future__ import annotations

from typing import Literal, NamedTuple, Optional

import torch
from pydantic import BaseModel, ConfigDict, Field, model_validator

from learner.correction import (
    SAFETY_BOUND,
    RolloutCorrectionConfig,
    check_mask,
    check_token_values,
    compute_rollout_correction,
    masked_mean,
    masked_mean_rows,
    to_floats,
)

LossAggMode = Literal["token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-mean",
                      "seq-mean-token-sum-norm"]
LossMode = Literal["vanilla", "gspo", "cispo", "sapo", "gpg", "dro", "dppo_tv", "dppo_kl", "geo_mean", "clip_cov",
                   "kl_cov"]
# modes that average within each sequence first whatever loss_agg_mode says (as verl's do)
SEQUENCE_MEAN_MODES = ("gspo", "sapo", "geo_mean")


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
    loss_mode: LossMode = Field(
        "vanilla", description="the policy-gradient loss (verl's policy_loss.loss_mode; see learner/losses.py): "
        "vanilla token-level dual-clip PPO; gspo sequence-level ratio (geometric mean), clipped per sequence; "
        "cispo −sg(clip(r))·A·log π_θ; sapo a soft sigmoid gate on r (tau_pos, tau_neg); gpg −A·log π_θ; "
        "dro −(A·log π_θ − ½·dro_beta·log² r); dppo_tv / dppo_kl drop tokens whose probability moved past "
        "clip_ratio_low/high in total variation / binary KL; geo_mean GMPO's geometric-mean ratio of "
        "clipped token ratios; clip_cov / kl_cov PPO with the highest-covariance tokens dropped / penalised")
    tau_pos: float = Field(1.0, gt=0, description="sapo: gate temperature where A > 0")
    tau_neg: float = Field(1.05, gt=0, description="sapo: gate temperature where A <= 0")
    dro_beta: Optional[float] = Field(None, gt=0, description="dro: weight of the ½·log² r penalty (required)")
    clip_cov_ratio: float = Field(0.0002, gt=0, le=1, description="clip_cov: share of tokens whose gradient is dropped")
    clip_cov_lb: float = Field(1.0, description="clip_cov: tokens with covariance above this are candidates")
    clip_cov_ub: float = Field(5.0, description="clip_cov: ... and below this")
    kl_cov_ratio: float = Field(0.0002, gt=0, le=1, description="kl_cov: share of tokens that get the |log r| penalty")
    ppo_kl_coef: float = Field(0.1, ge=0, description="kl_cov: weight of the |log r| penalty")

    @model_validator(mode="after")
    def _mode_parameters(self):
        if self.loss_mode == "dro" and self.dro_beta is None:
            raise ValueError("loss_mode dro needs dro_beta (> 0), the weight of its ½·log² r penalty")
        if self.clip_cov_lb >= self.clip_cov_ub:
            raise ValueError(f"clip_cov_lb ({self.clip_cov_lb}) must be below clip_cov_ub ({self.clip_cov_ub})")
        return self


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
class TokenLoss(NamedTuple):
    """One loss mode's per-token loss [B, T] and what its metrics are made of: where its clip binds
    (`clipped`: actor/pg_clipfrac; `clipped_lower`: actor/pg_clipfrac_lower, the dual clip's;
    None where the mode has no such clip) and the per-token value whose mean is actor/ppo_kl."""

    loss: torch.Tensor
    clipped: Optional[torch.Tensor]
    clipped_lower: Optional[torch.Tensor]
    ppo_kl: torch.Tensor


def _ratio(log_prob, anchor_log_prob):
    """(r, log r) with log r within ±20, as verl bounds it for the modes that bound it."""
    log_ratio = (log_prob - anchor_log_prob).clamp(-SAFETY_BOUND, SAFETY_BOUND)
    return torch.exp(log_ratio), log_ratio


def _clip_band(ratio, cfg: PolicyLossConfig):
    return ratio.clamp(1.0 - cfg.clip_ratio_low, 1.0 + cfg.clip_ratio_high)


def ppo_clip_token_loss(log_prob, anchor_log_prob, advantages, cfg: PolicyLossConfig) -> TokenLoss:
    """Per-token dual-clip PPO loss on r = π_θ/π_anchor and the masks of where each clip binds."""
    ratio, log_ratio = _ratio(log_prob, anchor_log_prob)
    unclipped = -advantages * ratio
    clipped = -advantages * _clip_band(ratio, cfg)
    clip_loss = torch.maximum(unclipped, clipped)
    dual_bound = -advantages * cfg.clip_ratio_c
    negative = advantages < 0
    loss = torch.where(negative, torch.minimum(clip_loss, dual_bound), clip_loss)
    return TokenLoss(loss, clipped > unclipped, negative & (clip_loss > dual_bound), -log_ratio)


GSPO_LOG_RATIO_MAX = 10.0  # verl's clamp of the sequence log-ratio (numerical safety)


def gspo_token_loss(log_prob, anchor_log_prob, advantages, mask, cfg: PolicyLossConfig) -> TokenLoss:
    """GSPO's per-token loss: the clipped sequence ratio in its straight-through form (see the
    module docstring)."""
    log_ratio = log_prob - anchor_log_prob
    seq_log_ratio = masked_mean_rows(log_ratio, mask)
    token_log_ratio = log_prob - log_prob.detach() + seq_log_ratio.detach().unsqueeze(-1)
    ratio = torch.exp(token_log_ratio.clamp(max=GSPO_LOG_RATIO_MAX))
    unclipped = -advantages * ratio
    clipped = -advantages * _clip_band(ratio, cfg)
    return TokenLoss(torch.maximum(unclipped, clipped), clipped > unclipped, None, -log_ratio)


def cispo_token_loss(log_prob, anchor_log_prob, advantages, cfg: PolicyLossConfig) -> TokenLoss:
    """CISPO's per-token loss (arXiv 2506.13585, verl's `compute_policy_loss_cispo`): the ratio is
    clipped and detached, a weight on the REINFORCE term, so a clipped token still has a gradient."""
    ratio, log_ratio = _ratio(log_prob, anchor_log_prob)
    clipped = _clip_band(ratio, cfg)
    return TokenLoss(-clipped.detach() * advantages * log_prob, ratio != clipped, None, -log_ratio)


def sapo_token_loss(log_prob, anchor_log_prob, advantages, cfg: PolicyLossConfig) -> TokenLoss:
    """SAPO (arXiv 2511.20347, verl's `compute_policy_loss_sapo`): no hard clip; the ratio passes a
    soft gate f(r) = sigmoid(τ(r − 1))·4/τ (slope 1 at r = 1, flat far from it), τ = tau_pos where
    A > 0 and tau_neg elsewhere."""
    ratio, log_ratio = _ratio(log_prob, anchor_log_prob)
    tau = torch.full_like(ratio, cfg.tau_neg).masked_fill(advantages > 0, cfg.tau_pos)
    gate = torch.sigmoid(tau * (ratio - 1.0)) * (4.0 / tau)
    return TokenLoss(-gate * advantages, None, None, -log_ratio)


def gpg_token_loss(log_prob, anchor_log_prob, advantages) -> TokenLoss:
    """GPG (arXiv 2504.02546, verl's `compute_policy_loss_gpg`): plain −A·log π_θ, no ratio, no clip."""
    return TokenLoss(-advantages * log_prob, None, None, -(log_prob - anchor_log_prob))


def dro_token_loss(log_prob, anchor_log_prob, advantages, cfg: PolicyLossConfig) -> TokenLoss:
    """DRO (verl's `compute_policy_loss_dro`): −(A·log π_θ − ½β·log² r), the quadratic keeping π_θ
    near π_anchor instead of a clip."""
    log_ratio = log_prob - anchor_log_prob
    return TokenLoss(-(advantages * log_prob - 0.5 * cfg.dro_beta * log_ratio.square()), None, None, -log_ratio)


def dppo_token_loss(log_prob, anchor_log_prob, advantages, cfg: PolicyLossConfig, divergence: str) -> TokenLoss:
    """DPPO-Binary (arXiv 2602.04879, verl's `compute_policy_loss_dppo_tv` / `_kl`): −A·sg(min(r, c))
    ·log π_θ on the tokens whose probability moved less than the trust region allows, 0 elsewhere.
    The region is on the token's probability p = π_θ against p_old = π_anchor, not on r:
    tv: p − p_old <= clip_ratio_high where A > 0, >= −clip_ratio_low where A <= 0; kl: the
    Bernoulli KL(p_old ‖ p) <= clip_ratio_high (A > 0) or clip_ratio_low (A <= 0), a move the other
    way always kept. `clipped`: tokens outside the region; `clipped_lower`: kept tokens whose r
    exceeded clip_ratio_c (truncated)."""
    ratio, log_ratio = _ratio(log_prob, anchor_log_prob)
    prob, old_prob = torch.exp(log_prob), torch.exp(anchor_log_prob)
    if divergence == "tv":
        inside_pos = prob - old_prob <= cfg.clip_ratio_high
        inside_neg = prob - old_prob >= -cfg.clip_ratio_low
    else:
        binary_kl = old_prob * (anchor_log_prob - log_prob) + (1 - old_prob) * torch.log(
            (1.0 - old_prob + 1e-8) / (1.0 - prob + 1e-8))
        inside_pos = (binary_kl <= cfg.clip_ratio_high) | (prob <= old_prob)
        inside_neg = (binary_kl <= cfg.clip_ratio_low) | (prob >= old_prob)
    inside = torch.where(advantages > 0, inside_pos, inside_neg).detach()
    truncated = ratio.clamp(max=cfg.clip_ratio_c).detach()
    loss = -advantages * truncated * log_prob * inside.to(log_prob.dtype)
    return TokenLoss(loss, ~inside, inside & (ratio > cfg.clip_ratio_c), -log_ratio)


def geo_mean_token_loss(log_prob, anchor_log_prob, advantages, mask, cfg: PolicyLossConfig) -> TokenLoss:
    """GMPO (arXiv 2507.20673, verl's `compute_policy_loss_geo_mean`): a sequence's ratio is the
    geometric mean of its token ratios, each token's log-ratio first clipped to [−clip_ratio_low,
    clip_ratio_high] on the pessimistic side (as PPO clips r); the loss −Ā·ratio with Ā the
    sequence's mean advantage, on every token of the sequence (aggregated seq-mean-token-mean, that
    is once per sequence). `clipped`: tokens clipped where A > 0; `clipped_lower`: where A < 0."""
    log_ratio = log_prob - anchor_log_prob
    sign = torch.sign(advantages)
    bounded = log_ratio.clamp(-cfg.clip_ratio_low, cfg.clip_ratio_high)
    pessimistic = sign * torch.minimum(sign * log_ratio, sign * bounded)
    ratio = torch.exp(masked_mean_rows(pessimistic, mask).clamp(max=SAFETY_BOUND))
    loss = -masked_mean_rows(advantages, mask) * ratio
    changed = log_ratio != bounded
    return TokenLoss(loss.unsqueeze(-1).expand_as(log_prob), changed & (advantages > 0), changed & (advantages < 0),
                     -log_ratio)


def clip_cov_token_loss(log_prob, anchor_log_prob, advantages, mask, cfg: PolicyLossConfig,
                        generator: Optional[torch.Generator] = None) -> TokenLoss:
    """Clip-Cov (arXiv 2505.22617, verl's `compute_policy_loss_clip_cov`): PPO's clipped loss (no dual
    clip), and among the tokens it left unclipped, those whose covariance of advantage and log π_θ
    (centred over the call's tokens) lies in (clip_cov_lb, clip_cov_ub): a random clip_cov_ratio
    of the call's tokens (at least one) lose their gradient, against the entropy collapse those
    tokens drive. `clipped`: the dropped tokens (verl's pg_clipfrac counts those only). Random: pass
    a seeded `generator` to repeat a choice."""
    ratio, log_ratio = _ratio(log_prob, anchor_log_prob)
    unclipped = -advantages * ratio
    clipped = -advantages * _clip_band(ratio, cfg)
    clip_by_ppo = (clipped > unclipped) & mask
    cov = (advantages - masked_mean(advantages, mask)) * (log_prob.detach() - masked_mean(log_prob.detach(), mask))
    candidates = ((cov > cfg.clip_cov_lb) & (cov < cfg.clip_cov_ub) & mask & ~clip_by_ppo).nonzero()
    quota = max(int(cfg.clip_cov_ratio * int(mask.sum())), 1)
    chosen = candidates[torch.randperm(len(candidates), generator=generator)[:quota].to(candidates.device)]
    dropped = torch.zeros_like(mask)
    dropped[chosen[:, 0], chosen[:, 1]] = True
    loss = torch.where(dropped, torch.zeros_like(ratio), torch.maximum(unclipped, clipped))
    return TokenLoss(loss, dropped, None, -log_ratio)


def kl_cov_token_loss(log_prob, anchor_log_prob, advantages, mask, cfg: PolicyLossConfig) -> TokenLoss:
    """KL-Cov (arXiv 2505.22617, verl's `compute_policy_loss_kl_cov`): the unclipped −A·r, plus
    ppo_kl_coef·|log r| on the kl_cov_ratio of the call's tokens (at least one) with the largest
    covariance of advantage and log π_θ. actor/ppo_kl is the mean |log r| here, as verl reports it."""
    ratio, log_ratio = _ratio(log_prob, anchor_log_prob)
    loss = -advantages * ratio
    flat = mask.reshape(-1).nonzero().squeeze(-1)
    if flat.numel():
        adv, logp = advantages.detach().reshape(-1)[flat], log_prob.detach().reshape(-1)[flat]
        cov = (adv - adv.mean()) * (logp - logp.mean())
        top = flat[torch.topk(cov, max(1, int(flat.numel() * cfg.kl_cov_ratio))).indices]
        penalised = torch.zeros(mask.numel(), dtype=torch.bool, device=mask.device)
        penalised[top] = True
        penalised = penalised.reshape(mask.shape)
        loss = torch.where(penalised, loss + cfg.ppo_kl_coef * log_ratio.abs(), loss)
    return TokenLoss(loss, None, None, log_ratio.abs())


def policy_token_loss(log_prob, anchor_log_prob, advantages, mask, cfg: PolicyLossConfig,
                      generator: Optional[torch.Generator] = None) -> TokenLoss:
    """The per-token policy-gradient loss of `cfg.loss_mode` against π_anchor (before IS weights)."""
    mode, args = cfg.loss_mode, (log_prob, anchor_log_prob, advantages)
    if mode == "vanilla":
        return ppo_clip_token_loss(*args, cfg)
    if mode == "gspo":
        return gspo_token_loss(*args, mask, cfg)
    if mode == "cispo":
        return cispo_token_loss(*args, cfg)
    if mode == "sapo":
        return sapo_token_loss(*args, cfg)
    if mode == "gpg":
        return gpg_token_loss(*args)
    if mode == "dro":
        return dro_token_loss(*args, cfg)
    if mode in ("dppo_tv", "dppo_kl"):
        return dppo_token_loss(*args, cfg, mode.removeprefix("dppo_"))
    if mode == "geo_mean":
        return geo_mean_token_loss(*args, mask, cfg)
    if mode == "clip_cov":
        return clip_cov_token_loss(*args, mask, cfg, generator)
    if mode == "kl_cov":
        return kl_cov_token_loss(*args, mask, cfg)
    raise ValueError(f"loss_mode must be one of {LossMode.__args__}, got {mode!r}")


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


def value_loss(values_pred: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor,
               cliprange_value: float, mode: LossAggMode = "token-mean", global_token_count=None,
               global_seq_count=None) -> tuple[torch.Tensor, torch.Tensor]:
    """The critic's clipped value loss (verl's `compute_value_loss`, after PPO's): per token
    max((V − R)², (clip(V, V_old ± ε) − R)²), aggregated by `mode` over `mask` and halved; and the
    fraction of the tokens where the clipped term is the larger (critic/vf_clipfrac; 0 without tokens)."""
    mask = check_mask(mask, values_pred.shape)
    clipped = torch.maximum(torch.minimum(values_pred, old_values + cliprange_value), old_values - cliprange_value)
    unclipped_loss = (values_pred - returns).square()
    clipped_loss = (clipped - returns).square()
    loss = 0.5 * aggregate_loss(torch.maximum(unclipped_loss, clipped_loss), mask, mode, global_token_count,
                                global_seq_count)
    tokens = mask.sum().clamp_min(1)
    clipfrac = ((clipped_loss > unclipped_loss) & mask).sum().to(values_pred.dtype) / tokens
    return loss, clipfrac.detach()


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
def check_loss_mode_fits(loss_mode: str, correction_config: RolloutCorrectionConfig) -> None:
    """Bypass REINFORCE is a policy-gradient loss of its own: it takes no other loss mode."""
    if correction_config.bypass_mode and correction_config.loss_type == "reinforce" and loss_mode != "vanilla":
        raise ValueError(f"loss_mode {loss_mode} is a policy-gradient loss of its own (in bypass mode anchored on "
                         "π_rollout): bypass mode needs loss_type ppo_clip with it, not reinforce")


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
    generator: Optional[torch.Generator] = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """The scalar policy loss (PPO / REINFORCE + KL − entropy) and its metrics. See the module
    docstring for the modes. `old_log_prob` may be None in bypass mode (π_old := π_rollout).
    `batch_norm_sums`: the whole minibatch's `is_batch_norm_sums` when the correction is computed
    here and batch-normalised (None: normalise over this call's rows). `generator`: clip_cov's
    random choice (None: torch's default generator)."""
    mask = check_mask(response_mask)
    log_prob = _upcast(check_token_values("log_prob", log_prob, mask))
    advantages = _upcast(check_token_values("advantages", advantages, mask)).detach()
    anchor, weights, loss_mask, metrics = _anchor_and_correction(
        log_prob, old_log_prob, rollout_log_prob, mask, correction_config, precomputed_correction, batch_norm_sums)

    stats: dict[str, torch.Tensor] = {}
    mode = loss_config.loss_mode
    check_loss_mode_fits(mode, correction_config)
    agg_mode = "seq-mean-token-mean" if mode in SEQUENCE_MEAN_MODES else loss_config.loss_agg_mode
    if correction_config.bypass_mode and correction_config.loss_type == "reinforce":
        w = weights if weights is not None else torch.ones_like(log_prob)
        # verl reports ppo_kl unclamped here
        pg = TokenLoss(-w * advantages * log_prob, None, None, -(log_prob.detach() - anchor))
    else:
        pg = policy_token_loss(log_prob, anchor, advantages, loss_mask, loss_config, generator)
    token_loss = pg.loss
    if weights is not None and not correction_config.bypass_mode:  # decoupled: the IS weights scale every mode
        # geo_mean's loss is a sequence's: its weight is the geometric mean of the token weights (verl's)
        token_loss = token_loss * (_geometric_mean_weights(weights, loss_mask) if mode == "geo_mean" else weights)
    for key, where in (("actor/pg_clipfrac", pg.clipped), ("actor/pg_clipfrac_lower", pg.clipped_lower)):
        stats[key] = log_prob.new_zeros(()) if where is None else masked_mean(where.to(log_prob.dtype), loss_mask)
    stats["actor/ppo_kl"] = masked_mean(pg.ppo_kl.detach(), loss_mask)

    def agg(x: torch.Tensor, over: torch.Tensor = loss_mask, how: str = loss_config.loss_agg_mode) -> torch.Tensor:
        return aggregate_loss(x, over, how, global_token_count, global_seq_count, loss_config.loss_scale_factor)

    # Bypass mode rejects inside the loss, for its policy-gradient term only: the KL and entropy
    # terms keep the batch's mask (as verl's bypass loss and actor do). Decoupled mode rejects up
    # front, so every term sees the rejected mask.
    aux_mask = mask if correction_config.bypass_mode else loss_mask
    pg_loss = agg(token_loss, how=agg_mode)  # a sequence-level loss fixes its own; KL and entropy keep the config's
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


def _geometric_mean_weights(weights: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Each row's geometric mean of its kept tokens' weights, on every token of the row."""
    return torch.exp(masked_mean_rows(torch.log(weights + 1e-10), mask)).unsqueeze(-1).expand_as(weights)


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
