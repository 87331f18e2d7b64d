"""Moving one version's byte stream (`layout.Layout`) through a weight group, chunk by chunk.

Two topologies:
  chain: rank 0 sends each chunk to rank 1, rank r forwards it to r + 1 while it receives the next
         one and its engine copies the one before: the sender puts every byte on the wire once
         whatever the number of engines, and the last engine has the version about (n − 1) chunks
         after the first. For gloo, whose broadcast is a binomial tree (rank 0 sends each byte to ranks
         1, 2, 4, ...: 3 times for 4 engines, measured by benchmarks/weight_sync.py).
  star:  the group's own broadcast of each chunk from rank 0. NCCL's broadcast pipelines over a
         ring or tree itself; gloo's is the binomial tree above.
The sender keeps two chunk buffers in flight; a receiver gets a buffer of its own per chunk (its
engine may hold views of a chunk while it loads, e.g. vLLM's layer-wise reload; in host memory they
are kept for the next version once the engine has loaded this one), receives in one
thread and forwards in another, and holds at most `ahead` chunks not yet both forwarded and
loaded: until then neither its engine nor the ranks after it hold up the ranks before it.
After the last chunk comes a trailer: the digest of each chunk as the sender filled it
(`integrity`), which every receiver compares with its own digests of what arrived.
"""
from __future__ import annotations

import queue
import threading
from collections import deque
from collections.abc import Iterator, Mapping

import torch
import torch.distributed as dist

from lm.weight_sync import integrity
from lm.weight_sync.layout import ChunkAssembler, Layout, fill_chunk

TOPOLOGIES = ("chain", "star")


def _broadcast(group, buf: torch.Tensor):
    options = dist.BroadcastOptions()
    options.rootRank = 0
    return group.broadcast([buf], options)


def send_stream(group, layout: Layout, tensors: Mapping[str, torch.Tensor], chunk_bytes: int, topology: str,
                device: torch.device | str = "cpu") -> None:
    """Rank 0: send every chunk of the stream (the tensors cast as the layout says), then the
    trailer of their digests."""
    spans = layout.chunks(chunk_bytes)
    if not spans:
        return
    size = spans[0][1] - spans[0][0]
    buffers = [torch.empty(size, dtype=torch.uint8, device=device) for _ in range(min(2, len(spans)))]
    works, digests = deque(), []
    for k, span in enumerate(spans):
        if len(works) == len(buffers):
            works.popleft().wait()  # the buffer about to be refilled has left
        buf = buffers[k % len(buffers)][: span[1] - span[0]]
        fill_chunk(buf, layout, span, tensors)
        works.append(_send(group, buf, k, topology))
        digests.append(integrity.digest(buf))  # while the chunk is on the wire (both only read it)
    works.append(_send(group, integrity.pack_trailer(digests, device), len(spans), topology))
    for work in works:
        work.wait()


def _send(group, buf: torch.Tensor, tag: int, topology: str):
    return group.send([buf], 1, tag) if topology == "chain" else _broadcast(group, buf)


