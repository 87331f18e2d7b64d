"""Turn pulled groups into the padded tensors the learner trains on, and plan its passes.

Rows are samples in the order they arrive (group by group); the response side is right-padded to
the longest response, and every per-token tensor is zero (or the sample's version) at padding.
The response mask is 1 on real response tokens whose `loss_mask` is 1: tool or environment
tokens stay in the context but never in the loss. An MoE policy's batch carries the engine's
routing ([B, T, layers, k], `learner.routing_replay`) when every sample has it, and per-token
rewards where a sample has them (multi-turn steps). `reward_components` reads the reward's parts
(GDPO's) from the samples' metrics, `reward_baselines` their groups' greedy rewards (ReMax's).

`plan_micro_batches` groups rows into forward passes by a token budget (rows of similar length
together, so little is padding), the same number on every rank.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Optional

import numpy as np
import torch

from buffer.codec import validate_group
from buffer.config import SampleLimits
from buffer.errors import SampleError
from buffer.sample import REWARD_BASELINE, Group


class BatchError(ValueError):
    """A pulled group cannot be trained on; the message names the sample and the field."""


@dataclass
class TrainBatch:
    prompts: list[np.ndarray]  # int64 token ids per row
    responses: list[np.ndarray]
    response_mask: torch.Tensor  # float32 [B, T]: real response tokens with loss_mask 1
    rollout_log_probs: torch.Tensor  # float32 [B, T], 0 at padding
    token_versions: torch.Tensor  # int64 [B, T], the sample's weight_version at padding
    weight_versions: torch.Tensor  # int64 [B]
    rewards: torch.Tensor  # float32 [B]
    group_index: torch.Tensor  # int64 [B]: position of the row's group in the pulled batch
    group_ids: list[str]  # per row
    sample_ids: list[str]  # per row
    routed_experts: Optional[torch.Tensor] = None  # int16 [B, T, layers, k]: MoE routing, zero at padding
    # float32 [B, T]: the samples' per-token rewards (multi-turn steps; 0 where a sample has none),
    # None when no sample has them
    token_rewards: Optional[torch.Tensor] = None
    # r2: the learner's own experts at every position of each row, [prompt + response, layers, k],
    # recorded by the step's proximal pass (learner/routing_replay.py)
    replay_routing: Optional[list[torch.Tensor]] = None

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
            if value is None:
                picked[f.name] = None
            elif isinstance(value, list):
                picked[f.name] = [value[r] for r in rows]
            elif value.dim() >= 2:
                picked[f.name] = value[rows, :width]
            else:
                picked[f.name] = value[rows]
        return TrainBatch(**picked)

    def to(self, device) -> "TrainBatch":
        """The same rows with every tensor on `device` (token arrays stay on the host)."""
        return TrainBatch(**{f.name: getattr(self, f.name).to(device) if isinstance(getattr(self, f.name), torch.Tensor)
                             else getattr(self, f.name) for f in fields(self)})

    def sequence_lengths(self, rows: list[int] | None = None) -> list[int]:
        """Prompt+response tokens of the given rows (all by default)."""
        rows = range(len(self)) if rows is None else rows
        return [len(self.prompts[r]) + len(self.responses[r]) for r in rows]

    def group_tokens(self) -> list[int]:
        """Prompt+response tokens of each group, by its position in the pulled batch."""
        lengths = torch.tensor(self.sequence_lengths(), dtype=torch.long)
        sums = torch.zeros(int(self.group_index.max()) + 1, dtype=torch.long).index_add_(0, self.group_index, lengths)
        return sums.tolist()

    def rows_of_groups(self, group_positions: list[int]) -> list[int]:
        wanted = set(group_positions)
        return [row for row, g in enumerate(self.group_index.tolist()) if g in wanted]


# The record contract is the buffer's (one home: buffer.codec); size limits are the transport's
# business, so the learner checks with none but the model's own: a token id beyond its embedding
# is a device-side assert (a group from an old log or a lax buffer must be refused here, named).
_NO_SIZE_LIMITS = SampleLimits(max_group_size=2**31, max_prompt_tokens=2**31, max_response_tokens=2**31,
                               max_metadata_items=2**31, max_string_chars=2**31, max_header_bytes=2**31,
                               max_frames=2**31)


_UNCHECKED = object()


def _check_routing(sample, shape) -> None:
    """A sample's routing against the policy's (layers, k, experts); None: a dense policy."""
    routing = sample.routed_experts
    if routing is None:
        return
    if shape is None:
        raise BatchError(f"sample {sample.sample_id!r}, field 'routed_experts': carries MoE routing "
                         f"{list(routing.shape[1:])} but the policy is dense (no routers)")
    if tuple(routing.shape[1:]) != (shape[0], shape[1]):
        raise BatchError(f"sample {sample.sample_id!r}, field 'routed_experts': [layers, k] is "
                         f"{list(routing.shape[1:])}, the policy routes [{shape[0]}, {shape[1]}]")


def _check_group(group, position: int, learner_version: int | None, limits: SampleLimits) -> None:
    if not isinstance(group, Group):
        raise BatchError(f"item {position} of the batch is a {type(group).__name__}, not a Group")
    if not group.samples:
        raise BatchError(f"group {group.group_id!r} has no samples")
    try:
        validate_group(group, limits, max_version=learner_version)
    except SampleError as exc:
        raise BatchError(f"{exc} (learner version {learner_version})") from None
    for sample in group.samples:
        if len(sample.prompt_ids) == 0:
            raise BatchError(f"sample {sample.sample_id!r}, field 'prompt_ids': empty (the first response token "
                             "needs a context)")


def _row(sample) -> dict:
    return dict(prompt=sample.prompt_ids.astype(np.int64), response=sample.response_ids.astype(np.int64),
                log_probs=sample.rollout_log_probs, loss_mask=sample.loss_mask.astype(np.float32),
                version=int(sample.weight_version), versions=sample.token_versions.astype(np.int64),
                reward=float(sample.reward), token_rewards=sample.token_rewards)


def build_batch(groups, learner_version: int | None = None, vocab_size: int | None = None,
                routing_shape=_UNCHECKED) -> TrainBatch:
    """Validate pulled groups (`buffer.codec.validate_group`) and pad them into a TrainBatch.
    `learner_version` rejects samples tagged with a version the learner has not produced yet;
    `vocab_size` (the model's embedding rows) token ids the model has no embedding for;
    `routing_shape` (the policy's `lm.moe.RoutingShape`, None for a dense one) routing that does
    not fit the policy (its expert ids, shape, or any routing for a dense policy)."""
    groups = list(groups)
    if not groups:
        raise BatchError("cannot build a training batch from zero groups")
    update = {} if vocab_size is None else {"vocab_size": vocab_size}
    if routing_shape is not _UNCHECKED and routing_shape is not None:
        update["num_experts"] = routing_shape[2]
    limits = _NO_SIZE_LIMITS.model_copy(update=update) if update else _NO_SIZE_LIMITS
    rows, group_index, group_ids, sample_ids, routing = [], [], [], [], []
    for position, group in enumerate(groups):
        _check_group(group, position, learner_version, limits)
        for sample in group.samples:
            if routing_shape is not _UNCHECKED:
                _check_routing(sample, routing_shape)
            routing.append(sample.routed_experts)
            rows.append(_row(sample))
            group_index.append(position)
            group_ids.append(str(group.group_id))
            sample_ids.append(str(sample.sample_id))
    if len(set(sample_ids)) != len(sample_ids):
        raise BatchError("the batch holds the same sample_id twice")

    # Per-token fields: each concatenated once, then scattered into the padded [B, T] layout.
    lengths = torch.tensor([len(r["response"]) for r in rows], dtype=torch.long)
    real = torch.arange(int(lengths.max()))[None, :] < lengths[:, None]
    weight_versions = torch.tensor([r["version"] for r in rows], dtype=torch.long)

    def padded(key: str, dtype: torch.dtype, fill: torch.Tensor | float = 0) -> torch.Tensor:
        out = torch.zeros(real.shape, dtype=dtype)
        out += fill if isinstance(fill, float | int) else fill[:, None]  # the sample's version at padding
        out[real] = torch.from_numpy(np.concatenate([r[key] for r in rows])).to(dtype)
        return out

    response_mask = padded("loss_mask", torch.float32)
    rollout_log_probs = padded("log_probs", torch.float32)
    token_versions = padded("versions", torch.long, weight_versions)
    token_rewards = None  # only where some sample has them (multi-turn steps): no [B, T] zeros otherwise
    if any(r["token_rewards"] is not None for r in rows):
        for r in rows:
            if r["token_rewards"] is None:
                r["token_rewards"] = np.zeros(len(r["response"]), np.float32)
        token_rewards = padded("token_rewards", torch.float32)
    return TrainBatch(
        prompts=[r["prompt"] for r in rows],  # int64 arrays: no Python int per token
        responses=[r["response"] for r in rows],
        response_mask=response_mask,
        rollout_log_probs=rollout_log_probs,
        token_versions=token_versions,
        weight_versions=weight_versions,
        rewards=torch.tensor([r["reward"] for r in rows], dtype=torch.float32),
        group_index=torch.tensor(group_index, dtype=torch.long),
        group_ids=group_ids,
        sample_ids=sample_ids,
        routed_experts=_padded_routing(routing, real),
        token_rewards=token_rewards,
    )


def reward_components(groups, keys: list[str]) -> torch.Tensor:
    """[K, B] float64: each sample's `reward/<key>` metric (what a verl-form reward's dict returned
    beside its score), in batch order; 0 where a sample has none (its reward failed and was
    scored failure_reward, or the function left the key out)."""
    def value(sample, key: str) -> float:
        v = sample.metadata.get(f"reward/{key}")
        return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) else 0.0

    samples = [s for g in groups for s in g.samples]
    return torch.tensor([[value(s, key) for s in samples] for key in keys], dtype=torch.float64).reshape(len(keys), -1)


def reward_baselines(groups) -> torch.Tensor:
    """[B] float64: each sample's `reward_baseline` (the reward of its group's greedy response, which
    a worker with rollout.greedy_baseline scores beside the samples), in batch order."""
    values = []
    for group in groups:
        for sample in group.samples:
            v = sample.metadata.get(REWARD_BASELINE)
            if not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(v):
                raise BatchError(f"sample {sample.sample_id} of group {group.group_id} has no finite "
                                 f"{REWARD_BASELINE} ({v!r}): learner.advantage.estimator=remax needs the workers' "
                                 "greedy baseline (rollout.greedy_baseline, on with remax in one config)")
            values.append(float(v))
    return torch.tensor(values, dtype=torch.float64)


def _padded_routing(routing: list, real: torch.Tensor) -> torch.Tensor | None:
    """The rows' routing as int16 [B, T, layers, k] (zero at padding), None unless every row has it."""
    lengths = real.sum(1).tolist()
    carried = [r for r in routing if r is not None]
    if not carried or any(r is None and n for r, n in zip(routing, lengths)):  # no tokens, no routing needed
        return None
    out = torch.zeros(*real.shape, *carried[0].shape[1:], dtype=torch.int16)
    out[real] = torch.from_numpy(np.concatenate([r.astype(np.int16) for r in carried]))
    return out


