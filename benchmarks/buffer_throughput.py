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
   - GPU-scale sizes (--gpu-scale, default 16-group engine batches, B = 32): a vLLM engine on a
     GPU batches far more than the CPU demo, and learners step on tens to hundreds of groups.
   Prints samples/s, the ratio to the raw pair (goal >= 0.5), CPU per sample by process and
   p50/p99 of the push round trip. On a machine with fewer cores than processes the stages share
   the cores, so the ratio follows the CPU ratio.
3. Memory: resident memory the buffer process gains holding 10,000 such samples, against their
   raw array bytes (goal <= 1.5x).

The machine may be shared: raw and service runs alternate for --rounds rounds and the medians
are compared, so a burst of outside load does not land on one side only; the ratio is also given
round by round (each service run against the raw run just before it), median and range.

`--large`: real sample sizes instead. Groups of 16 samples of 1,024 prompt + 8,192 response tokens
(1.8 MB a group) through the service with its durable log on (`fsync: interval`, compacting in
the background as it grows) against the raw pair with the same frames: MB/s of both and their
ratio (goal >= 0.5), push p50/p99 with and without a compaction running (goal: p99 during <= 2x
p99 without), the longest push and the longest lock hold of a compaction, and the resident memory
of the buffer holding --large-hold groups against their bytes (goal <= 1.5x). Also a bare relay
with the same frames: producers -> a process that appends each group with its CRC32 to a file and
sends it on -> the receiver, no validation, no bookkeeping, no fsync: the most any service that
logs and forwards the bytes can do on this machine, against the same raw pair.

    python benchmarks/buffer_throughput.py [--samples 24000] [--group-size 8] [--producers 4] [--rounds 3]
                                           [--groups-per-request 4] [--batch-groups 8] [--gpu-scale 16/32]
    python benchmarks/buffer_throughput.py --large [--large-groups 240] [--rounds 2]

