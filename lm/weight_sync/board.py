"""`WeightStore`: the run's notice board of weight versions, a threaded Ray actor (or a plain
object in tests). It carries no tensors.

Pull channels (object store, folder): the learner posts the live payload; a worker reads it at
its interrupt point and says when it has loaded it. A reader's claim on a version keeps that
version's folder on disk until the reader is done (or its claim is older than the caller allows).

Broadcast: the learner announces version v with its layout (the metadata header); a worker that
sees it at its interrupt point checks the layout against its model, says it is ready (with the
number of its engine's receiving processes: its width) and waits for its go; the learner waits
(bounded) until every member is ready, then starts the send to the ready ones: they form the
weight group of this send (rank 0 the learner, then each member's ranks from its rank offset).
The same members as last time keep their group; any change (a restart, a late joiner, one left
out) forms a new generation. A member that is not ready in time is left out and named; it rejoins
when it next asks. Then the learner drives vLLM's weight-update calls on the members through the
board (`post_op` / `wait_op` / `op_done` / `wait_acks`: `board_client.BoardWeightSyncClient`).
"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

_MAX_POLL_S = 5.0  # one long poll's longest wait: a caller asks again (and checks its stop flag)


@dataclass
class _Member:
    session: str  # one per worker process: a restarted worker is a new member
    have: int  # the version its engine holds (-1: unknown, after a failed load)
    waiting: bool = False  # at its interrupt point, asking for a version newer than `have`
    width: int = 1  # its engine's receiving processes (a tensor-parallel engine's ranks)
    go: dict | None = None  # its part in the send it was let into
    ops: list[dict] = field(default_factory=list)  # weight-update calls posted to it, not yet taken
    acks: dict[int, str] = field(default_factory=dict)  # op seq -> its error ("" if it went well)
    refused: str = ""  # why it withdrew (its model does not fit the layout), for the sender's log


@dataclass
class _Generation:
    id: int = 0
    ranks: dict[tuple[str, str], int] = field(default_factory=dict)  # (worker, session) -> rank


class WeightStore:
    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._live: dict | None = None
        self._pending: dict | None = None  # broadcast: {"version", "layout"} announced, not yet sent
        self._layout: dict | None = None  # the layout of the newest announced version
        self._claims: dict[str, tuple[int, float]] = {}  # reader -> (version, since)
        self._members: dict[str, _Member] = {}
        self._generation = _Generation()
        self._op_seq = 0

    # ------------------------------------------------------------ live version (every channel)

    def publish(self, payload: dict) -> None:
        with self._cond:
            if self._live is not None and payload["version"] < self._live["version"]:
                raise ValueError(f"weight version went backwards: {payload['version']} < {self._live['version']}")
            self._live = payload
            if self._pending is not None and self._pending["version"] <= payload["version"]:
                self._pending = None
            self._cond.notify_all()

    def latest_version(self) -> int:
        """The newest version announced or live (-1: none yet): a worker behind it should fetch."""
        with self._cond:
            versions = [p["version"] for p in (self._live, self._pending) if p is not None]
            return max(versions, default=-1)

    def latest(self, reader: str | None = None) -> dict | None:
        """The live payload; a named reader claims its version until `loaded` (or a newer claim)."""
        with self._cond:
            if reader is not None and self._live is not None:
                self._claims[reader] = (int(self._live["version"]), time.monotonic())
            return self._live

    def loaded(self, reader: str, version: int) -> None:
        with self._cond:
            self._claims.pop(reader, None)

    def wait_live(self, version: int, timeout: float) -> dict | None:
        """The live payload once it is at least `version` (None if not within `timeout`)."""
        with self._cond:
            self._cond.wait_for(lambda: self._live_version() >= version, timeout=min(timeout, _MAX_POLL_S))
            return self._live if self._live_version() >= version else None

    def retained_versions(self, max_claim_age_s: float) -> dict:
        """Versions a reader may still be reading (claims younger than `max_claim_age_s`) and the
        live one; expired claims are dropped and their readers returned."""
        now = time.monotonic()
        with self._cond:
            expired = sorted(r for r, (_, since) in self._claims.items() if now - since > max_claim_age_s)
            for reader in expired:
                del self._claims[reader]
            kept = {v for v, _ in self._claims.values()} | ({self._live_version()} if self._live else set())
            return {"versions": sorted(kept), "expired_readers": expired}

    def _live_version(self) -> int:
        return -1 if self._live is None else int(self._live["version"])

    # ------------------------------------------------------------ broadcast: workers

    def join(self, worker: str, session: str, have: int) -> None:
        """A worker process starts with version `have`: each newer version waits (bounded) for it."""
        with self._cond:
            self._member(worker, session).have = have

    def layout(self) -> dict | None:
        """The newest announced layout (None: nothing announced yet): a worker checks that its
        model takes it before it says it is ready."""
        with self._cond:
            return self._layout

    def ready(self, worker: str, session: str, have: int, width: int = 1) -> None:
        """A worker at its interrupt point asks for a version newer than `have`."""
        with self._cond:
            member = self._member(worker, session)
            member.have, member.waiting, member.go, member.refused = have, True, None, ""
            member.width, member.ops = max(1, int(width)), []
            self._cond.notify_all()

    def _member(self, worker: str, session: str) -> _Member:
        member = self._members.get(worker)
        if member is None or member.session != session:  # new, or restarted: its old rank is gone
            member = self._members[worker] = _Member(session, -1)
            self._cond.notify_all()
        return member

    def withdraw(self, worker: str, session: str, reason: str = "") -> dict | None:
        """The worker stops waiting (stopped, gave up, or its model does not fit: `reason`). If it
        was let into a send meanwhile, its go is returned: the others count on it, so it takes part."""
        with self._cond:
            member = self._members.get(worker)
            if member is None or member.session != session:
                return None
            go, member.go = member.go, None
            member.waiting, member.refused = False, reason
            self._cond.notify_all()
            return go

    def wait_go(self, worker: str, session: str, timeout: float) -> dict | None:
        """The worker's part in a send (None: not yet; ask again)."""
        with self._cond:
            self._cond.wait_for(lambda: self._go_of(worker, session) is not None, timeout=min(timeout, _MAX_POLL_S))
            go = self._go_of(worker, session)
            if go is not None:
                self._members[worker].go = None
            return go

    def _go_of(self, worker: str, session: str) -> dict | None:
        member = self._members.get(worker)
        return member.go if member is not None and member.session == session else None

    def done(self, worker: str, session: str, version: int, error: str = "", have: int | None = None) -> None:
        """The worker's receive of `version` ended (its engine serves it, or `error`; `have`: the
        version its engine still holds after an error, e.g. a version refused by content)."""
        with self._cond:
            member = self._members.get(worker)
            if member is None or member.session != session:
                return
            member.have = version if not error else (-1 if have is None else have)
            self._cond.notify_all()

    # ------------------------------------------------------------ broadcast: the sender

    def announce(self, version: int, layout: dict) -> None:
        with self._cond:
            if version < self._live_version():
                raise ValueError(f"weight version went backwards: {version} < {self._live_version()}")
            self._pending, self._layout = {"version": version, "layout": layout}, layout
            self._cond.notify_all()

    def wait_ready(self, version: int, timeout: float) -> list[str]:
        """Wait (at most `timeout`, capped per call) until every member is ready for `version`;
        the members not ready yet (empty: all are)."""
        with self._cond:
            self._cond.wait_for(lambda: not self._not_ready(version), timeout=min(timeout, _MAX_POLL_S))
            return self._not_ready(version)

    def _not_ready(self, version: int, refused_too: bool = False) -> list[str]:
        """Members that need `version` and are not waiting for it (those that refused it: only
        with `refused_too`; nobody waits for them)."""
        return sorted(w for w, m in self._members.items()
                      if m.have < version and not m.waiting and (refused_too or not m.refused))

    def behind(self, version: int) -> list[str]:
        """Members waiting for weights older than `version` (a restarted or late one): a catch-up."""
        with self._cond:
            return sorted(w for w, m in self._members.items() if m.waiting and m.have < version)

    def start_send(self, version: int, common: dict, leave_out_missing: bool) -> dict:
        """Let the members waiting for `version` into its send. Ranks follow the current
        generation when the members are the same, else a new generation is formed. Members not
        waiting are left out (`leave_out_missing`: removed, named in the reply, until they ask
        again). Returns {"generation", "world", "members": {worker: rank offset}, "left_out": {worker: why}}."""
        with self._cond:
            chosen = sorted((w, m.session) for w, m in self._members.items() if m.waiting and m.have < version)
            left_out = {}
            if leave_out_missing:
                for worker in self._not_ready(version, refused_too=True):
                    member = self._members.pop(worker)
                    left_out[worker] = member.refused or f"not at an interrupt point in time (its engine holds " \
                                                         f"v{member.have})"
            generation = self._generation_for(chosen)
            world = 1 + sum(self._members[w].width for w, _ in chosen)
            for key in chosen:
                go = {**common, "version": version, "generation": generation.id, "rank": generation.ranks[key],
                      "world": world}
                member = self._members[key[0]]
                member.waiting, member.go, member.ops = False, go, []
            self._cond.notify_all()
            return {"generation": generation.id, "world": world,
                    "members": {w: generation.ranks[(w, s)] for w, s in chosen}, "left_out": left_out}

    def _generation_for(self, chosen: list[tuple[str, str]]) -> _Generation:
        if set(chosen) != set(self._generation.ranks):
            ranks, offset = {}, 1
            for key in chosen:
                ranks[key], offset = offset, offset + self._members[key[0]].width
            self._generation = _Generation(self._generation.id + 1, ranks)
        return self._generation

    # ------------------------------------------------------------ broadcast: weight-update calls

    def post_op(self, workers_args: dict[str, dict], op: str) -> int:
        """Post the weight-update call `op` to each worker with its arguments; its sequence number."""
        with self._cond:
            self._op_seq += 1
            for worker, args in workers_args.items():
                member = self._members.get(worker)
                if member is not None:
                    member.ops.append({"seq": self._op_seq, "op": op, "args": args})
            self._cond.notify_all()
            return self._op_seq

    def wait_op(self, worker: str, session: str, timeout: float) -> dict | None:
        """The next call posted to this worker (None: none yet; ask again)."""
        with self._cond:
            def posted():
                member = self._members.get(worker)
                return member is not None and member.session == session and bool(member.ops)

            if not self._cond.wait_for(posted, timeout=min(timeout, _MAX_POLL_S)):
                return None
            return self._members[worker].ops.pop(0)

    def op_done(self, worker: str, session: str, seq: int, error: str = "") -> None:
        with self._cond:
            member = self._members.get(worker)
            if member is not None and member.session == session:
                member.acks = {k: e for k, e in member.acks.items() if k > seq - 16}  # the recent ones
                member.acks[seq] = error
                self._cond.notify_all()

    def wait_acks(self, seq: int, workers: list[str], timeout: float) -> dict[str, str]:
        """{worker: error ("" if it went well)} of those that have answered call `seq` (a worker
        missing from the reply has not answered yet: ask again, or name it after the deadline)."""
        with self._cond:
            self._cond.wait_for(lambda: len(self._acks_of(seq, workers)) == len(workers),
                                timeout=min(timeout, _MAX_POLL_S))
            return self._acks_of(seq, workers)

    def _acks_of(self, seq: int, workers: list[str]) -> dict[str, str]:
        out = {}
        for worker in workers:
            member = self._members.get(worker)
            if member is not None and seq in member.acks:
                out[worker] = member.acks[seq]
        return out

    def forget_generation(self) -> None:
        """A send failed: the next send forms a new generation (the old group is unusable)."""
        with self._cond:
            self._generation = _Generation(self._generation.id, {})

    def generation(self) -> int:
        """The current weight group's generation (a new one whenever the members change)."""
        with self._cond:
            return self._generation.id

    def members(self) -> dict:
        with self._cond:
            return {w: {"have": m.have, "waiting": m.waiting, "session": m.session}
                    for w, m in self._members.items()}
