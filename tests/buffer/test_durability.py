"""Durability: the buffer process is SIGKILLed mid-stream and restarted from its log; nothing
acknowledged is lost or consumed twice. Plus replay of the gate state, log compaction, and a
torn log tail."""
import threading
from collections import Counter

import pytest
from buffer_helpers import make_group

from buffer.client import BufferClient
from buffer.codec import encode_group, pack_frames
from buffer.config import BufferConfig, ClientConfig, GateConfig, LogConfig
from buffer.core import BufferCore
from buffer.durable_log import keep_as_previous, payloads_dir, read_records, settled_path
from buffer.errors import LogFailed


@pytest.mark.parametrize("fsync", ["always", "interval"])
def test_sigkill_mid_stream_loses_nothing_acknowledged(buffer_service, tmp_path, fsync):
    config = {"log": {"path": str(tmp_path / "buffer.log"), "fsync": fsync, "fsync_interval_ms": 50},
              "gate": {"batch_size": 2, "eta": None, "max_concurrent": 4}}
    server = buffer_service(**config)
    client_settings = ClientConfig(request_timeout_s=1.0, retries=30, retry_backoff_s=0.05)
    acknowledged, consumed, errors = set(), Counter(), []
    total_groups, resume = 60, threading.Event()

    def pusher():
        try:
            with BufferClient(server.endpoint, client_settings) as client:
                for i in range(total_groups):
                    if i == total_groups // 2:
                        resume.wait()  # so that the kill lands while pushes stream in
                    permit = client.acquire_permit("w", timeout=5)
                    group = make_group(permit.ticket)
                    client.push_group(group, permit.permit_id)  # retried across the restart
                    acknowledged.update(group.sample_ids)
        except Exception as exc:
            errors.append(exc)

    thread = threading.Thread(target=pusher)
    thread.start()
    puller = BufferClient(server.endpoint, client_settings)
    for _ in range(5):
        batch = puller.pull_batch(2, timeout=10)
        puller.ack(batch.lease_id)
        consumed.update(s.sample_id for s in batch.samples)
    in_flight = puller.pull_batch(2, timeout=10)  # trained on, but the ack comes after the crash
    resume.set()
    server.kill()
    assert len(acknowledged) < total_groups * 2, "the kill must land mid-stream"
    server.start()
    assert puller.ack(in_flight.lease_id) == 2, "the lease survives the restart"
    consumed.update(s.sample_id for s in in_flight.samples)
    thread.join()
    assert not errors
    while (batch := puller.pull_batch(2, timeout=1.0)) is not None:
        puller.ack(batch.lease_id)
        consumed.update(s.sample_id for s in batch.samples)
    stats = puller.stats()
    puller.close()
    assert len(acknowledged) == total_groups * 2
    assert set(consumed) == acknowledged, "an acknowledged push was lost"
    assert max(consumed.values()) == 1, "a sample was consumed twice"
    assert stats["accepted"] == total_groups and stats["running"] == 0


def core_with_log(path, batch_size=2, eta=2, **log):
    return BufferCore(BufferConfig(gate=GateConfig(batch_size=batch_size, eta=eta, max_concurrent=8),
                                   log=LogConfig(path=path, **log)))


def test_replay_restores_gate_tickets_versions_and_store(tmp_path):
    path = tmp_path / "b.log"
    core = core_with_log(path)
    permits = [core.acquire_permit("w") for _ in range(5)]
    core.set_version(1)
    pushed = []
    for p in permits[:3]:
        group = make_group(p.ticket, version=1)
        core.push_group(encode_group(group), p.permit_id)
        pushed.append(group)
    core.release_permit(permits[3].permit_id)  # ticket 3 goes back
    batch = core.pull_batch(2)
    core.ack(batch.lease_id)
    core.push_group(encode_group(make_group(permits[4].ticket, version=1)), permits[4].permit_id)
    leased = core.pull_batch(1)  # not acked before the crash
    before = core.stats()
    core.close()  # or a crash: every record is already written

    again = core_with_log(path)
    after = again.stats()
    for key in ("version", "accepted", "running", "next_ticket", "free_tickets", "groups_ready", "capacity"):
        assert after[key] == before[key], key
    assert again.acquire_permit("w").ticket == 3, "the released ticket is still reissued first"
    assert again.push_group(encode_group(pushed[0]), permits[0].permit_id)["duplicate"], "consumed ids are remembered"
    assert again.stats()["groups_leased"] == 1 and again.ack(leased.lease_id) == 1, "a lease survives"
    assert again.ack(batch.lease_id) == 2, "an ack before the crash is still known (a retried ack)"


