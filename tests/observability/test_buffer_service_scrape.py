"""The standalone path, all real processes: `python -m buffer serve` (the ZMQ buffer service),
`python -m services.metrics` (its exporter) and a Prometheus server scraping the exporter. A
client pushes, pulls and acks through the service; Prometheus sees the counts and the staleness."""
from __future__ import annotations

import subprocess
import sys
import time

import numpy as np
import pytest
import yaml

from buffer.client import BufferClient
from buffer.sample import Group, Sample, new_id
from prometheus_server import REPO, PrometheusServer
from services.chaos import free_port

ETA = 1


def make_group(ticket: int, version: int, n: int = 2, tokens: int = 3) -> Group:
    gid = new_id()
    samples = [Sample(sample_id=new_id(), group_id=gid, prompt_ids=np.arange(4, dtype=np.int32),
                      response_ids=np.arange(tokens, dtype=np.int32), rollout_log_probs=np.full(tokens, -0.5, np.float32),
                      loss_mask=np.ones(tokens, np.uint8), reward=1.0, weight_version=version, worker_id="w0",
                      finish_reason="stop", metadata={"ticket": ticket}) for _ in range(n)]
    return Group(gid, samples, ticket)


def start(cmd: list[str], ready: str, log_path) -> subprocess.Popen:
    log = open(log_path, "w+")
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        log.seek(0)
        if ready in log.read():
            return proc
        if proc.poll() is not None:
            break
        time.sleep(0.2)
    proc.kill()
    log.seek(0)
    raise RuntimeError(f"{cmd} did not start:\n{log.read()[-3000:]}")


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("buffer-stack")
    config = tmp / "buffer.yaml"
    config.write_text(yaml.safe_dump({"port": free_port(), "gate": {"batch_size": 1, "eta": ETA}}))
    procs = []
    server = None
    try:
        procs.append(start([sys.executable, "-m", "buffer", "serve", "--config", str(config)], "buffer serving on",
                           tmp / "buffer.log"))
        metrics_port = free_port()
        procs.append(start([sys.executable, "-m", "services.metrics", "--config", str(config), "--port", str(metrics_port),
                            "--interval", "0.5"],
                           "serving the metrics", tmp / "exporter.log"))
        server = PrometheusServer(tmp / "prom", {"etarl-buffer": [f"127.0.0.1:{metrics_port}"]})
        endpoint = f"tcp://127.0.0.1:{yaml.safe_load(config.read_text())['port']}"
        yield BufferClient(endpoint), server, procs
    finally:
        if server is not None:
            server.close()
        for proc in reversed(procs):
            stop(proc)


def test_prometheus_sees_the_buffer_services_counts_and_staleness(stack):
    client, server, _ = stack
    for _ in range(2):  # eta=1, B=1 at version 0: the gate admits exactly two groups
        permit = client.acquire_permit("w0", timeout=5)
        client.push_group(make_group(permit.ticket, version=0), permit.permit_id)
    assert client.acquire_permit("w0", timeout=0) is None
    client.set_version(1)
    batch = client.pull_batch(2, timeout=5)
    client.ack(batch.lease_id)

    server.wait_for("etarl_samples_consumed_total", lambda rows: rows and rows[0]["value"] == 4)
    assert server.query("etarl_buffer_up")[0]["value"] == 1
    assert server.targets_up() == {"etarl-buffer": "up"}
    one = lambda expr: server.query(expr)[0]["value"]  # noqa: E731
    assert one("etarl_samples_pushed_total") == 4
    assert one("etarl_groups_consumed_total") == 2
    assert one("etarl_buffer_version") == 1
    assert one("etarl_staleness_bound_versions") == ETA
    assert one("etarl_buffer_groups") == 0
    buckets = {r["metric"]["le"]: r["value"] for r in server.query("etarl_consumed_staleness_versions_bucket")}
    assert buckets == {"0.0": 0, "1.0": 4, "+Inf": 4}  # pushed at version 0, pulled at version 1
    assert one("etarl_consumed_samples_over_eta_total") == 0
    assert one("etarl_gate_accepted_groups_total") == 2


def test_the_exporter_keeps_answering_when_the_buffer_dies(stack):
    _, server, procs = stack
    buffer_proc = procs[0]
    buffer_proc.kill()
    buffer_proc.wait()
    server.wait_for("etarl_buffer_up", lambda rows: rows and rows[0]["value"] == 0)
    assert server.targets_up() == {"etarl-buffer": "up"}  # the exporter itself answers every scrape
    assert server.query("etarl_samples_consumed_total")[0]["value"] == 4  # the last stats it had
