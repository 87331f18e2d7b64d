"""Placement on Ray clusters with declared GPUs (none of them real), run as a child process by
tests/services/test_placement_ray.py (the test session holds a Ray cluster of its own). Prints one
line `RESULT <json>` with what every actor saw.

    four_gpus            an embedded cluster with 4 declared GPUs: probe actors placed by the plan, a
                         colocated plan (the default's on one GPU) and fractional requests
    two_nodes RUN_DIR    a head (the driver, the buffer) and two nodes of 2 GPUs each: a short real run,
                         then the shared-path check where one node sees another folder
"""
from __future__ import annotations

import json
import logging
import os
import sys
from pathlib import Path

import ray

REPO = Path(__file__).resolve().parents[2]


def actor_info(actor=None) -> dict:
    """What Ray gave the calling actor (run inside it with `__ray_call__`)."""
    info = {"node_id": ray.get_runtime_context().get_node_id(), "gpu_ids": [str(g) for g in ray.get_gpu_ids()],
            "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"), "pid": os.getpid()}
    engine = getattr(actor, "engine", None) or getattr(getattr(actor, "evaluator", None), "engine", None)
    if engine is not None:
        info["device"] = str(engine.device)
    return info


@ray.remote
class Probe:
    """Stands in for an actor of the plan: reports its GPUs and, asked to, the device `auto`
    resolves to (torch's import: 3 s a probe, so only where the test reads it)."""

    def info(self, resolve: bool = False) -> dict:
        if not resolve:
            return actor_info()
        from lm.device import resolve_device

        warnings = []
        handler = logging.Handler()
        handler.emit = lambda record: warnings.append(record.getMessage())
        logging.getLogger("etarl").addHandler(handler)
        devices = {str(resolve_device("auto", "probe")) for _ in range(2)}  # the warning comes once
        return {**actor_info(), "devices": sorted(devices), "warnings": warnings}


def listening(pid: int) -> list[list]:
    """The (address, port) of every socket process `pid` listens on."""
    import psutil

    return [[c.laddr.ip, c.laddr.port] for c in psutil.net_connections(kind="inet")
            if c.pid == pid and c.status == psutil.CONN_LISTEN]


def alive_actors() -> list[str]:
    return [a["ActorClassName"] for a in ray._private.state.actors().values() if a["State"] == "ALIVE"]


def live_placement_groups() -> int:
    return sum(g["state"] != "REMOVED" for g in ray.util.placement_group_table().values())


def place_probes(plan, resolve: bool = False) -> list[dict]:
    """Reserve the plan, start a probe per actor that asks for anything, report (`resolve`: with the
    device `auto` resolves to), release."""
    from services.placement import Placement

    placement = Placement(plan, timeout_s=120)
    try:
        probes = [(role.name, i, Probe.options(**placement.options(role.name, i)).remote())
                  for role in plan.roles if role.bundle for i in range(role.count)]
        seen = [{"role": name, "index": i, **ray.get(p.info.remote(resolve))} for name, i, p in probes]
        for _, _, p in probes:
            ray.kill(p)
        return seen
    finally:
        placement.release()


def four_gpus() -> dict:
    from services.config import build_config
    from services.placement import PlanError, start_ray

    def config(**changes):
        base = {"ray": {"num_cpus": 4, "num_gpus": 4, "worker_num_cpus": 0.5, "learner_num_cpus": 0.5,
                        "log_to_driver": False}, "eval": {"enabled": False}}
        for key, value in changes.items():
            section, _, name = key.partition("__")
            base.setdefault(section, {})[name] = value
        return build_config(base)

    out = {}
    # 3 workers + 1 learner; starts the embedded cluster (the plan is checked before it starts)
    out["three_workers_one_learner"] = place_probes(start_ray(config(rollout__num_workers=3)), resolve=True)
    out["two_ranks_two_workers"] = place_probes(start_ray(config(
        rollout__num_workers=2, learner__distributed={"world_size": 2, "placement": "spread"})))
    out["tensor_parallel"] = place_probes(start_ray(config(
        rollout__num_workers=1, rollout__engine={"kind": "vllm", "tensor_parallel_size": 2})))
    # The embedded default's plan for a machine of one GPU (colocated: one bundle, both actors in it),
    # placed here; then two actors asking for half a GPU each, without a placement group.
    from services.config import load_config
    from services.placement import Cluster, Node, plan_for

    one_gpu = plan_for(load_config(None, ["ray.worker_num_cpus=0.5", "ray.learner_num_cpus=0.5"]),
                       Cluster("one GPU", (Node("local", 4, 1),), ""))
    out["colocated_plan"] = one_gpu.to_dict()
    out["colocated"] = place_probes(one_gpu)
    halves = [Probe.options(num_cpus=0, num_gpus=0.5).remote() for _ in range(2)]
    out["fractional"] = ray.get([p.info.remote() for p in halves])
    for p in halves:
        ray.kill(p)
    out["before_refusal"] = {"actors": alive_actors(), "placement_groups": live_placement_groups()}
    try:
        start_ray(config(rollout__num_workers=4))  # 4 + 1 learner rank
        out["refused"] = None
    except PlanError as exc:
        out["refused"] = str(exc)
    out["after_refusal"] = {"actors": alive_actors(), "placement_groups": live_placement_groups()}
    ray.shutdown()
    return out


