"""Buffer service throughput and memory, measured in one run.

1. Raw pair: producers send groups of 4 KB samples over a ZMQ PUSH/PULL pair, encoded and decoded
   (with validation) by the same codec, no service logic: the transport ceiling.
2. Service: the same producers go through the real buffer process on loopback the way a rollout
   worker does (push the groups of one engine batch in one request, which also takes the permits
   of the next batch: `push_and_acquire`), and a learner pulls batches of B groups and ends each
   step as the controller does (`ack` with the new version, one request). Request patterns, each
   its own run:
   - one group per request, permit and push apart (the protocol's floor);
   - the embedded default run's sizes: 4-group engine batches, B = 8 (--groups-per-request,
     --batch-groups), the worker's requests;
   - the same with the permits taken in a request of their own (the worker before it pipelined);
   - GPU-scale sizes (--large, default 16-group engine batches, B = 32): a vLLM engine on a GPU
     batches far more than the CPU demo, and learners step on tens to hundreds of groups.
   Prints samples/s, the ratio to the raw pair (goal >= 0.5), CPU per sample by process and
   p50/p99 of the push round trip. On a machine with fewer cores than processes the stages share
   the cores, so the ratio follows the CPU ratio.
3. Memory: resident memory the buffer process gains holding 10,000 such samples, against their
   raw array bytes (goal <= 1.5x).

The machine may be shared: raw and service runs alternate for --rounds rounds and the medians
are compared, so a burst of outside load does not land on one side only; the ratio is also given
round by round (each service run against the raw run just before it), median and range.

    python benchmarks/buffer_throughput.py [--samples 24000] [--group-size 8] [--producers 4] [--rounds 3]
                                           [--groups-per-request 4] [--batch-groups 8] [--large 16/32]
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


def fresh_group(template: Group, ticket: int) -> Group:
    """The template's arrays under fresh ids, as a worker builds each group it pushes (both sides
    do this: the service would rightly treat a resent id as a duplicate)."""
    gid = new_id()
    return Group(gid, [Sample(**{**s.__dict__, "sample_id": new_id(), "group_id": gid}) for s in template.samples],
                 ticket)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---- producers (child processes) ------------------------------------------------------------

def raw_producer(endpoint: str, groups: int, group_size: int, seed: int, start, cpu) -> None:
    rng = np.random.default_rng(seed)
    templates = [make_group(0, group_size, rng) for _ in range(min(groups, 64))]
    ctx = zmq.Context()
    sock = ctx.socket(zmq.PUSH)
    sock.connect(endpoint)
    start.wait()
    cpu0 = time.process_time()
    for i in range(groups):
        sock.send_multipart(encode_group(fresh_group(templates[i % len(templates)], i)), copy=False)
    sock.close(linger=-1)
    ctx.term()
    cpu.put(time.process_time() - cpu0)


def service_producer(endpoint: str, groups: int, group_size: int, per_request: int, pipelined: bool, seed: int,
                     start, rtts) -> None:
    """Take up to `per_request` permits (what a worker generates in one engine batch), build their
    groups, push them in one request. `pipelined` (the rollout worker's way): the push also takes
    the next permits (`push_and_acquire`, one round trip per batch instead of two)."""
    rng = np.random.default_rng(seed)
    templates = [make_group(0, group_size, rng) for _ in range(min(groups, 64))]
    client = BufferClient(endpoint)
    times = []
    start.wait()
    cpu0 = time.process_time()
    done, permits, worker = 0, [], f"producer-{seed}"
    while done < groups:
        permits = permits or client.acquire_permits(worker, min(per_request, groups - done), timeout=30)
        batch = [fresh_group(templates[(done + k) % len(templates)], p.ticket) for k, p in enumerate(permits)]
        done += len(permits)
        ids = [p.permit_id for p in permits]
        t0 = time.perf_counter()
        if pipelined:
            _, permits = client.push_and_acquire(batch, ids, worker, min(per_request, groups - done))
        else:
            client.push_groups(batch, ids)
            permits = []
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


def run_service(workdir: Path, total_groups: int, group_size: int, producers: int, batch_groups: int, per_request: int,
                pipelined: bool):
    server, endpoint = start_server(workdir, gate={"batch_size": batch_groups, "eta": None, "max_concurrent": 256})
    spawn = mp.get_context("spawn")
    start, rtts = spawn.Event(), spawn.Queue()
    per = total_groups // producers
    procs = [spawn.Process(target=service_producer, args=(endpoint, per, group_size, per_request, pipelined, i, start, rtts))
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
    samples, groups, version = 0, 0, 0
    batch = learner.pull_batch(batch_groups, timeout=30)
    while True:  # the controller's loop: a step's end (ack, new version) takes the next batch
        groups, samples, version = groups + len(batch.groups), samples + len(batch.samples), version + 1
        if groups == per * producers:
            learner.ack(batch.lease_id, version=version)
            break
        batch = learner.pull_batch(min(batch_groups, per * producers - groups), timeout=30,
                                   ack_lease_id=batch.lease_id, version=version)
    elapsed = time.perf_counter() - t0
    cpu = {"learner": time.process_time() - cpu0, "server": server_cpu(server_proc) - server_cpu0}
    results = [rtts.get() for _ in procs]
    times = np.concatenate([r[0] for r in results])
    cpu["producers"] = sum(r[1] for r in results)
    for p in procs:
        p.join()
    learner.close()
    server.terminate()
    server.wait()
    cpu = {part: seconds / samples for part, seconds in cpu.items()}
    return samples / elapsed, np.percentile(times, 50), np.percentile(times, 99), cpu


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
        group = fresh_group(template, permit.ticket)
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
    parser.add_argument("--batch-groups", type=int, default=8, help="groups per learner pull (B of the default run)")
    parser.add_argument("--groups-per-request", type=int, default=4,
                        help="permits taken and groups pushed per request (the rollout worker's groups_per_batch "
                             "default)")
    parser.add_argument("--large", default="16/32", help="GPU-scale sizes: groups per request / groups per pull")
    parser.add_argument("--memory-samples", type=int, default=10000)
    args = parser.parse_args()
    groups = args.samples // args.group_size
    sample_bytes = PROMPT_TOKENS * 4 + RESPONSE_TOKENS * 13
    print(f"samples of {sample_bytes} bytes, groups of {args.group_size}, {args.producers} producer processes, "
          f"{groups * args.group_size} samples per run, {os.cpu_count()} CPUs, loadavg {os.getloadavg()[0]:.1f}")
    k, b = args.groups_per_request, args.batch_groups
    large_k, large_b = (int(x) for x in args.large.split("/"))
    # (label, groups per request, groups per pull, pipelined)
    patterns = [(f"one group per request, permit and push apart, B = {b}", 1, b, False),
                (f"default run sizes: {k} groups per request, next permits taken with the push (the rollout "
                 f"worker's requests), B = {b}", k, b, True),
                (f"the same, permits taken in a request of their own", k, b, False),
                (f"GPU-scale sizes: {large_k} groups per request (the worker's requests), B = {large_b}", large_k,
                 large_b, True)]
    raws, raw_cpu = [], []
    service = {p: {"rate": [], "p50": [], "p99": [], "cpu": []} for p in patterns}
    with tempfile.TemporaryDirectory() as tmp:
        workdir = Path(tmp)
        for round_ in range(args.rounds):
            rate, cpu = run_raw(groups, args.group_size, args.producers)
            raws.append(rate)
            raw_cpu.append(cpu)
            for pattern in patterns:
                _, per_request, pull, pipelined = pattern
                rate, p50, p99, cpu = run_service(workdir, groups, args.group_size, args.producers, pull, per_request,
                                                  pipelined)
                for key, value in (("rate", rate), ("p50", p50), ("p99", p99), ("cpu", cpu)):
                    service[pattern][key].append(value)
            print(f"round {round_ + 1}/{args.rounds}: raw {raws[-1]:.0f} samples/s, service "
                  + ", ".join(f"{service[p]['rate'][-1]:.0f}" for p in patterns), flush=True)
        grown, raw_bytes = run_memory(workdir, args.memory_samples, args.group_size)
    raw, rc = float(np.median(raws)), float(np.median(raw_cpu)) * 1e6
    print(f"raw PUSH/PULL + codec : {raw:10.0f} samples/s (median)  ({raw * sample_bytes / 1e6:.0f} MB/s), "
          f"CPU {rc:.0f} us per sample (all processes)")
    for pattern in patterns:
        m = service[pattern]
        rate = float(np.median(m["rate"]))
        paired = np.array(m["rate"]) / np.array(raws)  # each round's service run against the raw run just before it
        cpu = {part: float(np.median([c[part] for c in m["cpu"]])) * 1e6 for part in m["cpu"][0]}
        total = sum(cpu.values())
        print(f"buffer service, {pattern[0]}:")
        print(f"  samples/s           : {rate:10.0f} (median)  ({rate * sample_bytes / 1e6:.0f} MB/s)")
        print(f"  ratio service/raw   : {rate / raw:10.2f}   (goal >= 0.5; round by round, each against the raw run "
              f"just before it: median {np.median(paired):.2f}, range {paired.min():.2f}-{paired.max():.2f})")
        print(f"  CPU per sample      : {total:.0f} us (raw/service = {rc / total:.2f}, a load-independent view); "
              + ", ".join(f"{part} {us:.0f} us" for part, us in cpu.items()))
        print(f"  push round trip     : p50 {np.median(m['p50']) * 1e3:.2f} ms, p99 {np.median(m['p99']) * 1e3:.2f} ms")
    print(f"memory for {args.memory_samples} samples : {grown / 1e6:.1f} MB resident vs {raw_bytes / 1e6:.1f} MB raw "
          f"arrays = {grown / raw_bytes:.2f}x   (goal <= 1.5x)")


if __name__ == "__main__":
    main()
