"""A rollout worker's end of the weight channel (`WeightSubscription`), used at its interrupt
points (between engine steps or generations), so the tokens after a load carry the new version.

An engine here is anything with `version`, `load_weights(version, weights)` (a mapping or an
iterable of (name, tensor) pairs), and optionally `load_weights_folder(version, path)` (read a
folder itself), `expected_weights()` ((shapes by name, names it may lack) to check a layout
against before joining a send) and `weights_device` (where received chunks go).

Nothing reaches the engine before the whole version has passed its content check (`integrity`:
the digests the sender published or sent, and no NaN/inf): a version that fails raises
`WeightsRejected` and the engine keeps the weights it has. A broadcast is therefore received
whole into the receive buffers (which hold a whole version anyway) before the engine loads it.
"""
from __future__ import annotations

import logging
import threading
import time
import uuid

import torch

from lm.weight_sync import integrity
from lm.weight_sync.group import WeightGroup, call, node_address
from lm.weight_sync.integrity import WeightsRejected
from lm.weight_sync.layout import Layout
from lm.weight_sync.payloads import resolve_weights
from lm.weight_sync.stream import ReceiveStream

_POLL_S = 1.0  # the longest a wait for a go goes without checking the stop flag

log = logging.getLogger(__name__)


class WeightSubscription:
    def __init__(self, board, worker_id: str, have: int, address: str | None = None):
        self.board, self.worker_id = board, worker_id
        self.session = uuid.uuid4().hex  # this process: a restarted worker is a new member
        self.address = address
        self._group: WeightGroup | None = None  # of the last send this worker took part in
        self._pushed: bool | None = None  # unknown until a version is live
        self._spare = {"chunks": [], "assembly": {}}  # receive buffers kept from the last version (host memory)
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
        call(self.board, "ready", self.worker_id, self.session, int(engine.version))
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
        """Receive the send `go` describes into the engine. A failure part-way still forwards the
        rest of the stream (the ranks after this one get their version) and is reported."""
        version, layout, stream = int(go["version"]), Layout.from_wire(go["layout"]), None
        try:
            device = getattr(engine, "weights_device", "cpu")
            host = torch.device(device).type == "cpu"  # device memory is reused by its own allocator
            stream = ReceiveStream(self._group_of(go), go["rank"], go["world"], layout, go["chunk_bytes"],
                                   go["topology"], device,
                                   ahead=max(1, go.get("ahead_bytes", 4 * go["chunk_bytes"]) // go["chunk_bytes"]),
                                   spare=self._spare if host else None)
            check_fits(engine, layout)
            weights = list(stream)  # the whole version, checked before the engine takes any of it
            if not stream.complete:
                raise RuntimeError(f"the stream of weights v{version} ended part-way")
            integrity.check_chunks(version, layout, stream.spans, stream.digests, stream.sent_digests)
            bad = integrity.first_nonfinite(weights)
            if bad is not None:
                raise WeightsRejected(version, "broadcast", bad, "holds a NaN or an inf")
            engine.load_weights(version, iter(weights))
            del weights
            if host:
                stream.recycle()
        except WeightsRejected as err:
            self._rejected(err)
            if host:
                stream.recycle()  # the engine took nothing: the buffers serve the next version
            call(self.board, "done", self.worker_id, self.session, version, str(err), int(engine.version))
            raise
        except Exception as err:
            self._drain(stream)
            call(self.board, "done", self.worker_id, self.session, version, f"{type(err).__name__}: {err}")
            raise
        call(self.board, "done", self.worker_id, self.session, version)
        return version

    def _group_of(self, go: dict):
        if self._group is None or self._group.generation != go["generation"]:
            self._group = None  # leave the old generation before joining the new one
            self._group = WeightGroup(self.board, go, go["rank"], self.address or node_address())
        return self._group.group

    def _drain(self, stream: ReceiveStream | None) -> None:
        try:
            if stream is not None:
                stream.drain()
        except Exception:
            self._group = None  # the group itself failed: the next send forms a new one


def check_fits(engine, layout: Layout) -> None:
    """ValueError naming the first tensor of `layout` the engine's model cannot take."""
    expected = getattr(engine, "expected_weights", None)
    if expected is not None:
        shapes, may_lack = expected()
        layout.check_fits(shapes, may_lack)
