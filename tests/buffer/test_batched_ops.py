"""Several permits in one request and several groups in one push: what a worker generating an
engine batch of groups does. A push is all or nothing; retries of either stay idempotent; the
η bound holds for permits taken in bulk."""
import threading

import pytest
from buffer_helpers import make_group, wait_until

from buffer.client import BufferClient
from buffer.codec import encode_group
from buffer.config import BufferConfig, GateConfig, StoreConfig
from buffer.core import BufferCore
from buffer.errors import ProtocolError, RemoteError, RequestError, SampleError
from buffer.sample import new_id
from buffer.server import BufferServer


def new_core(capacity_groups=16, **gate):
    gate = {"batch_size": 2, "eta": 1, "max_concurrent": 64, **gate}
    return BufferCore(BufferConfig(gate=GateConfig(**gate), store=StoreConfig(capacity_groups=capacity_groups)))


def test_acquire_permits_takes_what_the_eta_bound_allows():
    core = new_core()  # (eta + 0 + 1) * B = 4 groups may be admitted at version 0
    permits = core.acquire_permits("w", [new_id() for _ in range(6)])
    assert [p.ticket for p in permits] == [0, 1, 2, 3]
    assert core.acquire_permits("w", [new_id()]) == []
    again = core.acquire_permits("w", [p.permit_id for p in permits])
    assert again == permits, "a retried request returns the same permits, no new tickets"
    assert core.stats()["running"] == 4


def test_push_groups_accepts_all_of_them_once():
    core = new_core()
    permits = core.acquire_permits("w", [new_id() for _ in range(3)])
    groups = [make_group(p.ticket) for p in permits]
    frames = [encode_group(g) for g in groups]
    results = core.push_groups(frames, [p.permit_id for p in permits])
    assert results == [{"samples": 2, "duplicate": False}] * 3
    assert core.push_groups(frames, [p.permit_id for p in permits]) == [{"samples": 2, "duplicate": True}] * 3
    stats = core.stats()
    assert (stats["groups_ready"], stats["running"], stats["accepted"], stats["duplicate_pushes"]) == (3, 0, 3, 3)


@pytest.mark.parametrize("spoil, error, words", [
    (lambda groups, ids: setattr(groups[2].samples[0], "reward", float("nan")), SampleError, "group 2 of the push"),
    (lambda groups, ids: ids.__setitem__(1, "forged"), RequestError, "group 1 of the push: permit .forged. is not held"),
    (lambda groups, ids: (groups.__setitem__(2, make_group(groups[0].prompt_index)), ids.__setitem__(2, ids[0])),
     RequestError, "twice"),
    (lambda groups, ids: (groups.__setitem__(1, groups[0]), ids.__setitem__(1, ids[0])), RequestError, "twice"),
])
def test_one_bad_group_refuses_the_whole_push(spoil, error, words):
    core = new_core()
    permits = core.acquire_permits("w", [new_id() for _ in range(3)])
    groups = [make_group(p.ticket) for p in permits]
    ids = [p.permit_id for p in permits]
    spoil(groups, ids)
    with pytest.raises(error, match=words):
        core.push_groups([encode_group(g) for g in groups], ids)
    stats = core.stats()
    assert (stats["groups_ready"], stats["running"], stats["accepted"]) == (0, 3, 0), "nothing was accepted"
    good = [make_group(p.ticket) for p in permits]
    assert core.push_groups([encode_group(g) for g in good], [p.permit_id for p in permits])[2]["samples"] == 2


def test_a_push_that_does_not_fit_is_refused_whole():
    core = new_core(capacity_groups=3)
    permits = core.acquire_permits("w", [new_id() for _ in range(3)])
    core.store.capacity_groups = 2  # as after a restart with a smaller store: the permits no longer fit
    with pytest.raises(RequestError, match="buffer full"):
        core.push_groups([encode_group(make_group(p.ticket)) for p in permits], [p.permit_id for p in permits])
    assert core.stats()["groups_ready"] == 0


