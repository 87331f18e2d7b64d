"""The store behind BufferCore: oldest-first pulls, stale drops counted, leases (ack, nack,
expiry), bounded capacity, idempotent pushes, and exactly-once delivery through the real ZMQ
service under concurrent pushers and pullers with random nacks and retried pushes."""
import random
import threading
from collections import Counter

import pytest
from buffer_helpers import make_group, wait_until

from buffer.client import BufferClient
from buffer.codec import PROTOCOL_VERSION, encode_group
from buffer.config import BufferConfig, ClientConfig, GateConfig, StoreConfig
from buffer.core import BufferCore
from buffer.errors import RemoteError, RequestError
from buffer.server import BufferServer


class FakeClock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def new_core(clock=None, **gate):
    gate = {"batch_size": 2, "eta": None, "max_concurrent": 64, **gate}
    config = BufferConfig(gate=GateConfig(**gate), store=StoreConfig(capacity_groups=8, lease_s=30))
    return BufferCore(config, clock=clock or FakeClock())


def push(core, version=None, n=2):
    permit = core.acquire_permit("w")
    group = make_group(permit.ticket, version=core.gate.version if version is None else version, n=n)
    core.push_group(encode_group(group), permit.permit_id)
    return group


def pulled_ids(result):
    from buffer.codec import group_index, unpack_frames
    return [group_index(unpack_frames(packed)[0])[0] for packed in result.groups]


def test_pull_takes_oldest_by_version_then_arrival():
    core = new_core()
    core.set_version(3)
    groups = [push(core, version=v) for v in (3, 1, 2, 1)]
    first = core.pull_batch(2)
    assert pulled_ids(first) == [groups[1].group_id, groups[3].group_id]
    assert pulled_ids(core.pull_batch(2)) == [groups[2].group_id, groups[0].group_id]
    assert core.pull_batch(1) is None


def test_stale_groups_are_dropped_and_counted():
    core = new_core(eta=1)
    old = [push(core, version=0) for _ in range(2)]
    core.set_version(1)
    fresh = push(core, version=1)
    core.set_version(2)  # version-0 groups are now 2 > η = 1 versions old
    fresh2 = push(core, version=2)
    result = core.pull_batch(2)
    assert pulled_ids(result) == [fresh.group_id, fresh2.group_id] and result.dropped_stale == 2
    stats = core.stats()
    assert stats["dropped_groups"] == {"stale": 2} and stats["dropped_samples"] == {"stale": 4}
    assert not any(g.group_id in core.store.ready for g in old)


def test_lease_ack_nack_and_expiry():
    clock = FakeClock()
    core = new_core(clock)
    a, b = push(core), push(core)
    lease = core.pull_batch(2)
    assert core.pull_batch(2) is None, "leased groups are not handed out twice"
    assert core.nack(lease.lease_id) == 2
    again = core.pull_batch(2)
    assert pulled_ids(again) == [a.group_id, b.group_id], "a nacked batch keeps its place"
    clock.now += 31  # lease expires
    core.tick()
    assert core.stats()["leases_expired"] == 1 and core.stats()["groups_ready"] == 2
    assert core.ack(again.lease_id) == 2, "ack after expiry is fine while nobody else got the groups"
    assert core.stats()["consumed_samples"] == 4 and core.stats()["groups_ready"] == 0
    assert core.ack(again.lease_id) == 2, "a retried ack is a no-op"
    assert core.stats()["consumed_samples"] == 4
    push(core), push(core)
    late = core.pull_batch(2)
    clock.now += 31
    redelivered = core.pull_batch(2)
    with pytest.raises(RequestError, match="handed out again"):
        core.ack(late.lease_id)
    assert core.ack(redelivered.lease_id) == 2
    with pytest.raises(RequestError, match="unknown lease"):
        core.ack("nope")