def plan_micro_batches(lengths, max_tokens: int | None, comm=None, max_rows: int | None = None,
                       packed: bool = False) -> list[list[int]]:
    """Split rows (given by their prompt+response lengths) into micro-batches of one forward pass
    each; returns lists of positions into `lengths`.

    A padded micro-batch costs rows x its longest row, a packed one (`packed`: the rows
    concatenated, `lm.causal_lm.pack_sequences`) the sum of its rows; that stays within
    `max_tokens` (None: no limit), with at most `max_rows` rows (None: no limit). Rows are taken
    longest first: padded, rows of similar length share a micro-batch and little is padding;
    packed, each goes to the first micro-batch with room (first-fit decreasing). With a
    `comm`, every rank gets the count the busiest rank needs (a MAX all-reduce, so call it on every
    rank): a rank with fewer splits its largest micro-batches, and one with fewer rows than that
    count gets empty ones. FSDP runs collectives in every pass, so every rank makes the same
    passes; a split never changes the update, which is normalised by whole-minibatch counts."""
    lengths = [int(n) for n in lengths]
    if max_tokens is not None and max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1 or None, got {max_tokens}")
    if max_rows is not None and max_rows < 1:
        raise ValueError(f"max_rows must be >= 1 or None, got {max_rows}")
    for row, n in enumerate(lengths):
        if n < 1:
            raise ValueError(f"row {row} has {n} tokens; every row needs at least one")
        if max_tokens is not None and n > max_tokens:
            raise ValueError(f"row {row} has {n} prompt+response tokens, more than the micro-batch budget "
                             f"max_tokens_per_micro_batch={max_tokens}: raise the budget to at least the longest "
                             f"sequence (prompt + max response tokens)")
    order = sorted(range(len(lengths)), key=lambda r: (-lengths[r], r))
    plan: list[list[int]] = []
    if packed:
        used: list[int] = []
        for row in order:
            fits = (i for i in range(len(plan)) if len(plan[i]) < (max_rows or math.inf)
                    and (max_tokens is None or used[i] + lengths[row] <= max_tokens))
            i = next(fits, None)
            if i is None:
                plan.append([])
                used.append(0)
                i = len(plan) - 1
            plan[i].append(row)
            used[i] += lengths[row]
        order = []  # planned
    width = 0
    for row in order:
        full = plan and (len(plan[-1]) == (max_rows or math.inf)
                         or max_tokens is not None and (len(plan[-1]) + 1) * width > max_tokens)
        if not plan or full:
            plan.append([])
            width = lengths[row]  # longest first: the first row sets the micro-batch's width
        plan[-1].append(row)
    if comm is not None and comm.world_size > 1:
        target = int(comm.all_reduce(torch.tensor([len(plan)], dtype=torch.int64), "max")[0])
        plan = _spread(plan, target)
    return plan