def node_view_probe(probe_file, token, node_file, node_name, readable):
    """services.shared_paths.probe_paths as a node whose ETARL_TEST_NODE_ROOT mounts another folder
    at the shared root would see it: every path under the root moves to the node's own folder."""
    from services.shared_paths import probe_paths

    shared, own = os.environ["ETARL_TEST_SHARED_ROOT"], os.environ["ETARL_TEST_NODE_ROOT"]

    def view(path: str) -> str:
        return own + path[len(shared):] if path.startswith(shared) else path

    lines = probe_paths(view(probe_file), token, view(node_file), node_name, {k: view(v) for k, v in readable.items()})
    return [line.replace(own, shared) for line in lines]


def two_nodes(run_dir: str) -> dict:
    from services.audit import audit, read_buffer_log, read_run_log
    from services.buffer_handle import RAY_BUFFER_LOG
    from services.config import load_config
    from services.controller import Controller
    from services.local_ray import loopback_cluster

    shared = Path(run_dir).parent / "shared"
    elsewhere = Path(run_dir).parent / "elsewhere"  # what the second node mounts at the shared root
    (shared / "data").mkdir(parents=True)
    elsewhere.mkdir()
    (shared / "data" / "train.jsonl").write_text("{}\n")
    roots = [{"ETARL_TEST_SHARED_ROOT": str(shared), "ETARL_TEST_NODE_ROOT": str(root)} for root in (shared, elsewhere)]
    cluster = loopback_cluster([{"num_cpus": 2, "num_gpus": 2, "env_vars": env} for env in roots],
                               head={"num_cpus": 1, "num_gpus": 0})
    try:
        ray.init(address=cluster.address, log_to_driver=False, runtime_env={"env_vars": {
            "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}})
        # The embedded default's config, so its tiny model: the one the suite builds once and shares
        # (the config classes' own defaults name another, whose build here took 70 s of CPU).
        cfg = load_config(None, [
            "mode=one_step_off", "run.steps=3", f"run.run_dir={run_dir}", f"run.cache_dir={REPO / '.cache'}",
            "run.eval_every=0", "run.progress=false",
            f"ray.address={cluster.address}", "ray.worker_num_cpus=0.5", "ray.learner_num_cpus=1",
            "ray.log_to_driver=false", "buffer.transport=ray", "buffer.gate.batch_size=2",
            "rollout.num_workers=1", "rollout.engine.kind=hf", "rollout.groups_per_batch=2",
            "rollout.sampling.n=2", "rollout.sampling.max_new_tokens=4",
            "learner.distributed.world_size=2", "learner.distributed.placement=spread",
            "eval.num_prompts=4", "eval.n_samples=0",
        ])
        controller = Controller(cfg)
        try:
            controller.start()
            result = controller.run()
            seen = {
                "driver_node": ray.get_runtime_context().get_node_id(),
                "head_node": [n["NodeID"] for n in ray.nodes() if "node:__internal_head__" in n["Resources"]][0],
                "gpu_nodes": [n["NodeID"] for n in ray.nodes() if n["Resources"].get("GPU")],
                "ranks": controller.learner.where(),
                "rank_listeners": [listening(ray.get(r.__ray_call__.remote(actor_info))["pid"])
                                   for r in controller.learner.ranks],
                "rendezvous": controller.learner.init_method,
                "workers": [ray.get(w.__ray_call__.remote(actor_info)) for w in controller.workers.workers],
                "buffer": ray.get(controller.buffer.actor.__ray_call__.remote(actor_info)),
            }
        finally:
            controller.stop()
        seen["shared_paths"] = shared_path_checks(shared)
        report = audit(read_run_log(run_dir), read_buffer_log(Path(run_dir) / RAY_BUFFER_LOG), cfg.eta)
        seen.update(completed=result.completed, steps=result.steps_done, evals=result.evals, eta=cfg.eta,
                    batch_size=cfg.batch_size, audit_ok=report.ok, audit=str(report),
                    consumed_groups=report.consumed_groups, worst_staleness=report.worst_staleness)
        return seen
    finally:
        ray.shutdown()
        cluster.shutdown()


def shared_path_checks(shared: Path) -> dict:
    """The shared-path check on this cluster: as it is (every node sees the same folders) and as it
    would be if the second GPU node mounted another folder at `shared` (node_view_probe)."""
    import time

    from services.config import ConfigError
    from services.shared_paths import check_shared_paths

    readable = {"rollout.task.path": str(shared / "data" / "train.jsonl")}
    out = {}
    started = time.perf_counter()
    out["shared_nodes"] = check_shared_paths(shared / "run", readable)
    out["shared_s"] = time.perf_counter() - started
    try:
        check_shared_paths(shared / "run", readable, probe=node_view_probe)
        out["split"] = None
    except ConfigError as exc:
        out["split"] = str(exc)
    out["split_node"] = [n["NodeManagerAddress"] + "/" + n["NodeID"][:8] for n in ray.nodes() if n["Alive"]
                         and n["Resources"].get("GPU")]
    out["probe_left"] = sorted(p.name for p in (shared / "run").iterdir())
    return out


if __name__ == "__main__":
    logging.basicConfig(level=logging.WARNING)
    what = sys.argv[1]
    found = four_gpus() if what == "four_gpus" else two_nodes(sys.argv[2])
    print("RESULT " + json.dumps(found))