def test_a_filtered_ticket_stays_ended_across_a_restart_and_a_compaction(tmp_path):
    """filter_group (dynamic sampling) is logged: a restart neither reissues the ticket nor holds
    its permit, a compaction's snapshot keeps it, and the audit counts the ticket as ended."""
    from services.audit import Consumption, audit, read_buffer_log

    path = tmp_path / "b.log"
    core = core_with_log(path, compact_min_bytes=0)
    permits = [core.acquire_permit("w") for _ in range(3)]
    assert core.filter_group(permits[1].permit_id, "all 2 samples scored reward = 1")
    assert not core.filter_group(permits[1].permit_id, "again"), "a permit ends once"
    pushed = [make_group(p.ticket) for p in (permits[0], permits[2])]
    for p, group in zip((permits[0], permits[2]), pushed):
        core.push_group(encode_group(group), p.permit_id)
    assert core.stats()["groups_filtered"] == 1
    batch = core.pull_batch(2)
    assert batch.groups_filtered == 1
    core.ack(batch.lease_id)
    core.set_version(1)
    assert core.wait_for_compaction(timeout=60) and core.stats()["log_compactions"] > 0
    core.close()
    records = read_buffer_log(path)
    ops = {r["op"] for r in records}
    assert "snapshot" in ops and "filter" not in ops, "compacted: the snapshot alone says ticket 1 ended"
    trained = Consumption(version=0, group_ids=[g.group_id for g in pushed], tickets=[0, 2], sample_versions=[0] * 4)
    report = audit([trained], records, eta=None)
    assert report.ok and report.consumed_groups == 2, report
    unaware = [dict(r, gate={k: v for k, v in r["gate"].items() if k != "filtered"}) if r["op"] == "snapshot" else r
               for r in records]
    assert audit([trained], unaware, eta=None).lost_tickets == [1], "without its record the ticket is lost"
    again = core_with_log(path, compact_min_bytes=0)
    assert again.stats()["groups_filtered"] == 1 and again.gate.running == 0 and again.gate.filtered == {1}
    assert again.acquire_permit("w").ticket == 3, "ticket 1 is not reissued"


def test_compaction_keeps_live_groups_and_consumed_ids(tmp_path):
    path = tmp_path / "b.log"
    core = core_with_log(path, compact_min_bytes=0)
    groups = []
    for _ in range(40):
        permit = core.acquire_permit("w")
        group = make_group(permit.ticket, version=core.gate.version, tokens=200)
        core.push_group(encode_group(group), permit.permit_id)
        groups.append(group)
        if len(core.store.ready) >= 4:
            core.ack(core.pull_batch(2).lease_id)
            core.set_version(core.gate.version + 1)
            assert core.wait_for_compaction(timeout=60)  # compaction runs in the background
    stats = core.stats()
    assert stats["log_compactions"] > 0 and stats["log_compaction_running"] is False
    size_before = path.stat().st_size
    core.close()
    again = core_with_log(path, compact_min_bytes=0)
    assert path.stat().st_size == size_before
    assert sorted(again.store.ready) == sorted(core.store.ready)
    assert again.gate.accepted == 40 and again.gate.next_ticket == 40
    assert again.push_group(encode_group(groups[0]), "any")["duplicate"], "ids of consumed groups survive compaction"


def test_torn_tail_is_cut_and_the_rest_replayed(tmp_path):
    path = tmp_path / "b.log"
    core = core_with_log(path)
    permit = core.acquire_permit("w")
    core.push_group(encode_group(make_group(permit.ticket)), permit.permit_id)
    core.close()
    good = path.stat().st_size
    with open(path, "ab") as f:
        f.write(b"\x40\x00\x00\x00\x01\x02\x03")  # a record header and a few bytes: a crash mid-write
    again = core_with_log(path)
    assert again.log.truncated_bytes == 7 and path.stat().st_size == good
    assert again.stats()["groups_ready"] == 1


