"""Moving one version's byte stream (`layout.Layout`) through a weight group, chunk by chunk.

Two topologies:
  chain: rank 0 sends each chunk to rank 1, rank r forwards it to r + 1 while it receives the next
         one and its engine copies the one before: the sender puts every byte on the wire once
         whatever the number of engines, and the last engine has the version about (n − 1) chunks
         after the first. For gloo, whose broadcast is a star.
  star:  the group's own broadcast of each chunk from rank 0. NCCL's broadcast pipelines over a
         ring or tree itself; gloo's sends every byte once per receiver from the root.
The sender keeps two chunk buffers in flight; a receiver gets a fresh buffer per chunk (its
engine may hold views of a chunk while it loads, e.g. vLLM's layer-wise reload) and keeps at most
three forwards in flight.
"""
from __future__ import annotations

from collections import deque
from collections.abc import Iterator, Mapping

import torch
import torch.distributed as dist

from lm.weight_sync.layout import ChunkAssembler, Layout, fill_chunk

TOPOLOGIES = ("chain", "star")


def _broadcast(group, buf: torch.Tensor):
    options = dist.BroadcastOptions()
    options.rootRank = 0
    return group.broadcast([buf], options)


def send_stream(group, layout: Layout, tensors: Mapping[str, torch.Tensor], chunk_bytes: int, topology: str,
                device: torch.device | str = "cpu") -> None:
    """Rank 0: send every chunk of the stream (the tensors cast as the layout says)."""
    spans = layout.chunks(chunk_bytes)
    if not spans:
        return
    size = spans[0][1] - spans[0][0]
    buffers = [torch.empty(size, dtype=torch.uint8, device=device) for _ in range(min(2, len(spans)))]
    works = deque()
    for k, span in enumerate(spans):
        if len(works) == len(buffers):
            works.popleft().wait()  # the buffer about to be refilled has left
        buf = buffers[k % len(buffers)][: span[1] - span[0]]
        fill_chunk(buf, layout, span, tensors)
        works.append(group.send([buf], 1, k) if topology == "chain" else _broadcast(group, buf))
    for work in works:
        work.wait()


class ReceiveStream:
    """Ranks 1..n: iterate to get (name, tensor) pairs as their bytes arrive, forwarding each
    chunk down the chain. `drain()` receives and forwards the rest without handing anything out:
    a receiver whose engine failed part-way must not stall the ranks after it."""

    _FORWARDS_IN_FLIGHT = 3

    def __init__(self, group, rank: int, world: int, layout: Layout, chunk_bytes: int, topology: str,
                 device: torch.device | str = "cpu"):
        if topology not in TOPOLOGIES:
            raise ValueError(f"unknown topology {topology!r}; expected one of {TOPOLOGIES}")
        self.group, self.rank, self.layout, self.topology, self.device = group, rank, layout, topology, device
        self.forward = topology == "chain" and rank < world - 1
        self.spans = layout.chunks(chunk_bytes)
        self.assembler = ChunkAssembler(layout, device)
        self._next = 0  # the next chunk to take in
        self._posted = None  # (buffer, work) of chunk _next, already posted
        self._forwards = deque()

    def _post(self, k: int):
        span = self.spans[k]
        buf = torch.empty(span[1] - span[0], dtype=torch.uint8, device=self.device)
        work = self.group.recv([buf], self.rank - 1, k) if self.topology == "chain" else _broadcast(self.group, buf)
        return buf, work

    def _take_chunk(self) -> torch.Tensor:
        """Wait for the next chunk, forward it, and post the receive of the one after."""
        k = self._next
        buf, work = self._posted or self._post(k)
        work.wait()
        if self.forward:
            self._forwards.append(self.group.send([buf], self.rank + 1, k))
            while len(self._forwards) > self._FORWARDS_IN_FLIGHT:
                self._forwards.popleft().wait()
        self._next += 1
        self._posted = self._post(self._next) if self._next < len(self.spans) else None
        return buf

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        while self._next < len(self.spans):
            span = self.spans[self._next]
            yield from self.assembler.feed(span, self._take_chunk())
        self._finish()

    def drain(self) -> None:
        while self._next < len(self.spans):
            self._take_chunk()
        self._finish()

    def _finish(self) -> None:
        while self._forwards:
            self._forwards.popleft().wait()

    @property
    def complete(self) -> bool:
        return self._next == len(self.spans) and not self._forwards and self.assembler.complete