def test_retried_push_does_not_duplicate_and_conflicts_are_refused():
    core = new_core()
    permit = core.acquire_permit("w")
    group = make_group(permit.ticket)
    assert core.push_group(encode_group(group), permit.permit_id) == {"samples": 2, "duplicate": False}
    assert core.push_group(encode_group(group), permit.permit_id) == {"samples": 2, "duplicate": True}
    other = core.acquire_permit("w")
    mixed = make_group(other.ticket)  # a new group reusing a sample id of a group held
    mixed.samples[0] = group.samples[0]
    mixed.samples[0].group_id = mixed.group_id
    with pytest.raises(RequestError, match="overlaps"):
        core.push_group(encode_group(mixed), other.permit_id)
    group.samples[0].group_id = group.group_id
    batch = core.pull_batch(1)
    core.ack(batch.lease_id)
    assert core.push_group(encode_group(group), permit.permit_id)["duplicate"], "even after consumption"
    assert core.stats()["pushed_samples"] == 2 and core.gate.accepted == 1
    reused_id = make_group(other.ticket)  # the consumed group's id with other samples
    reused_id.group_id = group.group_id
    for s in reused_id.samples:
        s.group_id = group.group_id
    with pytest.raises(RequestError, match="overlaps"):
        core.push_group(encode_group(reused_id), other.permit_id)


def test_memory_for_settled_groups_is_bounded():
    """Consumed groups leave a digest, for the last `remembered_settled_groups` of them: a retried
    push of a recent one is a duplicate; of an older one it meets its consumed permit."""
    config = BufferConfig(gate=GateConfig(batch_size=1, eta=None, max_concurrent=8),
                          store={"remembered_settled_groups": 3})
    core = BufferCore(config)
    pushed = []
    for _ in range(5):
        permit = core.acquire_permit("w")
        pushed.append((make_group(permit.ticket, n=4), permit.permit_id))
        core.push_group(encode_group(pushed[-1][0]), permit.permit_id)
        core.ack(core.pull_batch(1).lease_id)
    assert len(core.store.settled) == 3 and not core.store.sample_group and not core.store.held_ids
    group, permit_id = pushed[-1]
    assert core.push_group(encode_group(group), permit_id)["duplicate"]
    group, permit_id = pushed[0]
    with pytest.raises(RequestError, match="not held"):
        core.push_group(encode_group(group), permit_id)
    assert core.stats()["consumed_groups"] == 5 and core.gate.accepted == 5


def test_push_needs_the_right_permit_and_room():
    core = new_core()
    permit = core.acquire_permit("w")
    with pytest.raises(RequestError, match="ticket"):
        core.push_group(encode_group(make_group(permit.ticket + 1)), permit.permit_id)
    with pytest.raises(RequestError, match="not held"):
        core.push_group(encode_group(make_group(0)), "forged")
    core.release_permit(permit.permit_id)
    for _ in range(7):
        push(core)
    permit = core.acquire_permit("w")
    assert core.acquire_permit("w") is None, "7 held + 1 running: no room for another permit's group"
    core.store.capacity_groups = 7  # as after a restart with a smaller store: the held permit no longer fits
    with pytest.raises(RequestError, match="buffer full"):
        core.push_group(encode_group(make_group(permit.ticket)), permit.permit_id)
    assert core.gate.running == 1, "a refused push keeps its permit (the worker may retry or release)"


def test_exactly_once_with_concurrent_pushers_pullers_and_nacks():
    """3 pushers (each push sent twice, as a client retry would) and 2 pullers that nack at random,
    all over ZMQ: every pushed sample is consumed exactly once."""
    config = BufferConfig(port=0, gate=GateConfig(batch_size=3, eta=None, max_concurrent=6))
    server = BufferServer(config).start()
    settings = ClientConfig(request_timeout_s=10, retries=2)
    pushed, consumed, errors = Counter(), Counter(), []
    lock = threading.Lock()
    groups_per_pusher, pushers = 30, 3
    done_pushing = threading.Event()

    def pusher(seed):
        with BufferClient(server.endpoint, settings) as client:
            for _ in range(groups_per_pusher):
                permit = client.acquire_permit(f"w{seed}", timeout=10)
                group = make_group(permit.ticket, n=2)
                first = client.push_group(group, permit.permit_id)
                retry = client.push_group(group, permit.permit_id)
                if first["duplicate"] or not retry["duplicate"]:
                    errors.append(("push", first, retry))
                with lock:
                    pushed.update(group.sample_ids)

    def puller(seed):
        rng = random.Random(seed)
        with BufferClient(server.endpoint, settings) as client:
            while True:
                batch = client.pull_batch(3, timeout=0.2)
                if batch is None:
                    if done_pushing.is_set() and client.stats()["groups_ready"] == 0:
                        return
                    continue
                if rng.random() < 0.3:
                    client.nack(batch.lease_id)
                    continue
                assert client.ack(batch.lease_id) == 3
                with lock:
                    consumed.update(s.sample_id for s in batch.samples)

    def guarded(fn):
        def run(seed):
            try:
                fn(seed)
            except Exception as exc:  # surfaced by the assert below
                errors.append(exc)
                done_pushing.set()
        return run

    push_threads = [threading.Thread(target=guarded(pusher), args=(i,)) for i in range(pushers)]
    pull_threads = [threading.Thread(target=guarded(puller), args=(10 + i,)) for i in range(2)]
    for t in push_threads + pull_threads:
        t.start()
    for t in push_threads:
        t.join()
    done_pushing.set()
    for t in pull_threads:
        t.join()
    stats = BufferClient(server.endpoint).stats()
    server.stop()
    assert not errors
    assert len(pushed) == pushers * groups_per_pusher * 2
    assert set(consumed) == set(pushed) and max(consumed.values()) == 1
    assert stats["consumed_samples"] == len(pushed) and stats["duplicate_pushes"] == pushers * groups_per_pusher
    assert stats["nacks"] > 0