class ReceiveStream:
    """Ranks 1..n: iterate to get (name, tensor) pairs as their bytes arrive. One thread receives
    the chunks (the next one posted as soon as one arrives), another forwards each down the chain,
    and the engine loads them; a chunk is held until it has been both forwarded and handed to the
    engine, and at most `ahead` chunks are held. So neither a slow engine nor a slow rank further
    down holds up the ranks before this one until this one holds `ahead` chunks: with enough of
    them the learner's send ends about when the first engine has the bytes, whatever the number of
    engines. `drain()` takes the rest without handing anything out: a receiver whose engine failed
    part-way must not stall the ranks after it. Once iterated to the end, `digests` are those of
    the chunks as they arrived and `sent_digests` those the sender took (the trailer)."""

    def __init__(self, group, rank: int, world: int, layout: Layout, chunk_bytes: int, topology: str,
                 device: torch.device | str = "cpu", ahead: int = 4, spare: dict | None = None):
        if topology not in TOPOLOGIES:
            raise ValueError(f"unknown topology {topology!r}; expected one of {TOPOLOGIES}")
        self.group, self.rank, self.layout, self.topology, self.device = group, rank, layout, topology, device
        self.forward = topology == "chain" and rank < world - 1
        self.spans = layout.chunks(chunk_bytes)
        self._wire = len(self.spans) + 1 if self.spans else 0  # the chunks, then the trailer
        self.digests: list[bytes] = []
        self.sent_digests: list[bytes] = []
        spare = spare if spare is not None else {"chunks": [], "assembly": {}}  # what a finished version left
        self.assembler = ChunkAssembler(layout, device, spare["assembly"])
        self._spare = spare["chunks"]
        self._bases: list[torch.Tensor] = []  # the buffers this version's chunks went into
        self._slots = threading.BoundedSemaphore(max(1, ahead))  # chunks held: received, not yet let go
        self._chunks: queue.Queue = queue.Queue()  # for the engine: buffers, or a thread's error
        self._to_forward: queue.Queue = queue.Queue()
        self._lock = threading.Lock()
        self._let_go: dict[int, int] = {}  # chunk -> how many of its holders (forward, engine) are done
        self._taken = 0
        self._error: Exception | None = None
        self._threads = [threading.Thread(target=self._receive_all, name=f"weights-rank{rank}", daemon=True)]
        if self.forward:
            self._threads.append(threading.Thread(target=self._forward_all, name=f"weights-rank{rank}-forward",
                                                  daemon=True))
        for thread in self._threads:
            thread.start()

    def _post(self, k: int):
        self._slots.acquire()
        if k == len(self.spans):
            buf = torch.empty(integrity.trailer_bytes(k), dtype=torch.uint8, device=self.device)
        else:
            buf = self._buffer(self.spans[k][1] - self.spans[k][0])
        work = self.group.recv([buf], self.rank - 1, k) if self.topology == "chain" else _broadcast(self.group, buf)
        return buf, work

    def _buffer(self, size: int) -> torch.Tensor:
        """A buffer for one chunk: a spare one if it is big enough, else a new one of a full chunk
        (reused memory: a fresh buffer costs the kernel zeroing every page, about 4x the copy)."""
        while self._spare:
            base = self._spare.pop()
            if base.numel() >= size:
                break
        else:
            full = self.spans[0][1] - self.spans[0][0]
            base = torch.empty(max(size, full), dtype=torch.uint8, device=self.device)
        self._bases.append(base)
        return base[:size]

    def recycle(self) -> None:
        """The engine has loaded the version and holds no view of its chunks: their buffers (and
        the assembler's) are kept for the next version."""
        self._spare.extend(self._bases)
        self._bases = []
        self.assembler.recycle()

    def _release(self, k: int) -> None:
        """One holder of chunk k is done with it; its slot is free once both are (or the only one)."""
        with self._lock:
            done = self._let_go.pop(k, 0) + 1
            if done < (2 if self.forward else 1):
                self._let_go[k] = done
                return
        self._slots.release()

    def _receive_all(self) -> None:
        try:
            posted = self._post(0) if self._wire else None
            for k in range(self._wire):
                buf, work = posted
                work.wait()
                if self.forward:
                    self._to_forward.put((k, buf))
                self._chunks.put((k, buf))
                posted = self._post(k + 1) if k + 1 < self._wire else None
        except Exception as err:  # handed to the consumer, which raises it
            self._to_forward.put(err)
            self._chunks.put(err)

    def _forward_all(self) -> None:
        sending = deque()
        try:
            for _ in range(self._wire):
                item = self._to_forward.get()
                if isinstance(item, Exception):
                    return  # the receiver's error reaches the consumer on its own
                k, buf = item
                sending.append((k, self.group.send([buf], self.rank + 1, k)))
                # Two sends in flight at most, and none left unwaited while nothing new has come:
                # a waited send frees its chunk's slot, which the receiver may be waiting for.
                while len(sending) > 2 or (sending and self._to_forward.empty()):
                    self._forwarded(*sending.popleft())
            while sending:
                self._forwarded(*sending.popleft())
        except Exception as err:
            self._chunks.put(err)

    def _forwarded(self, k: int, work) -> None:
        work.wait()
        self._release(k)

    def _take_chunk(self) -> torch.Tensor:
        item = self._error or self._chunks.get()
        if isinstance(item, Exception):
            self._error = item  # a thread has ended: nothing more will come
            raise item
        k, buf = item
        self._taken += 1
        self._release(k)
        return buf

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        while self._taken < len(self.spans):
            span = self.spans[self._taken]
            chunk = self._take_chunk()
            self.digests.append(integrity.digest(chunk))  # in this thread, while the next chunk arrives
            yield from self.assembler.feed(span, chunk)
        if self._wire:
            self.sent_digests = integrity.unpack_trailer(self._take_chunk(), len(self.spans))
        self._join()

    def drain(self) -> None:
        while self._taken < self._wire:
            self._take_chunk()
        self._join()

    @property
    def complete(self) -> bool:
        return (self._taken == self._wire and not any(t.is_alive() for t in self._threads)
                and self.assembler.complete)

    def _join(self) -> None:
        for thread in self._threads:
            thread.join()
