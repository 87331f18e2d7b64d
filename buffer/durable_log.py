"""The append-only log that makes the buffer durable.

Each record is `<u32 length><u32 crc32><msgpack map>` written with one `os.write` on an O_APPEND
file, so a SIGKILLed buffer leaves every completed write in the OS page cache. Writes are group
committed: a request's records are written as they happen and synced once, when the request is
answered (`commit`): `fsync="always"` syncs then, if the request wrote a record that must survive a
machine crash (a permit grant need not: see `append`); `fsync="interval"` syncs at most every
`fsync_interval_ms` (a machine crash may lose that window). Replay streams the file record by
record; a torn or corrupt tail (a crash mid-write) is cut off at the last good record.

Compaction rewrites the log as one snapshot plus the live groups, off the request path
(`Compaction`): the snapshot is taken under the buffer's lock (references, no copies), written to
a temporary file by a background thread, the log's tail written since the snapshot is copied after
it, and only the last bit of tail, the sync of that bit and the rename happen under the lock again.

The settled archive (`<log>.settled`, beside the log) keeps what compaction removes from the log:
the `ack` and `drop` records, each naming its groups and their tickets. It is appended (and synced)
just before the log is replaced and never read by the buffer itself; the audit reads it with the
log, so every group the buffer ever settled stays identifiable by id and ticket. A record that is
in both (a kill between the two steps) carries the same settle number `n`: the audit counts it once.
About 100 bytes per settled group.
"""
from __future__ import annotations

import logging
import os
import struct
import time
import zlib
from pathlib import Path
from typing import Iterable, Iterator

import msgpack

from buffer.config import LogConfig

log = logging.getLogger(__name__)
_HEAD = struct.Struct("<II")
_COPY_CHUNK = 16 << 20  # bytes copied per read while a compaction catches up with the log's tail
_TAIL_UNDER_LOCK = 4 << 20  # a compaction takes the lock once the tail left to copy is this small


def _encode(record: dict) -> bytes:
    body = msgpack.packb(record, use_bin_type=True)
    return _HEAD.pack(len(body), zlib.crc32(body)) + body


def settled_path(path: str | os.PathLike) -> Path:
    """The settled archive beside the log at `path`."""
    path = Path(path)
    return path.with_name(path.name + ".settled")


def iter_records(path: Path) -> Iterator[tuple[dict, int]]:
    """Each intact record of the file and the offset just after it, read as a stream; stops at
    the first torn or corrupt record."""
    if not path.exists():
        return
    with open(path, "rb", buffering=1 << 20) as f:
        offset = 0
        while len(head := f.read(_HEAD.size)) == _HEAD.size:
            length, crc = _HEAD.unpack(head)
            body = f.read(length)
            if len(body) != length or zlib.crc32(body) != crc:
                return
            offset += _HEAD.size + length
            yield msgpack.unpackb(body, raw=False), offset


def _intact_length(path: Path) -> int:
    end = 0
    for _, end in iter_records(path):
        pass
    return end


def read_records(path: Path) -> tuple[list[dict], int]:
    """All intact records and the byte length they span (anything after is a torn tail)."""
    records, end = [], 0
    for record, end in iter_records(path):
        records.append(record)
    return records, end


