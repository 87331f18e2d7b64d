"""The sample record: one response to one prompt, and the group of n responses to that prompt.

Arrays have fixed dtypes (the wire codec relies on them): token ids int32, log-probs and token
rewards float32, loss mask uint8 (1 = policy token, 0 = tool/environment token), token versions
int32. Lists or other numeric arrays are converted on construction when that loses nothing; a
lossy conversion is a `SampleError`. Full validation (finite log-probs <= 0, versions not ahead
of the learner, size limits) happens in `buffer.codec.validate_group`, which every decode runs.

`routed_experts` (MoE policies only; None for dense ones) is the router's top-k expert ids of
every MoE layer for every response token, [T, layers, k], uint8 (or int16 past 256 experts). Row
t is the routing of the forward position that sampled token t (the one before it), the positions
the learner replays (`learner.routing_replay`); rows of tool tokens (loss_mask 0) carry no
routing (zeros, never replayed).
"""
from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field

import numpy as np

from buffer.errors import SampleError

MetadataValue = str | int | float | bool

# Canonical dtype of every array field, in wire order.
ARRAY_FIELDS: dict[str, np.dtype] = {
    "prompt_ids": np.dtype(np.int32),
    "response_ids": np.dtype(np.int32),
    "rollout_log_probs": np.dtype(np.float32),
    "loss_mask": np.dtype(np.uint8),
    "token_versions": np.dtype(np.int32),
    "token_rewards": np.dtype(np.float32),
}

ROUTING_DTYPES = (np.dtype(np.uint8), np.dtype(np.int16))  # compact expert ids; int16 past 256 experts
# The metadata key of the reward of the sample's group's greedy response (rollout.greedy_baseline),
# ReMax's baseline: the worker writes it, the learner reads it.
REWARD_BASELINE = "reward_baseline"


def as_routing_array(value, sample_id: str | None) -> np.ndarray:
    """`value` as a [T, layers, k] array of expert ids in uint8 (int16 when an id needs it);
    refuses other shapes and conversions that lose data."""
    if type(value) is np.ndarray and value.dtype in ROUTING_DTYPES and value.ndim == 3:
        return value
    arr = np.asarray(value)
    if arr.ndim != 3:
        raise SampleError("routed_experts", sample_id, f"expected a [tokens, layers, k] array, got shape {arr.shape}")
    if arr.dtype in ROUTING_DTYPES:
        return arr
    if arr.size and arr.dtype.kind not in "biu":
        raise SampleError("routed_experts", sample_id, f"expert ids must be integers, got dtype {arr.dtype}")
    low, high = (int(arr.min()), int(arr.max())) if arr.size else (0, 0)
    if low < 0 or high > np.iinfo(np.int16).max:
        raise SampleError("routed_experts", sample_id, f"expert ids must lie in [0, 32767], got {low}..{high}")
    return arr.astype(np.uint8 if high < 256 else np.int16)


def as_field_array(value, field_name: str, sample_id: str | None) -> np.ndarray:
    """`value` as a 1-D array of the field's canonical dtype; refuses conversions that lose data."""
    dtype = ARRAY_FIELDS[field_name]
    if type(value) is np.ndarray and value.dtype == dtype and value.ndim == 1:
        return value  # the common case, kept cheap: decode builds many samples
    arr = np.asarray(value)
    if arr.ndim != 1:
        raise SampleError(field_name, sample_id, f"expected a 1-D array, got shape {arr.shape}")
    if arr.dtype == dtype:
        return arr
    if arr.size == 0:
        return np.zeros(0, dtype=dtype)
    if arr.dtype.kind not in "biuf":
        raise SampleError(field_name, sample_id, f"expected numbers ({dtype}), got dtype {arr.dtype}")
    converted = arr.astype(dtype)
    same = np.array_equal(converted, arr, equal_nan=dtype.kind == "f")
    if dtype.kind == "f" and arr.dtype.kind == "f":
        same = True  # float64 -> float32 rounding is expected for log-probs and rewards
    if not same:
        raise SampleError(field_name, sample_id, f"values do not fit {dtype} (got {arr.dtype})")
    return converted


