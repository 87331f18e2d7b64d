"""The learner's config: model, optimizer and schedule, PPO minibatching, the proximal log-prob
method, rollout correction and policy loss, data parallelism and weight publication.

Flat where users override it most (`learner.lr=3e-5`), nested where a component owns the options
(`learner.rollout_correction.rollout_is_threshold=3`). A preset name is accepted wherever a
rollout-correction config is expected: `learner.rollout_correction=decoupled_seq_is`.
"""
from __future__ import annotations

from typing import Annotated, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag, field_validator, model_validator

from learner.advantages import OTB_ESTIMATORS, AdvantageConfig, KLRewardConfig
from learner.correction import RolloutCorrectionConfig
from learner.critic import CriticConfig
from learner.losses import PolicyLossConfig, check_loss_mode_fits


class DistributedConfig(BaseModel):
    """A data-parallel learner group. gloo runs on CPU, nccl needs GPUs; either can shard the
    parameters with FSDP2 (`strategy: fsdp`)."""

    model_config = ConfigDict(extra="forbid")

    world_size: int = Field(1, ge=1, description="learner ranks; each trains on its shard of the batch")
    backend: Literal["gloo", "nccl"] = "gloo"
    strategy: Literal["allreduce", "fsdp"] = Field(
        "allreduce", description="allreduce: full replicas, gradients summed; fsdp: sharded (GPU, nccl)")
    master_port: int = Field(0, ge=0, le=65535, description="the rendezvous port on rank 0's node, when the "
                             "ranks span nodes (0: a free port); ranks on one node meet through a file")
    timeout_s: float = Field(300.0, gt=0, description="collective timeout")
    publish_bucket_mb: float = Field(
        256.0, gt=0, description="under FSDP, weights leave the shards this many MB at a time (gathered "
        "parameter by parameter on the device and cast there to the publish dtype): a rank holds one bucket "
        "beyond its shards while a version is gathered")
    placement: Literal["pack", "spread"] = Field(
        "pack", description="the ranks' placement group: pack (as few nodes as possible) or spread (one rank "
        "per node where possible)")


_PublishDtype = Optional[Literal["float32", "bfloat16", "float16"]]


class _WeightChannel(BaseModel):
    model_config = ConfigDict(extra="forbid")

    dtype: _PublishDtype = Field(None, description="cast published weights (None: the learner's dtype)")


class ObjectStoreSync(_WeightChannel):
    """One shared object per version in the Ray object store, which every engine on a node maps
    without a private copy. For small models: the whole version passes through the object store."""

    channel: Literal["object_store"] = "object_store"


class FolderSync(_WeightChannel):
    """A safetensors folder per version (engines in their own processes read it themselves). A
    version's folder is kept while it is live or a reader has claimed it (retention by version)."""

    channel: Literal["folder"] = "folder"
    folder: str = Field(..., description="root of the versioned folders")
    claim_timeout_s: float = Field(
        600.0, gt=0, description="a reader's claim on a version keeps its folder at most this long")


