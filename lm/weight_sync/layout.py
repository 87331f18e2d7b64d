"""The wire layout of one weight version: which tensors, in what order, at which byte offsets.

A version travels as one byte stream: every tensor's bytes (in the publish dtype) at an offset
aligned to 64 bytes, cut into chunks of `chunk_bytes`. Chunk boundaries fall anywhere, so a big
tensor (an embedding) spans several chunks and a chain of receivers keeps pipelining through it;
the receiver hands out each tensor as soon as its last byte has arrived. The layout itself (names,
dtypes, shapes, offsets) is the small metadata header that every receiver checks against its own
model before it takes part in a send.
"""
from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass

import torch

ALIGN = 64  # bytes: every tensor starts on a 64-byte boundary, so a chunk's views are aligned


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _align(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


@dataclass(frozen=True)
class TensorMeta:
    name: str
    dtype: str
    shape: tuple[int, ...]
    offset: int  # bytes into the stream
    nbytes: int
    alias_of: str | None = None  # another name of the same storage (a tied lm_head): sent once

    @property
    def end(self) -> int:
        return self.offset + self.nbytes

    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype)


@dataclass(frozen=True)
class Layout:
    tensors: tuple[TensorMeta, ...]
    total_bytes: int

    @classmethod
    def of(cls, named: Iterable[tuple[str, torch.Tensor]], dtype: torch.dtype | None = None) -> "Layout":
        """The layout of these tensors, cast to `dtype` (None: each keeps its own). Names that
        share one storage (tied weights) are aliases of the first: their bytes go once. Meta
        tensors (shapes only: a layout declared before the bytes exist) alias when they are one object."""
        metas, offset, first = [], 0, {}
        for name, tensor in named:
            out = dtype or tensor.dtype
            where = id(tensor) if tensor.is_meta else tensor.data_ptr()
            key = (where, tuple(tensor.shape), tensor.stride(), tensor.dtype)
            if key in first and tensor.numel():
                metas.append(TensorMeta(**{**vars(first[key]), "name": name, "alias_of": first[key].name}))
                continue
            nbytes = tensor.numel() * torch.empty((), dtype=out).element_size()
            first[key] = TensorMeta(name, dtype_name(out), tuple(tensor.shape), offset, nbytes)
            metas.append(first[key])
            offset = _align(offset + nbytes)
        return cls(tuple(metas), offset)

    def to_wire(self) -> dict:
        return {"tensors": [[m.name, m.dtype, list(m.shape), m.offset, m.nbytes, m.alias_of] for m in self.tensors],
                "total_bytes": self.total_bytes}

    @classmethod
    def from_wire(cls, wire: dict) -> "Layout":
        return cls(tuple(TensorMeta(n, d, tuple(s), o, b, a) for n, d, s, o, b, a in wire["tensors"]),
                   int(wire["total_bytes"]))

    @property
    def stored(self) -> tuple[TensorMeta, ...]:
        """The tensors whose bytes are in the stream (aliases excluded), in stream order."""
        return tuple(m for m in self.tensors if m.alias_of is None)

    def chunks(self, chunk_bytes: int) -> list[tuple[int, int]]:
        """The [start, end) byte ranges of the stream's chunks."""
        size = max(ALIGN, chunk_bytes // ALIGN * ALIGN)
        return [(start, min(start + size, self.total_bytes)) for start in range(0, self.total_bytes, size)]

    def check_fits(self, expected: Mapping[str, tuple[int, ...]], may_lack: Iterable[str] = ()) -> None:
        """Raise ValueError naming the first tensor that does not fit a model whose weights have
        these shapes: one the model lacks, one of another shape, or one the model needs that the
        layout lacks (`may_lack`: names the model can do without, e.g. a tied lm_head)."""
        names = set()
        for meta in self.tensors:
            names.add(meta.name)
            if meta.name not in expected:
                raise ValueError(f"weights do not fit the model: it has no tensor {meta.name!r}")
            if tuple(expected[meta.name]) != meta.shape:
                raise ValueError(f"weights do not fit the model: tensor {meta.name!r} has shape {list(meta.shape)}, "
                                 f"the model's is {list(expected[meta.name])}")
        missing = sorted(set(expected) - names - set(may_lack))
        if missing:
            raise ValueError(f"weights do not fit the model: tensor {missing[0]!r} is missing "
                             f"({len(missing)} missing in all)")


def cast(tensors: Mapping[str, torch.Tensor], dtype: torch.dtype | None, copy: bool = False) -> dict[str, torch.Tensor]:
    """The tensors in `dtype` (None: their own), copied if `copy`; names that share a storage
    (a tied lm_head) still share one tensor, so the channels send and store its bytes once."""
    if dtype is None and not copy:
        return dict(tensors)
    out, done = {}, {}
    for name, tensor in tensors.items():
        key = (tensor.data_ptr(), tuple(tensor.shape), tensor.stride(), tensor.dtype)
        if key not in done:
            done[key] = tensor.to(dtype or tensor.dtype, copy=copy)
        out[name] = done[key]
    return out


def copy_into(buffer: dict[str, torch.Tensor] | None, tensors: Mapping[str, torch.Tensor],
              dtype: torch.dtype | None) -> dict[str, torch.Tensor]:
    """`cast(tensors, dtype, copy=True)`, written into `buffer` (an earlier copy of the same
    tensors) when there is one: a snapshot reuses its memory instead of allocating anew."""
    if buffer is None or buffer.keys() != tensors.keys():
        return cast(tensors, dtype, copy=True)
    done = set()
    for name, tensor in tensors.items():
        key = (tensor.data_ptr(), tuple(tensor.shape), tensor.stride(), tensor.dtype)
        if key not in done:  # tied names share one tensor in the buffer too
            buffer[name].copy_(tensor)
            done.add(key)
    return buffer


def fill_chunk(buf: torch.Tensor, layout: Layout, span: tuple[int, int], tensors: Mapping[str, torch.Tensor]) -> None:
    """Copy (and cast) the parts of `tensors` that fall in the byte range `span` into the uint8
    buffer `buf` (its first span-length bytes)."""
    start, end = span
    for meta in layout.stored:
        if meta.end <= start or meta.offset >= end or meta.nbytes == 0:
            continue
        lo, hi = max(start, meta.offset), min(end, meta.end)
        size = torch.empty((), dtype=meta.torch_dtype).element_size()
        source = tensors[meta.name].reshape(-1)[(lo - meta.offset) // size : (hi - meta.offset) // size]
        buf[lo - start : hi - start].view(meta.torch_dtype).copy_(source)


class ChunkAssembler:
    """Turns the stream's chunks, fed in order, into (name, tensor) pairs. A tensor that lies in
    one chunk is a view of that chunk's buffer (the buffer must not be reused while the consumer
    may hold it); one that spans chunks is assembled in its own tensor. An alias comes right after
    the tensor it names again, as the same tensor. `spare` (size -> buffers): assembly buffers a
    finished version left, reused (`recycle`) instead of new memory."""

    def __init__(self, layout: Layout, device: torch.device | str = "cpu", spare: dict | None = None):
        self.layout = layout
        self.device = device
        self._spare = spare if spare is not None else {}
        self._used: list[torch.Tensor] = []
        self._stored = layout.stored
        self._aliases: dict[str, list[str]] = {}
        for meta in layout.tensors:
            if meta.alias_of is not None:
                self._aliases.setdefault(meta.alias_of, []).append(meta.name)
        self._next = 0  # index into _stored of the first tensor not yet handed out
        self._partial: torch.Tensor | None = None  # bytes of a tensor that spans chunks

    def feed(self, span: tuple[int, int], chunk: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
        start, end = span
        tensors = self._stored
        while self._next < len(tensors) and tensors[self._next].offset < end:
            meta = tensors[self._next]
            if meta.offset >= start and meta.end <= end:
                data = chunk[meta.offset - start : meta.end - start]
            else:
                if self._partial is None:
                    self._partial = self._buffer(meta.nbytes)
                lo, hi = max(start, meta.offset), min(end, meta.end)
                self._partial[lo - meta.offset : hi - meta.offset].copy_(chunk[lo - start : hi - start])
                if meta.end > end:
                    return  # the rest of this tensor comes with the next chunk
                data, self._partial = self._partial, None
            self._next += 1
            tensor = data.view(meta.torch_dtype).view(meta.shape)
            yield meta.name, tensor
            for alias in self._aliases.get(meta.name, ()):
                yield alias, tensor

    def _buffer(self, nbytes: int) -> torch.Tensor:
        spare = self._spare.get(nbytes)
        buf = spare.pop() if spare else torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        self._used.append(buf)
        return buf

    def recycle(self) -> None:
        """The consumer holds no tensor of this version any more: its assembly buffers are spare."""
        for buf in self._used:
            self._spare.setdefault(buf.numel(), []).append(buf)
        self._used = []

    @property
    def complete(self) -> bool:
        return self._next == len(self._stored)


class BucketStream(Mapping):
    """Name -> tensor of a version that arrives a bucket at a time (an FSDP learner gathers each
    bucket when the send first asks for one of its tensors). A send reads tensors in layout order,
    so only the newest two buckets are kept: peak memory two buckets, not a model. `drain()` takes
    the buckets nobody asked for (each is a collective every rank runs to the end)."""

    def __init__(self, buckets: Iterable[Mapping[str, torch.Tensor]]):
        self._buckets = iter(buckets)
        self._held: list[Mapping[str, torch.Tensor]] = []
        self.gathered = 0

    def __getitem__(self, name: str) -> torch.Tensor:
        while not any(name in bucket for bucket in self._held):
            try:
                bucket = next(self._buckets)
            except StopIteration:
                raise KeyError(name) from None
            self.gathered += 1
            self._held = [*self._held[-1:], bucket]
        return next(bucket[name] for bucket in self._held if name in bucket)

    def __iter__(self) -> Iterator[str]:
        raise TypeError("a BucketStream is read by name, in layout order (its layout comes with it)")

    def __len__(self) -> int:
        raise TypeError("a BucketStream is read by name, in layout order (its layout comes with it)")

    def drain(self) -> None:
        for _ in self._buckets:
            self.gathered += 1
        self._held = []

