"""A client loses its connection with a request's reply in flight: the buffer did the work, the
reply is gone with the connection. The client times out, reconnects on a fresh socket and retries
the same request, and the retry does not do the work twice: the same permit, the same lease, the
push recognised as a duplicate, the ack counted once. The proxy in between (`ReplyLosingProxy`)
holds the buffer's replies and drops them with the closed connection."""
import threading

import pytest
from fault_helpers import consume_batch, make_group, wait_until

from buffer.client import BufferClient
from buffer.config import ClientConfig
from services.audit import Consumption, audit, read_buffer_log
from services.chaos import ReplyLosingProxy

IMPATIENT = ClientConfig(request_timeout_s=0.5, retries=30, retry_backoff_s=0.05)


@pytest.fixture
def setup(buffer_service, tmp_path):
    server = buffer_service(log={"path": str(tmp_path / "buffer.log")},
                            gate={"batch_size": 2, "eta": 2, "max_concurrent": 8})
    proxy = ReplyLosingProxy(server.config["port"])
    observer = BufferClient(server.endpoint)  # straight to the buffer, to see what it did
    client = BufferClient(proxy.endpoint, IMPATIENT)
    assert client.health()["ok"]  # connected before any reply is held
    yield server, proxy, observer, client
    client.close()
    observer.close()
    proxy.close()


def with_lost_reply(proxy, client, call, done_on_server):
    """Run `call` while the buffer's replies are held; once the buffer has done the work and the
    client has given up on that connection, let replies through again. Returns call's result."""
    result, errors = [], []
    reconnects = client.reconnects
    proxy.hold()

    def run():
        try:
            result.append(call())
        except Exception as exc:  # noqa: BLE001 - re-raised below
            errors.append(exc)

    thread = threading.Thread(target=run)
    thread.start()
    assert wait_until(done_on_server, timeout=30), "the request never reached the buffer"
    assert wait_until(lambda: client.reconnects > reconnects, timeout=30), "the client never retried"
    proxy.release()
    thread.join(60)
    if errors:
        raise errors[0]
    return result[0]


def test_retries_after_lost_replies_do_nothing_twice(setup, tmp_path):
    server, proxy, observer, client = setup
    acknowledged = set()

    permit = with_lost_reply(proxy, client, lambda: client.acquire_permit("w", timeout=1),
                             lambda: observer.stats()["running"] == 1)
    assert observer.stats()["running"] == 1, "the retried acquire took a second permit"

    group = make_group(permit.ticket)
    reply = with_lost_reply(proxy, client, lambda: client.push_group(group, permit.permit_id),
                            lambda: observer.stats()["pushed_groups"] == 1)
    acknowledged.add(group.group_id)
    assert reply["duplicate"] is True, "the retry must be recognised as the push already accepted"
    for _ in range(3):  # a batch's worth more, normally
        p = client.acquire_permit("w", timeout=1)
        g = make_group(p.ticket)
        client.push_group(g, p.permit_id)
        acknowledged.add(g.group_id)
    stats = observer.stats()
    assert (stats["pushed_groups"], stats["duplicate_pushes"], stats["running"]) == (4, 1, 0)

    batch = with_lost_reply(proxy, client, lambda: client.pull_batch(2, timeout=1),
                            lambda: observer.stats()["groups_leased"] == 2)
    assert observer.stats()["groups_leased"] == 2, "the retried pull leased a second batch"

    acked = with_lost_reply(proxy, client, lambda: client.ack(batch.lease_id),
                            lambda: observer.stats()["consumed_groups"] == 2)
    assert acked == 2 and observer.stats()["consumed_groups"] == 2
    assert proxy.dropped_bytes > 0, "no reply was actually lost"

    consumptions = [Consumption.of_batch(batch), consume_batch(client, 2)]
    report = audit(consumptions, read_buffer_log(tmp_path / "buffer.log"), eta=2, acknowledged=acknowledged)
    assert report.ok and report.consumed_groups == 4 and report.in_buffer_groups == 0, str(report)

