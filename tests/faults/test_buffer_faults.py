"""SIGKILL the buffer service (a real `python -m buffer serve` process with its durable log) and
restart it from the log: every acknowledged push is there, no group is delivered twice, a lease
held across the restart can still be acked, and a retried ack is not an error. The audit
(`services.audit`) runs over the consumer's record and the buffer's log after each fault."""
import random
import threading

import pytest

from fault_helpers import consume_batch, make_group, wait_until

from buffer.client import BufferClient
from buffer.codec import encode_group
from buffer.config import BufferConfig, ClientConfig, GateConfig, LogConfig
from buffer.core import BufferCore
from buffer.durable_log import payloads_dir
from services.audit import audit, read_buffer_log

PATIENT = ClientConfig(request_timeout_s=1.0, retries=120, retry_backoff_s=0.02)  # minutes, for a loaded machine


def durable(tmp_path, **gate):
    return {"log": {"path": str(tmp_path / "buffer.log"), "fsync": "interval", "fsync_interval_ms": 20,
                    "compact_min_bytes": 8192},  # small: compactions happen, and kills land around them
            "gate": {"batch_size": 2, "eta": 1, "max_concurrent": 8, **gate}}


def push_groups(client, count: int, acknowledged: set, version: int = 0, tokens: int = 4) -> None:
    for _ in range(count):
        permit = client.acquire_permit("w", timeout=5)
        group = make_group(permit.ticket, version=version, tokens=tokens)
        client.push_group(group, permit.permit_id)
        acknowledged.add(group.group_id)


def test_a_lease_held_across_a_restart_is_acked_once(buffer_service, tmp_path):
    server = buffer_service(**durable(tmp_path))
    acknowledged: set = set()
    with BufferClient(server.endpoint, PATIENT) as client:
        push_groups(client, 4, acknowledged)
        batch = client.pull_batch(2, timeout=5)  # the learner trains on it while the buffer dies
        server.kill()
        server.start()
        assert client.ack(batch.lease_id) == 2, "the lease must survive the restart"
        consumed = [batch]
        while (more := client.pull_batch(2, timeout=0.5)) is not None:
            client.ack(more.lease_id)
            consumed.append(more)
    groups = [g.group_id for b in consumed for g in b.groups]
    assert sorted(groups) == sorted(acknowledged), "a group was delivered twice or lost"


def test_a_retried_ack_after_a_restart_is_not_an_error(buffer_service, tmp_path):
    server = buffer_service(**durable(tmp_path))
    with BufferClient(server.endpoint, PATIENT) as client:
        push_groups(client, 2, set())
        batch = client.pull_batch(2, timeout=5)
        assert client.ack(batch.lease_id) == 2
        server.kill()  # as if the reply had been lost with the process: the client acks again
        server.start()
        assert client.ack(batch.lease_id) == 2
        stats = client.stats()
    assert stats["groups_ready"] == stats["groups_leased"] == 0


