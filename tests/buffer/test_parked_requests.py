"""The learner's requests never wait behind workers' long polls: with 200 acquire requests parked
at a closed gate, the learner still pulls and acks at once, on both transports (the ZMQ service
parks requests in its loop; the Ray actor serves the learner's calls from a thread pool of their
own). Its ack moves the version, which opens the gate for the parked workers."""
from __future__ import annotations

import pytest
from buffer_helpers import make_group, wait_until

from buffer.client import BufferClient
from buffer.config import BufferConfig, ClientConfig, GateConfig
from buffer.server import BufferServer

PARKED = 200
LONG_POLL_S = 120.0  # the parked acquires wait this long: far past the learner's deadline below
LEARNER = ClientConfig(request_timeout_s=20.0, retries=0)  # no resend: the first answer must come


def config(transport: str) -> BufferConfig:
    return BufferConfig(transport=transport, port=0, client=LEARNER,
                        gate=GateConfig(batch_size=2, eta=0, max_concurrent=PARKED + 8))


def fill_the_window(client) -> None:
    """η = 0, B = 2: two groups close the gate until the learner's next version."""
    for _ in range(2):
        permit = client.acquire_permit("w", timeout=5)
        client.push_group(make_group(permit.ticket), permit.permit_id)


def learner_step(client) -> None:
    batch = client.pull_batch(2, timeout=5)
    assert batch is not None and len(batch.groups) == 2
    assert client.ack(batch.lease_id, version=1) == 2


def test_zmq_service_serves_the_learner_with_200_acquires_parked():
    server = BufferServer(config("zmq")).start()
    sockets = []
    try:
        with BufferClient(server.endpoint, LEARNER) as client:
            fill_the_window(client)
            import zmq

            from buffer.codec import encode_message
            from buffer.sample import new_id

            context = zmq.Context.instance()
            for i in range(PARKED):  # 200 workers, each with its own connection, long-polling
                sock = context.socket(zmq.DEALER)
                sock.linger = 0
                sock.connect(server.endpoint)
                sock.send_multipart(encode_message({"id": f"r{i}", "op": "acquire_permits", "args": {
                    "worker_id": f"w{i}", "timeout": LONG_POLL_S, "permit_ids": [new_id()]}}))
                sockets.append(sock)
            assert wait_until(lambda: client.stats()["enqueued"] == PARKED, timeout=60), client.stats()
            learner_step(client)
            assert wait_until(lambda: client.stats()["running"] == 2, timeout=30), "the new version admits two"
            assert client.stats()["enqueued"] == PARKED - 2
    finally:
        for sock in sockets:
            sock.close(linger=0)
        server.stop()


@pytest.mark.slow
def test_ray_actor_serves_the_learner_with_200_acquires_parked(ray_cluster):
    from services.buffer_actor import RayBufferClient, create_buffer_actor

    cfg = config("ray")
    actor = create_buffer_actor(cfg)
    client = RayBufferClient(actor, cfg)
    try:
        fill_the_window(client)
        parked = [actor.acquire_permits.remote(f"w{i}", [f"p{i}"], LONG_POLL_S) for i in range(PARKED)]
        # The worker group's threads are all taken by long polls (64 waiting in the core, the rest
        # queued behind them): the learner's calls go through their own group.
        assert wait_until(lambda: client.stats()["enqueued"] >= 64, timeout=60), client.stats()
        learner_step(client)
        done, _ = ray_cluster.wait(parked, num_returns=2, timeout=60)
        assert sorted(len(ray_cluster.get(ref)) for ref in done) == [1, 1], "the new version admits two"
    finally:
        ray_cluster.kill(actor)