def test_snapshot_restores_into_a_fresh_buffer(tmp_path):
    """A checkpoint's view: permits in flight are returned to the reissue pool, live groups and
    the cursor carry over, and a durable target writes them to its own log."""
    source = core_with_log(tmp_path / "a.log")
    permits = [source.acquire_permit("w") for _ in range(3)]
    group, leased = make_group(permits[0].ticket), make_group(permits[1].ticket)
    source.push_group(encode_group(group), permits[0].permit_id)
    source.push_group(encode_group(leased), permits[1].permit_id)
    source.pull_batch(1)  # the learner's batch in flight: not in the checkpoint's state
    records = source.snapshot_records(keep_in_flight=False)
    target = core_with_log(tmp_path / "b.log")
    target.restore(records)
    assert target.gate.running == 0 and sorted(target.gate.free_tickets) == [2]
    assert target.gate.accepted == 2 and sorted(target.store.ready) == sorted([group.group_id, leased.group_id])
    with pytest.raises(Exception, match="fresh"):
        target.restore(records)
    target.close()
    reopened = core_with_log(tmp_path / "b.log")
    assert len(reopened.store.ready) == 2 and reopened.acquire_permit("w").ticket == 2


def test_one_fsync_per_request_and_none_for_a_permit_alone(tmp_path):
    """Group commit: a request's records are synced together when it is answered, and a permit
    grant (whose loss in a machine crash is harmless) is not synced on its own."""
    core = core_with_log(tmp_path / "b.log")  # fsync: always
    fsyncs = lambda: core.stats()["log_fsyncs"]  # noqa: E731
    before = fsyncs()
    permits = core.acquire_permits("w", [f"p{i}" for i in range(4)])
    assert len(permits) == 4 and fsyncs() == before, "permit grants ride with the next sync"
    groups = [encode_group(make_group(p.ticket)) for p in permits]
    results, more = core.push_and_acquire(groups, [p.permit_id for p in permits], "w", ["q0", "q1"])
    assert len(results) == 4 and len(more) == 2 and fsyncs() == before + 1, "4 pushes + 2 grants: one fsync"
    batch = core.pull_batch(2)
    assert fsyncs() == before + 2
    core.pull_batch(2, ack_lease_id=batch.lease_id, version=1)  # ack + version + lease: one request
    assert fsyncs() == before + 3
    core.close()
    again = core_with_log(tmp_path / "b.log")
    assert again.gate.version == 1 and again.stats()["groups_leased"] == 2


def test_compaction_runs_off_the_request_path(tmp_path, monkeypatch):
    """While a compaction writes its snapshot (held up here), pushes, pulls and acks are served;
    the records they wrote meanwhile end up in the compacted log (replayed identically)."""
    from buffer import durable_log

    writing, release = threading.Event(), threading.Event()
    real_run = durable_log.Compaction.run

    def slow_run(self, lock):
        writing.set()
        assert release.wait(60)
        real_run(self, lock)

    monkeypatch.setattr(durable_log.Compaction, "run", slow_run)
    path = tmp_path / "b.log"
    core = core_with_log(path, compact_min_bytes=0, batch_size=1, eta=None)
    for _ in range(3):  # until an ack starts a compaction
        permit = core.acquire_permit("w")
        core.push_group(encode_group(make_group(permit.ticket)), permit.permit_id)
        core.ack(core.pull_batch(1).lease_id)
        if writing.is_set():
            break
    assert writing.wait(10), "no compaction started"
    served = []
    for _ in range(3):  # the compaction is stuck writing: requests are not
        permit = core.acquire_permit("w")
        group = make_group(permit.ticket)
        core.push_group(encode_group(group), permit.permit_id)
        served.append(group.group_id)
    batch = core.pull_batch(1)
    core.ack(batch.lease_id, version=1)
    release.set()
    assert core.wait_for_compaction(timeout=60)
    assert core.stats()["log_compactions"] == 1
    state = (sorted(core.store.ready), core.gate.version, core.gate.accepted, core.gate.next_ticket)
    core.close()
    again = core_with_log(path, batch_size=1, eta=None)
    assert (sorted(again.store.ready), again.gate.version, again.gate.accepted, again.gate.next_ticket) == state
    assert sorted(again.store.ready) == sorted(served[1:])


