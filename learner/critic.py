"""The critic of PPO with GAE (`learner.advantage.estimator=gae`): a value model beside the policy
in every learner rank, sharded the same way, trained on the same minibatches.

A step with a critic (`learner.trainer.Learner.train_step`):
  1. the critic's values V(s_t) of every response token of the rank's shard (one no-grad pass, the
     policy's micro-batch plan), gathered over the ranks into the whole batch's [B, T];
  2. GAE on the whole batch (`learner.advantages.gae_advantages_and_returns`): the policy's
     advantages, whitened over the batch, and the returns R_t = A_t + V(s_t) the critic learns;
  3. for every minibatch of every epoch the policy updates on: the critic's clipped value loss
     (`learner.losses.value_loss`, normalised by the whole minibatch's counts over the ranks, as
     the policy loss is), one optimizer step; its learning rate warms up, then stays constant.

The critic is not published: engines sample from the policy alone. Its model and optimizer are in
the learner's sharded checkpoints (`learner.checkpoint`), so a resumed run continues it exactly.
"""
from __future__ import annotations

from collections import defaultdict
from typing import Optional

import torch
from pydantic import BaseModel, ConfigDict, Field

from learner.losses import LossAggMode, count_tokens_and_sequences, value_loss
from learner.optimizer import adamw_with_schedule, clip_and_step
from lm.value_model import load_value_model, response_values, value_model_on_meta, value_model_source


class CriticConfig(BaseModel):
    """verl's critic options under its names (critic.optim.lr, critic.cliprange_value, ...); the
    minibatches, epochs, micro-batch budget and data parallelism are the policy's."""

    model_config = ConfigDict(extra="forbid")

    model_path: Optional[str] = Field(
        None, description="HF folder whose decoder the value model starts from (None: the policy's); its value "
        "head starts fresh")
    lr: float = Field(1e-5, gt=0, description="AdamW's learning rate (verl's critic.optim.lr)")
    weight_decay: float = Field(0.01, ge=0)
    warmup_steps: int = Field(0, ge=0, description="linear warm-up of the lr over this many learner steps")
    grad_clip: Optional[float] = Field(1.0, gt=0, description="max global grad norm (None: no clipping)")
    cliprange_value: float = Field(
        0.5, gt=0, description="a value prediction moves at most this far from the step's starting value before "
        "its loss stops pulling it further (verl's critic.cliprange_value)")
    train_alone_steps: int = Field(
        0, ge=0, description="the first N learner steps train the critic alone (verl's trainer.critic_warmup): the "
        "policy's weights and lr schedule wait while a fresh value head learns the returns, so its noise does not "
        "steer the first policy updates; the version still goes up each step")
    loss_agg_mode: Optional[LossAggMode] = Field(
        None, description="how the value loss is averaged (None: the policy loss's loss_agg_mode)")


