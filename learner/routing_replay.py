"""MoE routing replay (`learner.routing_replay`: none | r2 | r3) and the routing-mismatch metric.

Source 4 of the off-policy mismatch (shared/reference/offpolicy_corrections_five_sources.md): an MoE
learner may send a token through other experts than the engine did, or than it did itself at the
proximal pass, which moves the IS ratios without any weight change. Replay fixes the experts:

- r3 (rollout routing replay): every pass of the step (proximal and update) uses the engine's
  experts (`Sample.routed_experts`) for the positions that sampled policy tokens;
- r2 (vanilla routing replay): the proximal pass records the learner's own experts at every
  position of each sequence, prompt and response (a prompt token routed elsewhere changes what
  the response attends to), and the update passes of the same step use them, as Megatron's
  router replay records and replays every token;
- none: the learner routes freely.

Forcing keeps the gate differentiable: the learner's router still computes its logits, and the
gate weights are what it computes at the forced experts (`lm.moe.replayed_gate`: the softmax
probabilities, renormalised when the router renormalises; DeepSeek-V3's scaled sigmoids), as the
reference and verl define R3. Under r3 prompt positions
and tool tokens are not forced: the engine reports routing for the positions that sampled.
r2's recording is kept on the host, compact (uint8 up to 256 experts).

Positions: row t of a sample's routing belongs to the forward position that sampled response token
t, i.e. input position (prompt length - 1 + t); in a padded micro-batch that is row x width +
position of the router's flattened input, in a packed one the row's start + position
(`lm.causal_lm.pad_sequences` / `pack_sequences` lay the tokens out the same way).

`moe/routing_mismatch` is the fraction of (policy token, MoE layer) pairs whose top-k set differs
between the engine and the learner's router at the proximal pass (under r3 the learner's router
given the replayed experts of the layers below); `moe/routing_mismatch_any` the fraction of
tokens that differ in at least one layer; `moe/routing_mismatch/layer_<l>` per layer.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch

from learner.batch import BatchError
from lm.moe import ROUTER_GATES, RoutingShape, other_routers, replayed_gate, routers, routing_shape

MODES = ("none", "r2", "r3")


@dataclass
class _Plan:
    """What the routers do in one forward pass: force `forced` [F, layers, k] at the flattened
    token positions `force_at` [F]; record their own top-k at every position when `record`.
    `positions` [N]: the positions that sampled response tokens; `sequence` [S]: every token's."""

    positions: torch.Tensor
    sequence: torch.Tensor
    lengths: list[int]
    force_at: torch.Tensor | None = None
    forced: torch.Tensor | None = None
    record: bool = False
    recorded: dict[int, torch.Tensor] = field(default_factory=dict)

    def _recorded(self) -> torch.Tensor:
        return torch.stack([self.recorded[layer] for layer in sorted(self.recorded)], dim=1)

    def own_routing(self) -> torch.Tensor:
        """[N, layers, k] the routers' own top-k at `positions` (after a recording pass)."""
        return self._recorded()[self.positions]

    def sequence_routing(self, num_experts: int) -> list[torch.Tensor]:
        """Per row, [prompt + response tokens, layers, k] the routers' own top-k at every position
        (after a recording pass), on the host in the smallest dtype that holds an expert id."""
        dtype = torch.uint8 if num_experts <= 256 else torch.int16
        return list(self._recorded()[self.sequence].to("cpu", dtype).split(self.lengths))


def sequence_positions(lengths: list[int], packed: bool) -> torch.Tensor:
    """The flattened input position of every token of every row, rows in order."""
    n = torch.tensor(lengths, dtype=torch.long)
    starts = torch.cumsum(n, 0) - n
    cols = torch.arange(int(n.sum())) - torch.repeat_interleave(starts, n)
    base = starts if packed else torch.arange(len(n)) * int(n.max())
    return torch.repeat_interleave(base, n) + cols


def predicting_positions(prompt_lengths: list[int], response_lengths: list[int], packed: bool):
    """(row, response column, flattened input position) of the position that sampled each response
    token, rows in order, columns ascending: the order of a [rows, T] tensor's real entries."""
    p_len = torch.tensor(prompt_lengths, dtype=torch.long)
    r_len = torch.tensor(response_lengths, dtype=torch.long)
    rows = torch.repeat_interleave(torch.arange(len(p_len)), r_len)
    cols = torch.arange(int(r_len.sum())) - torch.repeat_interleave(torch.cumsum(r_len, 0) - r_len, r_len)
    position = torch.repeat_interleave(p_len - 1, r_len) + cols
    lengths = p_len + r_len
    if packed:
        starts = torch.cumsum(lengths, 0) - lengths
        return rows, cols, starts[rows] + position
    return rows, cols, rows * int(lengths.max()) + position