def _fsync_dir(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_all(fd: int, data: bytes, what: str) -> None:
    if os.write(fd, data) != len(data):  # regular files write fully unless the disk is full
        raise OSError(f"{what}: short write")


class DurableLog:
    def __init__(self, config: LogConfig):
        if config.path is None:
            raise ValueError("DurableLog needs log.path")
        self.config = config
        self.path = Path(config.path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.fsyncs = 0
        self.compactions = 0
        self.truncated_bytes = 0
        self.longest_compaction_lock_s = 0.0  # the longest the buffer's lock was held by a compaction
        self._dirty = False  # written since the last fsync
        self._must_sync = False  # written a record that must be synced before the request is answered
        self._last_sync = time.monotonic()
        self._fd = -1
        self.base_size = 0

    def replay(self) -> Iterator[dict]:
        """Yield the stored records (streamed), cutting off a torn tail, then open the log for
        appending. A compaction's leftover temporary file is removed."""
        self._compact_path().unlink(missing_ok=True)
        good = 0
        for record, good in iter_records(self.path):
            yield record
        if self.path.exists() and self.path.stat().st_size > good:
            self.truncated_bytes = self.path.stat().st_size - good
            log.warning("buffer log %s: cutting %d bytes of torn tail", self.path, self.truncated_bytes)
            os.truncate(self.path, good)
        archive = settled_path(self.path)
        if archive.exists() and archive.stat().st_size > (good_archive := _intact_length(archive)):
            log.warning("buffer log %s: cutting a torn tail of its settled archive", self.path)
            os.truncate(archive, good_archive)
        self._open()

    def _open(self) -> None:
        self._fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        self.base_size = self.size  # the size at open or right after compaction

    def _compact_path(self) -> Path:
        return self.path.with_name(self.path.name + ".compact")

    @property
    def size(self) -> int:
        return os.fstat(self._fd).st_size

    def append(self, record: dict, durable: bool = True) -> None:
        """Write one record; `commit` syncs it. `durable=False`: a record whose loss in a machine
        crash the buffer survives (a permit grant: a forgotten permit's push is refused as
        unknown and its ticket issued again, so nothing is lost or trained twice); it is synced
        with the next record that must be, or by the interval."""
        _write_all(self._fd, _encode(record), f"buffer log {self.path}")
        self._dirty = True
        self._must_sync = self._must_sync or durable

    def commit(self) -> None:
        """The end of a request: its records are made durable as the fsync policy says."""
        if self.config.fsync == "always":
            if self._must_sync:
                self.sync()
        else:
            self.sync_if_due()

    def sync_if_due(self) -> None:
        if self._dirty and (time.monotonic() - self._last_sync) * 1000 >= self.config.fsync_interval_ms:
            self.sync()

    def sync(self) -> None:
        if self._dirty:
            os.fsync(self._fd)
            self.fsyncs += 1
            self._dirty = False
        self._must_sync = False
        self._last_sync = time.monotonic()

    def archive(self, settled: list[dict]) -> None:
        """Append the settled records (acks and drops compacted away) to the archive, synced."""
        if not settled:
            return
        fd = os.open(settled_path(self.path), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        try:
            _write_all(fd, b"".join(_encode(r) for r in settled), f"settled archive of {self.path}")
            os.fsync(fd)
        finally:
            os.close(fd)

    def rewrite(self, records: Iterable[dict]) -> None:
        """Replace the log with `records` at once (a restore into a fresh buffer; compaction goes
        through `Compaction`)."""
        tmp = self._compact_path()
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            for record in records:
                _write_all(fd, _encode(record), f"buffer log {tmp}")
            os.fsync(fd)
        finally:
            os.close(fd)
        self._swap_in(tmp)

    def _swap_in(self, tmp: Path) -> None:
        os.replace(tmp, self.path)
        _fsync_dir(self.path.parent)
        os.close(self._fd)
        self._open()
        self._dirty = self._must_sync = False
        self.compactions += 1

    def close(self) -> None:
        if self._fd >= 0:
            self.sync()
            os.close(self._fd)
            self._fd = -1


class Compaction:
    """One compaction of `log` off the request path. `start` is called under the buffer's lock
    with the snapshot records and the settled records to archive; `run` (a background thread)
    writes them and copies the log's tail written meanwhile; `finish(lock)` takes the buffer's
    lock for the last bit of tail and the swap."""

    def __init__(self, log: DurableLog, snapshot: list[dict], settled: list[dict]):
        self.log = log
        self.snapshot = snapshot
        self.settled = settled
        self.offset = log.size  # the log's end at the snapshot: the tail starts here
        self.tmp = log._compact_path()

    def run(self, lock) -> None:
        log_ = self.log
        log_.archive(self.settled)
        fd = os.open(self.tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            for record in self.snapshot:
                _write_all(fd, _encode(record), f"buffer log {self.tmp}")
            self.snapshot = []
            with open(log_.path, "rb") as src:
                self._copy_tail(src, fd, until=None)  # most of the tail, without the lock
                os.fsync(fd)
                started = time.monotonic()
                with lock:  # nothing is appended now: copy the rest and swap
                    self._copy_tail(src, fd, until=log_.size)
                    os.fsync(fd)
                    os.close(fd)
                    fd = -1
                    log_._swap_in(self.tmp)
                    log_.longest_compaction_lock_s = max(log_.longest_compaction_lock_s, time.monotonic() - started)
        finally:
            if fd >= 0:
                os.close(fd)

    def _copy_tail(self, src, fd: int, until: int | None) -> None:
        """Copy the log from `self.offset` on: up to `until`, or (None) until less than
        _TAIL_UNDER_LOCK is left unread."""
        while True:
            end = until if until is not None else os.fstat(src.fileno()).st_size
            left = end - self.offset
            if left <= 0 or (until is None and left < _TAIL_UNDER_LOCK):
                return
            src.seek(self.offset)
            chunk = src.read(min(left, _COPY_CHUNK))
            _write_all(fd, chunk, f"buffer log {self.tmp}")
            self.offset += len(chunk)