class Critic:
    """The value model, its optimizer and scheduler on one learner rank. `owner` is the rank's
    `Learner`: the critic builds, plans micro-batches and casts as the policy does."""

    def __init__(self, owner):
        self.owner = owner
        cfg, critic = owner.config, owner.config.critic
        self.config = critic
        path = critic.model_path or cfg.model_path
        self.model = owner.build_model(
            load=lambda device: load_value_model(path, cfg.dtype, device, cfg.attn_implementation, cfg.seed),
            on_meta=lambda: value_model_on_meta(path, cfg.dtype, cfg.attn_implementation),
            source=lambda shapes: value_model_source(path, shapes, cfg.dtype, cfg.seed),
            trainable=True)
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer, self.scheduler = adamw_with_schedule(self.params, critic.lr, cfg.betas, cfg.adam_eps,
                                                             critic.weight_decay, critic.warmup_steps)
        self.loss_agg_mode = critic.loss_agg_mode or cfg.policy_loss.loss_agg_mode

    def _forward(self, mb) -> torch.Tensor:
        owner = self.owner
        with owner._autocast():
            return response_values(self.model, mb.prompts, mb.responses, owner.config.pad_token_id, owner.packing,
                                   owner.pack_width(mb.sequence_lengths()))

    def _idle_pass(self, grad: bool) -> None:
        """A rank with no rows in a micro-batch slot still joins FSDP's gathers (and reductions)."""
        self.owner._idle_pass(grad, run=lambda prompts, responses: response_values(self.model, prompts, responses))

    def values(self, batch) -> torch.Tensor:
        """[rows, T] values of every response token of `batch` (no grad), micro-batch by micro-batch."""
        out = torch.zeros(batch.response_mask.shape, dtype=self.owner._log_prob_dtype, device=self.owner.device)
        with torch.no_grad():
            for rows in self.owner._micro_batches(batch, list(range(len(batch)))):
                if not rows:
                    self._idle_pass(grad=False)
                    continue
                values = self._forward(batch.select(rows))
                out[rows, : values.shape[1]] = values.to(out.dtype)
        return out

    def update(self, shard, old_values: torch.Tensor, returns: torch.Tensor, local: list[int],
               partial: dict[str, list[float]]) -> float:
        """One optimizer step on this rank's rows `local` of a minibatch (shard rows, as the policy's
        minibatch): the value loss normalised by the minibatch's counts over all ranks, gradients
        summed over ranks, clipped. Adds this rank's share of the minibatch's critic/vf_loss,
        vf_clipfrac and vpred_mean to `partial`; returns the gradient norm (inf: a non-finite
        gradient, the step skipped)."""
        comm = self.owner.comm
        tokens, seqs = count_tokens_and_sequences(shard.response_mask[local])
        counts = comm.all_reduce_sum(torch.tensor([tokens, seqs], dtype=torch.float64))
        global_tokens, global_seqs = counts.tolist()
        self.optimizer.zero_grad(set_to_none=True)
        sums: dict[str, float] = defaultdict(float)
        for rows in self.owner._micro_batches(shard, local):
            if not rows:
                self._idle_pass(grad=True)
                continue
            mb = shard.select(rows)
            width = mb.response_mask.shape[1]
            predicted = self._forward(mb)
            loss, clipfrac = value_loss(predicted, old_values[rows, :width].to(predicted.dtype),
                                        returns[rows, :width].to(predicted.dtype), mb.response_mask,
                                        self.config.cliprange_value, self.loss_agg_mode, global_tokens, global_seqs)
            # FSDP averages gradients over ranks; the loss is this rank's share of a sum
            (loss * comm.world_size if self.owner._sharded else loss).backward()
            mask = mb.response_mask.bool()
            share = float(mask.sum()) / max(global_tokens, 1.0)
            sums["critic/vf_loss"] += float(loss.detach())
            sums["critic/vf_clipfrac"] += float(clipfrac) * share
            sums["critic/vpred_mean"] += float(predicted.detach()[mask].double().mean()) * share if mask.any() else 0.0
        comm.sum_gradients(self.params)
        for key, value in sums.items():
            partial[key].append(value)
        return clip_and_step(self.params, self.optimizer, self.config.grad_clip)


def value_metrics(values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor) -> dict[str, float]:
    """verl's critic/values/{mean,max,min}, critic/returns/{mean,max,min} and critic/vf_explained_var
    (1 − Var(R − V) / Var(R), how much of the returns' spread the values foresee) over the batch's
    policy tokens."""
    mask = mask.bool()
    v, r = values[mask].double(), returns[mask].double()
    if v.numel() < 2:
        return {}
    return {"critic/values/mean": float(v.mean()), "critic/values/max": float(v.max()),
            "critic/values/min": float(v.min()), "critic/returns/mean": float(r.mean()),
            "critic/returns/max": float(r.max()), "critic/returns/min": float(r.min()),
            "critic/vf_explained_var": float(1.0 - (r - v).var() / (r.var() + 1e-5))}
