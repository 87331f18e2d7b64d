"""The send side of the three weight channels (`WeightSender.send(version, tensors, release)`).

Each runs on the learner's rank 0, in the publication thread (`publication.Publication`), and
calls `release()` as soon as it no longer reads the tensors (the learner's parameters may then
change). Each returns its timings: `own_s` (the sender's own time: put, write, or send) and
`served_s` (until every reader has the version, where the channel can know it). Every version
carries the digests of its bytes (`integrity`): a pull payload has one per tensor, a broadcast
one per chunk after its last chunk; receivers check them before an engine swaps.
"""
from __future__ import annotations

import logging
import shutil
import time
from pathlib import Path

import torch

from lm.weight_sync import integrity
from lm.weight_sync.group import WeightGroup, call, node_address
from lm.weight_sync.layout import Layout, cast
from lm.weight_sync.payloads import save_weights_folder, to_shared_arrays
from lm.weight_sync.stream import send_stream

log = logging.getLogger(__name__)


class ObjectStoreSender:
    """One shared object per version in the Ray object store (numpy arrays: zero-copy readers)."""

    catch_up_poll_s = None

    def __init__(self, board, dtype: torch.dtype | None = None):
        self.board, self.dtype = board, dtype

    def send(self, version: int, tensors: dict[str, torch.Tensor], release) -> dict:
        import ray

        start = time.perf_counter()
        try:
            cast_tensors = cast(tensors, self.dtype)
            ref = ray.put(to_shared_arrays(cast_tensors))
            digests = integrity.tensor_digests(cast_tensors.items())
        finally:
            release()
        call(self.board, "publish", {"version": version, "kind": "object_ref", "ref": [ref], "integrity": digests})
        return {"own_s": time.perf_counter() - start}

    def close(self) -> None:
        pass


class FolderSender:
    """A safetensors folder per version. A version's folder stays while a reader may still read it
    (it is live, or claimed on the board within `claim_timeout_s`): retention by version."""

    catch_up_poll_s = None

    def __init__(self, board, root: str, dtype: torch.dtype | None = None, claim_timeout_s: float = 600.0):
        self.board, self.root, self.dtype, self.claim_timeout_s = board, Path(root), dtype, claim_timeout_s
        self.written: dict[int, Path] = {}

    def send(self, version: int, tensors: dict[str, torch.Tensor], release) -> dict:
        start = time.perf_counter()
        try:
            cast_tensors = cast(tensors, self.dtype)
            folder = save_weights_folder(cast_tensors, self.root / f"v{version:06d}", version)
            digests = integrity.tensor_digests(cast_tensors.items())
        finally:
            release()
        self.written[version] = folder
        call(self.board, "publish", {"version": version, "kind": "folder", "path": str(folder), "integrity": digests})
        self.prune()
        return {"own_s": time.perf_counter() - start}

    def prune(self) -> list[int]:
        """Delete the folders no reader may still read; the versions deleted."""
        retained = call(self.board, "retained_versions", self.claim_timeout_s)
        for reader in retained["expired_readers"]:
            log.warning("weights: %s held a version for more than %.0fs (weight_sync.claim_timeout_s); its "
                        "claim is dropped", reader, self.claim_timeout_s)
        gone = [v for v in self.written if v not in retained["versions"] and v < max(self.written)]
        for version in gone:
            shutil.rmtree(self.written.pop(version), ignore_errors=True)
        return gone

    def close(self) -> None:
        pass


