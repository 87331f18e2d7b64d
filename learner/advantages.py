"""Outcome-reward advantages for groups of responses to the same prompt.

Public API:

- `AdvantageConfig` (pydantic): `estimator` ("grpo" | "dr_grpo" | "rloo" |
  "reinforce_plus_plus_baseline" | "grpo_passk" | "opo" | "reinforce_plus_plus" | "gpg" | "gdpo" |
  "optimal_token_baseline" | "tir_optimal_token_baseline" | "remax" | "gae"),
  `eps` (1e-6), `gamma` (1.0, reinforce_plus_plus's and gae's discount), `lam` (1.0, gae's λ), `gdpo_reward_keys`,
  `gdpo_reward_weights`, `gdpo_norm_by_std`.
- `compute_advantages(rewards, group_ids, response_mask, config, token_rewards=None,
  reward_components=None, old_log_probs=None, sum_pi_squared=None, is_weights=None,
  reward_baselines=None) -> advantages [B, T]`: one scalar per sequence, spread over its valid
  tokens (0 at padding); reinforce_plus_plus, optimal_token_baseline and remax give each token its own.
- `KLRewardConfig`, `kl_penalised_rewards(rewards, mask, kl, beta, token_rewards)`,
  `adaptive_kl_coef(beta, current_kl, rows, cfg)`: a KL penalty in the reward before the
  advantages (the learner's `kl_in_reward`).
- `group_index(group_ids) -> LongTensor [B]`: rows with equal ids share a group (any hashables,
  or an integer tensor); the estimators below take it.
- `grpo_advantages`, `dr_grpo_advantages`, `rloo_advantages`, `reinforce_pp_baseline_advantages`,
  `grpo_passk_advantages`, `opo_advantages`, `gpg_advantages`, `gdpo_advantages`: the per-sequence
  [B] advantages; `reinforce_pp_advantages`, `optimal_token_baseline_advantages`, `remax_advantages`:
  [B, T], from `token_level_rewards` (and `discounted_returns`).

Estimators (r = reward, groups by id):
- grpo: (r − mean_g) / (std_g + eps), std unbiased; a group of one has mean 0 and std 1.
- dr_grpo: r − mean_g (Dr.GRPO drops the std division; a group of one has mean 0).
- rloo: r − mean of the *other* rewards in the group = n/(n−1)·(r − mean_g); a group of one: r.
- reinforce_plus_plus_baseline: r − mean_g, then whitened over all valid tokens of the batch
  (REINFORCE++ with a group baseline).
- grpo_passk (Pass@k training, arXiv 2503.19595): only the group's best response learns,
  (r_max − r_second) / (std_g + eps); every other response gets 0 (a tie: the first best, as
  verl's `topk` picks it). A group of one has no second: 0 (the config refuses rollout.sampling.n=1).
- opo (arXiv 2505.23585): r − the group's length-weighted mean reward Σ|y|·r / Σ|y| (|y|: valid
  tokens); a group of one: r.
- reinforce_plus_plus (arXiv 2501.03262): no baseline; each policy token's discounted return,
  whitened over the batch's policy tokens. The rewards sit where the sample put them
  (`token_rewards`: a multi-turn step's on its action's last token) and the rest of the reward on
  the last policy token; a token's return is Σ γ^k·reward from it on (k: policy tokens between),
  so with one outcome reward it is γ^k·r, k the policy tokens after it.
- gpg (arXiv 2504.02546): α·(r − mean_g), α = B / (responses with a non-zero reward); a group of
  one: α·r.
- gdpo (arXiv 2601.05242): each reward component (`gdpo_reward_keys`) GRPO-normalised in its groups
  on its own, weighted and summed, then whitened over the batch's valid tokens; the reward itself
  is not used.
- optimal_token_baseline (verl's OTB): each token's return-to-go G_t less a baseline of its own,
  the group's returns at t weighted by each response's path variance so far,
  B_t = Σ_g G_t·W_t / (Σ_g W_t + 1e-8), W_t = Σ_{j<=t} (1 − 2π_j + Σ_v π_v²)_j (π: the proximal
  policy's probability of the sampled token, Σπ²: of its whole next-token distribution, from the
  proximal pass; each term times ρ̄_j² when the rollout correction gives IS weights). A group of
  one has no baseline; the tail of a group's single longest response beyond the second longest
  has none either. Needs prox_mode: recompute.
- tir_optimal_token_baseline (verl's multi-turn form): the same with t counting a trajectory's
  policy tokens only (the tool and observation tokens between turns skipped), so the baseline of
  each response's k-th own token compares the group's k-th own tokens.
- remax (ReMax, arXiv 2310.10505): each policy token's return-to-go (γ = 1; with one outcome
  reward, r on every token) less the reward of the group's greedy response, which the rollout
  worker generates and scores beside the n samples (`rollout.greedy_baseline`, on with remax) and
  hands over as each sample's `reward_baseline`; no whitening. The greedy response is not trained on.
- gae (PPO with a critic, arXiv 1506.02438): δ_t = r_t + γ·V(s_{t+1}) − V(s_t) over the policy
  tokens, A_t = Σ (γλ)^k δ_{t+k}, whitened over the batch's policy tokens; the critic learns the
  returns A_t + V(s_t) (before whitening). V comes from the learner's critic (learner/critic.py);
  no groups: rollout.sampling.n may be 1.
These are verl's `compute_*_outcome_advantage` with outcome rewards (parity checked on its code).
"""
from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import Literal, Optional, Union

