"""How far the sampler's policy is from the learner's, split into its two causes.

Every token of a batch carries three things the learner already has: the sampler's log-prob μ
(`rollout_log_prob`), the proximal log-prob π_old (the learner's current weights, recomputed at
the start of the step) and the version that sampled it. With s = the learner's version − the
token's version (its staleness), the gap between μ and π_old is

    gap(s) ≈ backend + s · drift_per_version

`backend` is the mismatch between the inference and the training backends at equal weights (the
gap of tokens sampled by the current version, s = 0; else the intercept of a fit), which η cannot
shrink and the rollout correction handles; `drift_per_version` is how far the policy moves per
learner step (the slope), which is what a staleness bound η multiplies. The gap is measured with
KL(μ ‖ π_old) estimators on tokens sampled from μ: k1 = log μ − log π_old and k3 = r − log r − 1
with r = π_old / μ (verl's `rollout_corr/kl` and `rollout_corr/k3_kl`, here per staleness bucket).

Metrics (`drift_metrics`): `drift/total_k1|k3`, `drift/backend_k1|k3`, `drift/per_version_k1|k3`
(NaN when the batch holds one staleness only: no slope), `drift/by_staleness/<s>` (k3) and
`drift/tokens_by_staleness/<s>`. Only tokens in the loss mask count (environment tokens never).
"""
from __future__ import annotations

import math

import torch

SAFETY_BOUND = 20.0  # log-ratios are clamped as the rollout correction clamps them
MIN_BUCKET_TOKENS = 16  # a staleness bucket with fewer tokens says too little to fit


def token_gaps(old_log_prob: torch.Tensor, rollout_log_prob: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token k1 and k3 estimates of KL(μ ‖ π_old), in float64."""
    log_ratio = (old_log_prob.double() - rollout_log_prob.double()).clamp(-SAFETY_BOUND, SAFETY_BOUND)
    return -log_ratio, torch.exp(log_ratio) - log_ratio - 1.0


def gap_by_staleness(old_log_prob, rollout_log_prob, token_versions, version: int, mask) -> dict[int, tuple]:
    """{staleness s: (tokens, mean k1, mean k3)} over the masked tokens."""
    k1, k3 = token_gaps(old_log_prob, rollout_log_prob)
    mask = mask.bool()
    staleness = (version - token_versions.long())[mask]
    k1, k3 = k1[mask], k3[mask]
    out = {}
    for s in torch.unique(staleness).tolist():
        picked = staleness == s
        out[int(s)] = (int(picked.sum()), float(k1[picked].mean()), float(k3[picked].mean()))
    return out


def split(buckets: dict[int, tuple], column: int) -> tuple[float, float]:
    """(backend, per-version drift) of one estimator (column 1: k1, 2: k3) from the buckets: a
    least-squares line through the bucket means weighted by their token counts. The backend is the
    s = 0 bucket's mean when it has enough tokens (exactly the gap at equal weights), else the
    intercept; NaN where the data cannot say (no bucket, or one staleness only)."""
    usable = {s: b for s, b in buckets.items() if b[0] >= MIN_BUCKET_TOKENS} or buckets
    if not usable:
        return math.nan, math.nan
    weights = torch.tensor([b[0] for b in usable.values()], dtype=torch.float64)
    xs = torch.tensor(list(usable), dtype=torch.float64)
    ys = torch.tensor([b[column] for b in usable.values()], dtype=torch.float64)
    if len(usable) < 2:
        return (float(ys[0]) if 0 in usable else math.nan), math.nan
    x_mean = float((weights * xs).sum() / weights.sum())
    y_mean = float((weights * ys).sum() / weights.sum())
    slope = float((weights * (xs - x_mean) * (ys - y_mean)).sum() / (weights * (xs - x_mean) ** 2).sum())
    backend = float(ys[list(usable).index(0)]) if 0 in usable else y_mean - slope * x_mean
    return backend, slope


def drift_metrics(old_log_prob, rollout_log_prob, token_versions, version: int, mask) -> dict[str, float]:
    """The drift split of one batch (see the module doc); plain floats."""
    buckets = gap_by_staleness(old_log_prob, rollout_log_prob, token_versions, version, mask)
    tokens = sum(b[0] for b in buckets.values())
    if not tokens:
        return {}
    out = {}
    for name, column in (("k1", 1), ("k3", 2)):
        backend, per_version = split(buckets, column)
        out[f"drift/total_{name}"] = sum(b[0] * b[column] for b in buckets.values()) / tokens
        out[f"drift/backend_{name}"] = backend
        out[f"drift/per_version_{name}"] = per_version
    for s, (count, _, k3) in sorted(buckets.items()):
        out[f"drift/by_staleness/{s}"] = k3
        out[f"drift/tokens_by_staleness/{s}"] = float(count)
    return out