@pytest.mark.parametrize("size", [0, 100, 70_000, 2_000_000])
def test_a_record_is_encoded_as_msgpack_writes_it(size):
    """A pushed group at least _INLINE_BYTES big is written from its own buffer, beside its
    record's head: the bytes are those of msgpack.packb of the whole record, and read back."""
    import struct
    import zlib

    import msgpack

    from buffer.durable_log import _encode_parts

    payload = memoryview(bytes(range(256)) * (size // 256) + bytes(size % 256))
    record = {"op": "push", "permit": "p1", "seq": 7, "group": payload, "handed_out": 0}
    written = b"".join(bytes(part) for part in _encode_parts(record))
    body = msgpack.packb({**record, "group": bytes(payload)}, use_bin_type=True)
    length, crc = struct.unpack_from("<II", written)
    assert written[8:] == body and length == len(body) and crc == zlib.crc32(body)


def test_a_large_pushed_group_is_logged_and_replayed(tmp_path):
    """A group of real size (16 samples of 9k tokens: 1.8 MB) goes to the log from the buffer it
    arrived in and comes back whole on replay."""
    path = tmp_path / "b.log"
    core = core_with_log(path, batch_size=1)
    permit = core.acquire_permit("w")
    group = make_group(permit.ticket, n=16, tokens=9000)
    packed = pack_frames(encode_group(group))
    assert len(packed) > 1_000_000
    core.push_group(memoryview(packed), permit.permit_id)
    core.close()
    again = core_with_log(path, batch_size=1)
    (stored,) = again.store.ready.values()
    assert bytes(stored.packed) == packed


def large_group(ticket: int, version: int = 0):
    """A group of 4 x 3,000 tokens (about 160 KB): its payload goes to a log segment."""
    return encode_group(make_group(ticket, version=version, n=4, tokens=3000))


def push_large(core) -> None:
    """Take a permit and push a large group under it."""
    permit = core.acquire_permit("w")
    core.push_group(large_group(permit.ticket), permit.permit_id)


def segment_files(path):
    return sorted(f.name for f in payloads_dir(path).glob("*.seg"))


def test_large_payloads_live_in_segments_that_compaction_drops_once_consumed(tmp_path):
    """The log holds references only; compaction keeps a segment while one of its groups is live
    (here: leased and not acked) and deletes the rest; a restart at each point replays the live
    groups byte for byte."""
    path = tmp_path / "b.log"
    settings = {"compact_min_bytes": 0, "segment_bytes": 400_000}  # 3 groups a segment
    core = core_with_log(path, batch_size=1, eta=None, **settings)
    pinned = None
    for i in range(18):
        push_large(core)
        batch = core.pull_batch(1)
        if pinned is None:
            pinned = batch  # the first group stays leased: its segment must stay
        else:
            core.ack(batch.lease_id)
        assert core.wait_for_compaction(timeout=60)
    assert core.stats()["log_compactions"] > 0
    assert path.stat().st_size < 100_000, "the log holds no payloads"
    kept = segment_files(path)
    assert kept[0] == "00000000.seg" and len(kept) <= 3, kept  # the pinned one, the current one or two
    assert core.stats()["log_bytes"] == path.stat().st_size + sum(
        f.stat().st_size for f in payloads_dir(path).glob("*.seg"))
    core.close()

    again = core_with_log(path, batch_size=1, eta=None, **settings)
    (lease,) = again.store.leases.values()
    assert [bytes(g.packed) for g in lease.groups] == [bytes(pinned.groups[0])]
    again.ack(pinned.lease_id)
    compactions = again.stats()["log_compactions"]
    while again.stats()["log_compactions"] < compactions + 2:  # writes start compactions (the first may
        push_large(again)                                      # have snapshotted before the ack)
        again.ack(again.pull_batch(1).lease_id)
        assert again.wait_for_compaction(timeout=60)
    assert "00000000.seg" not in segment_files(path), "a fully consumed segment is deleted"
    push_large(again)
    pushes = [r for r in read_records(path)[0] if r["op"] == "push"]
    assert pushes and all("blob" in r and len(r["group"]) > 100_000 for r in pushes), "read back with payloads"
    again.close()


def test_a_payload_lost_or_corrupt_in_its_segment_cuts_the_log_there(tmp_path):
    path = tmp_path / "b.log"
    core = core_with_log(path)
    for _ in range(2):
        push_large(core)
    core.close()
    (segment,) = payloads_dir(path).glob("*.seg")
    data = bytearray(segment.read_bytes())
    data[-10] ^= 0xFF  # the second group's payload, as a crash mid-write may leave it
    segment.write_bytes(bytes(data))
    whole, heads = read_records(path)[0], read_records(path, payloads=False)[0]
    assert [r["op"] for r in heads] == [r["op"] for r in whole], "a reader of headers cuts at the same record"
    again = core_with_log(path)
    assert again.log.truncated_bytes > 0, "the record naming the bad payload is cut as a torn tail"
    assert again.stats()["groups_ready"] == 1 and again.gate.accepted == 1
    again.close()


def test_a_reader_of_group_headers_gets_them_without_the_samples(tmp_path):
    """The audit reads a log for its groups' headers: a push whose payload is in a segment comes
    with the payload's first bytes only (checked whole all the same), and its header reads the
    same as from the whole payload."""
    from services.audit import group_header

    path = tmp_path / "b.log"
    core = core_with_log(path)
    for _ in range(2):
        push_large(core)
    core.close()
    whole = [r for r in read_records(path)[0] if r["op"] == "push"]
    heads = [r for r in read_records(path, payloads=False)[0] if r["op"] == "push"]
    assert len(heads) == 2 and all("group" not in r and len(r["group_head"]) < 4096 for r in heads)
    assert all(len(r["group"]) > 100_000 for r in whole)
    assert [group_header(r) for r in heads] == [group_header(r) for r in whole]
    assert [group_header(r)["prompt_index"] for r in heads] == [0, 1]


def test_a_restore_writes_large_payloads_to_segments(tmp_path):
    source = BufferCore(BufferConfig(gate=GateConfig(batch_size=1, eta=None, max_concurrent=8)))
    for _ in range(3):
        push_large(source)
    records = source.snapshot_records(keep_in_flight=False)
    target = core_with_log(tmp_path / "b.log", batch_size=1, eta=None)
    target.restore(records)
    assert all(g.blob is not None for g in target.store.live_groups())
    assert (tmp_path / "b.log").stat().st_size < 100_000 and len(segment_files(tmp_path / "b.log")) == 1
    target.close()
    again = core_with_log(tmp_path / "b.log", batch_size=1, eta=None)
    assert sorted(bytes(g.packed) for g in again.store.live_groups()) == sorted(
        bytes(g.packed) for g in source.store.live_groups())


def test_a_log_kept_as_previous_moves_with_its_archive_and_segments(tmp_path):
    path = tmp_path / "b.log"
    core = core_with_log(path, batch_size=1, eta=None, compact_min_bytes=0)
    push_large(core)
    core.ack(core.pull_batch(1).lease_id)
    push_large(core)
    assert core.wait_for_compaction(timeout=60)
    core.close()
    previous = keep_as_previous(path)
    assert not path.exists() and not payloads_dir(path).exists()
    assert keep_as_previous(path) == previous and payloads_dir(previous).is_dir(), \
        "with no log to keep, the older one stays whole"
    records = read_records(previous)[0] + read_records(settled_path(previous))[0]
    assert {r["op"] for r in records} >= {"push", "ack"}
    assert all(len(r["group"]) > 100_000 for r in records if r["op"] == "push")


def test_compaction_syncs_the_payloads_it_names_before_the_new_log(tmp_path, monkeypatch):
    """With `fsync: interval` a snapshot can name payloads no sync has reached yet; the compacted
    log must not be made durable before them (a power loss would leave it naming lost bytes, and
    replay would cut it there, losing older records after that point)."""
    import os

    path = tmp_path / "b.log"
    core = core_with_log(path, batch_size=1, eta=None, fsync="interval", fsync_interval_ms=10**9,
                         compact_min_bytes=0)
    synced, real_fsync = [], os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (synced.append(os.fstat(fd).st_ino), real_fsync(fd))[1])
    for _ in range(3):
        push_large(core)
    (segment,) = payloads_dir(path).glob("*.seg")
    assert segment.stat().st_ino not in synced, "the interval has not synced the payloads"
    core.ack(core.pull_batch(1).lease_id)  # starts a compaction whose snapshot names the other two
    assert core.wait_for_compaction(timeout=60) and core.stats()["log_compactions"] == 1
    new_log = path.stat().st_ino
    assert segment.stat().st_ino in synced and synced.index(segment.stat().st_ino) < synced.index(new_log)
    core.close()


def test_interval_fsyncs_run_off_the_request_path(tmp_path, monkeypatch):
    """`fsync: interval` with a disk that takes its time: while a due sync waits on the disk,
    requests are answered (and no second sync starts); each sync does the payload segment before
    the log; a background fsync that fails stops the buffer at the next request, for good."""
    import os
    import time

    path = tmp_path / "b.log"
    core = core_with_log(path, batch_size=1, eta=None, fsync="interval", fsync_interval_ms=1)
    disk, synced, real_fsync = threading.Semaphore(0), [], os.fsync

    def slow_fsync(fd):
        inode = os.fstat(fd).st_ino
        assert disk.acquire(timeout=60), "the test never let the disk go on"
        synced.append(inode)
        real_fsync(fd)

    push_large(core)  # opens the segment (its folder synced)
    permits = [core.acquire_permit("w") for _ in range(3)]
    settle_background_sync(core)
    core.log.sync()  # nothing unsynced: the next sync is due to the pushes alone
    before = core.stats()["log_fsyncs"]
    monkeypatch.setattr(os, "fsync", slow_fsync)
    time.sleep(0.01)  # only makes the 1 ms interval due; nothing waits on this
    for permit in permits:  # the first starts the sync, which now waits on the disk; all are answered
        core.push_group(large_group(permit.ticket), permit.permit_id)
    assert core.stats()["log_fsyncs"] == before and synced == [], "the sync is still waiting on the disk"
    disk.release(2)  # the segment's fsync, then the log's
    deadline = time.monotonic() + 60
    while core.stats()["log_fsyncs"] < before + 1:
        assert time.monotonic() < deadline, "the background sync never finished"
        time.sleep(0.005)
    (segment,) = payloads_dir(path).glob("*.seg")
    assert synced[:2] == [segment.stat().st_ino, path.stat().st_ino], "the payloads before the log"
    disk.release(100)  # any later sync goes through
    settle_background_sync(core)

    def failing_fsync(fd):
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(os, "fsync", failing_fsync)
    time.sleep(0.01)
    core.acquire_permit("w")  # due: starts a sync that fails in the background
    settle_background_sync(core)
    with pytest.raises(LogFailed, match=r"fsync of the log \(background sync\) failed \(\[Errno 5\]"):
        core.acquire_permit("w")
    monkeypatch.setattr(os, "fsync", real_fsync)
    with pytest.raises(LogFailed, match="stopped"):  # never forgotten, though fsync works again
        core.acquire_permit("w")
    core.close()
    again = core_with_log(path, batch_size=1, eta=None)
    assert again.gate.accepted == 4


def settle_background_sync(core) -> None:
    """Wait (bounded) until no background fsync of the log is in flight."""
    if core.log._background is not None:
        core.log._background.join(60)
        assert not core.log._background.is_alive(), "a background fsync never ended"


def test_a_restart_reclaims_the_segments_consumed_before_it_at_the_next_compaction(tmp_path):
    """A process that never compacted leaves segments full of consumed groups; the next process
    counts its doubling from what its live groups need, so its first ack compacts and deletes them
    (counting from the disk at open would wait until the disk doubled again)."""
    path = tmp_path / "b.log"
    core = core_with_log(path, batch_size=1, eta=None, compact_min_bytes=10**12, segment_bytes=400_000)
    for _ in range(9):  # 3 segments of consumed groups, no compaction
        push_large(core)
        core.ack(core.pull_batch(1).lease_id)
    push_large(core)  # one live group, in a 4th segment
    assert core.stats()["log_compactions"] == 0 and len(segment_files(path)) == 4
    core.close()

    again = core_with_log(path, batch_size=1, eta=None, compact_min_bytes=0, segment_bytes=400_000)
    disk_at_open = again.stats()["log_bytes"]
    push_large(again)
    again.ack(again.pull_batch(1).lease_id)  # the live group from before the restart
    assert again.wait_for_compaction(timeout=60) and again.stats()["log_compactions"] == 1
    assert segment_files(path) == ["00000004.seg"], "the consumed ones are gone (4: the new live group)"
    assert again.stats()["log_bytes"] < disk_at_open / 2
    (group,) = again.store.ready.values()
    again.close()
    third = core_with_log(path, batch_size=1, eta=None)
    assert [bytes(g.packed) for g in third.store.ready.values()] == [bytes(group.packed)]
    third.close()


# ---- failing stop: write and sync errors, corruption ------------------------------------------

def open_log(path, **settings):
    from buffer.durable_log import DurableLog

    log = DurableLog(LogConfig(path=path, **settings))
    records = list(log.replay())
    return log, records


def short_writes(monkeypatch, count: int = 1, keep: float = 0.5) -> None:
    """The next `count` writes (writev or write) store only part of their bytes and say so, as
    the kernel does when the disk fills."""
    import os

    real_write, left = os.write, [count]

    def partial(fd, data, real):
        if left[0] <= 0:
            return real(fd, data)
        left[0] -= 1
        data = b"".join(bytes(p) for p in data) if isinstance(data, list) else bytes(data)
        return real_write(fd, data[: int(len(data) * keep)])

    real_writev = os.writev
    monkeypatch.setattr(os, "writev", lambda fd, parts: partial(fd, parts, real_writev))
    monkeypatch.setattr(os, "write", lambda fd, data: partial(fd, data, real_write))


def test_a_short_write_leaves_no_half_record_before_later_ones(tmp_path, monkeypatch):
    """The issue's case: versions 1, a short write of 2 (a full disk), then 3, 4, 5 appended and
    committed. Replay gave [1] (the half record cut everything after it as a torn tail); the
    failed write is now cut back, so it gives 1, 3, 4, 5."""
    path = tmp_path / "b.log"
    log, _ = open_log(path)
    log.append({"op": "version", "version": 1})
    log.commit()
    short_writes(monkeypatch)
    with pytest.raises(Exception, match="short write"):
        log.append({"op": "version", "version": 2})
    monkeypatch.undo()
    for version in (3, 4, 5):
        log.append({"op": "version", "version": version})
    log.commit()
    log.close()
    _, records = open_log(path)
    assert [r["version"] for r in records] == [1, 3, 4, 5]


def test_a_short_payload_write_keeps_the_segment_offsets_right(tmp_path, monkeypatch):
    """A payload segment's short write is cut back too, and the next payload is named at its
    true offset (it was named after the half payload's start: replay cut it as corrupt)."""
    path = tmp_path / "b.log"
    log, _ = open_log(path)
    payload = lambda i: bytes([i]) * 70_000  # noqa: E731 - large: it goes to a segment
    log.append({"op": "push", "permit": None, "seq": 0, "group": payload(1)})
    log.commit()
    short_writes(monkeypatch)
    with pytest.raises(Exception, match="short write"):
        log.append({"op": "push", "permit": None, "seq": 1, "group": payload(2)})
    monkeypatch.undo()
    log.append({"op": "push", "permit": None, "seq": 2, "group": payload(3)})
    log.commit()
    log.close()
    (segment,) = payloads_dir(path).glob("*.seg")
    assert segment.stat().st_size == 2 * 70_000, "the half payload was cut from the segment"
    _, records = open_log(path)
    assert [bytes(r["group"]) for r in records] == [payload(1), payload(3)]


def test_a_write_that_cannot_be_cut_back_poisons_the_log(tmp_path, monkeypatch):
    import errno
    import os

    path = tmp_path / "b.log"
    log, _ = open_log(path)
    log.append({"op": "version", "version": 1})
    log.commit()
    short_writes(monkeypatch)

    def ftruncate(fd, length):
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(os, "ftruncate", ftruncate)
    with pytest.raises(LogFailed, match=r"short write.* cutting the file back to byte \d+ failed too"):
        log.append({"op": "version", "version": 2})
    monkeypatch.undo()
    for call in (lambda: log.append({"op": "version", "version": 3}), log.commit, log.sync):
        with pytest.raises(LogFailed, match="poisoned"):
            call()
    log.close()
    log, records = open_log(path)  # the half record is the tail: cut, as after a crash
    assert [r["version"] for r in records] == [1] and log.truncated_bytes > 0
    log.close()


def test_a_failed_fsync_stops_the_buffer_for_good(tmp_path, monkeypatch):
    """fsync-gate: after a failed fsync the kernel may have dropped the pages, and a second fsync
    can report success; so the push is refused, nothing is fsynced again, and every later call
    raises. A restart replays the log; the client's retried push is accepted once."""
    import errno
    import os

    path = tmp_path / "b.log"
    core = core_with_log(path)
    permit = core.acquire_permit("w")
    group = encode_group(make_group(permit.ticket))
    calls, real_fsync = [], os.fsync

    def fsync(fd):
        calls.append(fd)
        if len(calls) == 1:
            raise OSError(errno.EIO, "Input/output error")
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    with pytest.raises(LogFailed, match=r"fsync of the log failed \(\[Errno 5\]"):
        core.push_group(group, permit.permit_id)
    for call in (lambda: core.push_group(group, permit.permit_id), core.stats, lambda: core.pull_batch(1),
                 core.tick):
        with pytest.raises(LogFailed, match="stopped"):
            call()
    core.close()
    assert len(calls) == 1, "a failed fsync is never retried"
    monkeypatch.undo()
    again = core_with_log(path)
    again.push_group(group, permit.permit_id)  # the client's retry: accepted now, or a duplicate
    assert again.stats()["accepted"] == 1 and len(again.pull_batch(1).groups) == 1


def test_a_failed_write_stops_the_buffer_so_no_retry_is_answered_from_memory(tmp_path, monkeypatch):
    """An ack settles its groups before its record is written: if the write fails, the buffer
    stops rather than answer the retried ack from memory (the lease would come back after a
    restart and be delivered twice). The restarted buffer answers the retry from the log."""
    import errno
    import os

    path = tmp_path / "b.log"
    core = core_with_log(path)
    for _ in range(2):
        permit = core.acquire_permit("w")
        core.push_group(encode_group(make_group(permit.ticket)), permit.permit_id)
    batch = core.pull_batch(2)
    real_writev = os.writev

    def writev(fd, parts):
        monkeypatch.setattr(os, "writev", real_writev)
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "writev", writev)
    with pytest.raises(LogFailed, match=r"No space left on device.*cut back"):
        core.ack(batch.lease_id)
    with pytest.raises(LogFailed, match="stopped"):
        core.ack(batch.lease_id)
    core.close()
    again = core_with_log(path)
    assert again.ack(batch.lease_id) == 2 and again.pull_batch(2) is None
    assert again.stats()["consumed_groups"] == 2


