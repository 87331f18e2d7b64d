"""The learner: one training step over a pulled batch, weight publication, checkpoints.

A step (`Learner.train_step`):
  1. validate and pad the groups (`learner.batch`), compute advantages over the whole batch;
  2. proximal log-probs π_old: decoupled mode recomputes them with the current weights in one
     no-grad pass (`prox_logp: recompute`) or approximates them per minibatch from the behaviour
     and current log-probs (`prox_logp: loglinear`, AReaL); bypass mode uses μ itself;
  3. rollout correction (IS weights, rejection, veto) and the policy loss, for `ppo_epochs` over
     minibatches, each loss normalised by the token/sequence counts of the whole minibatch over
     all ranks (and batch-normalised IS weights by the whole batch's factor), so micro-batching
     and data parallelism do not change the update;
  4. one optimizer step per minibatch (gradients summed over ranks, clipped), one scheduler step
     per learner step, and the version goes up by one.
With a critic (`advantage.estimator: gae`, learner/critic.py) the advantages are GAE over its
values, and it takes its own step per minibatch before the policy's.

Memory follows the token budget, not the batch: every pass (proximal, reference, update) runs in
micro-batches of at most `max_tokens_per_micro_batch` padded tokens (`learner.batch.
plan_micro_batches`, rows of similar length together), and log-probs come from a chunked LM head
(`lm.causal_lm.response_log_probs`) that never holds [rows, length, vocab] logits.

The three log-probs keep the names of DESIGN.md: `rollout_log_prob` (μ), `old_log_prob` (π_old),
`log_prob` (π_θ). This is a plain class; services makes it a Ray actor.
"""
from __future__ import annotations

import contextlib
import copy
import functools
import logging
import math
import time
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch

from learner.advantages import (
    OTB_ESTIMATORS,
    adaptive_kl_coef,
    compute_advantages,
    gae_advantages_and_returns,
    kl_penalised_rewards,
    token_level_rewards,
)
from learner.batch import (
    TrainBatch,
    balance_groups,
    build_batch,
    padding_counts,
    plan_micro_batches,
    reward_baselines,
    reward_components,
    shape_bucket,
)
from learner.checkpoint import (  # noqa: F401 (the part names: services.checkpoint checks they agree)
    ADAPTER_DIR,
    POLICY_DIR,
    TRAINER_STATE_FILE,
    load_training_state,
    read_policy_weights,
    read_trainer_file,
    save_training_state,
    write_adapter,
    write_policy,
)
from learner.config import LearnerConfig
from learner.correction import compute_rollout_correction, is_batch_norm_sums, to_floats
from learner.critic import Critic, value_metrics
from learner.distributed import (
    FullWeightBuckets,
    LocalComm,
    PeakRSS,
    fill_shards,
    shard_model,
    unique_state_names,
)
from learner.lora import LoraAdapters
from learner.losses import compute_policy_loss, count_tokens_and_sequences, kl_penalty, staleness_metrics
from learner.optimizer import adamw_with_schedule, clip_and_step, load_schedule
from learner.routing_replay import MismatchCounts, RoutingReplay, require_routing
from lm.causal_lm import (
    causal_lm_on_meta,
    checkpoint_tensors,
    enable_gradient_checkpointing,
    load_causal_lm,
    response_log_probs,
    torch_dtype,
)
from lm.checkpoint_names import expert_naming, to_checkpoint_names
from lm.device import gpu_memory_peaks
from lm.lora_weights import is_adapter_name
from lm.weight_sync import (
    BroadcastSender,
    FolderSender,
    ObjectStoreSender,
    ParameterGuard,
    Publication,
    WeightStore,
)
from lm.weight_sync.layout import BucketStream, Layout

log = logging.getLogger(__name__)

# Loss-side metrics that are sums over the minibatch (each micro-batch adds its share).
_ADDITIVE_METRICS = frozenset({"actor/pg_loss", "actor/entropy", "actor/kl_loss"})


def loglinear_prox_log_prob(rollout_log_prob: torch.Tensor, log_prob: torch.Tensor,
                            token_versions: torch.Tensor, version: int) -> torch.Tensor:
    """AReaL's log-linear approximation of the proximal policy (`prox_logp_method: loglinear`,
    inclusionAI/AReaL docs/algorithms/prox_approx.md):
        α = (v_prox − v_behave) / (v_θ − v_behave),  log π_prox ≈ log π_behave + α (log π_θ − log π_behave)
    with v_behave the version that sampled each token, v_prox = the learner's version at the
    start of the step (the weights a recompute pass would use) and v_θ = v_prox + 1 (the version
    this step produces). A token sampled by the current weights gets α = 0 (π_prox = μ); an older
    one moves toward π_θ. log π_θ is detached: π_prox is a fixed anchor, not a path for gradients."""
    staleness = (version - token_versions).clamp(min=0).to(log_prob.dtype)
    alpha = staleness / (staleness + 1.0)
    return rollout_log_prob + alpha * (log_prob.detach() - rollout_log_prob)