import torch
from pydantic import BaseModel, ConfigDict, Field, model_validator

from learner.correction import check_mask

Estimator = Literal["grpo", "dr_grpo", "rloo", "reinforce_plus_plus_baseline", "grpo_passk", "opo",
                    "reinforce_plus_plus", "gpg", "gdpo", "optimal_token_baseline", "tir_optimal_token_baseline",
                    "remax", "gae"]
OTB_ESTIMATORS = ("optimal_token_baseline", "tir_optimal_token_baseline")  # need π_old's Σp²
GroupIds = Union[Sequence[Hashable], torch.Tensor]


class AdvantageConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    estimator: Estimator = "grpo"
    eps: float = Field(1e-6, gt=0, description="added to the group std (grpo, grpo_passk) before dividing")
    gamma: float = Field(1.0, gt=0, le=1, description="reinforce_plus_plus and gae: discount per response token "
                         "(verl's algorithm.gamma); 1: every token gets the sequence's reward")
    lam: float = Field(1.0, ge=0, le=1, description="gae: λ, the trade of bias (0: one-step TD errors, leaning "
                       "on the critic) against variance (1: Monte-Carlo returns less V) (verl's algorithm.lam)")
    gdpo_reward_keys: Optional[list[str]] = Field(
        None, description="gdpo: the reward components to normalise one by one, keys of the dict a verl-form "
        "reward returns (they reach the learner as the samples' reward/<key> metrics)")
    gdpo_reward_weights: Optional[list[float]] = Field(None, description="gdpo: one weight per key (None: 1 each)")
    gdpo_norm_by_std: bool = Field(True, description="gdpo: divide each component by its group std "
                                   "(verl's norm_adv_by_std_in_grpo)")

    @model_validator(mode="after")
    def _gdpo_keys(self):
        keys, weights = self.gdpo_reward_keys, self.gdpo_reward_weights
        if self.estimator == "gdpo" and not keys:
            raise ValueError("estimator gdpo needs gdpo_reward_keys: the reward components (keys of the dict your "
                             "compute_score returns, e.g. [format_reward, accuracy_reward]) to normalise one by one")
        if weights is not None and len(weights) != len(keys or []):
            raise ValueError(f"gdpo_reward_weights has {len(weights)} weights for {len(keys or [])} gdpo_reward_keys")
        return self


class KLRewardConfig(BaseModel):
    """A KL penalty in the reward (verl's use_kl_in_reward, OpenRLHF's default for REINFORCE++):
    each response token's reward less β·KL(π_old ‖ π_ref) of that token, before the advantages.
    Off at coef 0; the KL term of the loss is `policy_loss.kl_coef`."""

    model_config = ConfigDict(extra="forbid")

    coef: float = Field(0.0, ge=0, description="β (verl's kl_ctrl.kl_coef), the starting one when adaptive; 0: off")
    estimator: Literal["k1", "k2", "k3", "abs", "kl", "mse", "low_var_kl"] = Field(
        "k1", description="the per-token KL estimate (verl's algorithm.kl_penalty; kl = k1, its default)")
    controller: Literal["fixed", "adaptive"] = Field(
        "fixed", description="adaptive: β follows the measured KL towards target_kl (Ziegler et al. 2019, "
        "verl's AdaptiveKLController): β·(1 + clip(KL/target − 1, ±0.2)·rows/horizon) after every step")
    target_kl: float = Field(0.1, gt=0, description="adaptive: the KL per token β steers to")
    horizon: int = Field(10000, ge=1, description="adaptive: responses over which β moves by up to 20 %")