@pytest.mark.parametrize("payloads", ["inline", "segments"])
def test_repeated_kills_under_load_lose_and_repeat_nothing(buffer_service, tmp_path, payloads):
    """Two pushers and a learner (B = 2, versions advancing) run while the buffer is SIGKILLed
    four times at random moments; the audit over the learner's record and the buffer's log (with
    its settled archive: the log compacts often) finds nothing lost, nothing consumed twice,
    nothing staler than η (kills slow the pushers, so some groups go stale and are dropped: their
    tickets are reissued). Any thread's error stops the others, and every thread ends with the test.
    `segments`: groups of 2 x 3,000 tokens (78 KB), whose payloads live in 300 KB log segments
    that compactions delete as their groups are consumed."""
    config = durable(tmp_path)
    tokens = 3000 if payloads == "segments" else 4
    if payloads == "segments":
        config["log"]["segment_bytes"] = 300_000
    server = buffer_service(**config)
    per_pusher, batch_size, eta = 30, config["gate"]["batch_size"], config["gate"]["eta"]
    acknowledged, consumptions, errors = set(), [], []
    pushers_done, stop = threading.Event(), threading.Event()

    def guarded(body):
        def run():
            try:
                body()
            except Exception as exc:  # noqa: BLE001 - reported by the assertion below
                errors.append(exc)
                stop.set()
        return run

    def pusher():
        with BufferClient(server.endpoint, PATIENT) as client:
            pushed = 0
            while pushed < per_pusher and not stop.is_set():
                permit = client.acquire_permit("w", timeout=1)
                if permit is None:  # the gate stayed closed (the buffer was down): ask again
                    continue
                group = make_group(permit.ticket, version=permit.version, tokens=tokens)
                client.push_group(group, permit.permit_id)
                acknowledged.add(group.group_id)
                pushed += 1

    def learner():
        with BufferClient(server.endpoint, PATIENT) as client:
            while not stop.is_set() and (not pushers_done.is_set() or client.stats()["groups_ready"] >= batch_size):
                record = consume_batch(client, batch_size, timeout=0.5)
                if record is not None:
                    consumptions.append(record)
                    client.set_version(record.version + 1)

    pushers = [threading.Thread(target=guarded(pusher)) for _ in range(2)]
    consumer = threading.Thread(target=guarded(learner))
    for t in [*pushers, consumer]:
        t.start()
    kills = 0
    try:
        rng = random.Random(7)
        for fraction in (0.15, 0.35, 0.55, 0.75):  # kill at random moments, but surely mid-stream
            threshold = fraction * 2 * per_pusher + rng.randint(0, 3)
            assert wait_until(lambda: len(acknowledged) >= threshold or stop.is_set(), timeout=300), \
                f"{len(acknowledged)} pushes acknowledged, waiting for {threshold}"
            assert not errors, errors
            server.kill()
            kills += 1
            server.start()
        for t in pushers:
            t.join(300)
        pushers_done.set()
        consumer.join(300)
    finally:
        stop.set()  # on a failure above: the threads end here, not in the next test
        for t in [*pushers, consumer]:
            t.join(300)
    assert not any(t.is_alive() for t in [*pushers, consumer]), "a client thread did not end"
    assert not errors, errors
    assert len(acknowledged) == 2 * per_pusher and kills == 4
    if payloads == "segments":  # the last kill may come after the last compaction: push on until two
        drive_compactions(server, 2, acknowledged, consumptions, tokens)  # more reclaim the consumed
    server.stop()
    report = audit(consumptions, read_buffer_log(tmp_path / "buffer.log"), eta, acknowledged)
    assert report.ok, str(report)
    assert report.consumed_groups + report.in_buffer_groups + report.dropped_groups == len(acknowledged)
    if payloads == "segments":  # the groups filled dozens of segments; the consumed ones are gone
        kept = sorted(int(f.stem) for f in payloads_dir(tmp_path / "buffer.log").glob("*.seg"))
        assert kept and len(kept) < max(kept) + 1, kept


def drive_compactions(server, count: int, acknowledged: set, consumptions: list, tokens: int) -> None:
    """Push and consume groups until `count` more log compactions have completed (bounded)."""
    with BufferClient(server.endpoint, PATIENT) as client:
        target = client.stats()["log_compactions"] + count
        for _ in range(500):
            stats = client.stats()
            if stats["log_compactions"] >= target:
                return
            push_groups(client, 2, acknowledged, version=stats["version"], tokens=tokens)
            consumptions.append(consume_batch(client, 2, timeout=5))
            client.set_version(stats["version"] + 1)  # a learner step: the gate opens for the next
    raise AssertionError(f"{count} compactions did not happen in 1,000 pushed groups")


def test_stale_drops_give_their_gate_capacity_back(tmp_path):
    config = BufferConfig(gate=GateConfig(batch_size=2, eta=1, max_concurrent=64), log=LogConfig(path=tmp_path / "log"))
    core = BufferCore(config)

    def grant(worker):
        permit = core.acquire_permit(worker)
        stats = core.stats()
        assert permit is not None, (f"gate closed at version {stats['version']}: {stats['consumed_groups']} consumed, "
                                    f"{stats['dropped_groups']} dropped, {stats['groups_ready']} ready, "
                                    f"{stats['running']} running, accepted {stats['accepted']}")
        return permit

    for _ in range(3):  # each round: two groups granted early, pushed late, dropped as stale
        late = [grant("slow") for _ in range(2)]
        for _ in range(2):  # two learner steps on fresh groups
            for _ in range(2):
                permit = grant("fast")
                core.push_group(encode_group(make_group(permit.ticket, version=core.gate.version)), permit.permit_id)
            core.ack(core.pull_batch(2).lease_id)
            core.set_version(core.gate.version + 1)
        for permit in late:
            core.push_group(encode_group(make_group(permit.ticket, version=permit.version)), permit.permit_id)
        assert core.pull_batch(2) is None  # both late groups are dropped as stale
    # The log replays the drops the same way: a restarted buffer has the same gate.
    restarted = BufferCore(config)
    assert restarted.gate.accepted == core.gate.accepted and restarted.gate.capacity() == core.gate.capacity()
