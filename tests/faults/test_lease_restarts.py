"""Leases across a restart of the buffer's process, with either transport (the ZMQ service as a
real `python -m buffer serve` process, the Ray actor restarted by Ray), with and without a log
compaction between: whatever the log replays or compacts, an ack retried after a restart is a
no-op, and an ack of an expired lease whose groups were not leased again consumes them. Neither
ever raises."""
from __future__ import annotations

import os
import signal

import pytest

from fault_helpers import make_group, wait_until

from buffer.client import BufferClient
from buffer.config import BufferConfig, ClientConfig

PATIENT = {"request_timeout_s": 2.0, "retries": 60, "retry_backoff_s": 0.02}
B = 2


def settings(tmp_path, transport: str) -> dict:
    return {"transport": transport, "log": {"path": str(tmp_path / "buffer.log"), "compact_min_bytes": 0},
            "gate": {"batch_size": B, "eta": 0, "max_concurrent": 16},
            "store": {"lease_s": 1.0},  # leases expire during the test
            "client": PATIENT}


class ZmqBuffer:
    def __init__(self, buffer_service, tmp_path):
        self.service = buffer_service(**settings(tmp_path, "zmq"))
        self.client = BufferClient(self.service.endpoint, ClientConfig(**PATIENT))

    def restart(self) -> None:
        self.service.kill()
        self.service.start()

    def close(self) -> None:
        self.client.close()


class RayBuffer:
    def __init__(self, ray_cluster, tmp_path):
        from services.buffer_actor import RayBufferClient, create_buffer_actor

        config = BufferConfig.model_validate(settings(tmp_path, "ray"))
        self.ray = ray_cluster
        self.actor = create_buffer_actor(config, max_restarts=2, starts_file=tmp_path / "starts")
        self.client = RayBufferClient(self.actor, config)

    def restart(self) -> None:
        pid = self.client.health()["pid"]
        os.kill(pid, signal.SIGKILL)
        assert wait_until(lambda: self.client.health()["pid"] != pid, timeout=120)

    def close(self) -> None:
        self.ray.kill(self.actor)


@pytest.fixture(params=["zmq", "ray"])
def buffer(request, tmp_path):
    if request.param == "zmq":
        handle = ZmqBuffer(request.getfixturevalue("buffer_service"), tmp_path)
    else:
        handle = RayBuffer(request.getfixturevalue("ray_cluster"), tmp_path)
    handle.client.set_version(1)
    yield handle
    handle.close()


def push(client, count: int, version: int = 1) -> list[str]:
    ids = []
    for _ in range(count):
        permit = client.acquire_permit("w", timeout=10)
        assert permit is not None, client.stats()
        group = make_group(permit.ticket, version=version)
        client.push_group(group, permit.permit_id)
        ids.append(group.group_id)
    return ids


def compact(client) -> None:
    """Drive the log to a compaction without touching the ready groups: groups one version too old
    (η = 0) are pushed and dropped by a pull that cannot fill a batch; a drop may compact."""
    before = client.stats()["log_compactions"]
    for _ in range(40):
        push(client, 1, version=0)
        assert client.pull_batch(64, timeout=0) is None
        if client.stats()["log_compactions"] > before:
            return
    raise AssertionError(f"no compaction after 40 drops: {client.stats()}")


@pytest.mark.parametrize("compaction", [False, True], ids=["replayed", "compacted"])
def test_a_retried_ack_after_a_restart_is_a_no_op(buffer, compaction):
    client = buffer.client
    groups = push(client, B)
    batch = client.pull_batch(B, timeout=5)
    assert client.ack(batch.lease_id) == B  # as if the reply was lost: the learner acks again
    if compaction:
        compact(client)
    buffer.restart()
    assert client.ack(batch.lease_id) == B
    assert client.pull_batch(B, ack_lease_id=batch.lease_id, timeout=0) is None  # the step-end form too
    stats = client.stats()
    assert stats["groups_ready"] == stats["groups_leased"] == 0
    assert sorted(g.group_id for g in batch.groups) == sorted(groups)


@pytest.mark.parametrize("compaction", [False, True], ids=["replayed", "compacted"])
def test_an_ack_of_an_expired_lease_consumes_its_groups_after_a_restart(buffer, compaction):
    client = buffer.client
    push(client, B)
    batch = client.pull_batch(B, timeout=5)
    assert wait_until(lambda: client.stats()["leases_expired"] >= 1, timeout=60), "the lease never expired"
    if compaction:
        compact(client)
    buffer.restart()
    assert client.ack(batch.lease_id, version=2) == B, "the late ack consumes the expired lease's groups"
    stats = client.stats()
    assert stats["groups_ready"] == 0 and stats["version"] == 2
    assert client.ack(batch.lease_id) == B, "and is answered again when retried"


def test_an_expired_lease_whose_groups_were_leased_again_is_refused_not_trained_twice(buffer):
    client = buffer.client
    push(client, B)
    first = client.pull_batch(B, timeout=5)
    assert wait_until(lambda: client.stats()["leases_expired"] >= 1, timeout=60)
    second = client.pull_batch(B, timeout=5)
    assert sorted(g.group_id for g in second.groups) == sorted(g.group_id for g in first.groups)
    buffer.restart()
    from buffer.errors import RemoteError

    with pytest.raises(RemoteError, match="lease_expired"):
        client.ack(first.lease_id)
    assert client.ack(second.lease_id) == B
