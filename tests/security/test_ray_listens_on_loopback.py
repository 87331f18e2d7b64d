"""A local run's Ray cluster listens on 127.0.0.1 only: every listening socket of every Ray
process (GCS, raylet, core workers, agents, autoscaler monitor, the driver itself) of the
cluster `etarl train` embeds (services.controller.start_ray).

The control run starts Ray the way etarl did before (`ray.init(_node_ip_address="127.0.0.1")`):
Ray replaces that address by the machine's routable one and its servers bind every interface, which
shows the listing sees what it must catch (and notices a Ray upgrade that changes the default)."""
import ipaddress
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

# Runs in its own process: the test session may hold a Ray cluster of its own.
PROBE = r'''
import json, os, sys, time
import psutil, ray

if sys.argv[1] == "etarl":
    from services.config import build_config
    from services.controller import start_ray
    start_ray(build_config({"ray": {"num_cpus": 2, "log_to_driver": False}, "eval": {"enabled": False}}))
else:  # the call etarl made before services.local_ray
    ray.init(num_cpus=2, _node_ip_address="127.0.0.1", include_dashboard=False, log_to_driver=False)

@ray.remote
class Probe:
    def pid(self):
        return os.getpid()

probe = Probe.remote()  # held: an actor whose handle is dropped exits, and its sockets with it
probe_pid = ray.get(probe.pid.remote())  # an actor's core worker listens too
me = psutil.Process()
started = time.time()
deadline = started + 150
while True:  # the agents open their ports a little after ray.init returns
    procs = {p.pid: p for p in [me, *me.children(recursive=True)]}
    sockets = []
    for c in psutil.net_connections(kind="inet"):
        if c.status == psutil.CONN_LISTEN and c.pid in procs:
            try:  # the probe by its pid: its process title changes to ray::Probe only a moment later
                name = "ray::Probe" if c.pid == probe_pid else " ".join(procs[c.pid].cmdline())[:200]
            except psutil.Error:
                name = "?"
            sockets.append([c.laddr.ip, c.laddr.port, name])
    names = " ".join(s[2] for s in sockets)
    if all(part in names for part in ("gcs_server", "raylet", "DashboardAgent", "RuntimeEnvAgent", "ray::Probe")) \
            or time.time() > deadline:
        break
    time.sleep(0.5)
waited = time.time() - started
node_ip = ray._private.worker._global_node.node_ip_address
ray.shutdown()
print("PROBE " + json.dumps({"node_ip": node_ip, "sockets": sockets, "waited_s": round(waited, 1),
                             "auth_mode": os.environ.get("RAY_AUTH_MODE")}))
'''


def ray_listeners(mode: str) -> dict:
    out = subprocess.run([sys.executable, "-c", PROBE, mode], cwd=REPO, capture_output=True, text=True,
                         timeout=240, env={**os.environ, "PYTHONPATH": str(REPO)})
    lines = [line for line in out.stdout.splitlines() if line.startswith("PROBE ")]
    assert out.returncode == 0 and lines, out.stderr[-3000:]
    return {**json.loads(lines[-1][len("PROBE "):]), "stderr": out.stderr}


def is_loopback(ip: str) -> bool:
    address = ipaddress.ip_address(ip)
    mapped = getattr(address, "ipv4_mapped", None)  # ::ffff:127.0.0.1 on a dual-stack socket
    return address.is_loopback or bool(mapped and mapped.is_loopback)


def server_names(sockets) -> set[str]:
    kinds = ("gcs_server", "raylet", "DashboardAgent", "RuntimeEnvAgent", "monitor.py", "ray::Probe")
    return {kind for _, _, name in sockets for kind in kinds if kind in name}


def test_an_embedded_ray_cluster_listens_on_loopback_only():
    probe = ray_listeners("etarl")
    sockets = probe["sockets"]
    # The listing saw Ray's servers, so "no offender" means something. (The autoscaler monitor's
    # metrics port is fixed, 44217: with another Ray cluster on the machine it listens in that one.)
    assert server_names(sockets) >= {"gcs_server", "raylet", "DashboardAgent", "RuntimeEnvAgent", "ray::Probe"}, \
        f"after {probe['waited_s']} s: {sockets}"
    offenders = [s for s in sockets if not is_loopback(s[0])]
    assert not offenders, offenders
    assert probe["node_ip"] == "127.0.0.1"
    # token authentication on (Ray's default for a new local cluster), without Ray's notice saying so
    assert probe["auth_mode"] == "token"
    assert "Token authentication" not in probe["stderr"], probe["stderr"][-2000:]


def test_without_local_only_mode_ray_binds_every_interface():
    probe = ray_listeners("plain")
    if is_loopback(probe["node_ip"]):
        pytest.skip("this machine has no routable address: Ray falls back to loopback by itself")
    wide = {kind for kind in server_names([s for s in probe["sockets"] if not is_loopback(s[0])])}
    # The core gRPC servers and both agents are reachable from the network without the switch.
    assert {"gcs_server", "raylet", "DashboardAgent", "RuntimeEnvAgent", "ray::Probe"} <= wide, probe["sockets"]