def test_permits_wait_for_room_in_the_store():
    """eta = None leaves the store's size as the only bound: a permit is granted only while its
    group will fit (held + running < capacity), so no generation ends in a push refused as full."""
    core = new_core(capacity_groups=3, batch_size=1, eta=None)
    permits = core.acquire_permits("w", [new_id() for _ in range(5)])
    assert len(permits) == 3 and core.stats()["capacity"] == 0
    core.push_groups([encode_group(make_group(p.ticket)) for p in permits[:2]], [p.permit_id for p in permits[:2]])
    assert core.acquire_permits("w", [new_id()]) == [], "2 held + 1 running fill the store"
    lease = core.pull_batch(2)
    assert core.acquire_permits("w", [new_id()]) == [], "leased groups still take room"
    got = {}
    waiter = threading.Thread(target=lambda: got.update(p=core.acquire_permits("w", [new_id()], timeout=20)))
    waiter.start()
    core.ack(lease.lease_id)
    waiter.join(20)
    assert len(got["p"]) == 1, "an ack frees room and wakes a waiting acquire"
    assert core.stats()["request_errors"].get("buffer_full", 0) == 0


def test_service_round_trip_and_a_parked_bulk_acquire():
    server = BufferServer(BufferConfig(port=0, gate=GateConfig(batch_size=2, eta=0))).start()
    try:
        with BufferClient(server.endpoint) as worker, BufferClient(server.endpoint) as learner:
            permits = worker.acquire_permits("w", 5)
            assert [p.ticket for p in permits] == [0, 1], "eta = 0: one batch of 2 groups"
            got = {}
            waiting = threading.Thread(target=lambda: got.update(more=worker.acquire_permits("w", 5, timeout=20)))
            waiting.start()
            with BufferClient(server.endpoint) as pusher:
                assert wait_until(lambda: pusher.stats()["enqueued"] == 1)
                results = pusher.push_groups([make_group(p.ticket) for p in permits], [p.permit_id for p in permits])
            assert [r["duplicate"] for r in results] == [False, False]
            batch = learner.pull_batch(2, timeout=5)
            learner.ack(batch.lease_id)
            learner.set_version(1)  # the gate opens for the next batch: the parked request gets both
            waiting.join(10)
            assert [p.ticket for p in got["more"]] == [2, 3]
            with pytest.raises(RemoteError) as info:
                worker.push_groups([make_group(got["more"][0].ticket)], [p.permit_id for p in got["more"]])
            assert info.value.reason == "bad_frame_count", "one group frame per permit id"
            with pytest.raises(RemoteError) as info:
                worker.push_groups([], [])
            assert info.value.reason == "bad_args"
    finally:
        server.stop()


def test_push_and_acquire_takes_the_next_permits_in_the_same_request():
    core = new_core()  # 4 groups admissible at version 0
    first = core.acquire_permits("w", [new_id() for _ in range(2)])
    groups = [encode_group(make_group(p.ticket)) for p in first]
    next_ids = [new_id() for _ in range(3)]
    results, following = core.push_and_acquire(groups, [p.permit_id for p in first], "w", next_ids)
    assert [r["duplicate"] for r in results] == [False, False]
    assert [p.ticket for p in following] == [2, 3], "only what the eta gate allows, without waiting"
    again = core.push_and_acquire(groups, [p.permit_id for p in first], "w", next_ids)
    assert again == ([{"samples": 2, "duplicate": True}] * 2, following), "a retried request changes nothing"
    bad = make_group(following[0].ticket)
    bad.samples[0].reward = float("nan")
    with pytest.raises(SampleError):
        core.push_and_acquire([encode_group(bad)], [following[0].permit_id], "w", [new_id()])
    assert core.stats()["running"] == 2, "a failed push takes no permit"


def test_service_push_and_acquire():
    server = BufferServer(BufferConfig(port=0, gate=GateConfig(batch_size=2, eta=1))).start()
    try:
        with BufferClient(server.endpoint) as worker:
            permits = worker.acquire_permits("w", 2)
            results, following = worker.push_and_acquire([make_group(p.ticket) for p in permits],
                                                          [p.permit_id for p in permits], "w", 4)
            assert [r["samples"] for r in results] == [2, 2]
            assert [p.ticket for p in following] == [2, 3]
            assert worker.stats()["running"] == 2
    finally:
        server.stop()


