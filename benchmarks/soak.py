"""Soak: a bounded run that injects random faults on a schedule and audits what survived.

Two arenas, one after the other, each with real processes:
  service  the buffer service (`python -m buffer serve`, durable log, fsync=interval) with two
           producer clients and a learner client (η gate on, versions advancing); faults:
           SIGKILL the service (it restarts from its log) and connection loss (a proxy holds the
           learner's replies past its timeout and drops them with the connection).
  run      `etarl train` on the tiny model (local Ray, buffer actor, vLLM-CPU worker, learner);
           faults: SIGKILL the rollout worker (Ray restarts it), SIGKILL the buffer actor (Ray
           restarts it from its log in the run folder) and SIGKILL the learner mid-call (the run
           stops; `etarl train --resume` continues from the last checkpoint).
Each arena ends with the exactly-once audit (`services.audit`) over what the learner consumed and
the buffer's records. The table: faults injected and recovered by kind; samples consumed, lost
(must be 0), duplicated (must be 0); worst staleness against η; learner steps completed.

    python benchmarks/soak.py --minutes 6   (1/3 service, 2/3 run; the run's start-up is not counted)
"""
from __future__ import annotations

import argparse
import random
import signal
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from buffer.client import BufferClient  # noqa: E402
from buffer.config import ClientConfig  # noqa: E402
from buffer.sample import Group, Sample, new_id  # noqa: E402
from services import checkpoint as ckpt  # noqa: E402
from services.audit import Consumption, audit, read_buffer_log, read_checkpoint_buffer, read_run_log  # noqa: E402
from services.chaos import BufferService, ReplyLosingProxy, TrainProcess  # noqa: E402

SERVICE_ETA, SERVICE_B, SERVICE_N = 1, 4, 2
RUN_ETA, RUN_B, RUN_N = 2, 2, 4


class Tally:
    def __init__(self):
        self.injected: Counter = Counter()
        self.recovered: Counter = Counter()
        self.results: dict[str, dict] = {}

    def fault(self, kind: str, recovered: bool) -> None:
        self.injected[kind] += 1
        self.recovered[kind] += bool(recovered)
        print(f"  {time.strftime('%H:%M:%S')} {kind}: {'recovered' if recovered else 'NOT recovered'}", flush=True)


# ------------------------------------------------------------------ arena 1: the buffer service


def synthetic_group(ticket: int, version: int, rng: np.random.Generator) -> Group:
    """A producer's group: SERVICE_N responses of 6 tokens for prompt `ticket`."""
    gid = new_id()
    samples = [Sample(sample_id=new_id(), group_id=gid, prompt_ids=rng.integers(0, 500, 5),
                      response_ids=rng.integers(0, 500, 6), rollout_log_probs=-rng.random(6) - 0.01,
                      loss_mask=np.ones(6, np.uint8), reward=float(rng.random()), weight_version=version,
                      worker_id="soak", finish_reason="stop") for _ in range(SERVICE_N)]
    return Group(gid, samples, ticket)