def test_replay_refuses_a_bad_record_followed_by_intact_ones(tmp_path):
    """Damage in the middle of the log is not a torn tail: replay names the file and the byte and
    cuts nothing. The same damage in the last record is a torn tail, cut as before; so is a tail
    of zeros (which read as a record of length 0 and crashed replay)."""
    from buffer.durable_log import LogCorrupt

    path = tmp_path / "b.log"
    log, _ = open_log(path)
    ends = []
    for version in range(1, 6):
        log.append({"op": "version", "version": version})
        ends.append(log.size)
    log.close()
    data = bytearray(path.read_bytes())
    data[ends[1] + 12] ^= 0x04  # a bit of the third record's body
    path.write_bytes(bytes(data))
    with pytest.raises(LogCorrupt, match=rf"{path}: the record at byte {ends[1]} is corrupt, but an intact record "
                                         rf"follows at byte {ends[2]}"):
        core_with_log(path)
    assert path.read_bytes() == bytes(data), "nothing was cut"
    with pytest.raises(LogCorrupt):
        read_records(path)  # the audit reads it as replay does

    data[ends[3] + 12] ^= 0x04  # the last record instead: a torn tail
    data[ends[1] + 12] ^= 0x04
    path.write_bytes(bytes(data) + bytes(4096))  # and zeros after it
    log, records = open_log(path)
    assert [r["version"] for r in records] == [1, 2, 3, 4] and path.stat().st_size == ends[3]
    log.close()