class BroadcastSender:
    """Rank 0 of the weight group: announce, wait for the members (bounded), send in chunks.

    Settings: backend (gloo|nccl), topology (chain|star), chunk_bytes, ready_timeout_s (how long a
    member may take to reach its interrupt point), timeout_s (the group's collective timeout: a
    member that dies mid-send fails the send after this), address (this node's, for gloo),
    ahead_bytes (what a member may hold received but not yet forwarded and loaded; None: a whole
    version, so a slow member holds up neither the learner nor the members before it)."""

    catch_up_poll_s = 0.5

    def __init__(self, board, backend: str, topology: str, chunk_bytes: int, ready_timeout_s: float,
                 timeout_s: float, address: str | None = None, dtype: torch.dtype | None = None,
                 device: torch.device | str = "cpu", ahead_bytes: int | None = None):
        self.board, self.dtype, self.device = board, dtype, device
        self.ready_timeout_s = ready_timeout_s
        self.common = {"backend": backend, "topology": topology, "chunk_bytes": int(chunk_bytes),
                       "timeout_s": float(timeout_s)}
        self.ahead_bytes = ahead_bytes
        self.address = address or node_address()
        self._group: WeightGroup | None = None

    def send(self, version: int, tensors: dict[str, torch.Tensor], release, catch_up: bool = False) -> dict:
        """Send `version` to every member (a new version: waiting for them, bounded) or to the
        members behind it (`catch_up`: a restarted or late engine, no waiting)."""
        layout = Layout.of(tensors.items(), self.dtype)
        started = time.perf_counter()
        try:
            if not catch_up:
                call(self.board, "announce", version, layout.to_wire())
                self._wait_ready(version)
            ahead = self.ahead_bytes if self.ahead_bytes is not None else layout.total_bytes
            send = call(self.board, "start_send", version,
                        {**self.common, "layout": layout.to_wire(), "ahead_bytes": ahead}, not catch_up)
            for worker, why in send["left_out"].items():
                log.warning("weights v%d: %s left out of this send (weight_sync.ready_timeout_s=%.0fs): %s; it "
                            "rejoins when it next asks", version, worker, self.ready_timeout_s, why)
            own_start = time.perf_counter()
            if send["world"] > 1:
                self._send(send, layout, tensors, version)
            own_s = time.perf_counter() - own_start
            release()
            served_s = self._wait_served(version, send) - started if send["world"] > 1 else 0.0
        finally:
            release()
            if not catch_up:  # live even after a failed send: the members that missed it catch up
                call(self.board, "publish", {"version": version, "kind": "broadcast"})
        return {"own_s": own_s, "served_s": served_s, "ready_wait_s": own_start - started,
                "engines": send["world"] - 1}

    def _wait_ready(self, version: int) -> None:
        deadline = time.monotonic() + self.ready_timeout_s
        while call(self.board, "wait_ready", version, max(0.0, deadline - time.monotonic())):
            if time.monotonic() >= deadline:
                return

    def _send(self, send: dict, layout: Layout, tensors, version: int) -> None:
        try:
            group = self._group_of(send)
            send_stream(group, layout, tensors, self.common["chunk_bytes"], self.common["topology"], self.device)
        except Exception as err:
            self._group = None
            call(self.board, "forget_generation")
            raise RuntimeError(f"weights v{version}: the send to {sorted(send['members'])} failed "
                               f"({type(err).__name__}: {err})") from err

    def _group_of(self, send: dict):
        if self._group is None or self._group.generation != send["generation"]:
            self._group = None  # the old generation's group is dropped before the new one forms
            go = {**self.common, "generation": send["generation"], "world": send["world"]}
            self._group = WeightGroup(self.board, go, 0, self.address)
        return self._group.group

    def _wait_served(self, version: int, send: dict) -> float:
        """Wait (bounded) until every member reports its engine has the version; name any that
        failed or never reported. The perf_counter time at which the last one had reported."""
        workers = sorted(send["members"])
        deadline = time.monotonic() + self.common["timeout_s"]
        reports = {}
        while len(reports) < len(workers) and time.monotonic() < deadline:
            reports = call(self.board, "wait_done", version, workers, max(0.0, deadline - time.monotonic()))
        for worker in workers:
            if worker not in reports:
                log.warning("weights v%d: %s never reported loading it within %.0fs", version, worker,
                            self.common["timeout_s"])
            elif reports[worker]["error"]:
                log.warning("weights v%d: %s failed to load it: %s", version, worker, reports[worker]["error"])
        return time.perf_counter()

    def close(self) -> None:
        self._group = None
