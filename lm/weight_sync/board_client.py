"""`BoardWeightSyncClient`: vLLM's `VLLMWeightSyncClient` (the four weight-update calls a trainer
engine drives) for the members of one send, carried by the board: each call is posted to every
member still in the send, each member runs it on its engine at its interrupt point and answers,
and the call returns when all have answered (bounded by `timeout_s`).

A member that fails a call (or never answers) is out of the rest of the send; the call raises
naming it, and `end()` then finishes the members that received the whole version and aborts the
others (they resume generation on the weights they had). Each member gets its own rank offset in
the init info (vLLM's trainer engines give every engine offset 1: one engine per group).
"""
from __future__ import annotations

import time

from lm.weight_sync.group import call


class WeightUpdateFailed(RuntimeError):
    """Members that failed the call `op` (or never answered it): {worker: why}."""

    def __init__(self, version: int, op: str, errors: dict[str, str], unanswered: set[str] = frozenset()):
        self.op, self.errors, self.unanswered = op, errors, set(unanswered)
        super().__init__(f"weights v{version} {op}: " + "; ".join(f"{w}: {e}" for w, e in sorted(errors.items())))


class BoardWeightSyncClient:
    def __init__(self, board, version: int, members: dict[str, int], timeout_s: float):
        self.board, self.version, self.timeout_s = board, int(version), timeout_s
        self.offsets = dict(members)  # worker -> its first rank in the group
        self.live = sorted(members)  # members still in this send
        self.failed: dict[str, str] = {}
        self.received: set[str] = set()  # members whose engine received the whole version
        self.finished: set[str] = set()

    def _call(self, op: str, args: dict | None = None, per_member=None) -> None:
        workers = list(self.live)
        if not workers:
            return
        seq = call(self.board, "post_op", {w: per_member(w) if per_member else (args or {}) for w in workers}, op)
        deadline = time.monotonic() + self.timeout_s
        acks: dict[str, str] = {}
        while len(acks) < len(workers) and time.monotonic() < deadline:
            acks = call(self.board, "wait_acks", seq, workers, max(0.01, deadline - time.monotonic()))
        errors = {w: acks[w] if w in acks else f"no answer within {self.timeout_s:.0f}s" for w in workers
                  if acks.get(w, "no answer")}
        self.failed.update(errors)
        self.live = [w for w in workers if w not in errors]
        if errors:
            raise WeightUpdateFailed(self.version, op, errors, {w for w in workers if w not in acks})

    def init_weight_transfer_engine(self, init_info: dict) -> None:
        # Backends with a group (gloo, nccl) place each engine at its own ranks; ipc has none.
        self._call("init", per_member=lambda w: {**init_info, "rank_offset": self.offsets[w]}
                   if "rank_offset" in init_info else init_info)

    def start_weight_update(self) -> None:
        self._call("start")

    def update_weights(self, update_info: dict) -> None:
        self._call("update", update_info)
        self.received.update(self.live)

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self._call("finish", {"version": self.version})
        self.finished.update(self.live)

    def end(self) -> None:
        """After a failed send: finish the members that received the version, abort the rest."""
        received = [w for w in self.live if w in self.received and w not in self.finished]
        rest = [w for w in self.live if w not in self.received]
        for op, workers in (("finish", received), ("abort", rest)):
            self.live = workers
            try:
                self._call(op, {"version": self.version})
            except WeightUpdateFailed:
                pass  # named in `failed`
            if op == "finish":
                self.finished.update(self.live)
        self.live = []