def proximal_log_prob(mode: str, log_prob: torch.Tensor, rollout_log_prob: torch.Tensor,
                      token_versions: torch.Tensor, version: int,
                      recomputed: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """π_old of one micro-batch, by `LearnerConfig.prox_mode`: `recompute` -> the slice of the
    step's no-grad pass; `loglinear` -> AReaL's interpolation from μ toward π_θ; `bypass` -> None
    (the loss anchors on μ itself)."""
    if mode == "recompute":
        if recomputed is None:
            raise ValueError("prox mode 'recompute' needs the recomputed proximal log-probs")
        return recomputed
    if mode == "loglinear":
        return loglinear_prox_log_prob(rollout_log_prob, log_prob, token_versions, version)
    if mode == "bypass":
        return None
    raise ValueError(f"prox mode must be 'recompute', 'loglinear' or 'bypass', got {mode!r}")


@dataclass
class StepInputs:
    """What a step computes once for all its minibatches, on this rank's shard (row i of every
    tensor is shard row i, padded to the shard's longest response)."""

    shard: TrainBatch
    loss_mask: torch.Tensor  # recompute mode: after rejection; otherwise the response mask
    old_log_prob: Optional[torch.Tensor] = None  # recompute mode
    is_weights: Optional[torch.Tensor] = None  # recompute mode, when rollout_is is set
    sum_pi_squared: Optional[torch.Tensor] = None  # π_old's Σ_v p_v² per token: optimal_token_baseline
    prox_from_update: bool = False  # π_old and the IS weights are filled in by the update pass itself
    ref_log_prob: Optional[torch.Tensor] = None  # a KL penalty (in the loss or the reward)
    advantages: Optional[torch.Tensor] = None  # set once π_old and π_ref are known (a KL penalty in the reward)
    values: Optional[torch.Tensor] = None  # gae: the critic's values at the step's start
    returns: Optional[torch.Tensor] = None  # gae: what the critic learns
    # the loss's random choices (clip_cov), seeded by the version and rank: a resumed run repeats them
    loss_generator: Optional[torch.Generator] = None


@contextlib.contextmanager
def _timed(timing: dict, key: str):
    # GPU kernels run after the Python that queued them returns: a section's time is taken
    # once its kernels are done, not charged to the next section that waits for them. This
    # thread's stream only: a weight send on its own streams (vLLM's NCCL) is not waited for.
    synchronize = (lambda: torch.cuda.current_stream().synchronize()) if torch.cuda.is_initialized() \
        else (lambda: None)
    synchronize()
    start = time.perf_counter()
    try:
        yield
    finally:
        synchronize()
        timing[key] = timing.get(key, 0.0) + time.perf_counter() - start


class Learner:
    def __init__(self, config: LearnerConfig, comm=None, version: int = 0):
        self.config = config
        self.comm = comm or LocalComm()
        self.device = self._device()
        # learner.packing auto: packed on a GPU (or for varlen, which needs it); a CPU's sdpa over a
        # packed row's block-diagonal mask costs more than the padding it saves
        self.packing = config.packing if isinstance(config.packing, bool) else \
            self.device.type == "cuda" or config.attn_implementation == "varlen"
        torch.manual_seed(config.seed)
        self.load_report: dict[str, float] = {}  # host memory the policy's load added (sharded: per rank)
        self.adapters: LoraAdapters | None = None  # learner.lora: set as the policy is built
        self.model = self._build_model(trainable=True)
        # MoE: hooks on the policy's routers (learner.routing_replay), idle unless a pass plans replay
        self.routing = RoutingReplay(self.model, config.routing_replay)
        self._vocab_size = self.model.get_input_embeddings().num_embeddings  # build_batch refuses ids beyond it
        self._log_prob_dtype = torch.promote_types(torch_dtype(config.dtype), torch.float32)
        self._slots = torch.zeros(2, dtype=torch.float64)
        self._group_tokens: list[int] = []  # the current batch's tokens per group (set by train_step)
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer, self.scheduler = adamw_with_schedule(
            self.params, config.lr, config.betas, config.adam_eps, config.weight_decay, config.warmup_steps,
            config.lr_schedule, config.total_steps, config.min_lr_ratio)
        self.version = int(version)
        self.drift_probe = self._drift_probe()
        self.weight_guard = ParameterGuard()
        self.publication: Publication | None = None  # rank 0, once a board is attached
        # The KL penalty's reference (in the loss, in the reward or both): the initial policy, frozen.
        # With LoRA it is the policy with its adapters off (`_reference_log_probs`): no second model.
        self.ref_model = None
        if self._uses_reference() and self.adapters is None:
            self.ref_model = self._build_model(trainable=False)
        self.kl_reward_coef = config.kl_in_reward.coef  # β of the reward's KL penalty (adaptive: it moves)
        # PPO with GAE: a value model beside the policy, sharded and trained the same way
        self.critic = Critic(self) if config.advantage.estimator == "gae" else None

    # ------------------------------------------------------------------ set-up

    def _device(self) -> torch.device:
        """The GPU Ray assigned to this rank, or the CPU (`lm.device.resolve_device`)."""
        from lm.device import resolve_device

        device = resolve_device(self.config.device, f"learner rank {self.comm.rank}")
        if device.type == "cuda":
            torch.cuda.set_device(device)
        return device

    def _drift_probe(self):
        """The exact drift probe (`diagnostics.exact_drift_every`), on rank 0 in recompute mode."""
        diag = self.config.diagnostics
        if diag.exact_drift_every is None or self.config.prox_mode != "recompute" or self.comm.rank != 0:
            return None
        from learner.drift import ExactDriftProbe

        return ExactDriftProbe(self.config.model_path, self.config.dtype, diag.keep_versions, diag.exact_drift_every,
                               diag.exact_drift_rows, self.config.temperature, self.config.pad_token_id)

    def _build_model(self, trainable: bool):
        """The policy (or, not `trainable`, the frozen KL reference) on this rank (`build_model`),
        the policy with its LoRA adapters where `learner.lora` asks for them."""
        cfg = self.config
        return self.build_model(
            load=lambda device: load_causal_lm(cfg.model_path, dtype=cfg.dtype, device=device,
                                               attn_implementation=cfg.attn_implementation),
            on_meta=lambda: causal_lm_on_meta(cfg.model_path, cfg.dtype, cfg.attn_implementation),
            source=lambda shapes: checkpoint_tensors(cfg.model_path, shapes), trainable=trainable,
            adapt=self._add_adapters if trainable and cfg.lora is not None else None)

    def _add_adapters(self, model) -> None:
        self.adapters = LoraAdapters(model, self.config.lora, self.config.seed)

    def build_model(self, load, on_meta, source, trainable: bool, adapt=None):
        """A model of this rank (the policy, its reference, the critic): `load(device)` loads it whole,
        `on_meta()` builds it without values, `source(shapes)` reads the folder's tensors by the
        model's names (`shapes`: name -> shape; None: the folder does not hold them). Without FSDP a
        full copy per rank. With FSDP sharded from the first byte: every rank builds it on the meta
        device and shards it, rank 0 alone reads the folder and sends each rank its shards
        (`learner.distributed.fill_shards`), tensor by tensor from the safetensors files where they
        hold every tensor (a fused MoE expert tensor put together from its experts' matrices; no
        rank holds the model on the host), else from the model loaded whole on rank 0 (one copy per
        node). `adapt(model)` adds to the model before it is sharded (LoRA's adapters, which start
        from their own values, not the folder's)."""
        if not self._sharded:
            return self._prepare(load(str(self.device)), trainable, adapt)
        model = self._prepare(on_meta(), trainable, adapt)  # no values: ~0 bytes
        tensors, whole = None, 0.0
        if self.comm.rank == 0:
            state = model.state_dict()
            tensors = source({name: tuple(state[name].shape) for name in unique_state_names(model)
                              if not is_adapter_name(name)})
            whole = float(tensors is None)
        # measured from here: the first build also imported transformers' model code (~200 MB)
        with PeakRSS() as peak:
            model = shard_model(model, self.config.mixed_precision)
            if whole:
                tensors = load("cpu").state_dict()
            if tensors is not None and adapt is not None:  # rank 0 sends the adapters' start with the rest
                tensors = self.adapters.with_initial_values(tensors)
            fill_shards(model, tensors, self.device)
            del tensors
        if trainable and not self.load_report:  # the policy's, built first
            self.load_report = {"peak_host_bytes": float(peak.peak_bytes), "source_reads": float(self.comm.rank == 0),
                                "whole_model_read": whole}
        return model

    def _prepare(self, model, trainable: bool, adapt=None):
        model.config.use_cache = False
        if adapt is not None:
            adapt(model)
        # Dropout off for good: the proximal pass, the update and the sampler must see one policy.
        model.eval()
        if not trainable:
            return model.requires_grad_(False)
        if self.config.gradient_checkpointing:
            enable_gradient_checkpointing(model, "selective" if self.config.gradient_checkpointing == "selective"
                                          else "full")
        return model

    # ------------------------------------------------------------------ the step

    def train_step(self, groups) -> dict[str, float]:
        """Train on the pulled groups (every rank receives all of them) and bump the version.
        Returns plain floats under verl's metric names."""
        cfg = self.config
        timing: dict[str, float] = {}
        step_start = time.perf_counter()
        self._remember_version()
        self._slots = torch.zeros(2, dtype=torch.float64)  # (real tokens, padded slots) of this step's passes

        # 1. Validate and pad the groups.
        groups = list(groups)
        require_routing(groups, cfg.routing_replay)
        baselines = reward_baselines(groups) if cfg.advantage.estimator == "remax" else None
        batch = build_batch(groups, learner_version=self.version, vocab_size=self._vocab_size,
                            routing_shape=self.routing.shape)
        self._check_budget(batch)
        self._group_tokens = batch.group_tokens()  # balances the ranks' shares (_my_part)
        minibatches = self._minibatch_groups(batch.num_groups)
        shard_rows = batch.rows_of_groups(  # every group this rank trains on, in any epoch
            [g for epoch in minibatches for mb in epoch for g in self._my_part(mb)])
        shard = batch.select(shard_rows).to(self.device)
        row_of = {row: i for i, row in enumerate(shard_rows)}
        # The rows this rank answers for in batch-wide sums: its part of the first epoch (the
        # ranks' parts are disjoint and cover the batch; later epochs may reshuffle).
        owned = [row_of[r] for r in batch.rows_of_groups([g for mb in minibatches[0] for g in self._my_part(mb)])]
        inputs = StepInputs(shard=shard, loss_mask=shard.response_mask, loss_generator=torch.Generator().manual_seed(
            (cfg.seed * 1_000_003 + self.version) * 1_009 + self.comm.rank))

        # 2. π_old and the correction that does not depend on θ: once per step, on this rank's shard;
        # the gap between μ and π_old by staleness (learner/drift.py) from the same numbers.
        shard_stats: dict[str, float] = {}
        drift: dict[str, float] = {}
        routing: dict[str, float] = {}
        inputs.prox_from_update = self._prox_from_update(minibatches)
        with _timed(timing, "timing_s/old_log_prob"):
            if inputs.prox_from_update:  # filled micro-batch by micro-batch in the update pass
                inputs.old_log_prob = torch.zeros(shard.response_mask.shape, dtype=self._log_prob_dtype,
                                                  device=self.device)
                if cfg.rollout_correction.rollout_is is not None:
                    inputs.is_weights = torch.zeros_like(inputs.old_log_prob)
            elif cfg.prox_mode == "recompute" or cfg.routing_replay == "r2":
                # the proximal pass; r2 runs it without recompute too: it records the routing to replay
                old_log_prob, routing, inputs.sum_pi_squared = self._proximal_pass(
                    shard, owned, with_sum_pi_squared=cfg.advantage.estimator in OTB_ESTIMATORS)
                if cfg.prox_mode == "recompute":
                    inputs.old_log_prob = old_log_prob
                    inputs.is_weights, inputs.loss_mask, shard_stats = self._step_correction(
                        shard, inputs.old_log_prob, owned)
                    drift = self._drift(shard, inputs.old_log_prob, owned)
        if self.drift_probe is not None and self.drift_probe.due(self.version):
            with _timed(timing, "timing_s/exact_drift_probe"):
                drift.update(self.drift_probe.measure(shard, inputs.old_log_prob, owned, self.version))
        if self._uses_reference():
            with _timed(timing, "timing_s/ref"):
                inputs.ref_log_prob = self._reference_log_probs(shard)

        # 2b. Advantages over the whole batch (every rank the same), the reward's KL penalty first.
        rewards, token_rewards, kl_reward, critic_metrics = batch.rewards, batch.token_rewards, {}, {}
        if cfg.kl_in_reward.coef > 0:
            rewards, token_rewards, kl_reward = self._kl_penalised_rewards(batch, inputs, shard_rows, owned)
        components = reward_components(groups, cfg.advantage.gdpo_reward_keys) \
            if cfg.advantage.estimator == "gdpo" else None
        if self.critic is not None:  # GAE from the critic's values, over the whole batch
            with _timed(timing, "timing_s/values"):
                inputs.values = self.critic.values(shard)
            values = self._whole_batch(batch.response_mask.shape, inputs.values, shard_rows, owned)
            advantages, returns = gae_advantages_and_returns(
                token_level_rewards(rewards, batch.response_mask, token_rewards), values, batch.response_mask,
                cfg.advantage.gamma, cfg.advantage.lam)
            width = shard.response_mask.shape[1]
            inputs.advantages = advantages[shard_rows, :width].to(self.device)
            inputs.returns = returns[shard_rows, :width].to(self.device)
            critic_metrics = value_metrics(values, returns, batch.response_mask)
        elif cfg.advantage.estimator in OTB_ESTIMATORS:
            # per-token baselines from π_old, known on this rank's shard only: its groups are whole
            width = shard.response_mask.shape[1]
            inputs.advantages = compute_advantages(
                rewards[shard_rows].to(self.device), shard.group_index, shard.response_mask, cfg.advantage,
                None if token_rewards is None else token_rewards[shard_rows, :width].to(self.device),
                old_log_probs=inputs.old_log_prob, sum_pi_squared=inputs.sum_pi_squared, is_weights=inputs.is_weights)
        else:
            advantages = compute_advantages(rewards, batch.group_index, batch.response_mask, cfg.advantage,
                                            token_rewards, components, reward_baselines=baselines)
            inputs.advantages = advantages[shard_rows, : shard.response_mask.shape[1]].to(self.device)

        # 3-4. Per minibatch: the loss in token-budget micro-batches, normalised by the whole
        # minibatch's counts over all ranks, then one optimizer step.
        lr = self.optimizer.param_groups[0]["lr"]
        partial: dict[str, list[float]] = defaultdict(list)
        if self.critic is not None:  # the critic first, as verl does (the two models do not meet)
            critic_metrics.update(self._update_critic(inputs, minibatches, batch, row_of, partial, timing))
        grad_norms = []
        if self._policy_trains():
            with _timed(timing, "timing_s/update_actor"):
                for epoch in minibatches:
                    for mb_groups in epoch:
                        local = [row_of[r] for r in batch.rows_of_groups(self._my_part(mb_groups))]
                        grad_norms.append(self._minibatch_update(inputs, local, partial))
            self.scheduler.step()
        if inputs.prox_from_update:  # the metrics of π_old, now that the update pass has given it
            _, _, shard_stats = self._step_correction(shard, inputs.old_log_prob, owned)
            drift = self._drift(shard, inputs.old_log_prob, owned)
        self.version += 1

        metrics = self._combine(partial, sum(len(epoch) for epoch in minibatches), shard_stats, timing)
        metrics.update(self._batch_metrics(batch))
        metrics.update(drift)
        metrics.update(routing)
        metrics.update(kl_reward)
        metrics.update(self._advantage_metrics(inputs.advantages, shard.response_mask, owned))
        if baselines is not None:
            metrics["critic/reward_baseline/mean"] = float(baselines.mean())  # the greedy responses' reward
        if self.critic is not None:
            metrics.update(critic_metrics)
        tokens = self._reduce({"real": float(self._slots[0]), "slots": float(self._slots[1])}, "sum")
        metrics["perf/padding_fraction"] = 1.0 - tokens["real"] / tokens["slots"] if tokens["slots"] else 0.0
        # rank 0's, in GiB under verl's names (perf/max_memory_allocated_gb, perf/max_memory_reserved_gb)
        metrics.update({f"perf/{k}_gb": v / 2**30 for k, v in gpu_memory_peaks(self.device).items()})
        if grad_norms:
            metrics["actor/grad_norm"] = sum(grad_norms) / len(grad_norms)
        metrics["actor/optimizer_steps"] = float(len(grad_norms))
        metrics["actor/lr"] = lr
        metrics["learner/version"] = float(self.version)
        metrics["timing_s/step"] = time.perf_counter() - step_start
        return metrics

    def _policy_trains(self) -> bool:
        """False while the critic trains alone (`critic.train_alone_steps`, verl's critic_warmup): the
        policy's weights and schedule stay, the version still goes up."""
        return self.critic is None or self.version >= self.config.critic.train_alone_steps

    def _update_critic(self, inputs: StepInputs, minibatches, batch: TrainBatch, row_of: dict[int, int], partial,
                       timing: dict[str, float]) -> dict[str, float]:
        """The critic's optimizer steps, one per minibatch of every epoch (the policy's), and its
        scheduler's step; its loss metrics go into `partial` with the policy's."""
        lr = self.critic.optimizer.param_groups[0]["lr"]
        norms = []
        with _timed(timing, "timing_s/update_critic"):
            for epoch in minibatches:
                for mb_groups in epoch:
                    local = [row_of[r] for r in batch.rows_of_groups(self._my_part(mb_groups))]
                    norms.append(self.critic.update(inputs.shard, inputs.values, inputs.returns, local, partial))
        self.critic.scheduler.step()
        return {"critic/grad_norm": sum(norms) / len(norms), "critic/lr": lr}

    def _whole_batch(self, shape, rows_of_shard: torch.Tensor, shard_rows: list[int], owned: list[int]) -> torch.Tensor:
        """A per-row tensor of this rank's shard made whole: [B, T] on the host, the same on every rank
        (each rank fills the rows it answers for, one all-reduce sums them)."""
        out = torch.zeros(shape, dtype=rows_of_shard.dtype)
        out[[shard_rows[i] for i in owned], : rows_of_shard.shape[1]] = rows_of_shard[owned].cpu()
        return self.comm.all_reduce_sum(out)

    def _check_budget(self, batch: TrainBatch) -> None:
        """Every rank checks every row before any collective, so a sequence the budget cannot
        hold is an error on all ranks at once, not a rank leaving the others waiting."""
        budget = self.config.max_tokens_per_micro_batch
        lengths = batch.sequence_lengths()
        longest = max(range(len(lengths)), key=lengths.__getitem__)
        if budget is not None and lengths[longest] > budget:
            raise ValueError(f"sample {batch.sample_ids[longest]!r} has {lengths[longest]} prompt+response tokens, "
                             f"more than the micro-batch budget max_tokens_per_micro_batch={budget}: raise the "
                             f"budget to at least the longest sequence (prompt + max response tokens)")

    def _my_part(self, group_positions: list[int]) -> list[int]:
        """This rank's groups of a minibatch, the ranks' shares balanced by tokens
        (`learner.batch.balance_groups`, the same split on every rank). The loss is normalised by
        the whole minibatch's counts, so the split never changes the update."""
        if self.comm.world_size == 1:
            return list(group_positions)
        parts = balance_groups([self._group_tokens[g] for g in group_positions], self.comm.world_size)
        return [group_positions[i] for i in parts[self.comm.rank]]

    def _kl_penalised_rewards(self, batch: TrainBatch, inputs: StepInputs, shard_rows: list[int], owned: list[int]):
        """The batch's rewards less β·KL(π_old ‖ π_ref) per token (`learner.advantages.KLRewardConfig`):
        each rank scores the rows it answers for, one all-reduce gives every rank the whole batch's
        [B, T]; then β moves (adaptive), the same on every rank. π_old is the rollout policy where
        the step recomputes none (bypass, loglinear), as verl's bypass mode takes it."""
        cfg = self.config.kl_in_reward
        shard = inputs.shard
        old = inputs.old_log_prob if inputs.old_log_prob is not None else shard.rollout_log_probs
        per_token = kl_penalty(old, inputs.ref_log_prob.to(old.dtype), cfg.estimator)
        per_token = per_token * shard.response_mask.to(old.dtype)
        kl = self._whole_batch(batch.response_mask.shape, per_token, shard_rows, owned)  # on the host, as the batch
        beta = self.kl_reward_coef
        rewards, token_rewards = kl_penalised_rewards(batch.rewards, batch.response_mask.bool(), kl, beta,
                                                      batch.token_rewards)
        # verl's measure: each response's mean KL per token, averaged over the responses
        tokens = batch.response_mask.sum(-1)
        current_kl = float((kl.sum(-1) / tokens.clamp_min(1)).mean())
        self.kl_reward_coef = adaptive_kl_coef(beta, current_kl, len(batch), cfg)
        return rewards, token_rewards, {"actor/reward_kl_penalty": current_kl, "actor/reward_kl_penalty_coeff": beta}

    def _minibatch_groups(self, num_groups: int) -> list[list[list[int]]]:
        """Per epoch, the minibatches as lists of group positions. Shuffling is seeded by the
        version, so a resumed run repeats the same order. A rank may sit out a minibatch smaller
        than the world (it still joins the gradient sum, with zeros)."""
        if num_groups < self.comm.world_size:
            raise ValueError(f"a batch of {num_groups} groups cannot feed {self.comm.world_size} learner ranks "
                             f"(each rank needs at least one group)")
        # The last minibatch may be smaller (the buffer drops stale groups from a pull).
        size = self.config.ppo_mini_batch_size or num_groups
        epochs = []
        gen = torch.Generator().manual_seed(self.config.seed * 1_000_003 + self.version)
        for _ in range(self.config.ppo_epochs):
            order = list(range(num_groups))
            if self.config.shuffle_minibatches:
                order = torch.randperm(num_groups, generator=gen).tolist()
            epochs.append([order[i : i + size] for i in range(0, num_groups, size)])
        return epochs

    def _remember_version(self) -> None:
        """The exact probe (rank 0) keeps a CPU copy of the weights a version starts from when a
        later probe will score with it. Under FSDP every rank takes part (the full weights are a
        gather); else only rank 0 copies."""
        from learner.drift import keeps_version

        diag = self.config.diagnostics
        if diag.exact_drift_every is None or self.config.prox_mode != "recompute":
            return
        if self.drift_probe is None and self.config.distributed.strategy != "fsdp":
            return
        if not keeps_version(self.version, diag.exact_drift_every, diag.keep_versions):
            return
        state = self.policy_weights()
        if self.drift_probe is not None:
            self.drift_probe.remember(self.version, state)

    def _drift(self, shard: TrainBatch, old_log_prob: torch.Tensor, owned: list[int]) -> dict[str, float]:
        """The batch's drift split: per-staleness sums of the rows this rank answers for, summed
        over the ranks (`learner.drift`)."""
        from learner.drift import bucket_sums, drift_metrics

        sums = bucket_sums(old_log_prob[owned], shard.rollout_log_probs[owned], shard.token_versions[owned],
                           self.version, shard.response_mask[owned])
        return drift_metrics(self.comm.all_reduce_sum(sums))

    def _prox_from_update(self, minibatches) -> bool:
        """Whether π_old can come from the update pass (`learner.prox_from_update_pass`): one
        minibatch of one epoch (its pass runs the step's starting policy) and nothing that needs
        π_old before the update begins."""
        cfg, rc = self.config, self.config.rollout_correction
        return (cfg.prox_from_update_pass and cfg.prox_mode == "recompute" and len(minibatches) == 1
                and self._policy_trains()
                and len(minibatches[0]) == 1 and not rc.rejection_criteria and rc.rollout_token_veto_threshold is None
                and not rc.rollout_is_batch_normalize and cfg.kl_in_reward.coef == 0
                and cfg.advantage.estimator not in OTB_ESTIMATORS and cfg.routing_replay == "none"
                and self.routing.shape is None and self.drift_probe is None)

    def _fill_proximal(self, inputs: StepInputs, mb: TrainBatch, rows: list[int], log_prob: torch.Tensor) -> None:
        """π_old of a micro-batch's rows from the update pass's own log-probs (detached: the same
        numbers a no-grad pass would give before the optimizer steps), and their IS weights, which
        depend on each row alone when nothing is rejected or batch-normalised."""
        width = log_prob.shape[1]
        old = log_prob.detach().to(inputs.old_log_prob.dtype)
        inputs.old_log_prob[rows, :width] = old
        if inputs.is_weights is not None:
            weights, _, _ = compute_rollout_correction(old, mb.rollout_log_probs, mb.response_mask,
                                                       self.config.rollout_correction)
            inputs.is_weights[rows, :width] = weights

    def _proximal_pass(self, shard: TrainBatch, owned: list[int], with_sum_pi_squared: bool = False):
        """π_old of every shard row (no grad), and the MoE routing's part of it: the engine's routing
        replayed (r3), the learner's own recorded into the shard for the update passes (r2), and
        the mismatch between the engine's routing and the learner's router (when the samples carry
        routing), summed over the rows this rank answers for; and π_old's Σp² per token if asked
        (else None)."""
        mode, shape = self.config.routing_replay, self.routing.shape
        engine = shard.routed_experts
        mismatch = None if engine is None or shape is None else MismatchCounts(len(shard), shape.layers)
        recorded = [None] * len(shard) if mode == "r2" else None

        def seen(rows: list[int], mb: TrainBatch, plan) -> None:
            if plan is None:
                return
            if mismatch is not None:
                mismatch.add(rows, mb.routed_experts, mb.response_mask, plan, [len(r) for r in mb.responses])
            if recorded is not None:
                for row, routing in zip(rows, plan.sequence_routing(shape.num_experts)):
                    recorded[row] = routing

        old_log_prob, sum_pi_squared = self._no_grad_log_probs(
            shard, record=mismatch is not None or recorded is not None, seen=seen,
            with_sum_pi_squared=with_sum_pi_squared)
        if recorded is not None:
            shard.replay_routing = recorded  # the update passes replay it
        routing = {} if mismatch is None else mismatch.metrics(owned, self.comm.all_reduce_sum)
        return old_log_prob, routing, sum_pi_squared

    def _replay(self, mb: TrainBatch, record: bool = False, proximal: bool = False):
        """The routing plan of one policy pass over `mb` (a no-op context for a dense policy or none):
        r3 forces the engine's experts at the positions that sampled policy tokens, r2 (after its
        proximal pass, which records) the recorded ones at every position."""
        mode, plan = self.config.routing_replay, functools.partial(
            self.routing.plan, mb.prompts, mb.responses, self.packing, self.device, record=record)
        if mode == "r3":
            return plan(forced=mb.routed_experts, force_mask=mb.response_mask)
        if mode == "r2" and not proximal:
            return plan(replayed=mb.replay_routing)
        return plan()

    def _step_correction(self, shard: TrainBatch, old_log_prob: torch.Tensor, owned: list[int]):
        """IS weights, rejection mask and metrics of the shard against the recomputed π_old; batch
        normalisation divides by the factor of the whole batch, summed over the ranks."""
        rc = self.config.rollout_correction
        sums = None
        if rc.rollout_is_batch_normalize:
            sums = self.comm.all_reduce_sum(is_batch_norm_sums(
                old_log_prob[owned], shard.rollout_log_probs[owned], shard.response_mask[owned], rc).cpu())
        return compute_rollout_correction(old_log_prob, shard.rollout_log_probs, shard.response_mask, rc, sums)

    def _minibatch_update(self, inputs: StepInputs, local: list[int], partial) -> float:
        """Forward/backward over this rank's rows `local` of one minibatch in micro-batches, sum the
        gradients over ranks, clip and step. Returns the gradient norm."""
        cfg = self.config
        # Loss normaliser: the minibatch's counts over all ranks. Decoupled-recompute rejects up
        # front, so its counts are after rejection; bypass and loglinear reject inside the loss
        # (the weights depend on π_θ), so theirs are the loss mask's counts.
        tokens, seqs = count_tokens_and_sequences(inputs.loss_mask[local])
        counts = self.comm.all_reduce_sum(torch.tensor([tokens, seqs], dtype=torch.float64))
        global_tokens, global_seqs = counts.tolist()
        want_entropy = cfg.policy_loss.entropy_coeff > 0 or cfg.compute_entropy
        entropy_grad = cfg.policy_loss.entropy_coeff > 0  # reported only: no graph needed
        norm_sums = self._minibatch_norm_sums(inputs, local)
        self.optimizer.zero_grad(set_to_none=True)
        sums: dict[str, float] = defaultdict(float)
        for rows in self._micro_batches(inputs.shard, local):
            if not rows:
                self._idle_pass(grad=True)
                continue
            mb = inputs.shard.select(rows)
            width = mb.response_mask.shape[1]
            with self._replay(mb):  # open through backward: checkpointed layers re-run their routers there
                log_prob, entropy, _ = self._forward(mb, with_entropy=want_entropy, entropy_grad=entropy_grad)
                if inputs.prox_from_update:
                    self._fill_proximal(inputs, mb, rows, log_prob)
                loss, loss_metrics = self._micro_batch_loss(inputs, mb, rows, width, log_prob, entropy, norm_sums,
                                                            global_tokens, global_seqs)
                loss.backward()
            share = count_tokens_and_sequences(inputs.loss_mask[rows, :width])[0] / max(global_tokens, 1.0)
            for key, value in loss_metrics.items():
                # Aggregated losses are already this micro-batch's share of the minibatch's;
                # fractions and means are weighted by the micro-batch's share of the tokens.
                sums[key] += value if key in _ADDITIVE_METRICS else value * share
        self.comm.sum_gradients(self.params)
        for key, value in sums.items():
            partial[key].append(value)
        # the step waits while a weight send still reads the parameters
        return clip_and_step(self.params, self.optimizer, cfg.grad_clip, self.weight_guard.writing)

    def _micro_batch_loss(self, inputs: StepInputs, mb: TrainBatch, rows: list[int], width: int, log_prob, entropy,
                          norm_sums, global_tokens: float, global_seqs: float):
        """The loss of one micro-batch (already this micro-batch's share of the minibatch's) and its metrics."""
        cfg = self.config
        recomputed = None if inputs.old_log_prob is None else inputs.old_log_prob[rows, :width]
        old = proximal_log_prob(cfg.prox_mode, log_prob, mb.rollout_log_probs, mb.token_versions, self.version,
                                recomputed)
        extra = {}
        if inputs.ref_log_prob is not None:
            extra["ref_log_prob"] = inputs.ref_log_prob[rows, :width]
        if cfg.prox_mode == "recompute":
            weights = None if inputs.is_weights is None else inputs.is_weights[rows, :width]
            extra["precomputed_correction"] = (weights, inputs.loss_mask[rows, :width])
        else:
            extra["batch_norm_sums"] = norm_sums
        loss, loss_metrics = compute_policy_loss(
            log_prob, old, mb.rollout_log_probs, inputs.advantages[rows, :width], mb.response_mask,
            cfg.rollout_correction, cfg.policy_loss,
            global_token_count=global_tokens, global_seq_count=global_seqs, entropy=entropy,
            generator=inputs.loss_generator, **extra,
        )
        if cfg.distributed.strategy == "fsdp":
            loss = loss * self.comm.world_size  # FSDP averages gradients over ranks; we sum
        return loss, loss_metrics

    def _minibatch_norm_sums(self, inputs: StepInputs, local: list[int]) -> torch.Tensor | None:
        """The minibatch's batch-normalisation sums over all ranks, when the IS weights depend on
        π_θ (bypass, loglinear) and are batch-normalised. Every micro-batch's loss needs the factor
        of the whole minibatch before its backward pass: one extra no-grad pass over the rows
        pays for exactness (the recompute mode has its factor from the proximal pass)."""
        rc = self.config.rollout_correction
        if not rc.rollout_is_batch_normalize or self.config.prox_mode == "recompute":
            return None
        sums = torch.zeros(2, dtype=torch.float64)
        with torch.no_grad():
            for rows in self._micro_batches(inputs.shard, local):
                if not rows:
                    self._idle_pass(grad=False)
                    continue
                mb = inputs.shard.select(rows)
                with self._replay(mb):
                    log_prob, _, _ = self._forward(mb)
                old = proximal_log_prob(self.config.prox_mode, log_prob, mb.rollout_log_probs, mb.token_versions,
                                        self.version, None)
                sums += is_batch_norm_sums(log_prob if old is None else old, mb.rollout_log_probs,
                                           mb.response_mask, rc).cpu()
        return self.comm.all_reduce_sum(sums)

    # ------------------------------------------------------------------ passes

    def _micro_batches(self, batch: TrainBatch, rows: list[int]) -> list[list[int]]:
        """`rows` of `batch` in micro-batches within the token budget, as many on every rank."""
        cfg = self.config
        lengths = batch.sequence_lengths(rows)
        plan = plan_micro_batches(lengths, cfg.max_tokens_per_micro_batch, self.comm, cfg.micro_batch_size,
                                  packed=self.packing)
        return [[rows[i] for i in mb] for mb in plan]

    def _forward(self, mb: TrainBatch, with_entropy: bool = False, entropy_grad: bool = True, model=None,
                 with_sum_pi_squared: bool = False):
        """(log π(response tokens), entropy or None, Σp² or None) of one micro-batch under the policy
        (or the given model), with gradients if they are enabled."""
        cfg = self.config
        lengths = mb.sequence_lengths()
        width = self.pack_width(lengths)
        real, slots = padding_counts(lengths, width)
        self._slots += torch.tensor([real, slots], dtype=torch.float64)
        with self._autocast():
            out = response_log_probs(model or self.model, mb.prompts, mb.responses, cfg.temperature,
                                     cfg.pad_token_id, with_entropy=with_entropy, entropy_grad=entropy_grad,
                                     chunk_tokens=cfg.logprob_chunk_tokens, packed=self.packing, pack_width=width,
                                     with_sum_pi_squared=with_sum_pi_squared)
        return out[0], (out[2] if with_entropy else None), (out[-1] if with_sum_pi_squared else None)

    def pack_width(self, lengths: list[int]) -> int | None:
        """A packed micro-batch's width: its tokens, rounded up to a shape bucket where buckets are on
        (`learner.shape_buckets`); None when micro-batches are padded."""
        if not self.packing:
            return None
        cfg = self.config
        buckets = cfg.shape_buckets == "on" or cfg.shape_buckets == "auto" and self.device.type == "cuda"
        return shape_bucket(sum(lengths), cfg.max_tokens_per_micro_batch) if buckets else sum(lengths)

    def _no_grad_log_probs(self, batch: TrainBatch, model=None, record: bool = False, seen=None,
                           with_sum_pi_squared: bool = False) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """[rows, T] log-probs of every row of `batch` without gradients, micro-batch by micro-batch,
        and with `with_sum_pi_squared` their distributions' Σp² [rows, T] (else None). The policy's
        pass replays routing as the step's mode says (`_replay`), recording the routers' own top-k
        with `record` and handing each micro-batch's plan to `seen(rows, mb, plan)`."""
        out = torch.zeros(batch.response_mask.shape, dtype=self._log_prob_dtype, device=self.device)
        sum_pi_squared = torch.zeros_like(out) if with_sum_pi_squared else None
        with torch.no_grad():
            for rows in self._micro_batches(batch, list(range(len(batch)))):
                if not rows:
                    self._idle_pass(grad=False, model=model)  # the reference is sharded too
                    continue
                mb = batch.select(rows)
                replay = self._replay(mb, record, proximal=True) if model is None else contextlib.nullcontext()
                with replay as plan:
                    log_prob, _, squares = self._forward(mb, model=model, with_sum_pi_squared=with_sum_pi_squared)
                if seen is not None:
                    seen(rows, mb, plan)
                out[rows, : log_prob.shape[1]] = log_prob
                if squares is not None:
                    sum_pi_squared[rows, : squares.shape[1]] = squares
        return out, sum_pi_squared

    def _uses_reference(self) -> bool:
        """A KL penalty (in the loss, the reward or both) compares the policy with its reference."""
        return self.config.policy_loss.kl_coef > 0 or self.config.kl_in_reward.coef > 0

    def _reference_log_probs(self, batch: TrainBatch) -> torch.Tensor:
        """[rows, T] the reference policy's log-probs: the frozen initial model, or with LoRA the
        policy with its adapters off (the frozen weights are the initial model's)."""
        if self.adapters is None:
            return self._no_grad_log_probs(batch, model=self.ref_model)[0]
        with self.adapters.disabled():
            return self._no_grad_log_probs(batch, model=self.model)[0]  # a model given: no routing replay

    def _idle_pass(self, grad: bool, model=None, run=None) -> None:
        """A zero-weight pass over one pad token for a rank with no rows in a micro-batch slot:
        under FSDP every pass gathers parameters (and every backward reduces gradients) across
        all ranks, so a rank that skipped it would leave the others waiting. `run(prompts,
        responses)` is the pass (default: the log-probs of `model`, the policy if None)."""
        if self.config.distributed.strategy != "fsdp":
            return
        pad = [self.config.pad_token_id]
        run = run or (lambda prompts, responses: response_log_probs(model or self.model, prompts, responses,
                                                                    chunk_tokens=1)[0])
        with torch.set_grad_enabled(grad), self._autocast():
            out = run([pad], [pad])
        if grad:
            (out.sum() * 0.0).backward()

    def _autocast(self):
        """bfloat16 compute over float32 weights when mixed precision is on and FSDP does not do it
        (its MixedPrecisionPolicy gathers bfloat16 parameters: `learner.distributed.shard_model`);
        a no-op otherwise."""
        on = self.config.mixed_precision is not None and self.config.distributed.strategy != "fsdp"
        return torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=on)

    # ------------------------------------------------------------------ metrics

    def _combine(self, partial: dict[str, list[float]], num_minibatches: int, shard_stats: dict[str, float],
                 timing: dict[str, float]) -> dict[str, float]:
        """One dict for the step. Loss-side metrics are per-rank shares of each minibatch's
        value: summed over ranks, averaged over minibatches. The up-front correction's statistics
        describe each rank's shard: averaged over ranks (maxima by max, minima by min). Timings:
        the slowest rank."""
        losses = {k: sum(v) / num_minibatches for k, v in partial.items()}
        out = self._reduce(losses, "sum")
        shard_stats = {k: v for k, v in shard_stats.items() if k not in out}
        out.update(self._reduce({k: v for k, v in shard_stats.items() if k.endswith("_max")}, "max"))
        out.update(self._reduce({k: v for k, v in shard_stats.items() if k.endswith("_min")}, "min"))
        means = self._reduce({k: v for k, v in shard_stats.items() if not k.endswith(("_max", "_min"))}, "sum")
        out.update({k: v / self.comm.world_size for k, v in means.items()})
        out.update(self._reduce(timing, "max"))
        return out

    def _reduce(self, values: dict[str, float], op: str) -> dict[str, float]:
        if self.comm.world_size == 1 or not values:
            return dict(values)
        keys = sorted(values)
        reduced = self.comm.all_reduce(torch.tensor([values[k] for k in keys], dtype=torch.float64), op)
        return dict(zip(keys, reduced.tolist()))

    def _advantage_metrics(self, advantages: torch.Tensor, mask: torch.Tensor, owned: list[int]) -> dict[str, float]:
        """verl's critic/advantages/{mean,max,min} over the batch's valid tokens: each rank's owned
        rows (disjoint, covering the batch), reduced over ranks."""
        values = advantages[owned][mask[owned].bool()].double()
        some = values.numel() > 0
        total = self._reduce({"sum": float(values.sum()), "count": float(values.numel())}, "sum")
        # one MAX reduction for both ends: the minimum is minus the maximum of the negated values
        ends = self._reduce({"max": float(values.max()) if some else -math.inf,
                             "negated_min": float(-values.min()) if some else -math.inf}, "max")
        if not total["count"]:
            return {}
        return {"critic/advantages/mean": total["sum"] / total["count"], "critic/advantages/max": ends["max"],
                "critic/advantages/min": -ends["negated_min"]}

    def _batch_metrics(self, batch: TrainBatch) -> dict[str, float]:
        """Statistics of the whole pulled batch (identical on every rank). Staleness is measured
        against the version the batch was consumed at (before the bump)."""
        stats = to_floats(staleness_metrics(batch.token_versions, self.version - 1, batch.response_mask))
        lengths = torch.tensor([len(r) for r in batch.responses], dtype=torch.float64)
        return {
            **stats,
            "reward/mean": float(batch.rewards.mean()),
            "reward/std": float(batch.rewards.std(unbiased=False)),
            "response_length/mean": float(lengths.mean()),
            "response_length/max": float(lengths.max()),
            "learner/num_sequences": float(len(batch)),
            "learner/num_groups": float(batch.num_groups),
            "learner/num_tokens": float(batch.response_mask.sum()),
        }

    # ------------------------------------------------------------------ weights out

    def full_state_dict(self, model=None) -> dict[str, torch.Tensor]:
        """The policy's weights (or `model`'s) as full CPU tensors: views of the live parameters on
        CPU, host copies on a GPU (a tied weight copied once, still shared), a gather under FSDP (a
        collective: call on every rank)."""
        model = model or self.model
        if self._sharded:
            from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

            return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        state = model.state_dict(keep_vars=True)  # tied names share one object
        copies: dict[int, torch.Tensor] = {}
        for tensor in state.values():
            if id(tensor) not in copies:
                copies[id(tensor)] = tensor.detach().cpu()
        return {k: copies[id(v)] for k, v in state.items()}

    def policy_weights(self) -> dict[str, torch.Tensor]:
        """The weights of a plain model that computes what the policy computes, full, on the CPU,
        in the policy's dtype: `full_state_dict`, or with LoRA the adapted weights merged and the
        adapters left out (rank 0's; a gather under FSDP: call on every rank, others get {})."""
        if self.adapters is None:
            return self.full_state_dict()
        buckets = FullWeightBuckets(self.model, 2**62, keep=self.comm.rank == 0, out_device="cpu")
        return {name: tensor for bucket in buckets for name, tensor in bucket.items()}

    def _publishable(self) -> dict[str, torch.Tensor]:
        """The weights to send, every name (a tied lm_head too: vLLM's in-place reload keeps its
        old lm_head if the stream lacks it; the channels send a shared storage's bytes once), named
        as the checkpoint names them (an MoE's fused experts cut per expert, as copies: the folder
        channel's safetensors refuses views of one storage; lm/checkpoint_names.py). Views of the
        live parameters, or copies in the publish dtype: gathered under FSDP (rank 0's, empty
        elsewhere), a GPU's on the host (`_gathered`); with LoRA the adapted weights merged, as
        copies (`_gathered` too: the frozen rest are views that never change), or with
        `learner.lora.publish=adapter` the adapters alone, as copies."""
        if self._sharded or self._publishes_host_copies() or self.adapters is not None:
            state = self._gathered()
        elif self._publish_on_device():
            state = {k: v.detach() for k, v in self.model.state_dict().items()}  # views, on the GPU
        else:
            state = self.full_state_dict()
        return to_checkpoint_names(state, copy=True, naming=expert_naming(self.model.config))

    def _publishes_host_copies(self) -> bool:
        """A GPU learner without FSDP whose channel reads host memory (object store, folder, gloo):
        each version is cast to the publish dtype on the GPU and copied to the host a bucket at a
        time (`_gathered`), a copy the publication owns: no lease holds the optimizer back while it
        is sent, and a tied weight is copied once (per-tensor `.cpu()` copies would not share it)."""
        return not self._sharded and self.device.type == "cuda" and not self._publish_on_device()

    def _publish_on_device(self) -> bool:
        """vLLM's NCCL and IPC transfers send from the learner's GPU: the weights stay there."""
        sync = self.config.weight_sync
        return sync.channel == "broadcast" and sync.resolved(self.device.type)[0] in ("nccl", "ipc")

    def _gathered(self) -> dict[str, torch.Tensor]:
        """FSDP, or a GPU's host copies (`_publishes_host_copies`): the full weights on rank 0's
        host (its GPU for vLLM's NCCL/IPC transfers), gathered one bucket at a time with each
        parameter cast to the publish dtype on its device before it leaves (bfloat16: half the
        bytes of a float32 gather, and no cast on one CPU thread after it); other ranks hold one
        bucket at a time and get {}. Rank 0 ends with the whole version in
        the publish dtype: the broadcast channel streams buckets instead (`_publish_streamed`)."""
        buckets = self._publish_buckets()
        out: dict[str, torch.Tensor] = {}
        for bucket in buckets:  # a collective per parameter: every rank iterates to the end
            out.update(bucket)
        return out

    def _publish_buckets(self) -> FullWeightBuckets:
        """The version in buckets of `distributed.publish_bucket_mb` (FSDP's gather, or a GPU's host
        copies), each parameter cast to the publish dtype on its device; rank 0 keeps them (on its
        GPU for NCCL/IPC, else its host)."""
        size = int(self.config.distributed.publish_bucket_mb * 2**20)
        adapters_only = self.adapters is not None and self.config.lora.publish == "adapter"
        return FullWeightBuckets(self.model, size, dtype=self._publish_dtype(), keep=self.comm.rank == 0,
                                 out_device=None if self._publish_on_device() else "cpu", adapters_only=adapters_only)

    def _publish_dtype(self) -> torch.dtype | None:
        return torch_dtype(self.config.weight_sync.dtype) if self.config.weight_sync.dtype else None

    def _streams_buckets(self) -> bool:
        """The broadcast channel under FSDP, or with LoRA on a GPU (a merged version is otherwise a
        whole model's copy on the GPU), unless `stream_buckets` says otherwise: each version is
        gathered (merged) and sent a bucket at a time."""
        sync = self.config.weight_sync
        if sync.channel != "broadcast" or sync.stream_buckets is False:
            return False
        return bool(sync.stream_buckets) or self._sharded or self.adapters is not None and self.device.type == "cuda"

    def _publish_streamed(self) -> None:
        """Every rank gathers the version a bucket at a time (each parameter cast to the publish
        dtype on its device, LoRA's merged) while rank 0 sends each bucket as its send reaches it:
        rank 0 holds two buckets, never a model, and the step waits for the send. Under FSDP every
        rank runs every gather, also when rank 0's send fails part-way; replicas leave it to rank 0."""
        if self.comm.rank != 0:
            if self._sharded:  # replicas: rank 0 has the whole version
                for _ in self._publish_buckets():
                    pass
            return
        buckets = self._publish_buckets()
        naming = expert_naming(self.model.config)
        stream = BucketStream(to_checkpoint_names(bucket, copy=True, naming=naming) for bucket in buckets)
        layout = Layout.of(to_checkpoint_names(buckets.meta(), naming=naming).items())
        try:
            self.publication.send_now(self.version, stream, layout)  # its timings: publication.last
        except Exception:
            self.publication.failures += 1
            log.exception("weight publication of v%d failed (the run goes on; engines that missed it get the "
                          "next one)", self.version)
        finally:
            stream.drain()

    def attach_weight_board(self, board) -> None:
        """Rank 0 publishes through the channel of `weight_sync` around `board` (a `WeightStore`
        or its Ray actor handle), in a thread of its own."""
        if self.comm.rank != 0:
            return
        if self.publication is not None:
            self.publication.close()
        sync, dtype, snapshot = self.config.weight_sync, self._publish_dtype(), False
        if sync.channel == "object_store":
            sender = ObjectStoreSender(board, dtype)
        elif sync.channel == "folder":
            sender = FolderSender(board, sync.folder, dtype, sync.claim_timeout_s)
        else:
            backend, topology, snapshot, ahead_bytes = sync.resolved(self.device.type)
            sender = BroadcastSender(board, backend, topology, int(sync.bucket_mb * 2**20), sync.ready_timeout_s,
                                     sync.timeout_s, sync.address, dtype, ahead_bytes)
        self.publication = Publication(sender, self.weight_guard, self._publishable, snapshot, dtype,
                                       catch_ups=not self._streams_buckets())

    def publish_weights(self) -> dict | None:
        """Hand the current version to the publication thread and return: the learner's next step
        starts while it is sent. Every rank must call it (FSDP gathers); non-zero ranks get None.
        Rank 0 gets timings: publish_s (this call), blocked_s (optimizer steps that waited for a
        send since the last call), and the last finished send's own_s, served_s, sync_s (and, for
        a broadcast, the engines it reached)."""
        start = time.perf_counter()
        if self.comm.rank == 0 and self.publication is None:
            self.attach_weight_board(WeightStore())  # a board of its own (tests, benchmarks)
        streamed = self._streams_buckets()
        if streamed:
            self._publish_streamed()  # every rank, the send on the step path: all of it is blocked time
        else:
            # copies the publication owns: FSDP's gather (a collective: every rank), a GPU's host copies
            owned = self._sharded or self.comm.rank == 0 and (
                self._publishes_host_copies() or self.adapters is not None)  # LoRA's: merged copies
            gathered = self._publishable() if owned else None
        if self.comm.rank != 0:
            return None
        if not streamed:
            self.publication.publish(self.version, gathered)
        publish_s = time.perf_counter() - start
        last = {k: v for k, v in self.publication.last.items() if k.endswith("_s") or k == "engines"}
        return {"version": self.version, "publish_s": publish_s,
                "blocked_s": publish_s if streamed else self.weight_guard.take_blocked_s(),
                "failures": self.publication.failures, **last}

    def published(self, timeout: float = 120.0) -> dict | None:
        """The board's live payload once the current version is out (None: not within `timeout`)."""
        from lm.weight_sync.group import call

        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            payload = call(self.publication.sender.board, "wait_live", self.version, deadline - time.monotonic())
            if payload is not None:
                return payload
        return None

    def close_weight_sync(self) -> None:
        if self.publication is not None:
            self.publication.close()
            self.publication = None

    # ------------------------------------------------------------------ checkpoints

    def state_dict(self) -> dict:
        """A snapshot (copies, not live views) of model, optimizer, scheduler and version (and the
        critic's weights, to inspect: a run resumes its critic from `save_checkpoint`). With LoRA the
        model's tensors are as trained, unmerged, the adapters under their own names
        (`policy_weights` is what a plain model needs)."""
        state = {
            "model": self.full_state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "version": self.version,
            "kl_reward_coef": self.kl_reward_coef,
        }
        if self.critic is not None:
            state["critic_model"] = self.full_state_dict(self.critic.model)
        return copy.deepcopy(state)

    def load_state_dict(self, state: dict) -> None:
        missing = {"model", "optimizer", "scheduler", "version"} - set(state)
        if missing:
            raise KeyError(f"learner state is missing {sorted(missing)}")
        self._load_model_weights(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        load_schedule(self.scheduler, state["scheduler"])
        self.version = int(state["version"])
        self.kl_reward_coef = float(state.get("kl_reward_coef", self.kl_reward_coef))  # older states: the config's

    def _load_model_weights(self, weights: dict[str, torch.Tensor]) -> None:
        if self.config.distributed.strategy == "fsdp":
            from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

            set_model_state_dict(self.model, weights, options=StateDictOptions(full_state_dict=True))
            return
        result = self.model.load_state_dict(weights, strict=False)
        tied = {name for name in result.missing_keys if name.endswith("lm_head.weight")}
        if set(result.missing_keys) - tied or result.unexpected_keys:
            raise KeyError(f"weights do not fit the policy: missing {result.missing_keys}, "
                           f"unexpected {result.unexpected_keys}")

    def save_policy(self, folder) -> Path | None:
        """The policy as an HF folder: config and safetensors weights, plus the source folder's
        other files (tokenizer and the like). Written file by file from the shards under FSDP
        (`learner.checkpoint.write_policy`): every rank must call it then."""
        return write_policy(Path(folder), self.model, self.config.model_path, self.comm.rank, self._sharded)

    def save_checkpoint(self, folder) -> Path | None:
        """`folder/policy/` (HF folder), `folder/trainer_shards/` (model and optimizer, each rank
        its shards), `folder/trainer.pt` (scheduler, version) and with LoRA `folder/lora_adapter/`
        (PEFT's folder): see `learner.checkpoint`."""
        folder = Path(folder)
        self.save_policy(folder / POLICY_DIR)
        if self.adapters is not None:
            write_adapter(folder / ADAPTER_DIR, self.model, self.adapters, self.config.model_path, self.comm.rank,
                          self._sharded)
        save_training_state(folder, self.model, self.optimizer, self.scheduler, self.version, self.comm.rank,
                            kl_reward_coef=self.kl_reward_coef, critic=self.critic, lora=self.config.lora_settings())
        return folder if self.comm.rank == 0 else None

    def load_checkpoint(self, folder) -> None:
        """Resume from `save_checkpoint`'s folder: every rank reads its own shards. A checkpoint
        of the former layout (full optimizer state in trainer.pt) loads without FSDP only."""
        folder = Path(folder)
        state = read_trainer_file(folder)
        if "shards" not in state:
            if self._sharded or self.critic is not None or self.adapters is not None:
                raise ValueError(f"checkpoint {str(folder)!r} holds rank 0's optimizer state only (written before "
                                 f"sharded checkpoints): it cannot resume an FSDP learner, one with a critic or "
                                 f"one with LoRA; resume it without FSDP (and without a critic or LoRA: it has "
                                 f"neither)")
            self.load_state_dict({"model": read_policy_weights(folder / POLICY_DIR), **state})
            return
        load_training_state(folder, state, self.model, self.optimizer, self.critic, lora=self.config.lora_settings())
        load_schedule(self.scheduler, state["scheduler"])
        self.version = int(state["version"])
        self.kl_reward_coef = float(state.get("kl_reward_coef", self.kl_reward_coef))

    @property
    def _sharded(self) -> bool:
        return self.config.distributed.strategy == "fsdp"
