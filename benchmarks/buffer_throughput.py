"""Buffer service throughput and memory, measured in one run.

1. Raw pair: producers send groups of 4 KB samples over a ZMQ PUSH/PULL pair, encoded and decoded
   (with validation) by the same codec, no service logic: the transport ceiling.
2. Service: the same producers go through the real buffer process on loopback (acquire a permit,
   push the group: two round trips), a learner pulls batches and acks them.
   Prints samples/s of both, their ratio (goal >= 0.5) and p50/p99 of the push round trip.
3. Memory: resident memory the buffer process gains holding 10,000 such samples, against their
   raw array bytes (goal <= 1.5x).

The machine may be shared: raw and service runs alternate for --rounds rounds and the medians
are compared, so a burst of outside load does not land on one side only.

    python benchmarks/buffer_throughput.py [--samples 24000] [--group-size 8] [--producers 4] [--rounds 3]
"""
from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import psutil
import yaml
import zmq

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from buffer.client import BufferClient  # noqa: E402
from buffer.codec import decode_group, encode_group  # noqa: E402
from buffer.sample import Group, Sample, new_id  # noqa: E402

PROMPT_TOKENS, RESPONSE_TOKENS = 64, 295  # 64*4 + 295*(4+4+1+4) = 4091 bytes of arrays per sample


def make_group(ticket: int, n: int, rng: np.random.Generator) -> Group:
    gid = new_id()
    samples = [Sample(sample_id=new_id(), group_id=gid, prompt_ids=rng.integers(0, 32000, PROMPT_TOKENS, dtype=np.int32),
                      response_ids=rng.integers(0, 32000, RESPONSE_TOKENS, dtype=np.int32),
                      rollout_log_probs=-rng.random(RESPONSE_TOKENS, dtype=np.float32),
                      loss_mask=np.ones(RESPONSE_TOKENS, np.uint8), reward=1.0, weight_version=0,
                      worker_id="bench", finish_reason="stop") for _ in range(n)]
    return Group(gid, samples, ticket)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---- producers (child processes) ------------------------------------------------------------

def raw_producer(endpoint: str, groups: int, group_size: int, seed: int, start, cpu) -> None:
    rng = np.random.default_rng(seed)
    payloads = [make_group(i, group_size, rng) for i in range(min(groups, 64))]
    ctx = zmq.Context()
    sock = ctx.socket(zmq.PUSH)
    sock.connect(endpoint)
    start.wait()
    cpu0 = time.process_time()
    for i in range(groups):
        sock.send_multipart(encode_group(payloads[i % len(payloads)]), copy=False)
    sock.close(linger=-1)
    ctx.term()
    cpu.put(time.process_time() - cpu0)


def service_producer(endpoint: str, groups: int, group_size: int, seed: int, start, rtts) -> None:
    rng = np.random.default_rng(seed)
    templates = [make_group(0, group_size, rng) for _ in range(min(groups, 64))]
    client = BufferClient(endpoint)
    times = []
    start.wait()
    cpu0 = time.process_time()
    for i in range(groups):
        permit = client.acquire_permit(f"producer-{seed}", timeout=30)
        t = templates[i % len(templates)]
        gid = new_id()  # fresh ids: the service would (rightly) treat a resend as a duplicate
        samples = [Sample(**{**s.__dict__, "sample_id": new_id(), "group_id": gid}) for s in t.samples]
        group = Group(gid, samples, permit.ticket)
        t0 = time.perf_counter()
        client.push_group(group, permit.permit_id)
        times.append(time.perf_counter() - t0)
    client.close()
    rtts.put((times, time.process_time() - cpu0))


# ---- the three measurements -----------------------------------------------------------------

def server_cpu(proc: psutil.Process) -> float:
    t = proc.cpu_times()
    return t.user + t.system


def run_raw(total_groups: int, group_size: int, producers: int) -> tuple[float, float]:
    """(samples/s, CPU seconds of all processes per sample)."""
    ctx = zmq.Context()
    pull = ctx.socket(zmq.PULL)
    port = pull.bind_to_random_port("tcp://127.0.0.1")
    spawn = mp.get_context("spawn")
    start, cpu = spawn.Event(), spawn.Queue()
    per = total_groups // producers
    procs = [spawn.Process(target=raw_producer, args=(f"tcp://127.0.0.1:{port}", per, group_size, i, start, cpu))
             for i in range(producers)]
    for p in procs:
        p.start()
    time.sleep(1.0)  # let the children import and connect
    start.set()
    t0, cpu0 = time.perf_counter(), time.process_time()
    samples = 0
    for _ in range(per * producers):
        samples += len(decode_group(pull.recv_multipart(copy=False)))
    elapsed, cpu_s = time.perf_counter() - t0, time.process_time() - cpu0
    cpu_s += sum(cpu.get() for _ in procs)
    for p in procs:
        p.join()
    pull.close()
    ctx.term()
    return samples / elapsed, cpu_s / samples


