"""Placement: what every actor of a run asks Ray for, where it goes, and whether the cluster can
hold it. `make_plan` returns one plain `Plan`; `etarl plan` prints it, `start_ray` checks it
against the cluster before anything starts, and `Placement` reserves it for `Controller.start`.

- rollout: rollout.num_workers actors, each ray.worker_num_cpus CPUs and its engine's GPUs
  (rollout.engine.tensor_parallel_size); one placement group, a bundle per worker (a bundle is on
  one node: a tensor-parallel engine's GPUs are too), PACK.
- learner: learner.distributed.world_size ranks, each ray.learner_num_cpus CPUs and 1 GPU; one
  placement group, a bundle per rank, learner.distributed.placement (pack | spread).
- evaluator (eval.enabled): ray.worker_num_cpus CPUs and its engine's GPUs; a placement group of
  its own.
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
from dataclasses import dataclass
from pathlib import Path

from services.config import ConfigError, EtarlConfig
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
    gpus: int
    placement: str  # pack | spread (a placement group), driver-node, driver-process, any
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
    def has_gpus(self) -> bool:
        return any(n.gpus > 0 for n in self.nodes)

    def total(self) -> dict[str, float]:
        return {"CPU": sum(n.cpus for n in self.nodes), "GPU": sum(n.gpus for n in self.nodes)}

    def to_dict(self) -> dict:
        return {"source": self.source, "total": self.total(),
                "nodes": [{"name": n.name, "CPU": n.cpus, "GPU": n.gpus} for n in self.nodes]}


@dataclass(frozen=True)
class Plan:
    roles: tuple[Role, ...]

    def role(self, name: str) -> Role:
        (role,) = [r for r in self.roles if r.name == name]
        return role

    def total(self) -> dict[str, float]:
        return {"CPU": sum(r.count * r.cpus for r in self.roles), "GPU": sum(r.count * r.gpus for r in self.roles)}

    def bundles(self) -> list[dict[str, float]]:
        return [r.bundle for r in self.roles for _ in range(r.count) if r.bundle]

    def to_dict(self) -> dict:
        return {"roles": {r.name: r.to_dict() for r in self.roles}, "total": self.total()}

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


def make_plan(cfg: EtarlConfig, cluster_has_gpus: bool) -> Plan:
    """Every actor of the run `cfg` describes, on a cluster with or without GPUs."""
    ray, engine, dist = cfg.ray, cfg.rollout.engine, cfg.learner.distributed
    roles = [
        Role("rollout", cfg.rollout.num_workers, ray.worker_num_cpus,
             _gpus(engine.device, cluster_has_gpus, engine.tensor_parallel_size), "pack",
             "rollout.num_workers", "ray.worker_num_cpus", "rollout.engine.tensor_parallel_size"),
        Role("learner", dist.world_size, ray.learner_num_cpus, _gpus(cfg.learner.device, cluster_has_gpus, 1),
             dist.placement, "learner.distributed.world_size", "ray.learner_num_cpus"),
    ]
    if cfg.eval.enabled:
        tp = engine.tensor_parallel_size if (cfg.eval.engine or engine.kind) == "vllm" else 1
        roles.append(Role("evaluator", 1, ray.worker_num_cpus, _gpus(engine.device, cluster_has_gpus, tp), "pack",
                          "eval.enabled=false", "ray.worker_num_cpus", "rollout.engine.tensor_parallel_size"))
    buffer_place = "driver-node" if cfg.buffer.transport == "ray" else "driver-process"
    roles += [Role("buffer", 1, 0, 0, buffer_place), Role("weight_store", 1, 0, 0, "any")]
    return Plan(tuple(roles))


def check_plan(cfg: EtarlConfig, cluster: Cluster) -> Plan:
    """The run's plan for `cluster`; PlanError if it cannot fit."""
    return make_plan(cfg, cluster.has_gpus).check(cluster)


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
    else:  # logical CPUs, enough for every actor: the real cores are shared by all of them
        cpus = max(os.cpu_count() or 1, math.ceil(make_plan(cfg, gpus > 0).total()["CPU"]))
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


def start_ray(cfg: EtarlConfig) -> Plan:
    """Start (or join) the run's Ray cluster, and check the run's plan against it: the embedded
    cluster's declared resources before it starts, a cluster's nodes once joined (nothing of the
    run has started yet either way). Returns the plan; PlanError if it cannot fit."""
    import ray

    if ray.is_initialized():
        return check_plan(cfg, running_cluster("the Ray cluster this process is connected to"))
    if cfg.ray.address == "local":
        cluster = local_cluster(cfg)
        plan = check_plan(cfg, cluster)
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
    return check_plan(cfg, running_cluster(f"the Ray cluster at ray.address={cfg.ray.address}"))


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
    plan = make_plan(cfg, cluster.has_gpus)
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
            for name, group in self.groups.items():
                self._wait(name, group, timeout_s)
        except BaseException:
            self.release()
            raise

    def _wait(self, name: str, group, timeout_s: float) -> None:
        import ray

        ready, _ = ray.wait([group.ready()], timeout=timeout_s)
        if not ready:
            role = self.plan.role(name)
            raise PlanError(f"the cluster did not free {role.count} x {_res(role.bundle)} for the {name} within "
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

        for group in self.groups.values():
            try:
                remove_placement_group(group)
            except Exception as exc:  # Ray is gone already: its groups with it
                log.debug("placement group not removed: %s", exc)
        self.groups = {}
