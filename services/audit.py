"""The exactly-once audit: after a run (or a fault), every accepted group was consumed exactly once
or is still accounted for, and no consumed sample was staler than η.

Two records are compared:
  - the run's log: which groups and tickets each learner step trained on, and the weight versions
    of their samples (`metrics.jsonl` rows with `audit/*` keys, or `Consumption`s a test builds);
  - the buffer's log: the durable log of the buffer service (`buffer.log.path`) with its settled
    archive (`<log>.settled`: the acks and drops compactions removed), or the buffer records a
    checkpoint holds (`buffer.msgpack`); both are the buffer's own log records (`acquire`,
    `release`, `quarantine`, `filter`, `push`, `ack`, `drop`, `lease`, `nack`, `expire`, `version`,
    `recover`, `snapshot`).

A group is *lost* if the buffer accepted it (or a client was told its push succeeded) and it is
neither consumed by the run, nor still held by the buffer, nor dropped as stale (dropped groups
are counted, not lost). A group or ticket is *duplicated* if it was consumed more than once.
Every ticket (prompt number) the gate handed out must be consumed, held (a permit or a stored
group), waiting to be reissued (released, reclaimed, or its group dropped as stale), quarantined
(its prompt fails the engine) or filtered (its group was uninformative: dynamic sampling), exactly
one of those. A step whose ack the buffer may or may not have logged (it failed with the ack in
flight: `audit/ack_unconfirmed`, the run's last step) trained on its groups either way: consumed,
and acked or still held by the buffer, not both twice.
"""
from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable

import msgpack

from buffer.codec import first_frame_span, unpack, unpack_frames
from buffer.durable_log import read_records, settled_path


@dataclass
class Consumption:
    """One trained batch: the groups and tickets, and the learner version that trained on them."""

    version: int
    group_ids: list[str]
    tickets: list[int]
    sample_versions: list[int]
    step: int | None = None
    dropped_stale: int = 0  # groups the buffer dropped as too stale when serving this pull
    ack_unconfirmed: bool = False  # the buffer failed with this batch's ack in flight (logged or not)


    @property
    def staleness(self) -> int:
        return max((self.version - v for v in self.sample_versions), default=0)

    @classmethod
    def of_batch(cls, batch) -> "Consumption":
        """The record of a trained `buffer.sample.PulledBatch`."""
        return cls(batch.version, [g.group_id for g in batch.groups], [g.prompt_index for g in batch.groups],
                   [s.weight_version for g in batch.groups for s in g.samples], dropped_stale=batch.dropped_stale)


def read_run_log(run_dir: str | Path) -> list[Consumption]:
    """The consumption record of a run: the `audit/*` keys of its `metrics.jsonl` (the version
    logged is the one the step produced, so the step trained at version − 1)."""
    path = Path(run_dir) / "metrics.jsonl"
    out = []
    for line in path.read_text().splitlines():
        if not line.strip():
            continue
        row = json.loads(line)
        if "audit/groups" in row:
            out.append(Consumption(int(row["version"]) - 1, list(row["audit/groups"]), list(row["audit/tickets"]),
                                   list(row["audit/sample_versions"]), row.get("step"),
                                   int(row.get("buffer/dropped_stale_groups", 0)),
                                   bool(row.get("audit/ack_unconfirmed", False))))
    return out


def read_buffer_log(path: str | Path) -> list[dict]:
    """The records of a buffer's durable log (a torn tail is ignored, as replay does), preceded
    by its settled archive: the acks and drops that compactions removed from the log."""
    return read_records(settled_path(path))[0] + read_records(Path(path), payloads=False)[0]


def group_header(push: dict) -> dict:
    """The group header of a `push` record: from its payload, or from the first bytes of a
    payload kept in a log segment (`group_head`: the header frame, not the samples)."""
    if "group_head" in push:
        start, end = first_frame_span(push["group_head"])
        return unpack(memoryview(push["group_head"])[start:end])
    return unpack(unpack_frames(push["group"])[0])


def read_checkpoint_buffer(checkpoint: str | Path, name: str = "buffer.msgpack") -> list[dict]:
    """The buffer records a checkpoint holds (a `snapshot` record and one `push` per live group)."""
    return msgpack.unpackb((Path(checkpoint) / name).read_bytes(), raw=False)


@dataclass
class BufferHistory:
    """What the buffer's records say happened."""

    pushed: dict[str, int] = field(default_factory=dict)  # group id -> ticket, every push
    live: dict[str, int] = field(default_factory=dict)  # held now (ready or leased)
    acked: Counter = field(default_factory=Counter)  # group id -> acks
    dropped: dict[str, int] = field(default_factory=dict)  # group id -> ticket (reissued)
    pushed_twice: list[str] = field(default_factory=list)
    next_ticket: int = 0
    free_tickets: set[int] = field(default_factory=set)
    held_tickets: dict[str, int] = field(default_factory=dict)  # permit id -> ticket
    quarantined: set[int] = field(default_factory=set)  # tickets set aside for good
    filtered: set[int] = field(default_factory=set)  # tickets whose group was uninformative, ended


