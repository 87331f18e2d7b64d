"""The Ray actor transport runs the same core: permits, pushes, long-polled pulls, acks, the
η gate across versions, and errors with the same reasons as the ZMQ client."""
import threading

import pytest
from buffer_helpers import make_group, wait_until

from buffer.config import BufferConfig, GateConfig
from buffer.errors import RemoteError


def _actor_client(ray_cluster):
    from services.buffer_actor import RayBufferClient, create_buffer_actor

    config = BufferConfig(transport="ray", gate=GateConfig(batch_size=2, eta=0, max_concurrent=4))
    actor = create_buffer_actor(config)
    yield RayBufferClient(actor, config)
    ray_cluster.kill(actor)


# One actor for the tests that follow each other's versions (in file order, as the suite runs them).
client = pytest.fixture(scope="module")(_actor_client)
fresh_client = pytest.fixture(_actor_client)  # for a test that must not depend on the others


def test_round_trip_and_gate_through_the_actor(client):
    permits = [client.acquire_permit("w") for _ in range(2)]
    assert client.acquire_permit("w", timeout=0.1) is None, "η = 0: one batch per version"
    groups = [make_group(p.ticket) for p in permits]
    for g, p in zip(groups, permits):
        assert client.push_group(g, p.permit_id) == {"samples": 2, "duplicate": False}
    assert client.push_group(groups[0], permits[0].permit_id)["duplicate"]
    batch = client.pull_batch(2, timeout=1)
    assert [g.group_id for g in batch.groups] == [g.group_id for g in groups]
    assert batch.samples[0].rollout_log_probs.tolist() == pytest.approx(groups[0].samples[0].rollout_log_probs.tolist())
    assert client.ack(batch.lease_id) == 2

    waiter = {}
    thread = threading.Thread(target=lambda: waiter.setdefault("permit", client.acquire_permit("w", timeout=10)))
    thread.start()
    assert wait_until(lambda: client.stats()["enqueued"] == 1)
    client.set_version(1)  # the learner advances: the blocked acquire is admitted
    thread.join()
    assert waiter["permit"] is not None and waiter["permit"].version == 1
    stats = client.stats()
    assert stats["accepted"] == 2 and stats["consumed_samples"] == 4 and stats["rejected"] == 1
    assert stats["gate_waits"] >= 1 and stats["gate_wait_seconds"] > 0


def test_long_poll_pull_wakes_on_push(client):
    client.set_version(2)
    result = {}
    thread = threading.Thread(target=lambda: result.setdefault("batch", client.pull_batch(2, timeout=20)))
    thread.start()
    for _ in range(2):
        permit = client.acquire_permit("w", timeout=5)
        client.push_group(make_group(permit.ticket, version=2), permit.permit_id)
    thread.join()
    assert len(result["batch"].groups) == 2
    assert client.nack(result["batch"].lease_id) == 2
    again = client.pull_batch(2)
    assert client.ack(again.lease_id) == 2


def test_errors_keep_their_reason(fresh_client):
    client = fresh_client
    with pytest.raises(RemoteError) as info:
        client.push_group(make_group(0), "forged")
    assert info.value.reason == "unknown_permit"
    client.set_version(1)
    with pytest.raises(RemoteError) as info:
        client.set_version(0)
    assert info.value.reason == "version_regression"
    assert client.health()["ok"]


def test_batched_ops_through_the_actor(ray_cluster):
    """acquire_permits, push_groups, push_and_acquire, ack with a version and a pull that acks: the
    worker's and the learner's calls, as on the ZMQ client."""
    from services.buffer_actor import RayBufferClient, create_buffer_actor

    config = BufferConfig(transport="ray", gate=GateConfig(batch_size=2, eta=0, max_concurrent=4))
    actor = create_buffer_actor(config)
    try:
        client = RayBufferClient(actor, config)
        permits = client.acquire_permits("w", 3, timeout=1)
        assert [p.ticket for p in permits] == [0, 1], "eta = 0: one batch of B = 2"
        results, following = client.push_and_acquire([make_group(p.ticket) for p in permits],
                                                     [p.permit_id for p in permits], "w", 2)
        assert [r["duplicate"] for r in results] == [False, False] and following == [], "the gate is closed"
        first = client.pull_batch(2, timeout=1)
        assert client.pull_batch(2, ack_lease_id=first.lease_id, version=1) is None, "nothing ready yet"
        stats = client.stats()
        assert (stats["version"], stats["consumed_groups"]) == (1, 2), "the pull acked and set the version"
        assert client.ack(first.lease_id, version=1) == 2, "a repeated ack with its version is a no-op"
        more = client.acquire_permits("w", 2)
        assert client.push_groups([make_group(p.ticket, version=1) for p in more],
                                  [p.permit_id for p in more]) == [{"samples": 2, "duplicate": False}] * 2
        assert client.stats()["groups_ready"] == 2
    finally:
        ray_cluster.kill(actor)
