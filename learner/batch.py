"""Turn pulled groups into the padded tensors the learner trains on.

Rows are samples in the order they arrive (group by group); the response side is right-padded to
the longest response, and every per-token tensor is zero (or the sample's version) at padding.
The response mask is 1 on real response tokens whose `loss_mask` is 1: tool or environment
tokens stay in the context but never in the loss.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, fields

import numpy as np
import torch


class BatchError(ValueError):
    """A pulled group cannot be trained on; the message names the sample and the field."""


@dataclass
class TrainBatch:
    prompts: list[list[int]]
    responses: list[list[int]]
    response_mask: torch.Tensor  # float32 [B, T]: real response tokens with loss_mask 1
    rollout_log_probs: torch.Tensor  # float32 [B, T], 0 at padding
    token_versions: torch.Tensor  # int64 [B, T], the sample's weight_version at padding
    weight_versions: torch.Tensor  # int64 [B]
    rewards: torch.Tensor  # float32 [B]
    group_index: torch.Tensor  # int64 [B]: position of the row's group in the pulled batch
    group_ids: list[str]  # per row
    sample_ids: list[str]  # per row

    def __len__(self) -> int:
        return len(self.prompts)

    @property
    def num_groups(self) -> int:
        return len(set(self.group_index.tolist()))

    def select(self, rows: list[int] | torch.Tensor) -> "TrainBatch":
        """The sub-batch of the given rows, trimmed to its own longest response."""
        rows = [int(r) for r in rows]
        width = max((len(self.responses[r]) for r in rows), default=0)
        picked = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, list):
                picked[f.name] = [value[r] for r in rows]
            elif value.dim() == 2:
                picked[f.name] = value[rows, :width]
            else:
                picked[f.name] = value[rows]
        return TrainBatch(**picked)

    def rows_of_groups(self, group_positions: list[int]) -> list[int]:
        wanted = set(group_positions)
        return [row for row, g in enumerate(self.group_index.tolist()) if g in wanted]


def _array(sample, name: str, dtype, length: int | None = None) -> np.ndarray:
    value = getattr(sample, name, None)
    if value is None:
        raise BatchError(f"sample {sample.sample_id!r}: field {name!r} is missing")
    arr = np.asarray(value)
    if arr.ndim != 1:
        raise BatchError(f"sample {sample.sample_id!r}: field {name!r} must be 1-D, got shape {arr.shape}")
    if length is not None and arr.shape[0] != length:
        raise BatchError(
            f"sample {sample.sample_id!r}: field {name!r} has {arr.shape[0]} entries, "
            f"expected {length} (one per response token)"
        )
    return arr.astype(dtype, copy=False)


def _check_sample(sample, learner_version: int | None) -> dict:
    sid = sample.sample_id
    prompt = _array(sample, "prompt_ids", np.int64)
    response = _array(sample, "response_ids", np.int64)
    T = response.shape[0]
    if prompt.shape[0] == 0:
        raise BatchError(f"sample {sid!r}: field 'prompt_ids' is empty (the first response token needs a context)")
    log_probs = _array(sample, "rollout_log_probs", np.float32, T)
    if not np.all(np.isfinite(log_probs)):
        raise BatchError(f"sample {sid!r}: field 'rollout_log_probs' holds NaN or inf")
    if np.any(log_probs > 1e-4):
        raise BatchError(f"sample {sid!r}: field 'rollout_log_probs' holds values > 0 (not log-probabilities)")
    loss_mask = _array(sample, "loss_mask", np.float32, T)
    if not np.all((loss_mask == 0) | (loss_mask == 1)):
        raise BatchError(f"sample {sid!r}: field 'loss_mask' must hold only 0 and 1")
    version = int(sample.weight_version)
    versions = getattr(sample, "token_versions", None)
    versions = np.full(T, version, np.int64) if versions is None else _array(sample, "token_versions", np.int64, T)
    newest = max(version, int(versions.max()) if T else version)
    if learner_version is not None and newest > learner_version:
        raise BatchError(
            f"sample {sid!r}: field 'weight_version' is {newest}, ahead of the learner's version "
            f"{learner_version} (a version from the future)"
        )
    reward = float(sample.reward)
    if not math.isfinite(reward):
        raise BatchError(f"sample {sid!r}: field 'reward' is {reward}, not a finite number")
    return dict(prompt=prompt, response=response, log_probs=log_probs, loss_mask=loss_mask,
                version=version, versions=versions, reward=reward)


def build_batch(groups, learner_version: int | None = None) -> TrainBatch:
    """Validate pulled groups and pad them into a TrainBatch. `learner_version` rejects samples
    tagged with a version the learner has not produced yet."""
    groups = list(groups)
    if not groups:
        raise BatchError("cannot build a training batch from zero groups")
    rows, group_index, group_ids, sample_ids = [], [], [], []
    for position, group in enumerate(groups):
        if not hasattr(group, "samples") or not hasattr(group, "group_id"):
            raise BatchError(f"item {position} of the batch is a {type(group).__name__}, not a Group")
        if not group.samples:
            raise BatchError(f"group {group.group_id!r} has no samples")
        for sample in group.samples:
            if sample.group_id != group.group_id:
                raise BatchError(
                    f"sample {sample.sample_id!r}: field 'group_id' is {sample.group_id!r} "
                    f"but it sits in group {group.group_id!r}"
                )
            rows.append(_check_sample(sample, learner_version))
            group_index.append(position)
            group_ids.append(str(group.group_id))
            sample_ids.append(str(sample.sample_id))
    if len(set(sample_ids)) != len(sample_ids):
        raise BatchError("the batch holds the same sample_id twice")

    B, T = len(rows), max(len(r["response"]) for r in rows)
    response_mask = torch.zeros(B, T)
    rollout_log_probs = torch.zeros(B, T)
    token_versions = torch.zeros(B, T, dtype=torch.long)
    for i, r in enumerate(rows):
        n = len(r["response"])
        response_mask[i, :n] = torch.from_numpy(r["loss_mask"])
        rollout_log_probs[i, :n] = torch.from_numpy(r["log_probs"])
        token_versions[i] = r["version"]
        token_versions[i, :n] = torch.from_numpy(r["versions"])
    return TrainBatch(
        prompts=[r["prompt"].tolist() for r in rows],
        responses=[r["response"].tolist() for r in rows],
        response_mask=response_mask,
        rollout_log_probs=rollout_log_probs,
        token_versions=token_versions,
        weight_versions=torch.tensor([r["version"] for r in rows], dtype=torch.long),
        rewards=torch.tensor([r["reward"] for r in rows], dtype=torch.float32),
        group_index=torch.tensor(group_index, dtype=torch.long),
        group_ids=group_ids,
        sample_ids=sample_ids,
    )
