"""A rollout worker's end of the weight channel (`WeightSubscription`), used at its interrupt
points (between engine steps or generations), so the tokens after a load carry the new version.

An engine here is anything with `version`, `load_weights(version, weights)` (a mapping or an
iterable of (name, tensor) pairs), and optionally `load_weights_folder(version, path)` (read a
folder itself), `expected_weights()` ((shapes by name, names it may lack) to check a layout
against before joining a send). For the broadcast: `transfer_width` (its receiving processes) and
`weight_transfer(op, args)`, which runs vLLM's weight-update calls (init, start, update, finish,
and abort: resume on the weights it had) as the learner drives them through the board.

Nothing reaches the engine before the whole version has passed its content check (`integrity`:
the digests the sender published or sent, and no NaN/inf): a version that fails raises
`WeightsRejected` and the engine keeps the weights it has (a broadcast is checked where it is
received, inside the engine's processes, before the model takes any of it).
"""
from __future__ import annotations

import logging
import re
import threading
import time
import uuid

from lm.weight_sync import integrity
from lm.weight_sync.group import call, node_address
from lm.weight_sync.integrity import WeightsRejected
from lm.weight_sync.layout import Layout
from lm.weight_sync.payloads import resolve_weights

_POLL_S = 1.0  # the longest a wait for a go goes without checking the stop flag

log = logging.getLogger(__name__)