@dataclass(kw_only=True)
class Sample:
    """One response. Construct by keyword (fields as in docs/architecture.md)."""

    sample_id: str
    group_id: str
    prompt_ids: np.ndarray  # int32[P]
    response_ids: np.ndarray  # int32[T]
    rollout_log_probs: np.ndarray  # float32[T], behaviour policy log-probs (the inference engine)
    loss_mask: np.ndarray  # uint8[T]
    reward: float
    weight_version: int  # the weight version generation started with
    token_versions: np.ndarray | None = None  # int32[T]; None -> every token at weight_version
    token_rewards: np.ndarray | None = None  # float32[T] or None
    worker_id: str = ""
    created_at: float = field(default_factory=time.time)
    finish_reason: str = ""
    metadata: dict[str, MetadataValue] = field(default_factory=dict)
    routed_experts: np.ndarray | None = None  # uint8/int16 [T, layers, k]: MoE routing, None for dense models

    def __post_init__(self):
        sid = self.sample_id
        self.prompt_ids = as_field_array(self.prompt_ids, "prompt_ids", sid)
        self.response_ids = as_field_array(self.response_ids, "response_ids", sid)
        self.rollout_log_probs = as_field_array(self.rollout_log_probs, "rollout_log_probs", sid)
        self.loss_mask = as_field_array(self.loss_mask, "loss_mask", sid)
        if self.token_versions is None:
            self.token_versions = np.full(len(self.response_ids), self.weight_version, dtype=np.int32)
        self.token_versions = as_field_array(self.token_versions, "token_versions", sid)
        if self.token_rewards is not None:
            self.token_rewards = as_field_array(self.token_rewards, "token_rewards", sid)
        if self.routed_experts is not None:
            self.routed_experts = as_routing_array(self.routed_experts, sid)

    @property
    def num_response_tokens(self) -> int:
        return len(self.response_ids)

    @property
    def array_nbytes(self) -> int:
        """Bytes of the raw arrays (what the wire frames carry)."""
        arrays = [self.prompt_ids, self.response_ids, self.rollout_log_probs, self.loss_mask, self.token_versions]
        if self.token_rewards is not None:
            arrays.append(self.token_rewards)
        if self.routed_experts is not None:
            arrays.append(self.routed_experts)
        return sum(a.nbytes for a in arrays)


@dataclass
class Group:
    """The n responses to one prompt; the unit the gate admits and the store keeps whole.
    `prompt_index` is the data cursor of the prompt (the permit's ticket)."""

    group_id: str
    samples: list[Sample]
    prompt_index: int

    @property
    def weight_version(self) -> int:
        """The oldest weight version in the group: staleness is judged by it."""
        return min(s.weight_version for s in self.samples)

    @property
    def sample_ids(self) -> list[str]:
        return [s.sample_id for s in self.samples]

    def __len__(self) -> int:
        return len(self.samples)


def new_id() -> str:
    """A fresh random id for samples, groups, permits and leases."""
    return uuid.uuid4().hex


@dataclass
class PulledBatch:
    """What the learner gets from `pull_batch`: B groups under one lease. `ack(lease_id)` once
    trained on (consumed, exactly once), `nack(lease_id)` to hand them back. `dropped_stale`
    counts groups dropped as too stale since the previous batch; `version` is the learner version
    the buffer judged staleness against; `prompts_quarantined` the buffer's total of prompts set
    aside for good (they fail the engine), `groups_filtered` its total of groups left untrained as
    uninformative (dynamic sampling)."""

    lease_id: str
    groups: list[Group]
    dropped_stale: int
    version: int
    prompts_quarantined: int = 0
    groups_filtered: int = 0

    @property
    def samples(self) -> list[Sample]:
        return [s for g in self.groups for s in g.samples]
