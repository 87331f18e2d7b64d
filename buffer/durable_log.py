"""The append-only log that makes the buffer durable.

Each record is `<u32 length><u32 crc32><msgpack map>` written with one `os.write` on an O_APPEND
file, so a SIGKILLed buffer leaves every completed write in the OS page cache. `fsync="always"`
syncs before the buffer replies; `fsync="interval"` syncs at most every `fsync_interval_ms`
(protects against a machine crash losing that window). On replay a torn or corrupt tail (a crash
mid-write) is cut off at the last good record. Compaction rewrites the log as one snapshot plus
the live groups into a temporary file, syncs it and renames it over the old one.

The settled archive (`<log>.settled`, beside the log) keeps what compaction removes from the log:
the `ack` and `drop` records, each naming its groups and their tickets. It is appended (and synced)
just before the log is rewritten and never read by the buffer itself; the audit reads it with the
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


def _encode(record: dict) -> bytes:
    body = msgpack.packb(record, use_bin_type=True)
    return _HEAD.pack(len(body), zlib.crc32(body)) + body


def settled_path(path: str | os.PathLike) -> Path:
    """The settled archive beside the log at `path`."""
    path = Path(path)
    return path.with_name(path.name + ".settled")


def _intact_length(path: Path) -> int:
    """The byte length of the intact records at the start of `path` (framing and CRCs only)."""
    data = path.read_bytes() if path.exists() else b""
    offset = 0
    while offset + _HEAD.size <= len(data):
        length, crc = _HEAD.unpack_from(data, offset)
        end = offset + _HEAD.size + length
        if end > len(data) or zlib.crc32(data[offset + _HEAD.size:end]) != crc:
            break
        offset = end
    return offset


def read_records(path: Path) -> tuple[list[dict], int]:
    """All intact records and the byte length they span (anything after is a torn tail)."""
    data = path.read_bytes() if path.exists() else b""
    records, offset = [], 0
    while offset + _HEAD.size <= len(data):
        length, crc = _HEAD.unpack_from(data, offset)
        body = data[offset + _HEAD.size: offset + _HEAD.size + length]
        if len(body) != length or zlib.crc32(body) != crc:
            break
        records.append(msgpack.unpackb(body, raw=False))
        offset += _HEAD.size + length
    return records, offset


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
        self._dirty = False
        self._last_sync = time.monotonic()
        self._fd = -1
        self.base_size = 0

    def replay(self) -> Iterator[dict]:
        """Yield the stored records, cutting off a torn tail, then open the log for appending."""
        records, good = read_records(self.path)
        if self.path.exists() and self.path.stat().st_size > good:
            self.truncated_bytes = self.path.stat().st_size - good
            log.warning("buffer log %s: cutting %d bytes of torn tail", self.path, self.truncated_bytes)
            os.truncate(self.path, good)
        archive = settled_path(self.path)
        if archive.exists() and archive.stat().st_size > (good_archive := _intact_length(archive)):
            log.warning("buffer log %s: cutting a torn tail of its settled archive", self.path)
            os.truncate(archive, good_archive)
        self._open()
        yield from records

    def _open(self) -> None:
        self._fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        self.base_size = self.size  # the size at open or right after compaction

    @property
    def size(self) -> int:
        return os.fstat(self._fd).st_size

    def append(self, record: dict) -> None:
        data = _encode(record)
        written = os.write(self._fd, data)
        if written != len(data):  # regular files write fully unless the disk is full
            raise OSError(f"buffer log {self.path}: short write ({written} of {len(data)} bytes)")
        self._dirty = True
        if self.config.fsync == "always":
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
        self._last_sync = time.monotonic()

    def compact(self, snapshot: Iterable[dict], settled: list[dict]) -> None:
        """Archive the `settled` records (acks and drops since the last compaction), then replace
        the log with the `snapshot` records."""
        if settled:
            fd = os.open(settled_path(self.path), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
            try:
                data = b"".join(_encode(r) for r in settled)
                if os.write(fd, data) != len(data):
                    raise OSError(f"buffer log {self.path}: short write to its settled archive")
                os.fsync(fd)
            finally:
                os.close(fd)
        self.rewrite(snapshot)

    def rewrite(self, records: Iterable[dict]) -> None:
        """Atomically replace the log with `records`."""
        tmp = self.path.with_name(self.path.name + ".compact")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            for record in records:
                os.write(fd, _encode(record))
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, self.path)
        dir_fd = os.open(self.path.parent, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)
        os.close(self._fd)
        self._open()
        self._dirty = False
        self.compactions += 1

    def close(self) -> None:
        if self._fd >= 0:
            self.sync()
            os.close(self._fd)
            self._fd = -1
