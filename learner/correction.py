"""Rollout correction: truncated importance sampling (IS), rejection sampling (RS) and the veto.

The math, option names, presets and metric names follow verl's rollout-correction documents
(`../shared/reference/rollout_correction_*.md`). Public API:

- `RolloutCorrectionConfig` (pydantic): `rollout_is`, `rollout_is_threshold`,
  `rollout_is_batch_normalize`, `rollout_rs`, `rollout_rs_threshold`, `rollout_rs_threshold_lower`,
  `rollout_token_veto_threshold`, `bypass_mode`, `loss_type`; presets as classmethods
  (`decoupled_token_is()`, ..., `disabled()`, older names as aliases; `PRESETS` lists them all).
- `compute_rollout_correction(old_log_prob, rollout_log_prob, response_mask, config)
  -> (weights | None, modified_response_mask, metrics)`: all tensors [batch, tokens].
  `weights` are detached, safety-bounded (log ratio within ±20), truncated from above (or zeroed
  outside [L, U] for IcePop), zero at padding, optionally batch-normalised to mean 1; `None` when
  `rollout_is` is None. `modified_response_mask` (same dtype as the input mask) is the response
  mask with rejected tokens / sequences set to 0: it only ever shrinks. `metrics` maps
  `rollout_corr/<name>` to Python floats.
- `is_batch_norm_sums(old_log_prob, rollout_log_prob, response_mask, config) -> [sum, count]`:
  add them over micro-batches and ranks and pass them as `compute_rollout_correction(...,
  batch_norm_sums=...)`, so batch normalisation spans the whole batch however it is split.
- `check_token_values(name, tensor, mask)`, `check_mask(mask)`: the input checks every learner
  entry point shares.

In decoupled mode `old_log_prob` is the proximal policy π_old; in bypass mode the caller passes
the current policy's detached log-probs, so ρ = π_θ/π_rollout (see `learner.losses`).
"""
from __future__ import annotations

import math
from typing import Literal, Optional, Union

import torch
from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, field_validator, model_validator

# exp(±20) ≈ [2e-9, 5e8]: keeps every exponentiated ratio finite in float32.
SAFETY_BOUND = 20.0
METRIC_PREFIX = "rollout_corr/"

RS_OPTIONS = (
    "token_k1", "token_k2", "token_k3",
    "seq_sum_k1", "seq_sum_k2", "seq_sum_k3",
    "seq_mean_k1", "seq_mean_k2", "seq_mean_k3",
    "seq_max_k2", "seq_max_k3",
)
# etarl's turn-level forms of the sequence options (multi-turn trajectories, Source 5 of the
# five-sources reference): the statistic is taken per turn, and a turn that fails is rejected alone.
TURN_RS_OPTIONS = (
    "turn_sum_k1", "turn_sum_k2", "turn_sum_k3",
    "turn_mean_k1", "turn_mean_k2", "turn_mean_k3",
    "turn_max_k2", "turn_max_k3",
)
MAX_TURN_METRICS = 64
# The first usage guide's names, kept working: token / sequence (product) / geometric (mean).
RS_ALIASES = {"token": "token_k1", "sequence": "seq_sum_k1", "geometric": "seq_mean_k1"}