def kl_penalised_rewards(rewards: torch.Tensor, mask: torch.Tensor, kl: torch.Tensor, beta: float,
                         token_rewards: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(rewards [B], token rewards [B, T]) with β·kl taken off every valid token (`kl` [B, T]: the
    per-token estimate); a sequence's reward becomes r − β·Σ kl, what the outcome estimators use."""
    placed = token_level_rewards(rewards, mask, token_rewards) - beta * kl * mask.to(kl.dtype)
    return placed.sum(-1), placed


def adaptive_kl_coef(beta: float, current_kl: float, rows: int, cfg: KLRewardConfig) -> float:
    """The β of the next step: unchanged for a fixed controller; else moved towards target_kl."""
    if cfg.controller == "fixed":
        return beta
    error = min(max(current_kl / cfg.target_kl - 1.0, -0.2), 0.2)
    return beta * (1.0 + error * rows / cfg.horizon)


def group_index(group_ids: GroupIds, batch_size: int | None = None) -> torch.Tensor:
    """Dense group numbers [B] (0..G-1, in order of first appearance) for per-row group ids."""
    if isinstance(group_ids, torch.Tensor):
        if group_ids.dim() != 1 or group_ids.is_floating_point():
            raise ValueError(f"group_ids must be a 1-D integer tensor, got {group_ids.dtype} {tuple(group_ids.shape)}")
        keys = group_ids.tolist()
    else:
        keys = list(group_ids)
    if batch_size is not None and len(keys) != batch_size:
        raise ValueError(f"group_ids has {len(keys)} entries for {batch_size} rewards")
    numbers: dict = {}
    return torch.tensor([numbers.setdefault(k, len(numbers)) for k in keys], dtype=torch.long)


def _check_rewards(rewards: torch.Tensor) -> torch.Tensor:
    rewards = torch.as_tensor(rewards)
    if rewards.dim() != 1:
        raise ValueError(f"rewards must be one scalar per sequence ([batch]), got shape {tuple(rewards.shape)}")
    if not rewards.is_floating_point():
        rewards = rewards.to(torch.float32)
    bad = ~torch.isfinite(rewards)
    if bad.any():
        row = int(bad.nonzero()[0])
        raise ValueError(f"reward of row {row} is not finite ({rewards[row].item()})")
    return rewards if rewards.dtype == torch.float64 else rewards.to(torch.float32)


def _group_sums(values: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """[G]: the sum of `values` [B] over each group's rows."""
    index = index.to(values.device)
    n_groups = int(index.max()) + 1 if index.numel() else 0
    return torch.zeros(n_groups, dtype=values.dtype, device=values.device).index_add_(0, index, values)


def _group_stats(rewards: torch.Tensor, index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-row group size, group mean and unbiased group std (groups of one: mean 0, std 1)."""
    index = index.to(rewards.device)
    count = _group_sums(torch.ones_like(rewards), index)
    mean = _group_sums(rewards, index) / count
    sq_dev = _group_sums((rewards - mean[index]) ** 2, index)
    std = (sq_dev / (count - 1).clamp_min(1)).sqrt()
    single = count == 1
    mean = torch.where(single, torch.zeros_like(mean), mean)
    std = torch.where(single, torch.ones_like(std), std)
    return count[index], mean[index], std[index]


def grpo_advantages(rewards: torch.Tensor, index: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    _, mean, std = _group_stats(rewards, index)
    return (rewards - mean) / (std + eps)


def dr_grpo_advantages(rewards: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    _, mean, _ = _group_stats(rewards, index)
    return rewards - mean


def rloo_advantages(rewards: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    count, mean, _ = _group_stats(rewards, index)
    # Leave-one-out baseline: (Σ_g − r)/(n − 1), i.e. n/(n−1)·(r − mean); a group of one keeps r.
    return torch.where(count > 1, count / (count - 1).clamp_min(1) * (rewards - mean), rewards)


def _whiten(values: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """(values − mean) / sqrt(var + 1e-8), mean and unbiased variance weighted by `weights` (token
    counts or a token mask): verl's masked_whiten. Fewer than two tokens: the values unchanged."""
    weights = weights.to(values.dtype)
    n = weights.sum()
    if n < 2:
        return values
    mean = (values * weights).sum() / n
    var = (((values - mean) ** 2) * weights).sum() / (n - 1)
    return (values - mean) / (var + 1e-8).sqrt()


def reinforce_pp_baseline_advantages(rewards: torch.Tensor, index: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Group-baselined rewards whitened over the batch's valid tokens (each sequence counts once
    per valid token, as its advantage is spread over them); returns per-sequence values."""
    return _whiten(dr_grpo_advantages(rewards, index), mask.sum(-1))


def token_level_rewards(rewards: torch.Tensor, mask: torch.Tensor,
                        token_rewards: torch.Tensor | None = None) -> torch.Tensor:
    """[B, T]: the per-token rewards (a multi-turn trajectory's step rewards on its actions' last
    tokens; None: none), and whatever part of each reward they do not sum to (all of it for a
    single-turn sample; an environment failure's reward) on the response's last policy token."""
    mask = mask.bool()
    placed = torch.zeros(mask.shape, dtype=rewards.dtype, device=mask.device)
    if token_rewards is not None:
        placed += token_rewards.to(placed)
    if mask.shape[-1] == 0:
        return placed
    policy = mask.any(-1)
    last = mask.shape[-1] - 1 - mask.flip(-1).to(torch.int8).argmax(-1)  # the last policy token of each row
    residual = torch.where(policy, rewards - placed.sum(-1), torch.zeros_like(rewards))
    return placed.index_put_((torch.arange(len(rewards), device=mask.device), last), residual, accumulate=True)


def discounted_returns(token_rewards: torch.Tensor, mask: torch.Tensor, gamma: float) -> torch.Tensor:
    """Each policy token's return Σ γ^k·reward over the policy tokens from it on (k: the policy
    tokens between), as verl's REINFORCE++ loop computes it: tool tokens neither count nor
    discount, and a reward on one is not seen. 0 at non-policy positions."""
    valid = mask.to(token_rewards.dtype)
    if gamma == 1.0:  # nothing to discount: a suffix sum over the columns, tool tokens' rewards zeroed
        return (token_rewards * valid).flip(-1).cumsum(-1).flip(-1) * valid
    tokens = _PolicyTokensFirst(mask)  # the recursion runs over each row's own tokens only
    return tokens.expand(discounted_suffix_sums(tokens.compact(token_rewards), gamma))


def reinforce_pp_advantages(rewards: torch.Tensor, mask: torch.Tensor, gamma: float = 1.0,
                            token_rewards: torch.Tensor | None = None) -> torch.Tensor:
    """REINFORCE++ (arXiv 2501.03262, verl's `compute_reinforce_plus_plus_outcome_advantage`): each
    policy token's discounted return (`discounted_returns` of `token_level_rewards`), whitened over
    the batch's policy tokens. No group baseline. Returns [B, T] (0 elsewhere)."""
    returns = discounted_returns(token_level_rewards(rewards, mask, token_rewards), mask, gamma)
    return _whiten(returns, mask) * mask.to(returns.dtype)


def remax_advantages(rewards: torch.Tensor, baselines: torch.Tensor, mask: torch.Tensor,
                     token_rewards: torch.Tensor | None = None) -> torch.Tensor:
    """ReMax (arXiv 2310.10505, verl's `compute_remax_outcome_advantage`): each policy token's
    return-to-go of `token_level_rewards` (undiscounted) less its sequence's baseline (`baselines`
    [B]: the reward of its group's greedy response). No whitening. Returns [B, T] (0 elsewhere)."""
    returns = discounted_returns(token_level_rewards(rewards, mask, token_rewards), mask, 1.0)
    return returns - baselines[:, None].to(returns) * mask.to(returns.dtype)


class _PolicyTokensFirst:
    """Each row's policy tokens (mask 1) moved to the front in order, the tool tokens between a
    multi-turn row's turns taken out, so a recursion over a row's own tokens runs over columns
    (`compact`), and back (`expand`); zeros everywhere else both ways. Single-turn rows (no tool
    token between policy tokens) are their own compaction: a slice, no gather or scatter."""

    def __init__(self, mask: torch.Tensor):
        self.policy = mask.bool()
        lengths = self.policy.sum(-1)
        width = int(lengths.max()) if len(lengths) else 0
        self.own = torch.arange(width, device=mask.device)[None, :] < lengths[:, None]  # [B, width]
        self.prefix = torch.equal(self.policy[:, :width], self.own) and not self.policy[:, width:].any()

    def compact(self, x: torch.Tensor) -> torch.Tensor:
        if self.prefix:
            return torch.where(self.own, x[:, : self.own.shape[1]], torch.zeros((), dtype=x.dtype, device=x.device))
        out = x.new_zeros(self.own.shape)
        out[self.own] = x[self.policy]
        return out

    def expand(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.zeros(self.policy.shape, dtype=x.dtype, device=x.device)
        if self.prefix:
            out[:, : self.own.shape[1]] = torch.where(self.own, x, torch.zeros((), dtype=x.dtype, device=x.device))
        else:
            out[self.policy] = x[self.own]
        return out


def gae_advantages_and_returns(token_rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor,
                               gamma: float = 1.0, lam: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalized advantage estimation (verl's `compute_gae_advantage_return`): ([B, T] advantages
    whitened over the policy tokens, [B, T] returns = advantages before whitening + values), both 0
    off the policy tokens. `token_rewards` [B, T] (`token_level_rewards`), `values` [B, T]: V of the
    state before each token. A non-policy token (a tool's output between turns) neither carries a
    TD error nor breaks the recursion: the next policy token's value and advantage pass over it.

    verl walks the T columns one by one (8,192 steps of [B] work at 8k-token responses); here each
    row's policy tokens move to the front, δ_t = r_t + γ V_{t+1} − V_t is one vector operation, and
    A_t = Σ_k (γλ)^k δ_{t+k} is a matmul per block of columns (`discounted_suffix_sums`)."""
    tokens = _PolicyTokensFirst(mask)
    # compacted, every value is 0 past a row's last policy token: so is δ there, and the next value
    # of its last token
    v, r = tokens.compact(values), tokens.compact(token_rewards.to(values.dtype))
    next_v = torch.cat([v[:, 1:], v.new_zeros(len(v), 1)], dim=1)
    raw = tokens.expand(discounted_suffix_sums(r + gamma * next_v - v, gamma * lam))
    valid = mask.to(values.dtype)
    return _whiten(raw, mask.bool()) * valid, (raw + values) * valid


def discounted_suffix_sums(x: torch.Tensor, factor: float, block: int = 256) -> torch.Tensor:
    """y_t = x_t + factor·y_{t+1} along the last dimension of [B, T] `x` (y past the end: 0): within a
    block of columns one matmul with the [block, block] matrix of powers factor^(j−i) (j >= i), then
    the next block's first value carried in with factor^(distance); T / block steps, each power at
    most factor^block (no underflow however long T is)."""
    width = x.shape[-1]
    if width == 0 or factor == 0.0:
        return x.clone()
    idx = torch.arange(min(block, width), device=x.device)
    distance = (idx[None, :] - idx[:, None]).to(x.dtype)  # [i, j]: j − i
    powers = torch.triu(torch.pow(torch.tensor(factor, dtype=x.dtype, device=x.device), distance.clamp_min(0)))
    out = torch.empty_like(x)
    carry = None  # y at the first column of the block to the right
    for start in range(((width - 1) // block) * block, -1, -block):
        end = min(width, start + block)
        n = end - start
        y = x[:, start:end] @ powers[:n, :n].T
        if carry is not None:
            y += carry[:, None] * factor ** (n - idx[:n].to(x.dtype))
        out[:, start:end] = y
        carry = y[:, 0]
    return out


def optimal_token_baseline_advantages(token_rewards: torch.Tensor, mask: torch.Tensor, index: torch.Tensor,
                                      old_log_probs: torch.Tensor, sum_pi_squared: torch.Tensor,
                                      is_weights: torch.Tensor | None = None, eps: float = 1e-8,
                                      policy_tokens_only: bool = False) -> torch.Tensor:
    """The optimal token baseline (verl's `compute_optimal_token_baseline_advantage`, with its
    handle_zero_tail): [B, T] advantages G_t − B_t, where G_t is the return-to-go of the token
    rewards and B_t the group's returns at t weighted by each response's cumulative path variance
    W_t = Σ_{j<=t} w_j, w_j = (1 − 2 exp(old_log_prob_j) + Σπ²_j)·ρ̄_j² (ρ̄: `is_weights`, 1 if None).
    A group of one gets no baseline; neither does the part of a group's single longest response
    past the second longest (no other response has a return there to compare with).
    `policy_tokens_only` (verl's `compute_multi_turn_optimal_token_baseline_advantage`): t is the
    index among the row's policy tokens (mask 1), not its column."""
    if policy_tokens_only:
        tokens = _PolicyTokensFirst(mask)
        compact = tokens.compact
        advantages = optimal_token_baseline_advantages(
            compact(token_rewards * mask.to(token_rewards.dtype)), tokens.own.to(mask.dtype), index,
            compact(old_log_probs), compact(sum_pi_squared), None if is_weights is None else compact(is_weights), eps)
        return tokens.expand(advantages)
    valid = mask.to(token_rewards.dtype)
    returns = (token_rewards * valid).flip(-1).cumsum(-1).flip(-1)
    w = 1 - 2 * old_log_probs.to(returns).exp() + sum_pi_squared.to(returns)
    if is_weights is not None:
        w = w * is_weights.to(returns) ** 2
    w_cum = (w * valid).cumsum(-1)
    groups = int(index.max()) + 1
    index = index.to(returns.device)
    numerator = returns.new_zeros(groups, returns.shape[1]).index_add_(0, index, returns * w_cum * valid)
    denominator = returns.new_zeros(groups, returns.shape[1]).index_add_(0, index, w_cum * valid) + eps
    baseline = (numerator / denominator)[index]
    sizes = torch.bincount(index, minlength=groups)
    baseline[sizes[index] == 1] = 0.0
    # The zero tail: a group's longest response, if it alone is that long, past the second longest.
    lengths = valid.sum(-1)

    def group_max(values):  # each row's group's largest value (-1 for none)
        return lengths.new_full((groups,), -1.0).scatter_reduce(0, index, values, "amax")[index]

    at_longest = lengths == group_max(lengths)
    alone = at_longest & (torch.bincount(index[at_longest], minlength=groups)[index] == 1) & (sizes[index] > 1)
    second = group_max(torch.where(at_longest, torch.full_like(lengths, -1.0), lengths))
    columns = torch.arange(returns.shape[1], device=returns.device)
    baseline[alone[:, None] & (columns[None, :] >= second[:, None])] = 0.0
    return (returns - baseline) * valid


def gpg_advantages(rewards: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """GPG (arXiv 2504.02546, verl's `compute_gpg_outcome_advantage`): r − mean_g (a group of one:
    r), scaled by α = B / (responses with a non-zero reward), which undoes the dilution of a batch
    where most groups learn nothing."""
    alpha = rewards.numel() / max(int(torch.count_nonzero(rewards)), 1)
    _, mean, _ = _group_stats(rewards, index)  # a group of one: mean 0
    return alpha * (rewards - mean)


def grpo_passk_advantages(rewards: torch.Tensor, index: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    advantages = torch.zeros_like(rewards)
    index = index.to(rewards.device)
    for group in range(int(index.max()) + 1 if index.numel() else 0):
        rows = (index == group).nonzero().squeeze(-1)
        if rows.numel() < 2:
            continue
        group_rewards = rewards[rows]
        top, at = torch.topk(group_rewards, 2)
        advantages[rows[at[0]]] = (top[0] - top[1]) / (group_rewards.std() + eps)
    return advantages


def opo_advantages(rewards: torch.Tensor, index: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    index = index.to(rewards.device)
    count = _group_sums(torch.ones_like(rewards), index)[index]
    lengths = mask.sum(-1).to(rewards.dtype)
    baseline = _group_sums(lengths * rewards, index)[index] / _group_sums(lengths, index)[index].clamp_min(1e-30)
    return rewards - torch.where(count > 1, baseline, torch.zeros_like(baseline))  # empty responses: baseline 0


def gdpo_advantages(components: torch.Tensor, index: torch.Tensor, mask: torch.Tensor, weights=None,
                    eps: float = 1e-6, norm_by_std: bool = True) -> torch.Tensor:
    """GDPO (arXiv 2601.05242, verl's `compute_gdpo_outcome_advantage`): each reward component [K, B]
    normalised within its groups on its own (GRPO's, or Dr.GRPO's without the std), so a component
    with a large spread does not drown the others; their weighted sum, whitened over the batch's
    valid tokens. Returns per-sequence values."""
    weights = [1.0] * len(components) if weights is None else weights
    total = torch.zeros_like(components[0])
    for weight, component in zip(weights, components):
        total += weight * (grpo_advantages(component, index, eps) if norm_by_std else dr_grpo_advantages(component, index))
    return _whiten(total, mask.sum(-1))


def compute_advantages(
    rewards: torch.Tensor,
    group_ids: GroupIds,
    response_mask: torch.Tensor,
    config: AdvantageConfig | None = None,
    token_rewards: torch.Tensor | None = None,
    reward_components: torch.Tensor | None = None,
    old_log_probs: torch.Tensor | None = None,
    sum_pi_squared: torch.Tensor | None = None,
    is_weights: torch.Tensor | None = None,
    reward_baselines: torch.Tensor | None = None,
) -> torch.Tensor:
    """Per-token advantages [B, T]: the estimator's per-sequence value on every valid token
    (reinforce_plus_plus: each token's own, from `token_rewards` where a sample has them; gdpo:
    from `reward_components` [K, B], one row per `gdpo_reward_keys` entry; optimal_token_baseline:
    each token's own, from the proximal pass's `old_log_probs` and `sum_pi_squared` [B, T] and the
    rollout correction's `is_weights` [B, T] or None; remax: from `reward_baselines` [B], each
    sample's greedy baseline)."""
    config = config or AdvantageConfig()
    rewards = _check_rewards(rewards)
    mask = check_mask(response_mask)
    if mask.shape[0] != rewards.shape[0]:
        raise ValueError(f"response_mask has {mask.shape[0]} rows for {rewards.shape[0]} rewards")
    rewards = rewards.to(mask.device)
    index = group_index(group_ids, rewards.shape[0])
    if token_rewards is not None and token_rewards.shape != mask.shape:
        raise ValueError(f"token_rewards has shape {tuple(token_rewards.shape)}, expected {tuple(mask.shape)}")
    if config.estimator == "reinforce_plus_plus":  # per-token values (γ < 1)
        return reinforce_pp_advantages(rewards, mask, config.gamma, token_rewards)
    if config.estimator == "gae":
        raise ValueError("gae needs the critic's values: the learner calls gae_advantages_and_returns")
    if config.estimator == "remax":
        if reward_baselines is None or tuple(reward_baselines.shape) != (len(rewards),):
            got = None if reward_baselines is None else tuple(reward_baselines.shape)
            raise ValueError(f"remax needs reward_baselines [{len(rewards)}] (the groups' greedy rewards), got {got}")
        return remax_advantages(rewards, _check_rewards(reward_baselines).to(rewards), mask, token_rewards)
    if config.estimator in OTB_ESTIMATORS:  # per-token baselines
        for name, value in (("old_log_probs", old_log_probs), ("sum_pi_squared", sum_pi_squared),
                            ("is_weights", is_weights)):
            if (value is None and name != "is_weights") or (value is not None and value.shape != mask.shape):
                got = None if value is None else tuple(value.shape)
                raise ValueError(f"{config.estimator} needs {name} [{mask.shape[0]}, {mask.shape[1]}], got {got}")
        return optimal_token_baseline_advantages(
            token_level_rewards(rewards, mask, token_rewards), mask, index, old_log_probs, sum_pi_squared, is_weights,
            policy_tokens_only=config.estimator == "tir_optimal_token_baseline")
    if config.estimator == "grpo":
        per_seq = grpo_advantages(rewards, index, config.eps)
    elif config.estimator == "dr_grpo":
        per_seq = dr_grpo_advantages(rewards, index)
    elif config.estimator == "rloo":
        per_seq = rloo_advantages(rewards, index)
    elif config.estimator == "grpo_passk":
        per_seq = grpo_passk_advantages(rewards, index, config.eps)
    elif config.estimator == "opo":
        per_seq = opo_advantages(rewards, index, mask)
    elif config.estimator == "gpg":
        per_seq = gpg_advantages(rewards, index)
    elif config.estimator == "gdpo":
        k = len(config.gdpo_reward_keys)
        if reward_components is None or tuple(reward_components.shape) != (k, len(rewards)):
            got = None if reward_components is None else tuple(reward_components.shape)
            raise ValueError(f"gdpo needs reward_components [{k} keys, {len(rewards)} rows], got {got}")
        per_seq = gdpo_advantages(reward_components.to(rewards), index, mask, config.gdpo_reward_weights,
                                  config.eps, config.gdpo_norm_by_std)
    else:
        per_seq = reinforce_pp_baseline_advantages(rewards, index, mask)
    return per_seq[:, None].to(mask.device) * mask.to(per_seq.dtype)