def test_client_reports_refusals_with_reason():
    server = BufferServer(BufferConfig(port=0)).start()
    try:
        with BufferClient(server.endpoint) as client:
            with pytest.raises(RemoteError) as info:
                client.push_group(make_group(0), "forged-permit")
            assert info.value.reason == "unknown_permit"
            assert client.stats()["request_errors"] == {"unknown_permit": 1}
    finally:
        server.stop()


def test_batch_for_a_vanished_learner_is_handed_back_at_once():
    """A learner parks a long pull and dies; the batch that would have gone to it is not stuck in
    a lease until expiry: the next learner gets it right away."""
    import msgpack
    import zmq

    import psutil

    server = BufferServer(BufferConfig(port=0, gate=GateConfig(batch_size=1, eta=None))).start()
    port = int(server.endpoint.rsplit(":", 1)[1])

    def server_side_peers() -> set:  # the server's end of each TCP connection (it runs in this process)
        return {c.raddr for c in psutil.Process().net_connections(kind="tcp") if c.laddr.port == port and c.raddr}

    try:
        ctx = zmq.Context()
        before = server_side_peers()
        doomed = ctx.socket(zmq.DEALER)
        doomed.connect(server.endpoint)
        doomed.send(msgpack.packb({"v": PROTOCOL_VERSION, "id": "x", "op": "pull_batch", "args": {"batch_size": 1, "timeout": 30}}))
        assert wait_until(lambda: len(server._pulls) == 1)
        doomed_peer = server_side_peers() - before
        assert doomed_peer, "the doomed learner's connection is not visible"
        with BufferClient(server.endpoint) as client:
            doomed.close(linger=0)
            # The server's I/O thread has closed its end of the connection: the peer is gone.
            assert wait_until(lambda: not server_side_peers() & doomed_peer, timeout=30)
            permit = client.acquire_permit("w")
            group = make_group(permit.ticket)
            client.push_group(group, permit.permit_id)
            batch = client.pull_batch(1, timeout=5)
            assert batch is not None and batch.groups[0].group_id == group.group_id
            assert client.ack(batch.lease_id) == 1
        ctx.term()
    finally:
        server.stop()


def test_parked_acquire_is_admitted_when_the_learner_advances():
    server = BufferServer(BufferConfig(port=0, gate=GateConfig(batch_size=1, eta=0, max_concurrent=4))).start()
    try:
        with BufferClient(server.endpoint) as worker, BufferClient(server.endpoint) as learner:
            first = worker.acquire_permit("w1")
            assert worker.acquire_permit("w1", timeout=0.2) is None, "η = 0: one group per version"
            waiting = {}
            thread = threading.Thread(target=lambda: waiting.setdefault("p", worker.acquire_permit("w2", timeout=20)))
            thread.start()
            assert wait_until(lambda: learner.stats()["enqueued"] == 1)
            worker_group = make_group(first.ticket)
            learner.push_group(worker_group, first.permit_id)
            learner.ack(learner.pull_batch(1, timeout=1).lease_id)
            learner.set_version(1)
            thread.join()
            stats = learner.stats()
        assert waiting["p"].version == 1 and waiting["p"].ticket == 1
        assert stats["enqueued"] == 0 and stats["gate_waits"] == 2 and stats["rejected"] == 1
        assert stats["gate_wait_seconds"] > 0.2
    finally:
        server.stop()
