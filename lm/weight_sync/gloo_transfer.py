"""etarl's gloo weight transfer, both ends, without vLLM: what runs behind vLLM's weight-transfer
interface on CPUs (`vllm_plugin`), and in the transformers engine's own process.

Init info (from the sender's `group.Rendezvous`, with this receiver's `rank_offset` and node
`address` set by the board's client): where to join the group. Update info, per version:
{"version", "layout" (the wire header, `layout.Layout`), "chunk_bytes", "topology" (chain|star),
"ahead_bytes"}. The bytes move as `stream` moves them (chain: each receiving process forwards to
the next, so the sender puts every byte on the wire once), followed by the digests of the chunks;
a version is received whole, checked (digests, then no NaN/inf: `integrity`) and only then
handed to the model, so a refused version (`WeightsRejected`) leaves the model as it was.
"""
from __future__ import annotations

from collections.abc import Mapping

import torch

from lm.weight_sync import integrity
from lm.weight_sync.group import Rendezvous, join_group
from lm.weight_sync.integrity import WeightsRejected
from lm.weight_sync.layout import Layout
from lm.weight_sync.stream import ReceiveStream, send_stream


def update_info(version: int, layout: Layout, chunk_bytes: int, topology: str, ahead_bytes: int | None) -> dict:
    return {"version": int(version), "layout": layout.to_wire(), "chunk_bytes": int(chunk_bytes),
            "topology": topology, "ahead_bytes": None if ahead_bytes is None else int(ahead_bytes)}


class GlooReceiver:
    """One receiving process's end (a vLLM worker, or the transformers engine's process)."""

    def __init__(self) -> None:
        self.group = self._store = None
        self.rank = self.world = 0
        self._spare = {"chunks": [], "assembly": {}}  # receive buffers kept from the last version
        self._last: ReceiveStream | None = None  # the version handed out, until the model has copied it

    def init(self, init_info: dict, rank: int) -> None:
        """Join the group of `init_info` as `rank` (blocks until every rank has joined)."""
        self.shutdown()
        self.group, self._store = join_group(init_info, rank, init_info.get("address"))
        self.rank, self.world = rank, int(init_info["world_size"])

    def receive(self, info: dict) -> list[tuple[str, torch.Tensor]]:
        """The whole version of `info`, checked: (name, tensor) views into the receive buffers,
        valid until `recycle()`. WeightsRejected if its bytes or values are bad."""
        if self.group is None:
            raise RuntimeError("the gloo weight transfer was not initialised (init_weight_transfer_engine first)")
        version, layout = int(info["version"]), Layout.from_wire(info["layout"])
        chunk = int(info["chunk_bytes"])
        ahead = info.get("ahead_bytes")
        stream = ReceiveStream(self.group, self.rank, self.world, layout, chunk, info["topology"], "cpu",
                               ahead=len(layout.chunks(chunk)) + 1 if ahead is None else max(1, ahead // chunk),
                               spare=self._spare)
        try:
            weights = list(stream)
        except Exception:
            self._drain(stream)
            raise
        if not stream.complete:
            raise RuntimeError(f"the stream of weights v{version} ended part-way")
        try:
            integrity.check_chunks(version, layout, stream.spans, stream.digests, stream.sent_digests)
            bad = integrity.first_nonfinite(weights)
            if bad is not None:
                raise WeightsRejected(version, "broadcast", bad, "holds a NaN or an inf")
        except WeightsRejected:
            stream.recycle()  # nothing was handed out: the buffers serve the next version
            raise
        self._last = stream
        return weights

    def recycle(self) -> None:
        """The model has copied the last version: keep its buffers for the next one."""
        stream, self._last = self._last, None
        if stream is not None:
            stream.recycle()

    def _drain(self, stream: ReceiveStream) -> None:
        try:
            stream.drain()  # the ranks after this one still get their version
        except Exception:
            self.shutdown()  # the group itself failed: the next send forms a new one

    def shutdown(self) -> None:
        self.group = self._store = None


class GlooSender:
    """The learner's end (rank 0): a rendezvous per generation, then one stream per version."""

    def __init__(self, address: str, world: int, timeout_s: float):
        self.rendezvous = Rendezvous(address, world, timeout_s)
        self.group = None

    def init_info(self) -> dict:
        return self.rendezvous.init_info()

    def join(self) -> None:
        self.group = self.rendezvous.join()

    def send(self, layout: Layout, tensors: Mapping[str, torch.Tensor], chunk_bytes: int, topology: str) -> None:
        send_stream(self.group, layout, tensors, chunk_bytes, topology)  # gloo: host memory

    def shutdown(self) -> None:
        self.group = None

