"""The audit itself: it passes a clean history and catches each kind of fault it exists for (a
lost group, a group or ticket consumed twice, a sample staler than η), over a real buffer log."""
import dataclasses

import pytest
from fault_helpers import make_group

from buffer.codec import encode_group
from buffer.config import BufferConfig, GateConfig, LogConfig
from buffer.core import BufferCore
from buffer.durable_log import read_records, settled_path
from services.audit import Consumption, audit, read_buffer_log


@pytest.fixture
def history(tmp_path):
    """A buffer with a durable log: 6 groups pushed, 2 batches of 2 consumed, 2 groups left."""
    path = tmp_path / "b.log"
    core = BufferCore(BufferConfig(gate=GateConfig(batch_size=2, eta=2, max_concurrent=8), log=LogConfig(path=path)))
    pushed, consumed = [], []
    for _ in range(6):
        permit = core.acquire_permit("w")
        group = make_group(permit.ticket, version=core.gate.version)
        core.push_group(encode_group(group), permit.permit_id)
        pushed.append(group)
    for _ in range(2):
        result = core.pull_batch(2)
        core.ack(result.lease_id)
        by_id = {g.group_id: g for g in pushed}
        groups = [by_id[gid] for gid in _ids(result)]
        consumed.append(Consumption(result.version, [g.group_id for g in groups], [g.prompt_index for g in groups],
                                    [s.weight_version for g in groups for s in g.samples]))
        core.set_version(core.gate.version + 1)
    core.close()
    return consumed, read_buffer_log(path), {g.group_id for g in pushed}


def _ids(result):
    from buffer.codec import group_index, unpack_frames

    return [group_index(unpack_frames(packed)[0])[0] for packed in result.groups]


def test_a_clean_history_passes(history):
    consumed, records, acknowledged = history
    report = audit(consumed, records, eta=1, acknowledged=acknowledged)
    assert report.ok, str(report)
    assert (report.consumed_groups, report.in_buffer_groups, report.worst_staleness) == (4, 2, 1)


def test_a_lost_group_is_caught(history):
    consumed, records, acknowledged = history
    report = audit(consumed[:1], records, eta=1, acknowledged=acknowledged)  # a batch missing from the log
    assert set(report.lost_groups) == set(consumed[1].group_ids)
    assert sorted(report.lost_tickets) == sorted(consumed[1].tickets)
    phantom = audit(consumed, records, eta=1, acknowledged=acknowledged | {"never-stored"})
    assert phantom.lost_groups == ["never-stored"], "an acknowledged push the buffer does not hold"


def test_a_twice_consumed_group_and_ticket_are_caught(history):
    consumed, records, _ = history
    report = audit([*consumed, consumed[0]], records, eta=1)
    assert set(report.duplicated_groups) == set(consumed[0].group_ids)
    assert set(report.duplicated_tickets) == set(consumed[0].tickets)
    assert not report.ok and "duplicated_groups: 2" in str(report)


@pytest.mark.parametrize("ack_logged", [True, False])
def test_a_step_whose_ack_was_in_flight_counts_its_groups_once_whether_the_ack_was_logged_or_not(tmp_path,
                                                                                                ack_logged):
    """The buffer failed while the request acking a trained batch was in flight: the run's last
    record says so (`ack_unconfirmed`), and the audit accepts either outcome, the ack logged (the
    groups acked) or not (the buffer still holds them), as one consumption; unmarked, a batch the
    buffer still holds is a ticket held twice."""
    path = tmp_path / "b.log"
    core = BufferCore(BufferConfig(gate=GateConfig(batch_size=2, eta=2, max_concurrent=8), log=LogConfig(path=path)))
    by_id = {}
    for _ in range(4):
        permit = core.acquire_permit("w")
        group = make_group(permit.ticket, version=core.gate.version)
        core.push_group(encode_group(group), permit.permit_id)
        by_id[group.group_id] = group
    consumed = []
    for last in (False, True):
        result = core.pull_batch(2)
        if not last or ack_logged:
            core.ack(result.lease_id)
        groups = [by_id[gid] for gid in _ids(result)]
        consumed.append(Consumption(result.version, [g.group_id for g in groups], [g.prompt_index for g in groups],
                                    [s.weight_version for g in groups for s in g.samples], ack_unconfirmed=last))
    core.close()
    records = read_buffer_log(path)
    report = audit(consumed, records, eta=1, acknowledged=set(by_id))
    assert report.ok, str(report)
    assert (report.consumed_groups, report.in_buffer_groups) == (4, 0 if ack_logged else 2)
    unmarked = audit([consumed[0], dataclasses.replace(consumed[1], ack_unconfirmed=False)], records, eta=1)
    assert unmarked.ok == ack_logged
    if not ack_logged:
        assert sorted(unmarked.duplicated_tickets) == sorted(consumed[1].tickets)


