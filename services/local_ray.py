"""A single-machine Ray cluster whose every listening socket is on 127.0.0.1.

Ray's servers (GCS, raylet node manager and object manager, core workers, dashboard and runtime-env
agents, the autoscaler monitor) bind the loopback address when the node's address is loopback and
every interface otherwise. Asking for `_node_ip_address="127.0.0.1"` is not enough: `ray.init`
replaces a loopback address by the machine's routable one (`ray._private.services.
resolve_ip_for_localhost`) unless Ray is in its local-only mode, the macOS/Windows default, switched
by `RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0` (Ray 2.60). That variable is read once, when `ray` is
first imported, which may have happened before a local run starts (the test session, other
imports), so the constant it sets is set here instead. Local-only mode also refuses `ray start
--address` joins, which a local run never does. tests/security/test_ray_listens_on_loopback.py
lists every listening socket of an embedded cluster and fails if this stops working.
"""
from __future__ import annotations

import logging

LOOPBACK = "127.0.0.1"


def local_only_mode() -> None:
    """Ray's local-only mode: nodes started from this process keep a loopback address."""
    from ray._private import ray_constants

    if not hasattr(ray_constants, "ENABLE_RAY_CLUSTER"):
        raise RuntimeError("this Ray has no ray_constants.ENABLE_RAY_CLUSTER: cannot keep a local Ray "
                           "cluster on 127.0.0.1; see services/local_ray.py")
    ray_constants.ENABLE_RAY_CLUSTER = False  # = RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0, read at call time


# Ray's system config for a cluster that starts no idle workers ahead of its tasks and actors (each
# starts its own when it needs one). Not `etarl train`'s: its first actors may take prestarted ones,
# and a 6-step run cost the same with and without them (43.7 vs 43.0 CPU-s, three runs each).
NO_PRESTART = {"enable_worker_prestart": False, "prestart_worker_first_driver": False}


def init_local_ray(**init_kwargs):
    """`ray.init` of a new local cluster bound to 127.0.0.1, without the dashboard's web UI."""
    import ray

    local_only_mode()
    # "local": always a new cluster. Without it, ray.init joins a cluster another process (or a
    # killed one, through a stale /tmp/ray/ray_current_cluster) left on this machine.
    init_kwargs.setdefault("address", "local")
    # Ray turns token authentication on for a new local cluster (tests/security checks that it
    # refuses calls without the token) and warns that it did, on every run: noise on the first
    # screen, kept quiet here (with RAY_AUTH_MODE set, Ray says nothing either way).
    notice = logging.getLogger("ray._private.authentication.authentication_token_setup")
    level = notice.level
    notice.setLevel(logging.ERROR)
    try:
        return ray.init(_node_ip_address=LOOPBACK, include_dashboard=False, **init_kwargs)
    finally:
        notice.setLevel(level)


def loopback_cluster(nodes: list[dict], head: dict | None = None):
    """Several Ray nodes on this machine, all on 127.0.0.1 (`ray.cluster_utils.Cluster`): a head
    node (`head`: its ray start options, e.g. {"num_cpus": 1}) and one node per entry of `nodes`
    (e.g. {"num_cpus": 2, "num_gpus": 2}: GPUs may be declared, not real). For placement tests;
    connect with `ray.init(address=cluster.address)`, end with `cluster.shutdown()`."""
    from ray.cluster_utils import Cluster

    local_only_mode()
    # A placement test's actors ask for their own workers (in a head and two nodes, seven
    # prestarted ones sat idle to the end, 17 s of CPU).
    cluster = Cluster(initialize_head=True, head_node_args={"node_ip_address": LOOPBACK, "include_dashboard": False,
                                                            "_system_config": NO_PRESTART, **(head or {})})
    for node in nodes:
        cluster.add_node(node_ip_address=LOOPBACK, **node)
    return cluster
