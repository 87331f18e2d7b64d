"""How far the sampler's policy is from the learner's, split into its two causes.

Every token of a batch carries three things the learner already has: the sampler's log-prob μ
(`rollout_log_prob`), the proximal log-prob π_old (the learner's current weights, recomputed at
the start of the step) and the version that sampled it. With s = the learner's version − the
token's version (its staleness), the gap between μ and π_old is

    gap(s) ≈ backend + s · drift_per_version

`backend` is the mismatch between the inference and the training backends at equal weights (the
gap of tokens sampled by the current version, s = 0; NaN in a step without enough of them), which
η cannot shrink and the rollout correction handles; `drift_per_version` is how far the policy moves per
learner step (the slope), which is what a staleness bound η multiplies. The gap is measured with
KL(μ ‖ π_old) estimators on tokens sampled from μ: k1 = log μ − log π_old and k3 = r − log r − 1
with r = π_old / μ (verl's `rollout_corr/kl` and `rollout_corr/k3_kl`, here per staleness bucket).

Per batch: `bucket_sums` on each rank's rows (they add up over ranks), then `drift_metrics`:
`drift/total_k1|k3`, `drift/backend_k1|k3`, `drift/per_version_k1|k3`
(NaN when the batch holds one staleness only: no slope), `drift/backend_intercept_k1|k3` (the
line's value at s = 0: with a full window, where no token is fresh, the only cheap guess at the
backend part, and a biased one: the gap grows faster than linearly in staleness when successive
updates point the same way, KL growing with the square of the distance moved, so the intercept
falls below the truth; measured in docs/results.md §3, where it was off by 80x the bf16 gap),
`drift/per_version_from_gap_k3` (the stale tokens' gap over their mean staleness: a stand-in that
needs no slope), `drift/by_staleness/<s>` (k3) and `drift/tokens_by_staleness/<s>`. Only tokens in the loss mask count (environment tokens never).
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


MAX_STALENESS = 64  # the last bucket holds every token at least this stale


def bucket_sums(old_log_prob, rollout_log_prob, token_versions, version: int, mask) -> torch.Tensor:
    """[MAX_STALENESS + 1, 3] float64: per staleness s, (tokens, sum of k1, sum of k3) over the
    masked tokens. Sums add up over ranks and micro-batches (all-reduce them, then `drift_metrics`)."""
    k1, k3 = token_gaps(old_log_prob, rollout_log_prob)
    mask = mask.bool()
    staleness = (version - token_versions.long())[mask].clamp(0, MAX_STALENESS).cpu()
    sums = torch.zeros(MAX_STALENESS + 1, 3, dtype=torch.float64)
    sums[:, 0].index_add_(0, staleness, torch.ones(len(staleness), dtype=torch.float64))
    sums[:, 1].index_add_(0, staleness, k1[mask].cpu())
    sums[:, 2].index_add_(0, staleness, k3[mask].cpu())
    return sums


def gap_by_staleness(sums: torch.Tensor) -> dict[int, tuple]:
    """{staleness s: (tokens, mean k1, mean k3)} of the buckets that hold tokens."""
    return {s: (int(row[0]), float(row[1] / row[0]), float(row[2] / row[0]))
            for s, row in enumerate(sums) if row[0] > 0}


def split(buckets: dict[int, tuple], column: int) -> tuple[float, float, float]:
    """(backend, intercept, per-version drift) of one estimator (column 1: k1, 2: k3) from the
    buckets. The backend is the s = 0 bucket's mean when it has enough tokens (exactly the gap at
    equal weights), else NaN; the intercept and the slope are those of a least-squares line
    through the bucket means weighted by their token counts (NaN with one staleness only)."""
    usable = {s: b for s, b in buckets.items() if b[0] >= MIN_BUCKET_TOKENS} or buckets
    if not usable:
        return math.nan, math.nan, math.nan
    backend = usable[0][column] if 0 in usable else math.nan
    if len(usable) < 2:
        return backend, math.nan, math.nan
    weights = torch.tensor([b[0] for b in usable.values()], dtype=torch.float64)
    xs = torch.tensor(list(usable), dtype=torch.float64)
    ys = torch.tensor([b[column] for b in usable.values()], dtype=torch.float64)
    x_mean = float((weights * xs).sum() / weights.sum())
    y_mean = float((weights * ys).sum() / weights.sum())
    slope = float((weights * (xs - x_mean) * (ys - y_mean)).sum() / (weights * (xs - x_mean) ** 2).sum())
    return backend, y_mean - slope * x_mean, slope


def drift_metrics(sums: torch.Tensor) -> dict[str, float]:
    """The drift split of a batch from its `bucket_sums` (see the module doc); plain floats."""
    buckets = gap_by_staleness(sums)
    tokens = sum(b[0] for b in buckets.values())
    if not tokens:
        return {}
    out = {}
    for name, column in (("k1", 1), ("k3", 2)):
        backend, intercept, per_version = split(buckets, column)
        out[f"drift/total_{name}"] = sum(b[0] * b[column] for b in buckets.values()) / tokens
        out[f"drift/backend_{name}"] = backend
        out[f"drift/backend_intercept_{name}"] = intercept
        out[f"drift/per_version_{name}"] = per_version
    # Without a slope (one staleness only, e.g. a full window at η = 1) the stale tokens' gap over
    # their staleness stands in: the drift per version if the backend part were 0 and the gap grew
    # linearly. Once η opens, several staleness buckets give the slope again.
    stale = {s: b for s, b in buckets.items() if s > 0}
    stale_tokens = sum(b[0] for b in stale.values())
    if stale_tokens:
        gap = sum(b[0] * b[2] for b in stale.values()) / stale_tokens
        mean_staleness = sum(b[0] * s for s, b in stale.items()) / stale_tokens
        out["drift/per_version_from_gap_k3"] = max(gap, 0.0) / mean_staleness
    for s, (count, _, k3) in sorted(buckets.items()):
        out[f"drift/by_staleness/{s}"] = k3
        out[f"drift/tokens_by_staleness/{s}"] = float(count)
    return out


def exact_split(old_log_prob, rollout_log_prob, generating_log_prob, token_versions, version: int, mask
                ) -> dict[str, float]:
    """The split measured exactly on rows scored with the weights that sampled them
    (`generating_log_prob` = log π_learner(θ_k), k the token's version): backend = KL(μ ‖ π_θk) and
    staleness = KL(π_θk ‖ π_old), both k3 on the tokens μ drew, and the staleness per version.
    Beside them, the cheap estimate's split of the same rows and how far it is off."""
    mask = mask.bool()
    _, backend = token_gaps(generating_log_prob, rollout_log_prob)
    _, staleness_gap = token_gaps(old_log_prob, generating_log_prob)
    staleness = (version - token_versions.long()).double()
    tokens = int(mask.sum())
    if not tokens:
        return {}
    stale = mask & (staleness > 0)
    per_version = (float(staleness_gap[stale].sum() / staleness[stale].sum()) if stale.any() else math.nan)
    estimate = drift_metrics(bucket_sums(old_log_prob, rollout_log_prob, token_versions, version, mask))
    exact = {"drift/exact_backend_k3": float(backend[mask].mean()),
             "drift/exact_staleness_k3": float(staleness_gap[mask].mean()),
             "drift/exact_per_version_k3": per_version, "drift/exact_probe_tokens": float(tokens)}
    # The cheap estimate's backend: the fresh tokens' gap, or the intercept where none are fresh.
    cheap = estimate["drift/backend_k3"]
    cheap = estimate["drift/backend_intercept_k3"] if math.isnan(cheap) else cheap
    exact["drift/estimate_error_backend_k3"] = cheap - exact["drift/exact_backend_k3"]
    exact["drift/estimate_error_per_version_k3"] = estimate["drift/per_version_k3"] - per_version
    return exact


class VersionWeights:
    """CPU copies of the policy's weights for the versions still inside the staleness window
    (`keep` of them), and a model to score with any of them: the exact drift probe's memory,
    `keep` × the model's size (a 7B model in bf16: 14 GB per version, host memory)."""

    def __init__(self, model_path: str, dtype: str, keep: int):
        self.model_path, self.dtype, self.keep = model_path, dtype, keep
        self.weights: dict[int, dict[str, torch.Tensor]] = {}
        self._model = None

    def remember(self, version: int, state: dict[str, torch.Tensor]) -> None:
        self.weights[version] = {k: v.detach().to("cpu", copy=True) for k, v in state.items()}
        for old in sorted(self.weights)[:-self.keep]:
            del self.weights[old]

    def model_for(self, version: int):
        """A model holding the weights of `version` (one CPU model, reloaded per version)."""
        from lm.causal_lm import load_causal_lm

        if self._model is None:
            self._model = load_causal_lm(self.model_path, dtype=self.dtype).eval().requires_grad_(False)
        self._model.load_state_dict(self.weights[version], strict=False)
        return self._model


def keeps_version(version: int, every: int, keep: int) -> bool:
    """Whether a probe due every `every` versions, keeping `keep`, will score with `version`: the
    next due version is fewer than `keep` after it. Copying only those spares a model-sized copy
    on most steps; from the settings alone, so every rank (FSDP gathers) agrees."""
    return (-version) % every < keep


class ExactDriftProbe:
    """`diagnostics.exact_drift_every: K`: every K learner steps, score up to `rows` rows of the
    batch with the weights of the version(s) that sampled them (CPU copies of the versions inside
    the window, `VersionWeights`) and report `exact_split`. Runs on one rank, on the CPU, after
    π_old: it costs one no-grad pass per distinct version of the probed rows."""

    def __init__(self, model_path: str, dtype: str, keep: int, every: int, rows: int, temperature: float,
                 pad_token_id: int):
        self.weights = VersionWeights(model_path, dtype, keep)
        self.every, self.rows = every, rows
        self.temperature, self.pad_token_id = temperature, pad_token_id

    def due(self, version: int) -> bool:
        return version % self.every == 0

    def remember(self, version: int, state: dict[str, torch.Tensor]) -> None:
        self.weights.remember(version, state)

    def measure(self, shard, old_log_prob: torch.Tensor, candidates: list[int], version: int) -> dict[str, float]:
        """`exact_split` of up to `rows` of the candidate rows of `shard` (a TrainBatch) whose every
        token's version is still remembered; {} when none is."""
        from lm.causal_lm import response_log_probs

        known = set(self.weights.weights)
        rows = [r for r in candidates
                if set(shard.token_versions[r][shard.response_mask[r] > 0].tolist()) <= known][: self.rows]
        if not rows:
            return {}
        probe = shard.select(rows).to("cpu")
        width = probe.response_mask.shape[1]
        generating = torch.zeros(probe.response_mask.shape, dtype=torch.float64)
        with torch.no_grad():
            for v in sorted(set(probe.token_versions[probe.response_mask > 0].tolist())):
                scored, _ = response_log_probs(self.weights.model_for(v), probe.prompts, probe.responses,
                                               self.temperature, self.pad_token_id)
                mine = probe.token_versions == v
                generating[mine] = scored.double()[:, :width][mine]
        return exact_split(old_log_prob[rows, :width].detach().cpu(), probe.rollout_log_probs, generating,
                           probe.token_versions, version, probe.response_mask)