class RoutingReplay:
    """Hooks on the policy's routers that force or record experts while a plan is active (between
    `plan()`'s enter and exit: keep it open through the backward pass, which re-runs the routers
    under gradient checkpointing). A dense policy has no routers and `mode` must be none."""

    def __init__(self, model: torch.nn.Module, mode: str = "none") -> None:
        if mode not in MODES:
            raise ValueError(f"routing_replay must be one of {MODES}, got {mode!r}")
        self.mode = mode
        self.routers = routers(model)
        self.shape: RoutingShape | None = routing_shape(model)
        others = other_routers(model)
        if mode != "none" and (self.shape is None or others):
            what = (f"its routers {others} are not ones it replays (known: {', '.join(ROUTER_GATES)})"
                    if others else f"{type(model).__name__} has no top-k routers")
            raise ValueError(f"learner.routing_replay={mode!r} needs a mixture-of-experts policy; {what}")
        self._plan: _Plan | None = None
        self._handles = [router.register_forward_hook(self._hook(i, router)) for i, router in enumerate(self.routers)]

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def _hook(self, layer: int, router):
        def hook(_module, _args, output):
            plan = self._plan
            if plan is None:
                return None
            logits, scores, ids = output
            if plan.record:
                plan.recorded[layer] = ids.detach()
            if plan.force_at is None or not len(plan.force_at):
                return None
            at, want = plan.force_at, plan.forced[:, layer].to(ids.dtype)
            gate = replayed_gate(router, logits[at], want)
            ids = ids.index_put((at,), want)
            scores = scores.index_put((at,), gate.to(scores.dtype))
            return logits, scores, ids
        return hook

    @contextlib.contextmanager
    def plan(self, prompts, responses, packed: bool, device, forced: torch.Tensor | None = None,
             force_mask: torch.Tensor | None = None, record: bool = False,
             replayed: list[torch.Tensor] | None = None):
        """For the forward (and backward) passes inside: force `forced` [rows, T, layers, k] at the
        positions that sampled response tokens where `force_mask` [rows, T] is true (r3), or
        `replayed` (per row [prompt + response, layers, k]) at every position (r2), and/or record
        the routers' own top-k. Yields the plan (`own_routing()`, `sequence_routing()` after a
        recording pass) or None for a dense model."""
        if not self.routers or (forced is None and replayed is None and not record):
            yield None
            return
        lengths = [len(p) + len(r) for p, r in zip(prompts, responses)]
        rows, cols, flat = predicting_positions([len(p) for p in prompts], [len(r) for r in responses], packed)
        plan = _Plan(positions=flat.to(device), sequence=sequence_positions(lengths, packed).to(device),
                     lengths=lengths, record=record)
        if replayed is not None:
            got = [len(r) for r in replayed]
            if got != lengths:
                raise ValueError(f"replayed routing covers {got} tokens per row, the rows have {lengths}")
            plan.force_at = plan.sequence
            plan.forced = torch.cat(replayed).to(device, torch.long)
        elif forced is not None:
            chosen = force_mask[rows, cols].to(torch.bool).cpu()
            plan.force_at = flat[chosen].to(device)
            plan.forced = forced[rows.to(forced.device), cols.to(forced.device)][chosen.to(forced.device)].to(
                device, torch.long)
        self._plan = plan
        try:
            yield plan
        finally:
            self._plan = None


def require_routing(groups, mode: str) -> None:
    """r3 replays the engine's routing: every sample with response tokens must carry it (a batch
    without is refused, naming the sample: the run goes on, `services.controller`)."""
    if mode != "r3":
        return
    for group in groups:
        for sample in getattr(group, "samples", ()):
            if sample.routed_experts is None and len(sample.response_ids):
                raise BatchError(f"sample {sample.sample_id!r} carries no routing (routed_experts), which "
                                 f"learner.routing_replay='r3' replays: its engine must return its experts (the "
                                 f"transformers engine does; vLLM with rollout.engine.return_routing, GPUs only)")


class MismatchCounts:
    """Per shard row: policy tokens compared, and of them those whose top-k set differs from the
    engine's, per layer and in any layer; summed over the rows a rank answers for, then the ranks."""

    def __init__(self, rows: int, layers: int) -> None:
        self.tokens = torch.zeros(rows, dtype=torch.float64)
        self.differ = torch.zeros(rows, layers, dtype=torch.float64)
        self.differ_any = torch.zeros(rows, dtype=torch.float64)

    def add(self, shard_rows: list[int], mb_forced: torch.Tensor, mb_mask: torch.Tensor, plan: _Plan,
            response_lengths: list[int]) -> None:
        """One micro-batch: its rows' engine routing `mb_forced` [rows, T, L, k] and policy-token mask."""
        rows = torch.repeat_interleave(torch.arange(len(response_lengths)), torch.tensor(response_lengths))
        cols = torch.cat([torch.arange(n) for n in response_lengths])
        mask = mb_mask[rows, cols].cpu() > 0
        engine = mb_forced[rows, cols].cpu().long().sort(-1).values
        own = plan.own_routing().cpu().long().sort(-1).values
        differ = (engine != own).any(-1) & mask[:, None]  # [N, L]
        where = torch.tensor(shard_rows)[rows]
        self.tokens.index_add_(0, where, mask.double())
        self.differ.index_add_(0, where, differ.double())
        self.differ_any.index_add_(0, where, differ.any(-1).double())

    def metrics(self, owned: list[int], all_reduce_sum) -> dict[str, float]:
        sums = torch.cat([self.tokens[owned].sum()[None], self.differ_any[owned].sum()[None],
                          self.differ[owned].sum(0)])
        sums = all_reduce_sum(sums)
        tokens, layers = float(sums[0]), sums[2:]
        if tokens == 0:
            return {}
        out = {"moe/routing_mismatch": float(layers.sum()) / (tokens * len(layers)),
               "moe/routing_mismatch_any": float(sums[1]) / tokens}
        out.update({f"moe/routing_mismatch/layer_{i}": float(v) / tokens for i, v in enumerate(layers)})
        return out