def replay(records: Iterable[dict]) -> BufferHistory:
    """Follow the buffer's records in order. An ack or drop seen twice under one settle number
    (archived, then still in the log when a kill came between the two) counts once."""
    h = BufferHistory()
    settled_numbers: set[int] = set()
    for r in records:
        op = r["op"]
        if op == "snapshot":
            gate = r["gate"]
            h.next_ticket = gate["next_ticket"]
            h.free_tickets = set(gate["free_tickets"])
            h.held_tickets = {p["permit_id"]: p["ticket"] for p in gate["permits"]}
            h.quarantined = set(gate.get("quarantined", []))
            h.filtered = set(gate.get("filtered", []))
        elif op == "acquire":
            permit = r["permit"]
            h.held_tickets[permit["permit_id"]] = permit["ticket"]
            h.free_tickets.discard(permit["ticket"])
            h.next_ticket = max(h.next_ticket, permit["ticket"] + 1)
        elif op == "release":
            ticket = h.held_tickets.pop(r["permit"], None)
            if ticket is not None:
                h.free_tickets.add(ticket)
        elif op in ("quarantine", "filter"):
            ticket = h.held_tickets.pop(r["permit"], None)
            if ticket is not None:
                (h.quarantined if op == "quarantine" else h.filtered).add(ticket)
        elif op == "push":
            header = group_header(r)
            gid, ticket = header["group_id"], header["prompt_index"]
            if gid in h.pushed:
                h.pushed_twice.append(gid)
            h.pushed[gid] = h.live[gid] = ticket
            h.held_tickets.pop(r.get("permit"), None)
        elif op in ("ack", "drop"):
            counted = r["n"] not in settled_numbers  # its effects apply again, in log order; its count once
            settled_numbers.add(r["n"])
            for gid, ticket in zip(r["groups"], r["tickets"]):
                h.live.pop(gid, None)
                if op == "drop":  # the gate reissues a dropped group's ticket
                    h.free_tickets.add(ticket)
                    h.dropped[gid] = ticket
                elif counted:
                    h.acked[gid] += 1
        elif op == "recover":  # a fresh gate: permits of the old run are forgotten
            h.held_tickets.clear()
            h.free_tickets.clear()
    return h


@dataclass
class AuditReport:
    consumed_groups: int
    consumed_samples: int
    in_buffer_groups: int
    dropped_groups: int
    lost_groups: list[str]
    duplicated_groups: list[str]
    lost_tickets: list[int]
    duplicated_tickets: list[int]
    over_eta: list[tuple[int | None, int]]  # (step, staleness) of batches staler than η
    worst_staleness: int

    @property
    def ok(self) -> bool:
        return not (self.lost_groups or self.duplicated_groups or self.lost_tickets or self.duplicated_tickets
                    or self.over_eta)

    def problems(self) -> list[str]:
        out = []
        for name in ("lost_groups", "duplicated_groups", "lost_tickets", "duplicated_tickets", "over_eta"):
            value = getattr(self, name)
            if value:
                out.append(f"{name}: {len(value)} ({value[:5]}{' ...' if len(value) > 5 else ''})")
        return out

    def __str__(self) -> str:
        head = (f"consumed {self.consumed_groups} groups ({self.consumed_samples} samples), "
                f"{self.in_buffer_groups} in the buffer, {self.dropped_groups} dropped stale, "
                f"worst staleness {self.worst_staleness}")
        return head + ("; OK" if self.ok else "; " + "; ".join(self.problems()))


def audit(consumptions: list[Consumption], buffer_records: Iterable[dict], eta: int | None,
          acknowledged: Iterable[str] = ()) -> AuditReport:
    """Check the run's consumption record against the buffer's records (see the module doc).
    `acknowledged`: group ids whose push a client saw succeed (they must not be lost). Every group
    and ticket is accounted for by id: the buffer's log and its settled archive name each group it
    ever acked or dropped, with its ticket."""
    h = replay(buffer_records)
    consumed = Counter(g for c in consumptions for g in c.group_ids)
    tickets = Counter(t for c in consumptions for t in c.tickets)
    duplicated = sorted({g for g, n in consumed.items() if n > 1} | {g for g, n in h.acked.items() if n > 1}
                        | set(h.pushed_twice))
    accounted = set(consumed) | set(h.live) | set(h.dropped)
    # Acked in the buffer but absent from the run's record: trained on by nobody who logged it.
    expected = set(acknowledged) | set(h.pushed) | set(h.acked)
    lost = sorted(expected - accounted)

    holders = Counter(tickets)
    for source in (h.live.values(), h.free_tickets, h.held_tickets.values(), h.quarantined, h.filtered):
        holders.update(source)
    for c in consumptions:  # trained, the ack never logged: the buffer's copy is the same holding
        if c.ack_unconfirmed:
            holders.subtract(t for g, t in zip(c.group_ids, c.tickets) if h.live.get(g) == t)
    issued = max(h.next_ticket, max(holders, default=-1) + 1)
    lost_tickets = [t for t in range(issued) if holders[t] == 0]
    duplicated_tickets = sorted(t for t, n in holders.items() if n > 1)

    over = [(c.step, c.staleness) for c in consumptions if eta is not None and c.staleness > eta]
    reported_drops = sum(c.dropped_stale for c in consumptions)  # a checkpoint's records hold no drops
    return AuditReport(
        consumed_groups=sum(consumed.values()), consumed_samples=sum(len(c.sample_versions) for c in consumptions),
        in_buffer_groups=len(h.live), dropped_groups=max(len(h.dropped), reported_drops), lost_groups=lost,
        duplicated_groups=duplicated, lost_tickets=lost_tickets, duplicated_tickets=duplicated_tickets,
        over_eta=over, worst_staleness=max((c.staleness for c in consumptions), default=0),
    )