class WeightSubscription:
    def __init__(self, board, worker_id: str, have: int, address: str | None = None):
        self.board, self.worker_id = board, worker_id
        self.session = uuid.uuid4().hex  # this process: a restarted worker is a new member
        self.address = address
        self._pushed: bool | None = None  # unknown until a version is live
        # Versions refused for good (a stored object or folder that does not match its digest, a
        # NaN the learner sent): not asked for again; a newer version is.
        self.refused: dict[int, WeightsRejected] = {}
        self.rejected_total = 0  # versions refused by content, retried ones included
        call(board, "join", worker_id, self.session, int(have))  # `have`: the engine's version now

    def newest_version(self) -> int:
        return int(call(self.board, "latest_version"))

    def pushed(self) -> bool:
        """Whether versions come by broadcast (then every member's readiness counts)."""
        if self._pushed is None:
            live = call(self.board, "latest")
            self._pushed = None if live is None else live.get("kind") == "broadcast"
        return bool(self._pushed)

    def receive(self, engine, wait_s: float, stop: threading.Event | None = None) -> int | None:
        """Bring the engine to the newest version. The version loaded, or None if nothing newer
        came within `wait_s` (a broadcast is waited for; a pull payload is there or not)."""
        payload = call(self.board, "latest", self.worker_id)
        if payload is not None and payload.get("kind") != "broadcast":
            return self._load_payload(engine, payload)
        if self.refused and max(self.refused) >= self.newest_version():
            return None  # the newest version was refused for good: wait for the next one
        return self._receive_broadcast(engine, wait_s, stop)

    def refused_newest(self) -> WeightsRejected | None:
        """The refusal of the newest version, if it was refused for good (the engine stays on its
        version until a newer one comes)."""
        if not self.refused:
            return None
        return self.refused.get(self.newest_version())

    def _load_payload(self, engine, payload: dict) -> int | None:
        version = int(payload["version"])
        if version <= engine.version or version in self.refused:
            if version in self.refused:
                call(self.board, "loaded", self.worker_id, version)  # no claim on a folder it will not read
            return None
        channel = "folder" if payload["kind"] == "folder" else "object_store"
        try:
            if payload["kind"] == "folder" and hasattr(engine, "load_weights_folder"):
                integrity.check_folder(version, payload["path"], payload.get("integrity"))
                engine.load_weights_folder(version, payload["path"])  # no tensors through this process
            else:
                weights = resolve_weights(payload)
                integrity.check_tensors(version, channel, weights, payload.get("integrity"))
                engine.load_weights(version, weights)
        except WeightsRejected as err:
            self._rejected(err)
            raise
        finally:
            call(self.board, "loaded", self.worker_id, version)
        return version

    def _rejected(self, err: WeightsRejected) -> None:
        self.rejected_total += 1
        if not err.retry:
            self.refused[err.version] = err
            for old in sorted(self.refused)[:-8]:  # the newest few are all a worker asks about
                del self.refused[old]
        log.warning("%s: %s%s", self.worker_id, err, " (asks again)" if err.retry else "")

    # ---------------------------------------------------------------- broadcast

    def _receive_broadcast(self, engine, wait_s: float, stop) -> int | None:
        layout = call(self.board, "layout")
        if layout is not None:  # a model that cannot take it stays out of the send, saying why
            try:
                check_fits(engine, Layout.from_wire(layout))
            except ValueError as err:
                call(self.board, "withdraw", self.worker_id, self.session, str(err))
                raise
        call(self.board, "ready", self.worker_id, self.session, int(engine.version),
             int(getattr(engine, "transfer_width", 1)))
        go = self._wait_go(wait_s, stop)
        return None if go is None else self._take_part(engine, go)

    def _wait_go(self, wait_s: float, stop) -> dict | None:
        deadline = time.monotonic() + wait_s
        while True:
            left = deadline - time.monotonic()
            go = call(self.board, "wait_go", self.worker_id, self.session, max(0.0, min(_POLL_S, left)))
            if go is not None:
                return go
            if (stop is not None and stop.is_set()) or left <= 0:
                return call(self.board, "withdraw", self.worker_id, self.session)

    def _take_part(self, engine, go: dict) -> int:
        """Run the learner's weight-update calls of the send `go` let this worker into, until the
        version is finished (loaded) or the send ends without it."""
        version = int(go["version"])
        deadline = time.monotonic() + float(go.get("timeout_s", 120.0))
        error = rejected = None
        while True:
            op = call(self.board, "wait_op", self.worker_id, self.session,
                      max(0.0, min(_POLL_S, deadline - time.monotonic())))
            if op is None:
                if time.monotonic() < deadline:
                    continue
                error = RuntimeError(f"weights v{version}: the learner's calls stopped coming")
                engine.weight_transfer("abort", {"version": version})
                break
            deadline = time.monotonic() + float(go.get("timeout_s", 120.0))
            name, args = op["op"], dict(op["args"])
            if name == "init" and "prefix" in args:  # gloo: its sockets bind to this node's address
                args["address"] = self.address or node_address()
            try:
                # Every init joins a new group (a learner that restarted forms one under the same
                # generation number): the engine leaves the one it was in.
                engine.weight_transfer(name, args)
            except Exception as err:
                rejected = _rejection(err, version)
                error = rejected or err
                call(self.board, "op_done", self.worker_id, self.session, op["seq"], str(error))
                if name != "abort":
                    _quietly(engine.weight_transfer, "abort", {"version": version})
                break
            call(self.board, "op_done", self.worker_id, self.session, op["seq"], "")
            if name in ("finish", "abort"):
                break
        if error is None and int(engine.version) == version:
            call(self.board, "done", self.worker_id, self.session, version)
            return version
        why = str(error) if error is not None else "the send ended without it"
        call(self.board, "done", self.worker_id, self.session, version, why, int(engine.version))
        if rejected is not None:
            self._rejected(rejected)
            raise rejected
        raise error if error is not None else RuntimeError(f"weights v{version}: {why}")


_REFUSED = re.compile(r"weights v(\d+) \((\w+)\) refused: tensor '([^']*)' (.*?); the engine keeps its weights")


def _rejection(err: Exception, version: int) -> WeightsRejected | None:
    """A refusal by content raised inside the engine's own processes reaches this one as text."""
    if isinstance(err, WeightsRejected):
        return err
    found = _REFUSED.search(str(err))
    if found is None:
        return None
    return WeightsRejected(int(found[1]), found[2], found[3], found[4], retry="does not match the digest" in found[4])


def _quietly(fn, *args) -> None:
    try:
        fn(*args)
    except Exception as err:
        log.warning("weights: %s(%s) after a failed update: %s: %s", getattr(fn, "__name__", fn), args[0],
                    type(err).__name__, err)


def check_fits(engine, layout: Layout) -> None:
    """ValueError naming the first tensor of `layout` the engine's model cannot take."""
    expected = getattr(engine, "expected_weights", None)
    if expected is not None:
        shapes, may_lack = expected()
        layout.check_fits(shapes, may_lack)