class BroadcastSync(_WeightChannel):
    """vLLM's weight transfer: the learner (rank 0) drives each engine's weight update and sends
    each version once, while it trains on (see lm/weight_sync). For models past a few hundred MB.
    Needs vLLM on the learner too (its trainer side) and, for nccl/ipc, vLLM engines."""

    channel: Literal["broadcast"] = "broadcast"
    backend: Literal["auto", "gloo", "nccl", "ipc"] = Field(
        "auto", description="vLLM's weight-transfer backend. nccl: engines on other GPUs; ipc: an engine on "
        "the learner's GPU (ray.layout colocated); gloo: etarl's, on CPUs (a vLLM plugin; the transformers "
        "engine takes it too); auto: `etarl plan` chooses for both ends (ipc for one vLLM engine on the "
        "learner's GPU, nccl for vLLM engines on GPUs of their own, else gloo; a learner outside a plan: nccl on "
        "a GPU, gloo on a CPU). rollout.engine.weight_transfer follows it")
    topology: Literal["auto", "chain", "star"] = Field(
        "auto", description="gloo only. chain: each receiving process forwards chunks to the next, the learner "
        "sends each byte once (gloo's broadcast is a binomial tree: the root sends each byte about "
        "log2(engines + 1) times); star: gloo's broadcast; auto: chain")
    bucket_mb: float = Field(32.0, gt=0, description="gloo: chunk size of the send")
    receive_ahead_mb: Optional[float] = Field(
        None, gt=0, description="how much of a version an engine may hold received but not yet forwarded "
        "and loaded (at least one chunk): the learner's send waits for a slower rank further down the chain "
        "only once this much waits there. None: a whole version with gloo (host memory: one more model copy "
        "per engine, kept between versions, since new pages cost the kernel zeroing them), 4 chunks with "
        "nccl (device memory)")
    address: Optional[str] = Field(
        None, description="the learner node's address the group binds to (None: its Ray node address)")
    ready_timeout_s: float = Field(
        30.0, gt=0, description="how long the learner waits for every engine to reach an interrupt point; "
        "one that does not is left out of that send, named, and catches up later")
    timeout_s: float = Field(120.0, gt=0, description="the group's collective timeout (a member dying mid-send)")
    stream_buckets: Optional[bool] = Field(
        None, description="FSDP: gather and send one bucket at a time while every rank waits (rank 0 holds "
        "two buckets, not a model; the send is on the step path, short with NCCL; a restarted engine gets the "
        "next version) instead of gathering a whole version to rank 0's host and sending it in the background "
        "(one model copy in the publish dtype on rank 0). None: on under FSDP, and with learner.lora on a GPU "
        "(each version's merged weights would be a model copy on the GPU)")
    snapshot: Optional[bool] = Field(
        None, description="copy the weights (in the publish dtype) before sending, so the next optimizer "
        "step waits only for the copy, not the send: one more model copy in memory. None: on with gloo "
        "(a CPU send is slow next to a CPU step), off with nccl (the send is fast next to a GPU step)")

    def resolved(self, device: str) -> tuple[str, str, bool, int | None]:
        """(backend, topology, snapshot, receive-ahead bytes) with `auto`/None decided for a learner
        on `device`; None bytes: a whole version."""
        backend = self.backend if self.backend != "auto" else ("nccl" if device.startswith("cuda") else "gloo")
        topology = self.topology if self.topology != "auto" else ("chain" if backend == "gloo" else "star")
        snapshot = self.snapshot if self.snapshot is not None else backend == "gloo"
        ahead_mb = self.receive_ahead_mb if self.receive_ahead_mb is not None else (
            None if backend == "gloo" else 4 * self.bucket_mb)
        return backend, topology, snapshot, None if ahead_mb is None else int(ahead_mb * 2**20)


def _channel_of(value) -> str:
    return value.get("channel", "object_store") if isinstance(value, dict) else value.channel


# A union on `channel` (object_store when not given), each variant with only its own keys.
WeightSyncConfig = Annotated[
    Union[Annotated[ObjectStoreSync, Tag("object_store")], Annotated[FolderSync, Tag("folder")],
          Annotated[BroadcastSync, Tag("broadcast")]],
    Discriminator(_channel_of, custom_error_type="weight_channel",
                  custom_error_message="weight_sync.channel must be object_store, folder or broadcast"),
]


class DiagnosticsConfig(BaseModel):
    """Measurements that cost extra compute or memory, off by default. Set at the top level of a
    run's config (`diagnostics.exact_drift_every=K`); the learner is where they run."""

    model_config = ConfigDict(extra="forbid")

    exact_drift_every: Optional[int] = Field(
        None, ge=1, description="every K learner steps, score a sample of the batch with the weights of the "
        "version that generated it: the drift split into backend and staleness exactly (None: off)")
    exact_drift_rows: int = Field(8, ge=1, description="rows of the batch the exact drift probe scores")
    keep_versions: int = Field(
        3, ge=1, description="policy versions the probe keeps on the CPU (a run sets η + 1, or eta_max + 1): "
        "host memory of this many copies of the model")