def test_ack_with_a_version_ends_a_learner_step_in_one_request():
    """ack(lease, version): the batch is consumed and the gate moves to the learner's new version,
    which admits the next batch's permits. A retried request changes nothing; a refused one
    changes nothing either."""
    core = new_core(eta=0)
    permits = core.acquire_permits("w", [new_id() for _ in range(3)])
    assert len(permits) == 2, "eta = 0: one batch of B = 2"
    core.push_groups([encode_group(make_group(p.ticket)) for p in permits], [p.permit_id for p in permits])
    lease = core.pull_batch(2).lease_id
    assert core.ack(lease, version=1) == 2
    stats = core.stats()
    assert (stats["version"], stats["consumed_groups"], stats["capacity"]) == (1, 2, 2)
    assert core.ack(lease, version=1) == 2 and core.stats()["consumed_groups"] == 2, "a retry is a no-op"
    with pytest.raises(RequestError, match="unknown lease"):
        core.ack("forged", version=2)
    with pytest.raises(RequestError) as info:
        core.ack(lease, version=0)
    assert info.value.reason == "version_regression"
    assert core.stats()["version"] == 1, "neither refused request moved the version"


@pytest.fixture
def first_batch_pushed():
    """A buffer service (B = 2, eta = 0) with the first batch pushed: (worker, learner) clients."""
    server = BufferServer(BufferConfig(port=0, gate=GateConfig(batch_size=2, eta=0))).start()
    try:
        with BufferClient(server.endpoint) as worker, BufferClient(server.endpoint) as learner:
            permits = worker.acquire_permits("w", 2)
            worker.push_groups([make_group(p.ticket) for p in permits], [p.permit_id for p in permits])
            yield worker, learner
    finally:
        server.stop()


def test_service_ack_with_a_version_wakes_a_parked_acquire(first_batch_pushed):
    worker, learner = first_batch_pushed
    got = {}
    waiting = threading.Thread(target=lambda: got.update(more=worker.acquire_permits("w", 2, timeout=20)))
    waiting.start()
    assert wait_until(lambda: learner.stats()["enqueued"] == 1)
    assert learner.ack(learner.pull_batch(2, timeout=5).lease_id, version=1) == 2
    waiting.join(10)
    assert [p.ticket for p in got["more"]] == [2, 3]
    assert learner.stats()["version"] == 1
    with pytest.raises(RemoteError) as info:
        learner.ack(new_id(), version=2)
    assert info.value.reason == "unknown_lease" and learner.stats()["version"] == 1


def test_pull_can_end_the_previous_step_in_the_same_request():
    """pull_batch(ack_lease_id, version): the previous batch is consumed, the version moves, then
    the next batch is pulled, judged stale against the new version. A refused ack pulls nothing."""
    core = new_core(eta=1)
    permits = core.acquire_permits("w", [new_id() for _ in range(4)])
    core.push_groups([encode_group(make_group(p.ticket)) for p in permits], [p.permit_id for p in permits])
    first = core.pull_batch(2)
    with pytest.raises(RequestError, match="unknown lease"):
        core.pull_batch(2, ack_lease_id="forged", version=1)
    assert core.stats()["groups_leased"] == 2, "the refused request leased nothing"
    with pytest.raises(ProtocolError, match="with the ack"):
        core.pull_batch(2, version=1)
    second = core.pull_batch(2, ack_lease_id=first.lease_id, version=1)
    stats = core.stats()
    assert (stats["version"], stats["consumed_groups"], stats["groups_leased"]) == (1, 2, 2)
    assert second.version == 1 and second.dropped_stale == 0
    assert core.pull_batch(2, lease_id=None, ack_lease_id=second.lease_id, version=3) is None
    stats = core.stats()
    assert (stats["version"], stats["consumed_groups"], stats["groups_leased"]) == (3, 4, 0)


def test_service_pull_with_the_previous_ack_long_polls_for_the_next_batch(first_batch_pushed):
    worker, learner = first_batch_pushed
    first = learner.pull_batch(2, timeout=5)
    got = {}
    pulling = threading.Thread(target=lambda: got.update(
        batch=learner.pull_batch(2, timeout=20, ack_lease_id=first.lease_id, version=1)))
    pulling.start()
    with BufferClient(worker.endpoint) as observer:
        assert wait_until(lambda: observer.stats()["version"] == 1), "the ack happened before the wait"
        assert observer.stats()["consumed_groups"] == 2
        more = worker.acquire_permits("w", 2, timeout=5)  # the new version admits the next batch
        worker.push_groups([make_group(p.ticket, version=1) for p in more], [p.permit_id for p in more])
    pulling.join(10)
    assert sorted(g.prompt_index for g in got["batch"].groups) == [2, 3]
    with pytest.raises(RemoteError) as info:
        learner.pull_batch(2, ack_lease_id=new_id(), version=2)
    assert info.value.reason == "unknown_lease"