def test_staleness_above_eta_is_caught(history):
    consumed, records, _ = history
    late = dataclasses.replace(consumed[1], version=consumed[1].version + 5)
    report = audit([consumed[0], late], records, eta=1)
    assert report.over_eta == [(None, 6)] and report.worst_staleness == 6


@pytest.fixture
def compacted(tmp_path):
    """A buffer whose log compacts as soon as it doubles: one group dropped as stale, then steps
    that consume one group each until an ack, too, was compacted away."""
    path = tmp_path / "b.log"
    core = BufferCore(BufferConfig(gate=GateConfig(batch_size=1, eta=0, max_concurrent=8),
                                   log=LogConfig(path=path, compact_min_bytes=0)))
    groups, trained = [], []

    def push(version):
        permit = core.acquire_permit("w")
        groups.append(make_group(permit.ticket, version=version))
        core.push_group(encode_group(groups[-1]), permit.permit_id)

    push(0)
    core.set_version(1)
    for version in range(1, 12):
        push(version)
        result = core.pull_batch(1)  # the first drops the version-0 group as too stale
        core.ack(result.lease_id, version=version + 1)
        assert core.wait_for_compaction(timeout=60)  # compaction runs in the background
        group = groups[-1]
        trained.append(Consumption(result.version, [group.group_id], [group.prompt_index],
                                   [s.weight_version for s in group.samples], dropped_stale=result.dropped_stale))
        if any(r["op"] == "ack" for r in read_records(settled_path(path))[0]):
            break
    core.close()
    assert trained[0].dropped_stale == 1
    return path, groups, trained


def test_a_compacted_log_names_every_settled_group_with_its_ticket(compacted):
    """Compaction removes the drop and the ack from the log; its settled archive keeps them, so
    the audit accounts for both groups by id and ticket, whatever the run reported."""
    path, groups, trained = compacted
    log_only = read_records(path)[0]
    assert log_only[0]["op"] == "snapshot" and not any(r["op"] in ("drop", "ack") for r in log_only), "compacted"
    records = read_buffer_log(path)
    acknowledged = {g.group_id for g in groups}
    unreported = [dataclasses.replace(c, dropped_stale=0) for c in trained]  # as if a kill cut the reply
    report = audit(unreported, records, eta=0, acknowledged=acknowledged)
    assert report.ok, str(report)
    assert report.dropped_groups == 1 and report.lost_tickets == []
    # The dropped group's prompt was generated again (its ticket reissued) and trained on once.
    assert groups[2].prompt_index == groups[0].prompt_index
    assert [t for c in trained for t in c.tickets].count(groups[0].prompt_index) == 1
    missing = audit(trained[1:], records, eta=0, acknowledged=acknowledged)  # the run never logged a step
    assert missing.lost_groups == [groups[1].group_id] and missing.lost_tickets == [groups[1].prompt_index]


def test_an_ack_archived_and_still_in_the_log_counts_once(compacted):
    """A kill between archiving and rewriting leaves an ack in both places, under one settle
    number: counted once. A second ack of the same group under another number is a duplicate."""
    path, _, trained = compacted
    archive = read_records(settled_path(path))[0]
    records = archive + read_buffer_log(path)
    assert audit(trained, records, eta=0).ok
    ack = next(r for r in archive if r["op"] == "ack")
    again = {**ack, "n": max(r["n"] for r in records if "n" in r) + 1}
    assert audit(trained, [*records, again], eta=0).duplicated_groups == ack["groups"]