def _spread(plan: list[list[int]], target: int) -> list[list[int]]:
    """`target` micro-batches from `plan`: halve the one with the most rows until there are enough,
    then add empty ones when every micro-batch is down to one row."""
    plan = [list(mb) for mb in plan]
    while len(plan) < target:
        largest = max(range(len(plan)), key=lambda i: len(plan[i]), default=None)
        if largest is None or len(plan[largest]) < 2:
            plan.extend([] for _ in range(target - len(plan)))
            break
        rows = plan.pop(largest)
        half = len(rows) // 2
        plan[largest:largest] = [rows[:half], rows[half:]]
    return plan


def padding_counts(lengths: list[int], packed_width: int | None = None) -> tuple[int, int]:
    """(real tokens, slots) of one micro-batch: right-padded, or packed `packed_width` wide."""
    if packed_width is not None:
        return sum(lengths), packed_width
    return sum(lengths), len(lengths) * max(lengths, default=0)


def shape_bucket(tokens: int, max_tokens: int | None = None) -> int:
    """The packed width for `tokens`: the next of 4, 5, 6, 7 x 2^k (at most 25 % filler, about 4
    widths per doubling), capped at the budget, so a GPU plans its kernels for a few shapes once
    instead of for every new length."""
    if tokens < 1:
        raise ValueError(f"tokens must be >= 1, got {tokens}")
    if tokens <= 4:
        width = tokens
    else:
        scale = 1 << max(0, tokens.bit_length() - 3)  # tokens / scale lies in [4, 8)
        width = -(-tokens // scale) * scale
    return width if max_tokens is None else max(tokens, min(width, max_tokens))


def balance_groups(tokens: list[int], world_size: int) -> list[list[int]]:
    """Positions of groups (given by their prompt+response tokens) for each rank, balanced by
    tokens so no rank waits long for the busiest (verl's sequence-length balancing; here the
    longest-processing-time rule: largest group first, to the rank with the fewest tokens so far,
    ties to the lower rank). Deterministic: every rank computes the same split from the same batch.
    Each rank's positions in ascending order; a rank gets none only when groups are fewer than ranks."""
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    load = [0] * world_size
    parts: list[list[int]] = [[] for _ in range(world_size)]
    for position in sorted(range(len(tokens)), key=lambda g: (-tokens[g], g)):
        rank = min(range(world_size), key=lambda r: (load[r], len(parts[r]), r))
        parts[rank].append(position)
        load[rank] += tokens[position]
    return [sorted(p) for p in parts]
