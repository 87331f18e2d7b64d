"""The audit itself: it passes a clean history and catches each kind of fault it exists for (a
lost group, a group or ticket consumed twice, a sample staler than η), over a real buffer log."""
import dataclasses

import pytest
from fault_helpers import make_group

from buffer.codec import encode_group
from buffer.config import BufferConfig, GateConfig, LogConfig
from buffer.core import BufferCore
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


def test_staleness_above_eta_is_caught(history):
    consumed, records, _ = history
    late = dataclasses.replace(consumed[1], version=consumed[1].version + 5)
    report = audit([consumed[0], late], records, eta=1)
    assert report.over_eta == [(None, 6)] and report.worst_staleness == 6


def test_a_compacted_log_needs_reported_drops_to_explain_what_it_settled(tmp_path):
    """After compaction the log keeps only the ids of settled groups (acked or dropped alike): a
    group the run did not train on is accounted for only by a drop the buffer reported."""
    path = tmp_path / "b.log"
    core = BufferCore(BufferConfig(gate=GateConfig(batch_size=1, eta=0, max_concurrent=8),
                                   log=LogConfig(path=path, compact_min_bytes=0)))
    groups = []
    for version in (0, 1):
        core.set_version(version)
        permit = core.acquire_permit("w")
        groups.append(make_group(permit.ticket, version=version))
        core.push_group(encode_group(groups[-1]), permit.permit_id)
    result = core.pull_batch(1)  # drops the version-0 group as too stale, leases the other
    core.ack(result.lease_id)
    core.close()
    records = read_buffer_log(path)
    assert records[0]["op"] == "snapshot" and not any(r["op"] == "drop" for r in records), "compacted"
    fresh = groups[1]
    trained = Consumption(result.version, [fresh.group_id], [fresh.prompt_index],
                          [s.weight_version for s in fresh.samples], dropped_stale=result.dropped_stale)
    acknowledged = {g.group_id for g in groups}
    assert result.dropped_stale == 1
    assert audit([trained], records, eta=0, acknowledged=acknowledged).ok
    unexplained = dataclasses.replace(trained, dropped_stale=0)
    assert audit([unexplained], records, eta=0, acknowledged=acknowledged).lost_groups == [groups[0].group_id]