class RejectionCriterion(BaseModel):
    """One parsed `rollout_rs` option, as verl's `compute_rollout_rejection_mask` applies it.
    k1 options bound verl's k1 statistic, −log ρ aggregated (per token, summed or averaged over
    the sequence), from both sides: log(lower) <= stat <= log(upper), i.e. ρ_agg in
    [1/upper, 1/lower] (lower and upper bound π_rollout/π_old). k2/k3 options bound a divergence
    from above: stat <= upper."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    option: str
    upper: float
    lower: Optional[float] = None

    @property
    def level(self) -> str:
        return self.option.split("_k")[0]  # token | seq_sum | seq_mean | seq_max | turn_sum | turn_mean | turn_max

    @property
    def estimator(self) -> str:
        return self.option[-2:]  # k1 | k2 | k3


def _reject_bool(field: str, value):
    # pydantic would turn True into 1.0; a bool threshold is always a config mistake.
    if isinstance(value, bool):
        raise ValueError(f"{field} must be a number or a threshold string, not a bool ({value!r})")
    return value


def _positive_float(field: str, text: str) -> float:
    try:
        value = float(text)
    except (TypeError, ValueError):
        raise ValueError(f"{field}: {text!r} is not a number") from None
    if math.isnan(value) or value <= 0:  # inf is allowed, as verl allows it: no cap, no rejection
        raise ValueError(f"{field}: thresholds must be numbers > 0, got {text!r}")
    return value


def _parse_bounds(field: str, spec: Union[str, float]) -> tuple[Optional[float], float]:
    """'L_U' -> (L, U); a number or number-like string -> (None, U)."""
    if isinstance(spec, str) and "_" in spec:
        parts = spec.split("_")
        if len(parts) != 2:
            raise ValueError(f"{field}: expected 'LOWER_UPPER', got {spec!r}")
        lower, upper = (_positive_float(field, p.strip()) for p in parts)
        if lower > upper:
            raise ValueError(f"{field}: lower bound {lower} exceeds upper bound {upper} in {spec!r}")
        return lower, upper
    return None, _positive_float(field, spec if isinstance(spec, str) else str(spec))


class RolloutCorrectionConfig(BaseModel):
    """How the learner corrects the gap between the rollout (behaviour) policy and the learner.

    rollout_is: None | "token" | "sequence" | "turn": IS weight ρ = π_old/π_rollout per token, per
        sequence (product), or per turn (the product over the turn's tokens, applied to that turn
        only), detached. A turn is a run of valid tokens: in a multi-turn trajectory, the tokens
        the policy wrote between two environment observations (loss mask 0). rollout_is_threshold: a float caps weights from above (TIS);
        "L_U" is IcePop: weights outside [L, U] become 0 (the mask is unchanged).
    rollout_rs: None or comma-separated options that must all pass (see RS_OPTIONS; "token",
        "sequence", "geometric" are the older names of token_k1, seq_sum_k1, seq_mean_k1; the
        TURN_RS_OPTIONS take the seq_ statistic per turn and reject a failing turn alone).
        k1 options bound verl's k1 statistic −log ρ (per token, summed, or averaged over the
        sequence) to [log L, log U]; k2 (½·log²ρ) and k3 (ρ − log ρ − 1) options bound a
        divergence from above.
    rollout_rs_threshold: a float U (k1: L = 1/U, so ρ within [1/U, U]), "L_U" (k1 only, verl's
        form: ρ within [1/U, 1/L]), or one entry per option separated by commas.
        rollout_rs_threshold_lower (verl's older form, beside a float threshold U): the k1 bounds
        on ρ itself, ρ within [lower, U], as verl applied it (default 1/U).
    rollout_token_veto_threshold: reject a whole sequence if any token's unclamped ρ is below it.
    rollout_turn_metrics: report `rollout_corr/kl_by_turn/<t>` and `k3_kl_by_turn/<t>` for turns
        t = 1..N (0 when a batch has no turn t; 0: off).
    bypass_mode: π_old := π_rollout (no proximal forward pass). loss_type: "ppo_clip" (PPO on
        π_θ/π_rollout) or "reinforce" (bypass only: −stopgrad(w)·A·log π_θ).
    """

    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    rollout_is: Optional[Literal["token", "sequence", "turn"]] = None
    rollout_is_threshold: Union[float, str] = 2.0
    rollout_is_batch_normalize: bool = False
    rollout_rs: Optional[str] = None
    rollout_rs_threshold: Optional[Union[float, str]] = None
    rollout_rs_threshold_lower: Optional[float] = None
    rollout_token_veto_threshold: Optional[float] = None
    rollout_turn_metrics: int = Field(0, ge=0, le=MAX_TURN_METRICS)
    bypass_mode: bool = False
    loss_type: Literal["ppo_clip", "reinforce"] = "ppo_clip"

    _criteria: tuple[RejectionCriterion, ...] = PrivateAttr(default=())
    _is_bounds: tuple[Optional[float], float] = PrivateAttr(default=(None, 2.0))

    # ---- validation -----------------------------------------------------------------------
    @field_validator("rollout_is_threshold", "rollout_rs_threshold", "rollout_rs_threshold_lower",
                     "rollout_token_veto_threshold", mode="before")
    @classmethod
    def _no_bool_thresholds(cls, value, info):
        return _reject_bool(info.field_name, value)

    @field_validator("rollout_is_batch_normalize", "bypass_mode", mode="before")
    @classmethod
    def _strict_bool(cls, value, info):
        if not isinstance(value, bool):
            raise ValueError(f"{info.field_name} must be true or false, got {value!r}")
        return value

    @field_validator("rollout_rs", mode="before")
    @classmethod
    def _canonical_rs(cls, value):
        if value is None:
            return None
        if not isinstance(value, str):
            raise ValueError(f"rollout_rs must be a string of comma-separated options, got {value!r}")
        options: list[str] = []
        for raw in value.split(","):
            name = raw.strip()
            if not name:
                continue
            name = RS_ALIASES.get(name, name)
            if name not in RS_OPTIONS + TURN_RS_OPTIONS:
                raise ValueError(f"rollout_rs: unknown option {raw.strip()!r}; choose from "
                                 f"{', '.join(RS_OPTIONS + TURN_RS_OPTIONS)} (or {', '.join(RS_ALIASES)})")
            if name not in options:
                options.append(name)
        if not options:
            raise ValueError("rollout_rs: no option given (use null to disable rejection)")
        return ",".join(options)

    @model_validator(mode="after")
    def _consistent(self):
        self._is_bounds = _parse_bounds("rollout_is_threshold", self.rollout_is_threshold)
        if self.rollout_is_batch_normalize and self.rollout_is is None:
            raise ValueError("rollout_is_batch_normalize needs rollout_is ('token', 'sequence' or 'turn')")
        if self.loss_type == "reinforce" and not self.bypass_mode:
            raise ValueError("loss_type 'reinforce' needs bypass_mode=true (decoupled mode uses ppo_clip)")
        veto = self.rollout_token_veto_threshold
        if veto is not None and not (0.0 < veto < 1.0 and math.isfinite(veto)):
            raise ValueError(f"rollout_token_veto_threshold must lie in (0, 1), got {veto}")
        self._criteria = self._parse_criteria()
        return self

    def _parse_criteria(self) -> tuple[RejectionCriterion, ...]:
        lower_default = self.rollout_rs_threshold_lower
        if self.rollout_rs is None:
            if self.rollout_rs_threshold is not None or lower_default is not None:
                raise ValueError("rollout_rs_threshold / rollout_rs_threshold_lower are set but rollout_rs "
                                 "is null: enable a rollout_rs option or remove the thresholds")
            return ()
        options = self.rollout_rs.split(",")
        spec = self.rollout_rs_threshold
        if spec is None:
            raise ValueError(f"rollout_rs_threshold is required when rollout_rs is set ({self.rollout_rs!r})")
        entries = [p.strip() for p in spec.split(",") if p.strip()] if isinstance(spec, str) else [spec]
        if len(entries) == 1:
            entries = entries * len(options)
        if len(entries) != len(options):
            raise ValueError(f"rollout_rs_threshold has {len(entries)} entries for {len(options)} rollout_rs "
                             f"options ({self.rollout_rs!r}): give one shared value or one per option")
        if lower_default is not None:
            _positive_float("rollout_rs_threshold_lower", str(lower_default))
            if not any(o.endswith("k1") for o in options):
                raise ValueError("rollout_rs_threshold_lower bounds ratios from below; it only applies to k1 "
                                 f"options, and rollout_rs ({self.rollout_rs!r}) has none")
        criteria = []
        for option, entry in zip(options, entries):
            field = f"rollout_rs_threshold (option {option})"
            lower, upper = _parse_bounds(field, entry)
            if option.endswith("k1"):
                if lower is not None and lower_default is not None:
                    raise ValueError(f"{field}: 'L_U' bounds and rollout_rs_threshold_lower are both given")
                if lower is None and lower_default is not None:
                    if lower_default > upper:
                        raise ValueError(f"rollout_rs_threshold_lower ({lower_default}) exceeds the upper bound "
                                         f"{upper} of option {option}")
                    # ρ in [lower_default, upper] is −log ρ in [log(1/upper), log(1/lower_default)]
                    lower, upper = 1.0 / upper, 1.0 / lower_default
                elif lower is None:
                    lower = 1.0 / upper
                    if lower > upper:
                        raise ValueError(f"{field}: a single k1 bound U keeps ρ in [1/U, U], so U must be >= 1, "
                                         f"got {upper}")
                if not 0.0 < lower < math.inf:
                    raise ValueError(f"{field}: the k1 bounds must be finite numbers > 0, got {entry!r}")
            elif lower is not None:
                raise ValueError(f"{field}: {option} bounds a divergence from above; give one number, not "
                                 f"{entry!r}")
            criteria.append(RejectionCriterion(option=option, upper=upper, lower=lower))
        return tuple(criteria)

    # ---- parsed views ---------------------------------------------------------------------
    @property
    def rejection_criteria(self) -> tuple[RejectionCriterion, ...]:
        return self._criteria

    @property
    def is_upper(self) -> float:
        return self._is_bounds[1]

    @property
    def is_lower(self) -> Optional[float]:
        """IcePop's lower bound; None for plain truncation."""
        return self._is_bounds[0]

    @property
    def icepop(self) -> bool:
        return self._is_bounds[0] is not None

    @property
    def uses_turns(self) -> bool:
        """Whether anything is computed per turn (the IS weight, a rejection option, the metrics)."""
        return (self.rollout_is == "turn" or self.rollout_turn_metrics > 0
                or any(c.level.startswith("turn") for c in self._criteria))

    @property
    def enabled(self) -> bool:
        """True if the correction changes weights or the mask (otherwise it only measures)."""
        return bool(self.rollout_is or self.rollout_rs or self.rollout_token_veto_threshold)

    # ---- presets (defaults from the reference documents) ----------------------------------
    @classmethod
    def decoupled_token_is(cls, threshold: float = 2.0) -> "RolloutCorrectionConfig":
        """Token-TIS: per-token truncated IS weights."""
        return cls(rollout_is="token", rollout_is_threshold=threshold)

    @classmethod
    def decoupled_seq_is(cls, threshold: float = 2.0) -> "RolloutCorrectionConfig":
        """Seq-TIS: one truncated weight per sequence (the product of token ratios)."""
        return cls(rollout_is="sequence", rollout_is_threshold=threshold)

    @classmethod
    def decoupled_seq_is_rs(cls, is_threshold: float = 2.0, rs_threshold: float = 2.0,
                            rs_threshold_lower: Optional[float] = None) -> "RolloutCorrectionConfig":
        """Seq-MIS: Seq-TIS plus rejection of sequences whose product leaves [lower, upper]
        (lower defaults to 1/upper)."""
        return cls(rollout_is="sequence", rollout_is_threshold=is_threshold, rollout_rs="seq_sum_k1",
                   rollout_rs_threshold=rs_threshold, rollout_rs_threshold_lower=rs_threshold_lower)

    @classmethod
    def decoupled_geo_rs(cls, rs_threshold: float = 1.001, rs_threshold_lower: Optional[float] = None,
                         veto_threshold: Optional[float] = 1e-4) -> "RolloutCorrectionConfig":
        """Geo-RS: reject on the geometric-mean ratio, plus the catastrophic-token veto."""
        return cls(**_geo_rs(rs_threshold, rs_threshold_lower, veto_threshold))

    @classmethod
    def decoupled_geo_rs_seq_tis(cls, is_threshold: float = 2.0, rs_threshold: float = 1.001,
                                 rs_threshold_lower: Optional[float] = None,
                                 veto_threshold: Optional[float] = 1e-4) -> "RolloutCorrectionConfig":
        """Geo-RS-Seq-TIS: geometric filter + truncated sequence weight."""
        return cls(rollout_is="sequence", rollout_is_threshold=is_threshold,
                   **_geo_rs(rs_threshold, rs_threshold_lower, veto_threshold))

    @classmethod
    def decoupled_geo_rs_token_tis(cls, is_threshold: float = 2.0, rs_threshold: float = 1.001,
                                   rs_threshold_lower: Optional[float] = None,
                                   veto_threshold: Optional[float] = 1e-4) -> "RolloutCorrectionConfig":
        """Geo-RS-Token-TIS: geometric filter + truncated token weights."""
        return cls(rollout_is="token", rollout_is_threshold=is_threshold,
                   **_geo_rs(rs_threshold, rs_threshold_lower, veto_threshold))

    @classmethod
    def decoupled_k3_rs(cls, rs_threshold: float = 0.01) -> "RolloutCorrectionConfig":
        """K3-RS: reject sequences whose mean K3 divergence exceeds the threshold."""
        return cls(rollout_rs="seq_mean_k3", rollout_rs_threshold=rs_threshold)

    @classmethod
    def decoupled_k3_rs_seq_tis(cls, is_threshold: float = 2.0, rs_threshold: float = 0.01) -> "RolloutCorrectionConfig":
        """K3-RS-Seq-TIS: K3 filter + truncated sequence weight."""
        return cls(rollout_is="sequence", rollout_is_threshold=is_threshold, rollout_rs="seq_mean_k3",
                   rollout_rs_threshold=rs_threshold)

    @classmethod
    def decoupled_k3_rs_token_tis(cls, is_threshold: float = 2.0, rs_threshold: float = 0.01) -> "RolloutCorrectionConfig":
        """K3-RS-Token-TIS: K3 filter + truncated token weights."""
        return cls(rollout_is="token", rollout_is_threshold=is_threshold, rollout_rs="seq_mean_k3",
                   rollout_rs_threshold=rs_threshold)

    @classmethod
    def decoupled_token_icepop(cls, threshold: float = 5.0, threshold_lower: float = 0.5) -> "RolloutCorrectionConfig":
        """Token IcePop: token weights outside [lower, upper] become 0; the mask is unchanged."""
        return cls(rollout_is="token", rollout_is_threshold=f"{threshold_lower}_{threshold}")

    @classmethod
    def bypass_ppo_clip(cls) -> "RolloutCorrectionConfig":
        """PPO clipped against the rollout policy; the ratio itself corrects, no extra weights."""
        return cls(bypass_mode=True, loss_type="ppo_clip")

    @classmethod
    def bypass_ppo_clip_geo_rs(cls, rs_threshold: float = 1.001, rs_threshold_lower: Optional[float] = None,
                               veto_threshold: Optional[float] = 1e-4) -> "RolloutCorrectionConfig":
        """Bypass PPO-clip with the geometric filter (and veto) masking outliers."""
        return cls(bypass_mode=True, loss_type="ppo_clip",
                   **_geo_rs(rs_threshold, rs_threshold_lower, veto_threshold))

    @classmethod
    def bypass_ppo_clip_k3_rs(cls, rs_threshold: float = 0.01) -> "RolloutCorrectionConfig":
        """Bypass PPO-clip with K3 rejection."""
        return cls(rollout_rs="seq_mean_k3", rollout_rs_threshold=rs_threshold, bypass_mode=True,
                   loss_type="ppo_clip")

    @classmethod
    def bypass_pg_is(cls, threshold: float = 2.0) -> "RolloutCorrectionConfig":
        """Off-policy REINFORCE with a truncated sequence weight π_θ/π_rollout."""
        return cls(rollout_is="sequence", rollout_is_threshold=threshold, bypass_mode=True,
                   loss_type="reinforce")

    @classmethod
    def bypass_pg_geo_rs(cls, rs_threshold: float = 1.001, rs_threshold_lower: Optional[float] = None,
                         veto_threshold: Optional[float] = 1e-4) -> "RolloutCorrectionConfig":
        """REINFORCE with the geometric filter (and veto), no IS weights."""
        return cls(bypass_mode=True, loss_type="reinforce",
                   **_geo_rs(rs_threshold, rs_threshold_lower, veto_threshold))

    @classmethod
    def bypass_pg_geo_rs_seq_tis(cls, is_threshold: float = 2.0, rs_threshold: float = 1.001,
                                 rs_threshold_lower: Optional[float] = None,
                                 veto_threshold: Optional[float] = 1e-4) -> "RolloutCorrectionConfig":
        """REINFORCE + geometric filter + truncated sequence weight."""
        return cls(rollout_is="sequence", rollout_is_threshold=is_threshold, bypass_mode=True,
                   loss_type="reinforce", **_geo_rs(rs_threshold, rs_threshold_lower, veto_threshold))

    @classmethod
    def bypass_pg_geo_rs_token_tis(cls, is_threshold: float = 2.0, rs_threshold: float = 1.001,
                                   rs_threshold_lower: Optional[float] = None,
                                   veto_threshold: Optional[float] = 1e-4) -> "RolloutCorrectionConfig":
        """REINFORCE + geometric filter + truncated token weights."""
        return cls(rollout_is="token", rollout_is_threshold=is_threshold, bypass_mode=True,
                   loss_type="reinforce", **_geo_rs(rs_threshold, rs_threshold_lower, veto_threshold))

    @classmethod
    def bypass_pg_token_icepop(cls, threshold: float = 5.0, threshold_lower: float = 0.5) -> "RolloutCorrectionConfig":
        """REINFORCE with token IcePop weights."""
        return cls(rollout_is="token", rollout_is_threshold=f"{threshold_lower}_{threshold}",
                   bypass_mode=True, loss_type="reinforce")

    @classmethod
    def disabled(cls) -> "RolloutCorrectionConfig":
        """Metrics only: no weights, no rejection (decoupled PPO without IS)."""
        return cls()

    @classmethod
    def ppo_is_bypass(cls, threshold: float = 2.0) -> "RolloutCorrectionConfig":
        """Older name of bypass_ppo_clip. As documented, token IS weights are computed for the
        metrics only: the PPO ratio π_θ/π_rollout already corrects, so the loss ignores them."""
        return cls(rollout_is="token", rollout_is_threshold=threshold, bypass_mode=True, loss_type="ppo_clip")

    # Older documented names of the presets above.
    token_is = decoupled_token_is
    seq_is = decoupled_seq_is
    seq_is_rs = decoupled_seq_is_rs
    geo_rs = decoupled_geo_rs
    geo_rs_seq_tis = decoupled_geo_rs_seq_tis
    pure_is = bypass_pg_is
    pg_is = bypass_pg_is
    pg_rs = bypass_pg_geo_rs
    pg_geo_rs_seq_tis = bypass_pg_geo_rs_seq_tis

    @classmethod
    def preset(cls, name: str, **kwargs) -> "RolloutCorrectionConfig":
        """A preset by name (for YAML and CLI: `rollout_correction=decoupled_seq_is`)."""
        if name not in PRESETS:
            raise ValueError(f"unknown rollout-correction preset {name!r}; choose from {', '.join(PRESETS)}")
        return getattr(cls, name)(**kwargs)


def _geo_rs(upper: float, lower: Optional[float], veto: Optional[float]) -> dict:
    return dict(rollout_rs="seq_mean_k1", rollout_rs_threshold=upper, rollout_rs_threshold_lower=lower,
                rollout_token_veto_threshold=veto)


PRESETS = (
    "decoupled_token_is", "decoupled_seq_is", "decoupled_seq_is_rs", "decoupled_geo_rs",
    "decoupled_geo_rs_seq_tis", "decoupled_geo_rs_token_tis", "decoupled_k3_rs", "decoupled_k3_rs_seq_tis",
    "decoupled_k3_rs_token_tis", "decoupled_token_icepop", "bypass_ppo_clip", "bypass_ppo_clip_geo_rs",
    "bypass_ppo_clip_k3_rs", "bypass_pg_is", "bypass_pg_geo_rs", "bypass_pg_geo_rs_seq_tis",
    "bypass_pg_geo_rs_token_tis", "bypass_pg_token_icepop", "disabled",
    # older names
    "token_is", "seq_is", "seq_is_rs", "geo_rs", "geo_rs_seq_tis", "pure_is", "ppo_is_bypass", "pg_is",
    "pg_rs", "pg_geo_rs_seq_tis",
)


# ---- input checks ------------------------------------------------------------------------------
def check_mask(response_mask: torch.Tensor, shape: Optional[torch.Size] = None) -> torch.Tensor:
    """The response mask as bool, after checking it is [B, T] and holds only 0/1."""
    if not isinstance(response_mask, torch.Tensor) or response_mask.dim() != 2:
        raise ValueError(f"response_mask must be a [batch, tokens] tensor, got "
                         f"{getattr(response_mask, 'shape', type(response_mask).__name__)}")
    if shape is not None and response_mask.shape != shape:
        raise ValueError(f"response_mask has shape {tuple(response_mask.shape)}, expected {tuple(shape)}")
    if response_mask.dtype == torch.bool:
        return response_mask
    if not ((response_mask == 0) | (response_mask == 1)).all():
        raise ValueError("response_mask must hold only 0 and 1")
    return response_mask != 0


def check_token_values(name: str, values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Check a [B, T] float tensor (log-probs, advantages, entropy) against the bool mask and
    return it with padding zeroed (the autograd graph is kept).

    Values at padding are ignored (they may be anything, NaN included); a non-finite value on a
    valid token is an error that names the tensor, the row and the column."""
    if not isinstance(values, torch.Tensor):
        raise ValueError(f"{name} must be a tensor, got {type(values).__name__}")
    if values.shape != mask.shape:
        raise ValueError(f"{name} has shape {tuple(values.shape)}, but response_mask has {tuple(mask.shape)}")
    if not values.is_floating_point():
        raise ValueError(f"{name} must be a floating-point tensor, got {values.dtype}")
    bad = ~torch.isfinite(values.detach()) & mask
    if bad.any():
        row, col = (int(i) for i in bad.nonzero()[0])
        raise ValueError(f"{name} is not finite ({values[row, col].item()}) at row {row}, token {col} "
                         f"({int(bad.sum())} such valid tokens)")
    return torch.where(mask, values, torch.zeros((), dtype=values.dtype, device=values.device))


def compute_dtype(*tensors: torch.Tensor) -> torch.dtype:
    """float64 if any input is float64, else float32 (bf16/fp16 inputs are upcast)."""
    return torch.float64 if any(t.dtype == torch.float64 for t in tensors) else torch.float32


# ---- masked reductions (fully masked rows give 0, never NaN) ----------------------------------
def masked_sum_rows(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return torch.where(mask, x, torch.zeros((), dtype=x.dtype, device=x.device)).sum(-1)


def masked_mean_rows(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return masked_sum_rows(x, mask) / mask.sum(-1).clamp_min(1)


def masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return torch.where(mask, x, torch.zeros((), dtype=x.dtype, device=x.device)).sum() / mask.sum().clamp_min(1)


def _masked_max(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    if x.numel() == 0:
        return x.new_zeros(())
    filled = torch.where(mask, x, torch.full((), -math.inf, dtype=x.dtype, device=x.device)).max()
    return torch.where(torch.isfinite(filled), filled, torch.zeros_like(filled))


def _masked_min(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return -_masked_max(-x, mask)


def _masked_std(x: torch.Tensor, mask: torch.Tensor, unbiased: bool = False) -> torch.Tensor:
    n = mask.sum()
    mean = masked_mean(x, mask)
    sq = masked_mean((x - mean) ** 2, mask) * n / (n - 1 if unbiased else n).clamp_min(1)
    return sq.clamp_min(0).sqrt()


# ---- turns ---------------------------------------------------------------------------------------
class Turns:
    """The turns of a [B, T] bool mask: the runs of valid tokens of each row (in a multi-turn
    trajectory the environment's tokens, loss mask 0, separate them). Reductions per turn give
    [B, K] tensors (K: the most turns in a row, at least 1); `spread` puts a per-turn value back
    on the turn's tokens."""

    def __init__(self, mask: torch.Tensor) -> None:
        before = torch.zeros_like(mask)
        before[:, 1:] = mask[:, :-1]
        index = (mask & ~before).long().cumsum(-1) - 1
        self.mask = mask
        self.index = torch.where(mask, index, torch.full_like(index, -1))  # -1: not in a turn
        self.count = max(int(self.index.max()) + 1 if self.index.numel() else 0, 1)
        self._slot = self.index.clamp(min=0)
        self.tokens = self.sum(torch.ones(mask.shape, dtype=torch.float64, device=mask.device))
        self.valid = self.tokens > 0  # [B, K]: turns that exist

    def sum(self, x: torch.Tensor) -> torch.Tensor:
        out = x.new_zeros(x.shape[0], self.count)
        return out.scatter_add_(1, self._slot, torch.where(self.mask, x, torch.zeros((), dtype=x.dtype, device=x.device)))

    def mean(self, x: torch.Tensor) -> torch.Tensor:
        return self.sum(x) / self.tokens.to(x.dtype).clamp_min(1)

    def max(self, x: torch.Tensor) -> torch.Tensor:
        low = torch.full((), -math.inf, dtype=x.dtype, device=x.device)
        out = torch.full((x.shape[0], self.count), -math.inf, dtype=x.dtype, device=x.device)
        out = out.scatter_reduce_(1, self._slot, torch.where(self.mask, x, low), "amax")
        return torch.where(torch.isfinite(out), out, torch.zeros_like(out))

    def spread(self, per_turn: torch.Tensor) -> torch.Tensor:
        """[B, K] -> [B, T]: each token gets its turn's value (tokens outside turns: turn 0's)."""
        return per_turn.gather(1, self._slot)


# ---- the correction ----------------------------------------------------------------------------
def compute_rollout_correction(
    old_log_prob: torch.Tensor,
    rollout_log_prob: torch.Tensor,
    response_mask: torch.Tensor,
    config: RolloutCorrectionConfig,
    batch_norm_sums: Optional[torch.Tensor] = None,
) -> tuple[Optional[torch.Tensor], torch.Tensor, dict[str, float]]:
    """IS weights, the rejection-modified mask and the `rollout_corr/...` metrics.

    Tensors are [batch, tokens]; inputs are detached (weights never carry gradient). Metrics are
    verl's, defined as its code defines them (the batch-wide sequence metrics count a fully padded
    row, as verl's do; a rejection option's own ones do not); an all-padding batch gives zeros,
    never NaN (verl raises). With `rollout_is_batch_normalize`, `batch_norm_sums` (from
    `is_batch_norm_sums`, summed over every micro-batch and rank of the batch) normalise the
    weights over the whole batch; None normalises over the rows given here.
    """
    if not isinstance(config, RolloutCorrectionConfig):
        raise TypeError(f"config must be a RolloutCorrectionConfig, got {type(config).__name__}")
    mask = check_mask(response_mask)
    log_ratio, old, rollout = _log_ratio(old_log_prob, rollout_log_prob, mask)
    seq_valid = mask.any(-1)
    # verl's batch-wide sequence metrics average over every row, a fully padded one included (its
    # per-row means are 0); an all-padding batch has no rows to average (zeros, where verl raises).
    rows = mask.any().expand_as(seq_valid)
    turns = Turns(mask) if config.uses_turns else None
    stats: dict[str, torch.Tensor] = {}

    weights = None
    if config.rollout_is is not None:
        weights = _is_weights(log_ratio, mask, seq_valid, rows, turns, config, stats, batch_norm_sums)

    keep = torch.ones_like(mask)
    if config.rejection_criteria:
        keep = _rejection_keep(log_ratio, mask, seq_valid, rows, turns, config.rejection_criteria, stats)
    _veto(log_ratio, mask, rows, config.rollout_token_veto_threshold, keep, stats)
    _offpolicy_stats(old, rollout, log_ratio, mask, rows, stats)
    if config.rollout_turn_metrics:
        _by_turn_stats(log_ratio, turns, config.rollout_turn_metrics, stats)

    modified = response_mask * keep.to(response_mask.dtype) if response_mask.dtype != torch.bool \
        else response_mask & keep
    return weights, modified, to_floats(stats, METRIC_PREFIX)


def to_floats(stats: dict[str, torch.Tensor], prefix: str = "") -> dict[str, float]:
    """One device sync for all metrics instead of one per metric."""
    if not stats:
        return {}
    values = torch.stack([v.detach().to(torch.float64).reshape(()) for v in stats.values()]).tolist()
    return {prefix + k: float(v) for k, v in zip(stats, values)}


def is_batch_norm_sums(
    old_log_prob: torch.Tensor,
    rollout_log_prob: torch.Tensor,
    response_mask: torch.Tensor,
    config: RolloutCorrectionConfig,
) -> torch.Tensor:
    """float64 [sum, count] of the truncated IS weights whose ratio is `rollout_is_batch_normalize`'s
    factor: token level Σ w over valid tokens and their count, sequence (turn) level Σ of
    per-sequence mean weights and the count of valid sequences. Sums of these over micro-batches
    and ranks give the whole batch's factor (pass them to `compute_rollout_correction`)."""
    if config.rollout_is is None:
        raise ValueError("is_batch_norm_sums needs rollout_is ('token', 'sequence' or 'turn')")
    mask = check_mask(response_mask)
    log_ratio, _, _ = _log_ratio(old_log_prob, rollout_log_prob, mask)
    turns = Turns(mask) if config.uses_turns else None
    _, weights, _, _ = _truncated_weights(log_ratio, mask, mask.any(-1), turns, config)
    return _norm_sums(weights, mask, config.rollout_is)


def _log_ratio(old_log_prob, rollout_log_prob, mask):
    """log π_old − log μ (0 at padding), and the two checked inputs, in the compute dtype."""
    dtype = compute_dtype(old_log_prob, rollout_log_prob)
    old = check_token_values("old_log_prob", old_log_prob.detach(), mask).to(dtype)
    rollout = check_token_values("rollout_log_prob", rollout_log_prob.detach(), mask).to(dtype)
    return old - rollout, old, rollout


def _norm_sums(weights, mask, level) -> torch.Tensor:
    if level == "token":
        total, count = masked_sum_rows(weights, mask).sum(), mask.sum()
    else:
        seq_valid = mask.any(-1)
        total, count = torch.where(seq_valid, masked_mean_rows(weights, mask), 0.0).sum(), seq_valid.sum()
    return torch.stack([total.to(torch.float64), count.to(torch.float64)])


def _truncated_weights(log_ratio, mask, seq_valid, turns, config):
    """(raw ratios, truncated weights, per-unit log ratio, its validity), 0 at padding; the unit
    is the sequence or the turn (None, None at token level)."""
    zero = torch.zeros((), dtype=log_ratio.dtype, device=log_ratio.device)
    upper, lower = config.is_upper, config.is_lower
    unit_log = unit_valid = None
    if config.rollout_is == "token":
        raw = torch.exp(log_ratio.clamp(-SAFETY_BOUND, SAFETY_BOUND))
    elif config.rollout_is == "sequence":
        unit_log, unit_valid = masked_sum_rows(log_ratio, mask), seq_valid
        raw = torch.exp(unit_log.clamp(-SAFETY_BOUND, SAFETY_BOUND))[:, None].expand_as(log_ratio)
    else:  # turn: each turn's product, on its own tokens
        unit_log, unit_valid = turns.sum(log_ratio), turns.valid
        raw = torch.exp(turns.spread(unit_log).clamp(-SAFETY_BOUND, SAFETY_BOUND))
    raw = torch.where(mask, raw, zero)
    if lower is None:
        weights = raw.clamp(max=upper)
    else:
        weights = torch.where((raw >= lower) & (raw <= upper), raw, zero)
    return raw, weights, unit_log, unit_valid


def _is_weights(log_ratio, mask, seq_valid, rows, turns, config, stats, batch_norm_sums=None) -> torch.Tensor:
    zero = torch.zeros((), dtype=log_ratio.dtype, device=log_ratio.device)
    upper, lower = config.is_upper, config.is_lower
    raw, weights, unit_log, unit_valid = _truncated_weights(log_ratio, mask, seq_valid, turns, config)
    low = lower if lower is not None else 1.0 / upper

    # As verl's `compute_is_metrics`: the fractions judge the ratios before truncation; max/min are
    # the applied weights' at token level and the true extremes (in log space, even beyond the
    # safety bound) over sequences (turns) otherwise; the seq_ fractions judge each sequence's mean
    # ratio before truncation (after it, a mean could never pass the cap).
    if config.rollout_is != "token":
        unit_valid = rows if config.rollout_is == "sequence" else unit_valid
        unit_log = torch.where(unit_valid, unit_log, zero)
        # exp of the true log extremes, capped at exp(20) against overflow (small ones just underflow)
        stats["rollout_is_max"] = torch.exp(_masked_max(unit_log, unit_valid).clamp(max=SAFETY_BOUND))
        stats["rollout_is_min"] = torch.exp(_masked_min(unit_log, unit_valid).clamp(max=SAFETY_BOUND))
        stats["rollout_is_ratio_fraction_high"] = masked_mean((unit_log > math.log(upper)).to(zero.dtype), unit_valid)
        stats["rollout_is_ratio_fraction_low"] = masked_mean((unit_log < math.log(low)).to(zero.dtype), unit_valid)
    else:
        stats["rollout_is_max"] = _masked_max(weights, mask)
        stats["rollout_is_min"] = _masked_min(weights, mask)
        stats["rollout_is_ratio_fraction_high"] = masked_mean((raw > upper).to(zero.dtype), mask)
        stats["rollout_is_ratio_fraction_low"] = masked_mean((raw < low).to(zero.dtype), mask)
    mean = masked_mean(weights, mask)
    stats["rollout_is_mean"] = mean
    stats["rollout_is_std"] = _masked_std(weights, mask)
    normalized_sq = masked_mean((weights / (mean + 1e-8)) ** 2, mask)  # verl's 1e-8
    stats["rollout_is_eff_sample_size"] = torch.where(normalized_sq > 0, 1.0 / normalized_sq.clamp_min(1e-30), zero)
    seq_mean = masked_mean_rows(weights, mask)
    stats["rollout_is_seq_mean"] = masked_mean(seq_mean, rows)
    stats["rollout_is_seq_std"] = _masked_std(seq_mean, rows, unbiased=True)
    stats["rollout_is_seq_max"] = _masked_max(seq_mean, rows)
    stats["rollout_is_seq_min"] = _masked_min(seq_mean, rows)
    stats["rollout_is_seq_max_deviation"] = _masked_max((seq_mean - 1.0).abs(), rows)
    raw_seq_mean = masked_mean_rows(raw, mask)
    stats["rollout_is_seq_fraction_high"] = masked_mean((raw_seq_mean > upper).to(zero.dtype), rows)
    stats["rollout_is_seq_fraction_low"] = masked_mean((raw_seq_mean < low).to(zero.dtype), rows)
    if lower is not None:
        stats["rollout_is_oob_ratio"] = masked_mean(((raw < lower) | (raw > upper)).to(zero.dtype), mask)

    if config.rollout_is_batch_normalize:
        # Token level: mean over valid tokens; sequence and turn level: mean of per-sequence means.
        sums = _norm_sums(weights, mask, config.rollout_is) if batch_norm_sums is None else batch_norm_sums
        sums = torch.as_tensor(sums, dtype=torch.float64, device=weights.device)
        if sums.shape != (2,) or not bool(torch.isfinite(sums).all()) or float(sums[1]) < 0:
            raise ValueError(f"batch_norm_sums must be a finite [sum, count] pair, got {batch_norm_sums!r}")
        factor = (sums[0] / sums[1].clamp_min(1)).to(weights.dtype)
        factor = torch.where(factor > 1e-8, factor, torch.ones_like(factor))
        weights = weights / factor
        stats["rollout_is_batch_norm_factor"] = factor
    return weights.detach()


def _rejection_keep(log_ratio, mask, seq_valid, rows, turns, criteria, stats) -> torch.Tensor:
    """Bool [B, T]: True where every criterion passes (padding is True; the mask handles it)."""
    dtype = log_ratio.dtype
    safe = log_ratio.clamp(-SAFETY_BOUND, SAFETY_BOUND)
    token_stat = {"k1": -safe, "k2": 0.5 * safe ** 2, "k3": torch.exp(safe) - 1.0 - safe}
    keep_all = torch.ones_like(mask)
    for c in criteria:
        per_token = token_stat[c.estimator]
        if c.level == "token":
            stat = per_token
            stat_mask = mask
        elif c.level.startswith("turn"):
            stat = getattr(turns, c.level.removeprefix("turn_"))(per_token)  # turns.sum | mean | max
            stat_mask = turns.valid
        else:
            if c.level == "seq_sum":
                stat = masked_sum_rows(per_token, mask)
            elif c.level == "seq_mean":
                stat = masked_mean_rows(per_token, mask)
            else:
                stat = _rowwise_max(per_token, mask)
            stat_mask = seq_valid
        if c.estimator == "k1":
            high_at, low_at = math.log(c.upper), math.log(c.lower)
        else:
            high_at, low_at = c.upper, 0.0  # no lower bound (the std below clamps at 0)
        high = stat > high_at
        low = stat < low_at if c.estimator == "k1" else torch.zeros_like(stat, dtype=torch.bool)
        passed = ~(high | low)
        if c.level == "token":
            keep, on_tokens = passed, stat
        elif c.level.startswith("turn"):
            keep, on_tokens = turns.spread(passed), turns.spread(stat)  # a failing turn is rejected alone
        else:
            keep, on_tokens = passed[:, None].expand_as(mask), stat[:, None].expand_as(mask)
        keep_all = keep_all & keep
        _rejection_metrics(f"rollout_rs_{c.option}", c, stat, stat_mask, on_tokens, mask, seq_valid,
                           high, low, high_at, low_at, keep, stats)
    stats["rollout_rs_masked_fraction"] = masked_mean((~keep_all).to(dtype), mask)
    stats["rollout_rs_seq_masked_fraction"] = masked_mean((~keep_all & mask).any(-1).to(dtype), rows)
    return keep_all


def _rejection_metrics(name, c, stat, stat_mask, token_stat, mask, seq_valid, high, low, high_at, low_at,
                       keep, stats) -> None:
    """One option's metrics, as verl's `compute_rs_metrics` defines them, in the statistic's units
    (k1: −log ρ): `_mean` and `_std` over tokens (a sequence's statistic counts once per token),
    `_max`/`_min`/`_fraction_*` over the units the option judges (tokens, sequences, turns),
    `_seq_*` over sequences (at token level, each sequence's token mean)."""
    dtype = stat.dtype
    stats[f"{name}_mean"] = masked_mean(token_stat, mask)
    stats[f"{name}_max"] = _masked_max(stat, stat_mask)
    stats[f"{name}_min"] = _masked_min(stat, stat_mask)
    stats[f"{name}_fraction_high"] = masked_mean(high.to(dtype), stat_mask)
    stats[f"{name}_fraction_low"] = masked_mean(low.to(dtype), stat_mask)
    clamped = token_stat.clamp(min=low_at, max=high_at)
    spread = masked_mean(clamped ** 2, mask) - masked_mean(clamped, mask) ** 2
    stats[f"{name}_std"] = torch.where(mask.sum() > 1, spread.clamp_min(0).sqrt(), torch.zeros_like(spread))
    per_seq = stat if c.level.startswith("seq") else masked_mean_rows(token_stat, mask)
    stats[f"{name}_seq_mean"] = masked_mean(per_seq, seq_valid)
    stats[f"{name}_seq_std"] = _masked_std(per_seq, seq_valid, unbiased=True)
    stats[f"{name}_seq_max"] = _masked_max(per_seq, seq_valid)
    stats[f"{name}_seq_min"] = _masked_min(per_seq, seq_valid)
    stats[f"{name}_seq_max_deviation"] = _masked_max(per_seq.abs(), seq_valid)
    stats[f"{name}_seq_fraction_high"] = masked_mean((per_seq > high_at).to(dtype), seq_valid)
    if c.estimator == "k1":
        stats[f"{name}_seq_fraction_low"] = masked_mean((per_seq < low_at).to(dtype), seq_valid)
    stats[f"{name}_masked_fraction"] = masked_mean((~keep).to(dtype), mask)
    stats[f"{name}_seq_masked_fraction"] = masked_mean((~keep & mask).any(-1).to(dtype), seq_valid)


def _rowwise_max(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    if x.shape[-1] == 0:
        return x.new_zeros(x.shape[:-1])
    filled = torch.where(mask, x, torch.full((), -math.inf, dtype=x.dtype, device=x.device)).max(-1).values
    return torch.where(torch.isfinite(filled), filled, torch.zeros_like(filled))


def _veto(log_ratio, mask, rows, threshold, keep, stats) -> None:
    """Reject (in place, on `keep`) every sequence holding a token with unclamped ρ < threshold."""
    dtype = log_ratio.dtype
    if threshold is None:
        zero = torch.zeros((), dtype=dtype, device=log_ratio.device)
        stats["rollout_is_veto_fraction"] = zero
        stats["rollout_is_catastrophic_token_fraction"] = zero
        return
    catastrophic = (log_ratio < math.log(threshold)) & mask
    vetoed = catastrophic.any(-1)
    keep &= ~vetoed[:, None]
    stats["rollout_is_veto_fraction"] = masked_mean(vetoed.to(dtype), rows)
    stats["rollout_is_catastrophic_token_fraction"] = masked_mean(catastrophic.to(dtype), mask)


def _by_turn_stats(log_ratio, turns: Turns, count: int, stats) -> None:
    """KL (k1) and K3 of the tokens of turn t, for t = 1..count (0 where no row has turn t)."""
    safe = log_ratio.clamp(-SAFETY_BOUND, SAFETY_BOUND)
    k3 = torch.exp(safe) - safe - 1.0
    for t in range(count):
        in_turn = turns.index == t
        stats[f"kl_by_turn/{t + 1}"] = masked_mean(-log_ratio, in_turn)
        stats[f"k3_kl_by_turn/{t + 1}"] = masked_mean(k3, in_turn)


def _offpolicy_stats(old, rollout, log_ratio, mask, rows, stats) -> None:
    """KL, K3, perplexities and χ² between the training-side policy and the rollout policy."""
    safe = log_ratio.clamp(-SAFETY_BOUND, SAFETY_BOUND)
    # Per-sequence means in float64: a perplexity of a very unlikely sequence overflows float32.
    mean_old = masked_mean_rows(old, mask).double()
    mean_rollout = masked_mean_rows(rollout, mask).double()
    stats["training_ppl"] = masked_mean(torch.exp(-mean_old), rows)
    stats["training_log_ppl"] = masked_mean(-mean_old, rows)
    stats["rollout_ppl"] = masked_mean(torch.exp(-mean_rollout), rows)
    stats["rollout_log_ppl"] = masked_mean(-mean_rollout, rows)
    stats["kl"] = masked_mean(-log_ratio, mask)
    stats["k3_kl"] = masked_mean(torch.exp(safe) - safe - 1.0, mask)
    log_ppl_diff = mean_rollout - mean_old  # = log(training_ppl / rollout_ppl) per sequence
    stats["log_ppl_diff"] = masked_mean(log_ppl_diff, rows)
    stats["log_ppl_abs_diff"] = masked_mean(log_ppl_diff.abs(), rows)
    stats["log_ppl_diff_max"] = _masked_max(log_ppl_diff, rows)
    stats["log_ppl_diff_min"] = _masked_min(log_ppl_diff, rows)
    stats["ppl_ratio"] = masked_mean(torch.exp(log_ppl_diff.clamp(-SAFETY_BOUND, SAFETY_BOUND)), rows)
    seq_log = masked_sum_rows(log_ratio, mask).clamp(-SAFETY_BOUND, SAFETY_BOUND)
    any_valid = mask.any().to(old.dtype)  # an all-padding batch reports χ² = 0, not -1
    stats["chi2_token"] = (masked_mean(torch.exp(2.0 * safe), mask) - 1.0) * any_valid
    stats["chi2_seq"] = (masked_mean(torch.exp(2.0 * seq_log), rows) - 1.0) * any_valid