class LoraConfig(BaseModel):
    """Low-rank adapters on the policy's linear layers, every other weight frozen (learner/lora.py):
    the optimizer and gradients hold the adapters only, the saved policy is merged weights, the
    engines get merged weights or the adapters (`publish`), the KL reference is the policy without
    its adapters (no second model)."""

    model_config = ConfigDict(extra="forbid")

    rank: int = Field(..., ge=1, description="r, the adapters' inner size (verl's lora_rank)")
    alpha: float = Field(16.0, gt=0, description="the update is scaled by alpha / rank (verl's lora_alpha)")
    target_modules: Union[Literal["all-linear"], list[str], str] = Field(
        "all-linear", description="all-linear: every linear layer but the LM head; a list: modules by their last "
        "name parts (q_proj, v_proj, ...); another string: a regular expression the whole module name matches")
    exclude_modules: Union[list[str], str] = Field(
        [], description="modules taken back out of target_modules, named the same two ways")
    publish: Literal["merged", "adapter"] = Field(
        "merged", description="what each version sends the engines. merged: every weight, W + alpha/rank * B A "
        "(any engine; 15 GB a version for a 7B model in bfloat16). adapter (verl's lora.merge=False): A and B alone "
        "(rank 64 on a 7B model's seven projections: 0.3 GB), which vLLM applies as a LoRA adapter (LoRARequest, "
        "swapped in place) and the transformers engine merges; through the object_store or folder channel (vLLM's "
        "weight transfer loads model weights only). The saved policy/ is merged either way")

    @field_validator("target_modules", "exclude_modules")
    @classmethod
    def _patterns_compile(cls, value, info):
        import re

        if isinstance(value, str) and value != "all-linear":
            try:
                re.compile(value)
            except re.error as exc:
                raise ValueError(f"{value!r} is not a regular expression: {exc}") from None
        if isinstance(value, list) and not all(value):
            raise ValueError("module names must not be empty")
        if info.field_name == "target_modules" and value == []:
            raise ValueError("an empty list adapts nothing: name modules, or all-linear")
        return value


class LearnerConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model_path: str = Field(..., description="HF model folder of the initial policy")
    dtype: Literal["float32", "bfloat16", "float16", "float64"] = Field(
        "float32", description="weights, gradients and optimizer state (float64: exactness checks on CPU). "
        "bfloat16 halves their memory but costs the updates: bfloat16 keeps 8 bits of mantissa, so an update "
        "below ~0.4% of a weight (lr 1e-6 Adam steps are ~1e-6 absolute) rounds away; prefer float32 with "
        "mixed_precision=bfloat16. With lora only the frozen weights take it (the adapters stay float32): "
        "bfloat16 then halves the frozen model's memory and costs no update")
    mixed_precision: Optional[Literal["bfloat16"]] = Field(
        None, description="compute the forward and backward passes in bfloat16 while weights, gradients and "
        "optimizer state stay in `dtype` (float32): under FSDP its MixedPrecisionPolicy (bfloat16 all-gathers "
        "and compute, float32 gradient reduction), without FSDP autocast; log-probs, losses and the correction "
        "stay float32")
    gradient_checkpointing: Union[bool, Literal["selective"]] = Field(
        False, description="true: keep only each decoder layer's input and recompute the layer in the backward "
        "pass; selective: also keep its matmul and attention outputs and recompute only the elementwise work in "
        "between: a quarter less matmul work per step than true (6 instead of 8 x parameters x tokens), for about half "
        "the activation memory of false (per token and layer about 2 bytes x (6 x hidden + 2 x kv + 2 x "
        "intermediate) under bfloat16 autocast: 55 KB at Qwen2.5-1.5B's shape, x 28 layers x 16,384 tokens = "
        "25 GB; docs/architecture.md). Unset on GPUs, the plan takes the least recomputation whose step fits the "
        "learner's memory beside its state (etarl plan says which and why)")
    lora: Optional[LoraConfig] = Field(
        None, description="train low-rank adapters instead of every weight (None: full fine-tuning); e.g. "
        "learner.lora.rank=64 (learner/lora.py)")
    device: Literal["auto", "cpu", "cuda"] = Field(
        "auto", description="auto: the GPU Ray assigned to the rank if CUDA works there, else the CPU; cuda: "
        "that GPU or an error (lm/device.py)")
    seed: int = 0

    # AdamW and the learning-rate schedule (warm-up, then constant / linear / cosine decay)
    lr: float = Field(1e-6, gt=0)
    betas: tuple[float, float] = (0.9, 0.999)
    adam_eps: float = Field(1e-8, gt=0)
    weight_decay: float = Field(0.01, ge=0)
    warmup_steps: int = Field(0, ge=0)
    lr_schedule: Literal["constant", "linear", "cosine"] = "constant"
    total_steps: Optional[int] = Field(None, ge=1, description="steps the decay spans (linear/cosine); None: the "
                                       "run's steps (run.steps, or those run.epochs works out), as verl's decay spans "
                                       "its run")
    min_lr_ratio: float = Field(0.0, ge=0, le=1, description="the decayed lr floor, as a fraction of lr")
    grad_clip: Optional[float] = Field(1.0, gt=0, description="max global grad norm (None: no clipping)")

    # PPO: each pulled batch is split into minibatches (one optimizer step each) for ppo_epochs
    ppo_epochs: int = Field(1, ge=1)
    ppo_mini_batch_size: Optional[int] = Field(
        None, ge=1, description="groups per minibatch (None: the whole batch, one step per epoch)")
    max_tokens_per_micro_batch: Optional[int] = Field(
        16384, ge=1, description="padded prompt+response tokens per forward/backward on a rank (rows x the "
        "longest row): peak activation memory follows this, not the batch size (None: no limit)")
    micro_batch_size: Optional[int] = Field(
        None, ge=1, description="at most this many sequences per forward/backward (None: the token budget alone)")
    packing: Union[bool, Literal["auto"]] = Field(
        "auto", description="a micro-batch is its sequences concatenated (per-sequence positions, attention "
        "that never crosses a boundary) instead of right-padded to its longest: no padding, and the token "
        "budget counts real tokens; log-probs and losses equal the padded path. auto: packed where the learner "
        "computes on a GPU or attn_implementation is varlen; padded on a CPU, where sdpa's block-diagonal mask "
        "over a packed row costs more than the padding it saves (3.2x the step of the embedded default)")
    attn_implementation: Optional[Literal["sdpa", "eager", "flash_attention_2", "flex_attention", "varlen"]] = Field(
        None, description="transformers' attention kernel for the policy and reference (None: sdpa; on CUDA GPUs "
        "the plan sets varlen where it fits: bfloat16 compute, packing, no sliding window). Packed "
        "micro-batches: sdpa and eager take a block-diagonal mask ([tokens, tokens] per pass, every block "
        "computed); varlen (etarl's, lm/packed_attention.py) computes each sequence alone: PyTorch's flash "
        "varlen kernel on CUDA (bfloat16: needs mixed_precision or dtype bfloat16), an exact per-sequence "
        "fallback elsewhere; flash_attention_2 (CUDA, the flash-attn package) the same through flash-attn")
    shape_buckets: Literal["auto", "on", "off"] = Field(
        "auto", description="round a packed micro-batch's width up to one of a few sizes (4-7 x 2^k, at most "
        "25 % filler) so kernels are planned once per shape, not per step (auto: on with CUDA)")
    logprob_chunk_tokens: int = Field(
        1024, ge=1, description="response tokens per LM-head chunk: log-prob memory is about 2 x this x vocab "
        "x 4 bytes, never batch x length x vocab")
    shuffle_minibatches: bool = Field(False, description="reshuffle groups between epochs (seeded)")

    # Algorithm
    temperature: float = Field(1.0, gt=0, description="the sampling temperature: log-probs use logits / T")
    prox_logp: Literal["recompute", "loglinear"] = Field(
        "recompute", description="decoupled mode's proximal log-probs: one no-grad forward pass, or "
        "AReaL's log-linear interpolation between behaviour and current log-probs")
    prox_from_update_pass: bool = Field(
        True, description="recompute mode with one minibatch and one epoch: π_old is the policy the update pass "
        "itself runs (the optimizer has not stepped yet), so take it from that pass, detached, instead of a "
        "separate no-grad pass (a fifth less model work per step with full checkpointing). Only where nothing needs "
        "π_old before the update: no rejection, veto or batch-normalised IS weights, no KL in the reward, no "
        "optimal token baseline, no MoE routing replay, no exact drift probe; elsewhere the pass runs")
    advantage: AdvantageConfig = Field(default_factory=AdvantageConfig)
    critic: CriticConfig = Field(default_factory=CriticConfig, description="the value model of advantage.estimator "
                                 "gae (PPO with a critic; unused otherwise)")
    kl_in_reward: KLRewardConfig = Field(default_factory=KLRewardConfig)
    rollout_correction: RolloutCorrectionConfig = Field(default_factory=RolloutCorrectionConfig.decoupled_token_is)
    policy_loss: PolicyLossConfig = Field(default_factory=PolicyLossConfig)
    compute_entropy: bool = Field(True, description="report actor/entropy (always on when entropy_coeff > 0)")
    routing_replay: Literal["none", "r2", "r3"] = Field(
        "none", description="MoE policies (learner/routing_replay.py): r3 replays the engine's experts (the "
        "samples' routed_experts) at the positions that sampled, in the proximal and update passes; r2 records "
        "the learner's own experts at every position (prompt and response) at the proximal pass and replays "
        "them in the update passes of the step; none routes freely")
    pad_token_id: int = Field(0, ge=0)

    distributed: DistributedConfig = Field(default_factory=DistributedConfig)
    weight_sync: WeightSyncConfig = Field(default_factory=ObjectStoreSync)
    diagnostics: DiagnosticsConfig = Field(default_factory=DiagnosticsConfig)

    @field_validator("rollout_correction", mode="before")
    @classmethod
    def _preset_by_name(cls, value):
        return RolloutCorrectionConfig.preset(value) if isinstance(value, str) else value

    @field_validator("betas")
    @classmethod
    def _betas_in_range(cls, value):
        if not all(0.0 <= b < 1.0 for b in value):
            raise ValueError(f"betas must lie in [0, 1), got {value}")
        return value

    def lora_settings(self) -> dict | None:
        """The LoRA settings a checkpoint records (None: every weight trained)."""
        return self.lora.model_dump(exclude={"publish"}) if self.lora is not None else None  # not what trains

    def check_decay_span(self, steps: int, what: str) -> None:
        """A decay without total_steps spans a run's `steps` (`what` says which): ValueError where the
        warm-up alone is longer."""
        if self.lr_schedule != "constant" and self.total_steps is None and self.warmup_steps > steps:
            raise ValueError(f"learner.warmup_steps ({self.warmup_steps}) exceeds {what}, which the decay spans "
                             "(learner.total_steps unset)")

    @model_validator(mode="after")
    def _consistent(self):
        if self.total_steps is not None and self.warmup_steps > self.total_steps:
            raise ValueError(f"warmup_steps ({self.warmup_steps}) exceeds total_steps ({self.total_steps})")
        if self.prox_logp == "loglinear" and self.bypass_mode:
            raise ValueError("prox_logp 'loglinear' approximates decoupled mode's proximal policy; "
                             "the rollout-correction preset is in bypass mode, which has none")
        if self.distributed.backend == "nccl" and self.device == "cpu":
            raise ValueError("distributed.backend 'nccl' needs device 'cuda'")
        if self.mixed_precision is not None and self.dtype != "float32":
            raise ValueError(f"mixed_precision {self.mixed_precision!r} computes in bfloat16 over float32 master "
                             f"weights: set dtype float32 (got {self.dtype!r})")
        if getattr(self.weight_sync, "backend", None) == "nccl" and self.device == "cpu":
            raise ValueError("weight_sync.backend 'nccl' needs device 'cuda'")
        if self.kl_in_reward.coef > 0 and self.advantage.estimator == "gdpo":
            raise ValueError("kl_in_reward lowers the reward, but advantage.estimator gdpo reads the reward's parts "
                             "only: the penalty would do nothing (use policy_loss.kl_coef for a KL term with gdpo)")
        if self.advantage.estimator in OTB_ESTIMATORS and self.prox_mode != "recompute":
            raise ValueError(f"advantage.estimator {self.advantage.estimator} weighs each token by the proximal policy's "
                             f"distribution (Σp²), which only the proximal pass computes: it needs prox_logp "
                             f"'recompute' and a rollout correction outside bypass mode (got {self.prox_mode!r})")
        check_loss_mode_fits(self.policy_loss.loss_mode, self.rollout_correction)
        if self.attn_implementation == "varlen" and self.packing is False:
            raise ValueError("attn_implementation 'varlen' computes packed micro-batches' sequences one by one: "
                             "it needs packing: true (padded rows take sdpa)")
        return self

    @property
    def prox_mode(self) -> Literal["recompute", "loglinear", "bypass"]:
        """Where π_old comes from: a no-grad pass, AReaL's interpolation, or μ itself (bypass)."""
        return "bypass" if self.bypass_mode else self.prox_logp

    @property
    def bypass_mode(self) -> bool:
        return bool(self.rollout_correction.bypass_mode)