def service_arena(seconds: float, workdir: Path, rng: random.Random, tally: Tally) -> None:
    config = {"log": {"path": str(workdir / "buffer.log"), "fsync": "interval", "fsync_interval_ms": 20,
                      "compact_min_bytes": 1 << 16},
              "gate": {"batch_size": SERVICE_B, "eta": SERVICE_ETA, "max_concurrent": 16}}
    service = BufferService(config, workdir).start()
    proxy = ReplyLosingProxy(service.config["port"])
    patient = ClientConfig(request_timeout_s=0.5, retries=200, retry_backoff_s=0.02)
    acknowledged, consumptions, errors = set(), [], []
    stop = threading.Event()

    def producer(seed: int):
        data_rng = np.random.default_rng(seed)
        try:
            with BufferClient(service.endpoint, patient) as client:
                while not stop.is_set():
                    permit = client.acquire_permit("soak", timeout=1.0)
                    if permit is not None:
                        group = synthetic_group(permit.ticket, permit.version, data_rng)
                        client.push_group(group, permit.permit_id)
                        acknowledged.add(group.group_id)
        except Exception as exc:  # noqa: BLE001 - reported in the table
            errors.append(f"producer: {exc}")

    learner_client = BufferClient(proxy.endpoint, patient)

    def learner():
        try:
            while not stop.is_set():
                batch = learner_client.pull_batch(SERVICE_B, timeout=0.5)
                if batch is None:
                    continue
                time.sleep(0.02)  # "training"
                learner_client.ack(batch.lease_id, version=batch.version + 1)
                consumptions.append(Consumption.of_batch(batch))
        except Exception as exc:  # noqa: BLE001
            errors.append(f"learner: {exc}")

    threads = [threading.Thread(target=producer, args=(i,)) for i in range(2)] + [threading.Thread(target=learner)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline - 3:
        time.sleep(rng.uniform(1.0, 4.0))
        before = len(consumptions)
        if rng.random() < 0.5:
            service.kill()
            service.start()
            tally.fault("buffer SIGKILL", _progress(lambda: len(consumptions) > before, 60))
        else:
            reconnects = learner_client.reconnects
            proxy.hold()
            time.sleep(1.5)  # past the learner's request timeout: it gives up on the connection
            proxy.release()
            tally.fault("connection loss",
                        _progress(lambda: learner_client.reconnects > reconnects and len(consumptions) > before, 60))
    stop.set()
    for t in threads:
        t.join(120)
    proxy.close()
    with BufferClient(service.endpoint, patient) as client:  # the learner takes what is left
        while (batch := client.pull_batch(SERVICE_B, timeout=1.0)) is not None:
            client.ack(batch.lease_id)
            consumptions.append(Consumption.of_batch(batch))
    service.stop()
    report = audit(consumptions, read_buffer_log(workdir / "buffer.log"), SERVICE_ETA, acknowledged)
    tally.results["service"] = {"report": report, "eta": SERVICE_ETA, "n": SERVICE_N, "steps": len(consumptions),
                                "errors": errors}


def _progress(predicate, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return False


# ------------------------------------------------------------------ arena 2: a training run


def run_args(run_dir: Path) -> list[str]:
    return [f"run.run_dir={run_dir}", "run.steps=100000", "run.checkpoint_every=3", "run.eval_every=0",
            "eval.enabled=false", "run.progress=false", f"buffer.gate.eta={RUN_ETA}",
            f"buffer.gate.batch_size={RUN_B}", "buffer.gate.permit_lease_s=5", f"rollout.sampling.n={RUN_N}",
            "rollout.groups_per_batch=2", "ray.num_cpus=2", "ray.worker_num_cpus=0", "ray.learner_num_cpus=0",
            "ray.worker_max_restarts=1000", "buffer.max_restarts=1000", "buffer.client.request_timeout_s=2"]


def run_arena(seconds: float, workdir: Path, rng: random.Random, tally: Tally) -> None:
    """`seconds` of faults once the run is up (starting Ray and vLLM is not counted); worker,
    buffer and learner kills take turns, at random intervals."""
    run_dir = workdir / "run"
    proc = TrainProcess(run_dir, run_args(run_dir), "run-0")
    runs = [proc]
    proc.wait_for(lambda: len(proc.steps()) >= 3, "the first steps", timeout=900)
    deadline = time.monotonic() + seconds
    kinds = ["worker SIGKILL", "run buffer SIGKILL", "learner SIGKILL"]
    while time.monotonic() < deadline - 20:
        time.sleep(rng.uniform(5.0, 15.0))
        kind = kinds[sum(tally.injected[k] for k in kinds) % len(kinds)]
        if kind == "learner SIGKILL" and _checkpoint_step(run_dir) > 0:
            learner = proc.wait_for(lambda: proc.titled("ray::LearnerRank.call"), "the learner mid-call",
                                    timeout=120, interval=0.01)
            learner[0].kill()
            proc.wait(300)
            resumed_at = _checkpoint_step(run_dir)
            proc = TrainProcess(run_dir, ["--resume", str(run_dir), "run.steps=100000"], f"run-{len(runs)}")
            runs.append(proc)
            tally.fault(kind, _progress(lambda: len(read_steps(run_dir)) > resumed_at + 2, 900))
        elif kind == "run buffer SIGKILL":
            actors = proc.titled("ray::CheckpointableBufferActor")
            if not actors:
                continue
            before = proc.steps()
            restarts = before[-1].get("buffer/restarts", 0) if before else 0
            actors[0].kill()  # Ray restarts it; it replays RUN_DIR/buffer-actor.log
            tally.fault(kind, _progress(lambda: len(proc.steps()) > len(before) + 2
                                        and proc.steps()[-1].get("buffer/restarts", 0) > restarts, 600))
        else:
            workers = proc.titled("ray::RolloutWorker")
            if not workers:
                continue
            workers[0].kill()
            steps = len(proc.steps())
            tally.fault("worker SIGKILL", _progress(
                lambda: any(p.pid != workers[0].pid for p in proc.titled("ray::RolloutWorker"))
                and len(proc.steps()) > steps + 2, 600))
    proc.proc.send_signal(signal.SIGINT)  # Ctrl-C: stop after the step, with a checkpoint
    code = proc.wait(600)
    for p in runs:
        p.kill_all()
    rows = read_run_log(run_dir)
    report = audit(rows, read_checkpoint_buffer(ckpt.latest_checkpoint(run_dir)), RUN_ETA)
    tally.results["run"] = {"report": report, "eta": RUN_ETA, "n": RUN_N, "steps": len(rows),
                            "errors": [] if code == 0 else [f"final stop exited {code}"]}


def read_steps(run_dir: Path) -> list:
    try:
        return read_run_log(run_dir)
    except (FileNotFoundError, ValueError):
        return []


def _checkpoint_step(run_dir: Path) -> int:
    try:
        return ckpt.read_state(ckpt.latest_checkpoint(run_dir))["step"]
    except (FileNotFoundError, ValueError):
        return 0


# ------------------------------------------------------------------ the table


def print_table(tally: Tally, seconds: float) -> bool:
    print(f"\nsoak: {seconds / 60:.1f} minutes")
    print(f"{'fault':<20}{'injected':>10}{'recovered':>11}")
    for kind in ("buffer SIGKILL", "connection loss", "worker SIGKILL", "run buffer SIGKILL", "learner SIGKILL"):
        print(f"{kind:<20}{tally.injected[kind]:>10}{tally.recovered[kind]:>11}")
    print(f"\n{'arena':<9}{'steps':>7}{'samples consumed':>18}{'in buffer':>11}{'dropped stale':>15}"
          f"{'lost':>6}{'duplicated':>12}{'worst staleness':>17}")
    ok = tally.injected == tally.recovered
    for arena, res in tally.results.items():
        r, n = res["report"], res["n"]
        lost = len(r.lost_groups) * n
        duplicated = len(r.duplicated_groups) * n
        print(f"{arena:<9}{res['steps']:>7}{r.consumed_samples:>18}{r.in_buffer_groups * n:>11}"
              f"{r.dropped_groups * n:>15}{lost:>6}{duplicated:>12}{r.worst_staleness:>10} (η={res['eta']})")
        for line in r.problems() + res["errors"]:
            print(f"  {arena}: {line}")
        ok = ok and r.ok and not res["errors"]
    total = sum(tally.injected.values())
    print(f"\nfaults injected {total}, recovered {sum(tally.recovered.values())} "
          f"({sum(tally.recovered.values()) / max(total, 1):.0%}); audit {'clean' if ok else 'FAILED'}")
    return ok


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=6.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--workdir", help="keep logs and run folders here (default: a temp folder)")
    args = parser.parse_args(argv)
    rng = random.Random(args.seed)
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="etarl-soak-"))
    workdir.mkdir(parents=True, exist_ok=True)
    total = args.minutes * 60
    tally = Tally()
    started = time.monotonic()
    print(f"soak in {workdir}: service arena {total / 3:.0f} s, run arena {2 * total / 3:.0f} s", flush=True)
    (workdir / "service").mkdir(exist_ok=True)
    service_arena(total / 3, workdir / "service", rng, tally)
    run_arena(2 * total / 3, workdir, rng, tally)
    return 0 if print_table(tally, time.monotonic() - started) else 1


if __name__ == "__main__":
    sys.exit(main())
