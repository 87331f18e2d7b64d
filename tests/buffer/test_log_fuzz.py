"""Fuzzing the durable log's replay: logs of records of every kind (inline and segment payloads),
written by `DurableLog` itself, then cut at a random byte or with bits flipped at random places
(in the log or in a payload segment). Replay never crashes with anything but `LogCorrupt`, never
hangs, never yields a record that was not written; a cut gives a prefix, and so does damage in
the last record or in a payload (a record may outlive its payload with `fsync: interval`)."""
from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from buffer.config import LogConfig
from buffer.durable_log import DurableLog, LogCorrupt, payloads_dir

_IDS = st.text("0123456789abcdef", min_size=1, max_size=12)
_RECORDS = st.one_of(
    st.builds(lambda p, t: {"op": "acquire", "permit": {"permit_id": p, "ticket": t, "worker_id": "w"}},
              _IDS, st.integers(0, 2**31)),
    st.builds(lambda p: {"op": "release", "permit": p}, _IDS),
    st.builds(lambda p, s, n: {"op": "push", "permit": p, "seq": s, "group": bytes([s % 256]) * n},
              _IDS, st.integers(0, 10**6), st.sampled_from([0, 1, 300, 70_000])),  # 70 KB: a segment
    st.builds(lambda lease, gs: {"op": "lease", "lease": lease, "groups": gs, "version": 3}, _IDS, st.lists(_IDS)),
    st.builds(lambda lease, gs, n: {"op": "ack", "lease": lease, "groups": gs, "tickets": list(range(len(gs))), "n": n},
              _IDS, st.lists(_IDS, max_size=40), st.integers(0, 10**6)),
    st.builds(lambda v: {"op": "version", "version": v}, st.integers(0, 2**40)),
    st.builds(lambda e: {"op": "eta", "eta": e}, st.none() | st.integers(0, 8)),
    st.builds(lambda s: {"op": "snapshot", "gate": {"x": s}, "next_seq": 0, "settled": [], "leases": {},
                         "settle_n": 0}, st.lists(st.integers(-2**62, 2**62), max_size=20)),
)


def _write(folder: Path, records: list[dict]) -> tuple[Path, list[dict], list[int]]:
    """The log at folder/b.log, the records as replay gives them back, and each record's end."""
    log = DurableLog(LogConfig(path=folder / "b.log", segment_bytes=100_000))
    list(log.replay())
    ends = []
    for record in records:
        log.append(record)
        ends.append(log.size)
    log.close()
    return folder / "b.log", records, ends


def _replay(path: Path) -> list[dict]:
    log = DurableLog(LogConfig(path=path, segment_bytes=100_000))
    try:
        return list(log.replay())
    finally:
        log.close()


def _comparable(record: dict) -> dict:
    return {k: bytes(v) if k == "group" else v for k, v in record.items() if k != "blob"}


def _check_prefix(got: list[dict], written: list[dict]) -> None:
    assert len(got) <= len(written)
    assert [_comparable(r) for r in got] == [_comparable(r) for r in written[: len(got)]], "a record not written"


@settings(max_examples=60, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(records=st.lists(_RECORDS, min_size=1, max_size=12), cut=st.floats(0, 1))
def test_a_cut_log_replays_a_prefix(records, cut):
    folder = Path(tempfile.mkdtemp(prefix="logfuzz"))
    try:
        path, written, ends = _write(folder, records)
        size = int(path.stat().st_size * cut)
        with open(path, "r+b") as f:
            f.truncate(size)
        got = _replay(path)
        _check_prefix(got, written)
        assert len(got) == sum(end <= size for end in ends), "every whole record before the cut is kept"
    finally:
        shutil.rmtree(folder)


@settings(max_examples=80, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(records=st.lists(_RECORDS, min_size=1, max_size=12), flips=st.lists(st.tuples(st.floats(0, 1), st.integers(0, 7)),
       min_size=1, max_size=4), in_segment=st.booleans())
def test_flipped_bits_give_a_prefix_or_a_clear_refusal(records, flips, in_segment):
    folder = Path(tempfile.mkdtemp(prefix="logfuzz"))
    try:
        path, written, ends = _write(folder, records)
        segments = sorted(payloads_dir(path).glob("*.seg"))
        target = segments[0] if in_segment and segments else path
        data = bytearray(target.read_bytes())
        for where, bit in flips:
            data[min(int(len(data) * where), len(data) - 1)] ^= 1 << bit
        target.write_bytes(bytes(data))
        first_bad = min(min(int(len(data) * w), len(data) - 1) for w, _ in flips)
        try:
            got = _replay(path)
        except LogCorrupt as exc:
            event("refused: damage before an intact record")
            assert target == path, "damage to a payload is cut, never refused"
            assert str(path) in str(exc) and "corrupt" in str(exc)
            assert len(ends) > 1 and first_bad < ends[-2], "a refusal needs an intact record after the damage"
            return
        event(f"replayed a prefix ({'segment' if target != path else 'log'} damaged)")
        _check_prefix(got, written)
        if target == path:  # the log itself: the records before the first damaged one are all kept
            assert len(got) >= sum(end <= first_bad for end in ends)
    finally:
        shutil.rmtree(folder)