def test_new_files_and_folders_are_synced_in_their_parent(tmp_path, monkeypatch):
    """The log's folders and file, the segments folder and each segment, and the settled archive:
    each new name is made durable by an fsync of its folder."""
    import os

    synced, real_fsync = [], os.fsync

    def fsync(fd):
        if os.path.isdir(f"/proc/self/fd/{fd}"):
            synced.append((os.readlink(f"/proc/self/fd/{fd}"), set(os.listdir(fd))))
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    path = tmp_path / "run" / "logs" / "b.log"
    core = core_with_log(path, batch_size=1, compact_min_bytes=0)
    push_large(core)
    core.ack(core.pull_batch(1).lease_id)  # a compaction: its archive is created
    assert core.wait_for_compaction(timeout=60) and core.stats()["log_compactions"] == 1
    core.close()

    def was_synced(folder, name):
        return any(f == str(folder) and name in names for f, names in synced)

    for folder, name in [(tmp_path, "run"), (tmp_path / "run", "logs"), (path.parent, "b.log"),
                         (path.parent, "b.log.payloads"), (payloads_dir(path), "00000000.seg"),
                         (path.parent, "b.log.settled")]:
        assert was_synced(folder, name), f"{name} was not synced in {folder}"


def test_the_zmq_service_answers_an_error_and_stops_when_its_log_fails(tmp_path, monkeypatch):
    import errno
    import os

    from buffer.errors import RemoteError
    from buffer.server import BufferServer

    config = BufferConfig(port=0, gate=GateConfig(batch_size=1, eta=None, max_concurrent=4),
                          log=LogConfig(path=tmp_path / "b.log"))
    server = BufferServer(config).start()
    with BufferClient(server.endpoint, ClientConfig(request_timeout_s=10, retries=0)) as client:
        permit = client.acquire_permit("w")

        def fsync(fd):
            raise OSError(errno.EIO, "Input/output error")

        monkeypatch.setattr(os, "fsync", fsync)
        with pytest.raises(RemoteError, match="fsync of the log failed") as error:
            client.push_group(make_group(permit.ticket), permit.permit_id)
        assert error.value.reason == "log_failed"
        server._thread.join(10)
        assert not server._thread.is_alive(), "the service loop ends (its process exits non-zero)"
    assert server.core.failed is not None and server.core.counters.request_errors["log_failed"] == 1
