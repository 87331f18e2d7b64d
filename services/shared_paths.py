"""Before any actor of a run starts: every node that may host one sees the run folder (readable and
writable), the model folder and the data files at the same path as the driver.

A cluster run assumes a shared file system: the learner writes checkpoints on its node and the
driver reads them, every engine loads the model from its own node. Nothing else checks it, and a
node that mounts something else at the path (or nothing) fails the run at its first checkpoint,
hours in. The probe: the driver writes a file with a random token into the run folder; a task on
every other node reads it (same folder, not merely the same path?), writes a file of its own there
(writable?), and reads the model's config.json and the data files; the driver then reads each
node's file. A failure names the node, the path and what to mount. The driver's own node is
checked in the driver (no task), so a single-node run costs a few file operations.
"""
from __future__ import annotations

import logging
import os
import secrets
import shutil
import time
from pathlib import Path

from services.config import ConfigError

log = logging.getLogger("etarl")

PROBE_DIR = ".etarl-shared-probe"
_MOUNT_HINT = ("mount the same shared file system (NFS, CephFS, Lustre, a ReadWriteMany volume: etarl-runs and "
               "etarl-models under KubeRay, deploy/k8s/storage.yaml) at that path on every node")


def probe_paths(probe_file: str, token: str, node_file: str, node_name: str, readable: dict[str, str]) -> list[str]:
    """What this node cannot see: run on each node (a Ray task) and in the driver. `readable`:
    config key -> a file or folder that must be readable. Returns one problem line per failure."""
    problems = []
    try:
        seen = Path(probe_file).read_text()
    except OSError as exc:
        seen = f"<{type(exc).__name__}: {exc.strerror or exc}>"
    if seen != token:
        problems.append(f"run.run_dir: the probe file the driver wrote at {probe_file} is not there "
                        f"(found {seen[:60]!r}): this node has another folder, or none, at "
                        f"{Path(probe_file).parent.parent}")
    else:
        try:
            Path(node_file).write_text(node_name)
        except OSError as exc:
            problems.append(f"run.run_dir: cannot write {node_file} ({exc.strerror or exc}): the run folder must "
                            "be writable on every node (the learner writes checkpoints on its own)")
    for key, path in readable.items():
        target = Path(path)
        try:
            if target.is_dir():
                next(iter(os.scandir(target)), None)
            else:
                with open(target, "rb") as fh:
                    fh.read(1)
        except OSError as exc:
            problems.append(f"{key}: {path} is not readable here ({exc.strerror or exc})")
    return problems


def check_shared_paths(run_dir: str | os.PathLike, readable: dict[str, str], probe=probe_paths,
                       timeout_s: float = 120.0) -> list[str]:
    """Probe every alive node of the connected Ray cluster that can host an actor (it has CPUs
    or GPUs); ConfigError naming node, path and the fix if any of them does not see the paths as
    the driver does. `probe` runs on each node (a stand-in in tests). Returns the nodes checked."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    started = time.perf_counter()
    run_dir = Path(run_dir).resolve()
    readable = {key: str(Path(path).resolve()) for key, path in readable.items()}
    token = secrets.token_hex(16)
    folder = run_dir / PROBE_DIR
    folder.mkdir(parents=True, exist_ok=True)
    probe_file = folder / token
    probe_file.write_text(token)
    me = ray.get_runtime_context().get_node_id()
    nodes = {n["NodeID"]: n["NodeManagerAddress"] + "/" + n["NodeID"][:8] for n in ray.nodes()
             if n.get("Alive") and (n["Resources"].get("CPU", 0) > 0 or n["Resources"].get("GPU", 0) > 0)}
    nodes.setdefault(me, "the driver's node")
    node_file = {node: str(folder / f"{token}.{node[:16]}") for node in nodes}
    problems: dict[str, list[str]] = {}
    try:
        remote = ray.remote(num_cpus=0, max_retries=0)(probe)
        refs = {node: remote.options(scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False)).remote(
                    str(probe_file), token, node_file[node], node, readable) for node in nodes if node != me}
        problems[me] = probe_paths(str(probe_file), token, node_file[me], me, readable)  # the driver's own view
        for node, ref in refs.items():
            try:
                problems[node] = ray.get(ref, timeout=timeout_s)
            except Exception as exc:  # a node that cannot run a task at all is no place for the run either
                problems[node] = [f"the probe task did not finish within {timeout_s:.0f}s: {type(exc).__name__}: {exc}"]
        for node, path in node_file.items():  # a node's file must land in the driver's folder
            if problems[node]:
                continue
            try:
                back = Path(path).read_text()
            except OSError:
                back = None
            if back != node:
                problems[node].append(f"run.run_dir: the file this node wrote at {path} is not in the driver's "
                                      f"{run_dir}: this node writes somewhere else")
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    failed = {node: lines for node, lines in problems.items() if lines}
    if failed:
        report = "\n  ".join(f"node {nodes[node]}: {line}" for node, lines in failed.items() for line in lines)
        raise ConfigError(f"not every node sees the run's files where the driver does:\n  {report}\n"
                          f"  {_MOUNT_HINT}, or point run.run_dir / run.model / the data keys at such a folder")
    # One node is the common case and has nothing to report: said only where nodes were checked.
    log.log(logging.INFO if len(nodes) > 1 else logging.DEBUG,
            "shared paths: %d node(s) see the run folder, the model and the data (%.2fs)", len(nodes),
            time.perf_counter() - started)
    return [nodes[n] for n in nodes]


def run_paths(cfg, model_dir) -> dict[str, str]:
    """config key -> path every node must be able to read: the model folder, the data files and the
    tools environment's tool config."""
    paths = {"run.model": str(model_dir)}
    tool_config = cfg.rollout.multi_turn.environment_kwargs.get("config")
    if cfg.rollout.multi_turn.environment == "tools" and tool_config:
        paths["rollout.multi_turn.environment_kwargs.config"] = tool_config
    task = cfg.rollout.task
    if task.kind == "file":
        paths |= task.files("path")
        if cfg.eval.enabled:
            paths |= task.files("heldout_path")
    return paths