The last line printed is a JSON summary.
"""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import subprocess
import sys
import tempfile
import time
import zlib
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
from services.chaos import free_port  # noqa: E402

SMALL = (64, 295)  # (prompt, response) tokens: 64*4 + 295*(4+4+1+4) = 4091 bytes of arrays per sample
LARGE = (1024, 8192)  # 110,592 bytes per sample; 1.77 MB per group of 16


def sample_bytes(shape: tuple[int, int]) -> int:
    prompt, response = shape
    return prompt * 4 + response * 13


def make_group(ticket: int, n: int, rng: np.random.Generator, shape: tuple[int, int] = SMALL) -> Group:
    prompt, response = shape
    gid = new_id()
    samples = [Sample(sample_id=new_id(), group_id=gid, prompt_ids=rng.integers(0, 32000, prompt, dtype=np.int32),
                      response_ids=rng.integers(0, 32000, response, dtype=np.int32),
                      rollout_log_probs=-rng.random(response, dtype=np.float32),
                      loss_mask=np.ones(response, np.uint8), reward=1.0, weight_version=0,
                      worker_id="bench", finish_reason="stop") for _ in range(n)]
    return Group(gid, samples, ticket)


def templates(groups: int, group_size: int, seed: int, shape: tuple[int, int]) -> list[Group]:
    rng = np.random.default_rng(seed)
    return [make_group(0, group_size, rng, shape) for _ in range(min(groups, 64 if shape == SMALL else 4))]


def fresh_group(template: Group, ticket: int) -> Group:
    """The template's arrays under fresh ids, as a worker builds each group it pushes (both sides
    do this: the service would rightly treat a resent id as a duplicate)."""
    gid = new_id()
    return Group(gid, [Sample(**{**s.__dict__, "sample_id": new_id(), "group_id": gid}) for s in template.samples],
                 ticket)


# ---- producers (child processes) ------------------------------------------------------------

def raw_producer(endpoint: str, groups: int, group_size: int, seed: int, start, cpu, shape=SMALL) -> None:
    kinds = templates(groups, group_size, seed, shape)
    ctx = zmq.Context()
    sock = ctx.socket(zmq.PUSH)
    sock.connect(endpoint)
    start.wait()
    cpu0 = time.process_time()
    for i in range(groups):
        sock.send_multipart(encode_group(fresh_group(kinds[i % len(kinds)], i)), copy=False)
    sock.close(linger=-1)
    ctx.term()
    cpu.put(time.process_time() - cpu0)


def service_producer(endpoint: str, groups: int, group_size: int, per_request: int, pipelined: bool, seed: int,
                     start, rtts, shape=SMALL) -> None:
    """Take up to `per_request` permits (what a worker generates in one engine batch), build their
    groups, push them in one request. `pipelined` (the rollout worker's way): the push also takes
    the next permits (`push_and_acquire`, one round trip per batch instead of two)."""
    kinds = templates(groups, group_size, seed, shape)
    client = BufferClient(endpoint)
    times = []  # (wall-clock start, seconds) of each push
    start.wait()
    cpu0 = time.process_time()
    done, permits, worker = 0, [], f"producer-{seed}"
    while done < groups:
        permits = permits or client.acquire_permits(worker, min(per_request, groups - done), timeout=30)
        batch = [fresh_group(kinds[(done + k) % len(kinds)], p.ticket) for k, p in enumerate(permits)]
        done += len(permits)
        ids = [p.permit_id for p in permits]
        wall, t0 = time.time(), time.perf_counter()
        if pipelined:
            _, permits = client.push_and_acquire(batch, ids, worker, min(per_request, groups - done))
        else:
            client.push_groups(batch, ids)
            permits = []
        times.append((wall, time.perf_counter() - t0))
    client.close()
    rtts.put((times, time.process_time() - cpu0))


# ---- the three measurements -----------------------------------------------------------------

def server_cpu(proc: psutil.Process) -> float:
    t = proc.cpu_times()
    return t.user + t.system


def raw_relay(groups: int, log_path: str | None, consumer: str, ports, start, cpu) -> None:
    """The least a store-and-forward service can do with each group: take it in, append it to a
    file with a CRC32 (what a durable log needs to find a torn write; not with `log_path` None),
    and send it on. No Python bookkeeping, no validation, no fsync."""
    ctx = zmq.Context()
    pull, push = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
    ports.put(pull.bind_to_random_port("tcp://127.0.0.1"))
    push.connect(consumer)
    fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600) if log_path else -1
    start.wait()
    cpu0 = time.process_time()
    for _ in range(groups):
        frames = pull.recv_multipart(copy=False)
        if fd >= 0:
            views = [memoryview(f) for f in frames]
            checks = [zlib.crc32(v) for v in views]
            os.writev(fd, [np.array(checks, np.uint32).tobytes(), *views])
        push.send_multipart(frames, copy=False)
    if fd >= 0:
        os.close(fd)
    push.close(linger=-1)
    pull.close()
    ctx.term()
    cpu.put(time.process_time() - cpu0)


def run_raw(total_groups: int, group_size: int, producers: int, shape=SMALL, relay: bool = False,
            relay_log: Path | None = None) -> tuple[float, float]:
    """(samples/s, CPU seconds of all processes per sample). `relay`: the producers send to a
    `raw_relay` that sends each group on to the receiver (two hops), logging it to `relay_log`."""
    ctx = zmq.Context()
    pull = ctx.socket(zmq.PULL)
    port = pull.bind_to_random_port("tcp://127.0.0.1")
    spawn = mp.get_context("spawn")
    start, cpu = spawn.Event(), spawn.Queue()
    per = total_groups // producers
    endpoint, helpers = f"tcp://127.0.0.1:{port}", []
    if relay:
        ports = spawn.Queue()
        log_path = None if relay_log is None else str(relay_log)
        helpers = [spawn.Process(target=raw_relay, args=(per * producers, log_path, endpoint, ports, start, cpu))]
        helpers[0].start()
        endpoint = f"tcp://127.0.0.1:{ports.get(timeout=60)}"
    procs = [spawn.Process(target=raw_producer, args=(endpoint, per, group_size, i, start, cpu, shape))
             for i in range(producers)]
    for p in procs:
        p.start()
    procs += helpers
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
                pipelined: bool, shape=SMALL, **server_config):
    """(samples/s, push times [(wall start, seconds)], CPU seconds per sample by process, the
    server's final stats)."""
    server, endpoint = start_server(workdir, gate={"batch_size": batch_groups, "eta": None, "max_concurrent": 256},
                                    **server_config)
    try:
        rate, times, cpu, stats = drive_service(endpoint, server.pid, total_groups, group_size, producers,
                                                batch_groups, per_request, pipelined, shape)
    finally:
        server.terminate()
        server.wait()
    return rate, times, cpu, stats


def settled_stats(learner: BufferClient, timeout: float = 300.0) -> dict:
    """The server's stats once no compaction is under way (the last push or ack may have started
    one; it is counted, with its window, when it swaps in)."""
    deadline = time.monotonic() + timeout
    stats = learner.stats()
    while stats.get("log_compaction_running") and time.monotonic() < deadline:
        time.sleep(0.05)
        stats = learner.stats()
    if stats.get("log_compaction_running"):
        raise RuntimeError(f"a log compaction still ran {timeout:.0f} s after the last ack")
    return stats


def drive_service(endpoint, server_pid, total_groups, group_size, producers, batch_groups, per_request, pipelined,
                  shape):
    spawn = mp.get_context("spawn")
    start, rtts = spawn.Event(), spawn.Queue()
    per = total_groups // producers
    procs = [spawn.Process(target=service_producer,
                           args=(endpoint, per, group_size, per_request, pipelined, i, start, rtts, shape))
             for i in range(producers)]
    for p in procs:
        p.start()
    learner = BufferClient(endpoint)
    learner.health()
    time.sleep(1.0)
    server_proc = psutil.Process(server_pid)
    server_cpu0 = server_cpu(server_proc)
    start.set()
    t0, cpu0 = time.perf_counter(), time.process_time()
    samples, groups, version = 0, 0, 0
    batch = None
    while batch is None:  # producers start at their own pace on a loaded machine
        if not any(p.is_alive() for p in procs):
            raise RuntimeError("the producers ended before the first batch")
        batch = learner.pull_batch(batch_groups, timeout=30)
    while True:  # the controller's loop: a step's end (ack, new version) takes the next batch
        groups, samples, version = groups + len(batch.groups), samples + len(batch.samples), version + 1
        if groups == per * producers:
            learner.ack(batch.lease_id, version=version)
            break
        want = min(batch_groups, per * producers - groups)
        following = learner.pull_batch(want, timeout=30, ack_lease_id=batch.lease_id, version=version)
        while following is None:
            if not any(p.is_alive() for p in procs):
                raise RuntimeError(f"the producers ended before {per * producers} groups arrived ({groups} did)")
            following = learner.pull_batch(want, timeout=30)
        batch = following
    elapsed = time.perf_counter() - t0
    cpu = {"learner": time.process_time() - cpu0, "server": server_cpu(server_proc) - server_cpu0}
    results = [rtts.get() for _ in procs]
    times = [t for r in results for t in r[0]]
    cpu["producers"] = sum(r[1] for r in results)
    for p in procs:
        p.join()
    stats = settled_stats(learner)
    learner.close()
    return samples / elapsed, times, {part: seconds / samples for part, seconds in cpu.items()}, stats


def run_memory(workdir: Path, samples: int, group_size: int, shape=SMALL, **server_config) -> tuple[int, int]:
    """(resident bytes the buffer process gains holding `samples` samples, their array bytes)."""
    server, endpoint = start_server(workdir, gate={"batch_size": 8, "eta": None, "max_concurrent": 256},
                                    **server_config)
    try:
        return measure_memory(psutil.Process(server.pid), BufferClient(endpoint), samples, group_size, shape)
    finally:
        server.terminate()
        server.wait()


def measure_memory(rss: psutil.Process, client: BufferClient, samples: int, group_size: int, shape) -> tuple[int, int]:
    template = make_group(0, group_size, np.random.default_rng(0), shape)

    def push_one() -> int:
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
    raw_bytes = sum(push_one() for _ in range(samples // group_size))
    time.sleep(0.2)
    grown = rss.memory_info().rss - before
    assert client.stats()["samples_ready"] == samples // group_size * group_size
    client.close()
    return grown, raw_bytes


def percentiles(times: list[tuple[float, float]]) -> tuple[float, float]:
    seconds = [t for _, t in times]
    return float(np.percentile(seconds, 50)), float(np.percentile(seconds, 99))


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
    parser.add_argument("--gpu-scale", default="16/32", help="GPU-scale batching: groups per request / groups per pull")
    parser.add_argument("--memory-samples", type=int, default=10000)
    parser.add_argument("--large", action="store_true", help="real sample sizes with the durable log (see above)")
    parser.add_argument("--large-groups", type=int, default=240, help="--large: groups of 16 pushed per run")
    parser.add_argument("--large-hold", type=int, default=96, help="--large: groups held for the memory measurement")
    parser.add_argument("--compact-mb", type=int, default=64, help="--large: the log's compact_min_bytes, in MB")
    parser.add_argument("--no-log", action="store_true",
                        help="--large without the durable log: what the log costs (compare the ratios)")
    args = parser.parse_args()
    summary = run_large(args) if args.large else run_patterns(args)
    print(json.dumps(summary))


def run_patterns(args) -> dict:
    groups = args.samples // args.group_size
    size = sample_bytes(SMALL)
    print(f"samples of {size} bytes, groups of {args.group_size}, {args.producers} producer processes, "
          f"{groups * args.group_size} samples per run, {os.cpu_count()} CPUs, loadavg {os.getloadavg()[0]:.1f}")
    k, b = args.groups_per_request, args.batch_groups
    large_k, large_b = (int(x) for x in args.gpu_scale.split("/"))
    # (label, groups per request, groups per pull, pipelined)
    patterns = [(f"one group per request, permit and push apart, B = {b}", 1, b, False),
                (f"default run sizes: {k} groups per request, next permits taken with the push (the rollout "
                 f"worker's requests), B = {b}", k, b, True),
                ("the same, permits taken in a request of their own", k, b, False),
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
                rate, times, cpu, _ = run_service(workdir, groups, args.group_size, args.producers, pull, per_request,
                                                  pipelined)
                p50, p99 = percentiles(times)
                for key, value in (("rate", rate), ("p50", p50), ("p99", p99), ("cpu", cpu)):
                    service[pattern][key].append(value)
            print(f"round {round_ + 1}/{args.rounds}: raw {raws[-1]:.0f} samples/s, service "
                  + ", ".join(f"{service[p]['rate'][-1]:.0f}" for p in patterns), flush=True)
        grown, raw_bytes = run_memory(workdir, args.memory_samples, args.group_size)
    raw, rc = float(np.median(raws)), float(np.median(raw_cpu)) * 1e6
    print(f"raw PUSH/PULL + codec : {raw:10.0f} samples/s (median)  ({raw * size / 1e6:.0f} MB/s), "
          f"CPU {rc:.0f} us per sample (all processes)")
    summary = {"raw_samples_per_s": round(raw), "patterns": []}
    for pattern in patterns:
        m = service[pattern]
        rate = float(np.median(m["rate"]))
        paired = np.array(m["rate"]) / np.array(raws)  # each round's service run against the raw run just before it
        cpu = {part: float(np.median([c[part] for c in m["cpu"]])) * 1e6 for part in m["cpu"][0]}
        total = sum(cpu.values())
        print(f"buffer service, {pattern[0]}:")
        print(f"  samples/s           : {rate:10.0f} (median)  ({rate * size / 1e6:.0f} MB/s)")
        print(f"  ratio service/raw   : {rate / raw:10.2f}   (goal >= 0.5; round by round, each against the raw run "
              f"just before it: median {np.median(paired):.2f}, range {paired.min():.2f}-{paired.max():.2f})")
        print(f"  CPU per sample      : {total:.0f} us (raw/service = {rc / total:.2f}, a load-independent view); "
              + ", ".join(f"{part} {us:.0f} us" for part, us in cpu.items()))
        print(f"  push round trip     : p50 {np.median(m['p50']) * 1e3:.2f} ms, p99 {np.median(m['p99']) * 1e3:.2f} ms")
        summary["patterns"].append({"pattern": pattern[0], "samples_per_s": round(rate), "ratio": round(rate / raw, 3),
                                    "push_p99_ms": round(float(np.median(m["p99"])) * 1e3, 2)})
    print(f"memory for {args.memory_samples} samples : {grown / 1e6:.1f} MB resident vs {raw_bytes / 1e6:.1f} MB raw "
          f"arrays = {grown / raw_bytes:.2f}x   (goal <= 1.5x)")
    summary["memory_ratio"] = round(grown / raw_bytes, 3)
    return summary


def during(times: list[tuple[float, float]], windows: list) -> tuple[list, list]:
    """The pushes that overlapped a compaction, and the others."""
    inside = [t for t in times if any(start <= t[0] + t[1] and t[0] <= end for start, end in windows)]
    inside_set = set(inside)
    return inside, [t for t in times if t not in inside_set]


def run_large(args) -> dict:
    group_size, producers, pull, per_request = 16, args.producers, 8, args.groups_per_request
    size = sample_bytes(LARGE) * group_size
    log_config = {"fsync": "interval", "fsync_interval_ms": 100, "compact_min_bytes": args.compact_mb << 20}
    print(f"groups of {group_size} samples x ({LARGE[0]} + {LARGE[1]}) tokens = {size / 1e6:.2f} MB, "
          f"{args.large_groups} groups per run, {producers} producers pushing {per_request} groups per request "
          f"(the worker's engine batch), B = {pull}, durable log {'off' if args.no_log else log_config}, "
          f"{os.cpu_count()} CPUs, loadavg {os.getloadavg()[0]:.1f}", flush=True)
    raws, raw_cpus, relays, rates, times, stats, cpus = [], [], [], [], [], [], []
    with tempfile.TemporaryDirectory() as tmp:
        workdir = Path(tmp)

        def durable(name: str) -> dict:  # the server's log setting: none with --no-log
            return {} if args.no_log else {"log": {"path": str(workdir / name), **log_config}}

        for round_ in range(args.rounds):
            rate, cpu = run_raw(args.large_groups, group_size, producers, LARGE)
            raws.append(rate)
            raw_cpus.append(cpu)
            relay_log = None if args.no_log else workdir / f"relay-{round_}.log"  # a relay like the service
            relays.append(run_raw(args.large_groups, group_size, producers, LARGE, True, relay_log)[0])
            if relay_log is not None:
                relay_log.unlink()
            rate, pushed, cpu, final = run_service(workdir, args.large_groups, group_size, producers, pull,
                                                   per_request, True, LARGE, **durable(f"large-{round_}.log"))
            rates.append(rate)
            cpus.append(cpu)
            times.append(pushed)
            stats.append(final)
            print(f"round {round_ + 1}/{args.rounds}: raw {raws[-1] * sample_bytes(LARGE) / 1e6:.0f} MB/s, relay "
                  f"{relays[-1] * sample_bytes(LARGE) / 1e6:.0f} MB/s, service "
                  f"{rate * sample_bytes(LARGE) / 1e6:.0f} MB/s, {final['log_compactions']} compactions", flush=True)
        hold = args.large_hold * group_size
        grown, raw_bytes = run_memory(workdir, hold, group_size, LARGE, **durable("hold.log"))
    raw_mb = float(np.median(raws)) * sample_bytes(LARGE) / 1e6
    service_mb = float(np.median(rates)) * sample_bytes(LARGE) / 1e6
    relay_mb = float(np.median(relays)) * sample_bytes(LARGE) / 1e6
    all_times = [t for run in times for t in run]
    windows = [w for s in stats for w in s["log_compaction_windows"]]
    inside, outside = during(all_times, windows)
    p50, p99 = percentiles(all_times)
    p99_in = percentiles(inside)[1] if inside else float("nan")
    p99_out = percentiles(outside)[1] if outside else float("nan")
    longest_in = max((t for _, t in inside), default=float("nan"))
    lock = max(s["log_compaction_longest_lock_s"] for s in stats)
    compactions = sum(s["log_compactions"] for s in stats)
    print(f"raw PUSH/PULL + codec   : {raw_mb:8.0f} MB/s (median of {args.rounds})")
    label = "service, no log" if args.no_log else "service, durable log"
    what = "passes each group on" if args.no_log else "appends each group with a CRC32 to a file and sends it on"
    print(f"raw relay, two hops     : {relay_mb:8.0f} MB/s   ratio {relay_mb / raw_mb:.2f}   (producers -> a process "
          f"that {what} -> the receiver, nothing else: the most a service {'that logs ' * (not args.no_log)}"
          f"between them can do here)")
    print(f"{label:24s}: {service_mb:8.0f} MB/s   ratio {service_mb / raw_mb:.2f}   (goal >= 0.5; "
          f"{service_mb / relay_mb:.2f} of the relay)")
    print(f"push round trip         : p50 {p50 * 1e3:.1f} ms, p99 {p99 * 1e3:.1f} ms over {len(all_times)} pushes")
    per_mb = {part: float(np.median([c[part] for c in cpus])) * 1e6 / sample_bytes(LARGE) * 1e3 for part in cpus[0]}
    raw_per_mb = float(np.median(raw_cpus)) * 1e6 / sample_bytes(LARGE) * 1e3
    print("CPU per MB moved        : " + ", ".join(f"{part} {ms:.1f} ms" for part, ms in per_mb.items())
          + f" (total {sum(per_mb.values()):.1f} ms; the raw pair, producers and receiver: {raw_per_mb:.1f} ms)")
    print(f"during a compaction     : {len(inside)} pushes, p99 {p99_in * 1e3:.1f} ms vs {p99_out * 1e3:.1f} ms "
          f"without = {p99_in / p99_out:.2f}x (goal <= 2x); longest push {longest_in * 1e3:.1f} ms; "
          f"{compactions} compactions, the longest lock hold {lock * 1e3:.1f} ms")
    print(f"memory holding {args.large_hold} groups : {grown / 1e6:.0f} MB resident vs {raw_bytes / 1e6:.0f} MB of "
          f"arrays = {grown / raw_bytes:.2f}x   (goal <= 1.5x)")
    return {"mode": "large", "durable_log": not args.no_log, "group_mb": round(size / 1e6, 2),
            "raw_mb_per_s": round(raw_mb), "service_mb_per_s": round(service_mb), "ratio": round(service_mb / raw_mb, 3),
            "relay_mb_per_s": round(relay_mb), "relay_ratio": round(relay_mb / raw_mb, 3),
            "service_over_relay": round(service_mb / relay_mb, 3),
            "push_p50_ms": round(p50 * 1e3, 1),
            "push_p99_ms": round(p99 * 1e3, 1), "compactions": compactions, "pushes_during_compaction": len(inside),
            "p99_during_compaction_ms": round(p99_in * 1e3, 1), "p99_without_ms": round(p99_out * 1e3, 1),
            "p99_ratio": round(p99_in / p99_out, 2), "longest_push_during_compaction_ms": round(longest_in * 1e3, 1),
            "longest_compaction_lock_ms": round(lock * 1e3, 1), "memory_ratio": round(grown / raw_bytes, 3),
            "cpu_ms_per_mb": {part: round(ms, 2) for part, ms in per_mb.items()},
            "raw_cpu_ms_per_mb": round(raw_per_mb, 2)}


if __name__ == "__main__":
    main()