def start_server(workdir: Path, **config) -> tuple[subprocess.Popen, str]:
    port = free_port()
    path = workdir / f"buffer-{port}.yaml"
    path.write_text(yaml.safe_dump({"port": port, **config}))
    proc = subprocess.Popen([sys.executable, "-m", "buffer", "serve", "--config", str(path), "--log-level", "WARNING"],
                            cwd=REPO, stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": str(REPO)})
    line = proc.stdout.readline()
    assert "serving on" in line, line
    return proc, f"tcp://127.0.0.1:{port}"


def run_service(workdir: Path, total_groups: int, group_size: int, producers: int, batch_groups: int):
    server, endpoint = start_server(workdir, gate={"batch_size": batch_groups, "eta": None, "max_concurrent": 256})
    spawn = mp.get_context("spawn")
    start, rtts = spawn.Event(), spawn.Queue()
    per = total_groups // producers
    procs = [spawn.Process(target=service_producer, args=(endpoint, per, group_size, i, start, rtts))
             for i in range(producers)]
    for p in procs:
        p.start()
    learner = BufferClient(endpoint)
    learner.health()
    time.sleep(1.0)
    server_proc = psutil.Process(server.pid)
    server_cpu0 = server_cpu(server_proc)
    start.set()
    t0, cpu0 = time.perf_counter(), time.process_time()
    samples, groups = 0, 0
    while groups < per * producers:
        batch = learner.pull_batch(min(batch_groups, per * producers - groups), timeout=30)
        learner.ack(batch.lease_id)
        groups += len(batch.groups)
        samples += len(batch.samples)
    elapsed = time.perf_counter() - t0
    cpu_s = time.process_time() - cpu0 + server_cpu(server_proc) - server_cpu0
    results = [rtts.get() for _ in procs]
    times = np.concatenate([r[0] for r in results])
    cpu_s += sum(r[1] for r in results)
    for p in procs:
        p.join()
    learner.close()
    server.terminate()
    server.wait()
    return samples / elapsed, np.percentile(times, 50), np.percentile(times, 99), cpu_s / samples


def run_memory(workdir: Path, samples: int, group_size: int) -> tuple[int, int]:
    server, endpoint = start_server(workdir, gate={"batch_size": 8, "eta": None, "max_concurrent": 256})
    rss = psutil.Process(server.pid)
    client = BufferClient(endpoint)
    rng = np.random.default_rng(0)
    template = make_group(0, group_size, rng)
    raw_bytes = 0

    def push_one():
        nonlocal raw_bytes
        permit = client.acquire_permit("mem")
        gid = new_id()
        group = Group(gid, [Sample(**{**s.__dict__, "sample_id": new_id(), "group_id": gid}) for s in template.samples],
                      permit.ticket)
        client.push_group(group, permit.permit_id)
        return sum(s.array_nbytes for s in group.samples)

    for _ in range(8):  # warm up code paths and allocator pools, then drain
        push_one()
    while (batch := client.pull_batch(8)) is not None:
        client.ack(batch.lease_id)
    time.sleep(0.2)
    before = rss.memory_info().rss
    for _ in range(samples // group_size):
        raw_bytes += push_one()
    time.sleep(0.2)
    grown = rss.memory_info().rss - before
    stats = client.stats()
    assert stats["samples_ready"] == samples // group_size * group_size
    client.close()
    server.terminate()
    server.wait()
    return grown, raw_bytes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--samples", type=int, default=24000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--producers", type=int, default=4, help="rollout workers pushing at once")
    parser.add_argument("--batch-groups", type=int, default=8)
    parser.add_argument("--memory-samples", type=int, default=10000)
    args = parser.parse_args()
    groups = args.samples // args.group_size
    sample_bytes = PROMPT_TOKENS * 4 + RESPONSE_TOKENS * 13
    print(f"samples of {sample_bytes} bytes, groups of {args.group_size}, {args.producers} producer processes, "
          f"{groups * args.group_size} samples per run, {os.cpu_count()} CPUs, loadavg {os.getloadavg()[0]:.1f}")
    raws, services, p50s, p99s, raw_cpu, service_cpu = [], [], [], [], [], []
    with tempfile.TemporaryDirectory() as tmp:
        workdir = Path(tmp)
        for _ in range(args.rounds):
            rate, cpu = run_raw(groups, args.group_size, args.producers)
            raws.append(rate)
            raw_cpu.append(cpu)
            service, p50, p99, cpu = run_service(workdir, groups, args.group_size, args.producers, args.batch_groups)
            services.append(service)
            service_cpu.append(cpu)
            p50s.append(p50)
            p99s.append(p99)
        grown, raw_bytes = run_memory(workdir, args.memory_samples, args.group_size)
    print("per round (raw, service) samples/s: " + ", ".join(f"({r:.0f}, {s:.0f})" for r, s in zip(raws, services)))
    raw, service = float(np.median(raws)), float(np.median(services))
    p50, p99 = float(np.median(p50s)), float(np.median(p99s))
    print(f"raw PUSH/PULL + codec : {raw:10.0f} samples/s (median)  ({raw * sample_bytes / 1e6:.0f} MB/s)")
    print(f"buffer service        : {service:10.0f} samples/s (median)  ({service * sample_bytes / 1e6:.0f} MB/s)")
    print(f"ratio service/raw     : {service / raw:10.2f}   (goal >= 0.5)")
    rc, sc = float(np.median(raw_cpu)) * 1e6, float(np.median(service_cpu)) * 1e6
    print(f"CPU per sample        : raw {rc:.0f} us, service {sc:.0f} us (all processes; raw/service = {rc / sc:.2f},"
          " a load-independent view of the same ratio)")
    print(f"push round trip       : p50 {p50 * 1e3:.2f} ms, p99 {p99 * 1e3:.2f} ms  (group of {args.group_size})")
    print(f"memory for {args.memory_samples} samples : {grown / 1e6:.1f} MB resident vs {raw_bytes / 1e6:.1f} MB raw "
          f"arrays = {grown / raw_bytes:.2f}x   (goal <= 1.5x)")


if __name__ == "__main__":
    main()
