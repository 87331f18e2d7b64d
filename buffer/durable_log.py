"""The append-only log that makes the buffer durable.

Each record is `<u32 length><u32 crc32><msgpack map>` written with one `os.writev` on an O_APPEND
file, so a SIGKILLed buffer leaves every completed write in the OS page cache. Writes are group
committed: a request's records are written as they happen and synced once, when the request is
answered (`commit`): `fsync="always"` syncs then, if the request wrote a record that must survive a
machine crash (a permit grant need not: see `append`); `fsync="interval"` syncs at most every
`fsync_interval_ms` (a machine crash may lose that window). Replay streams the file record by
record; a torn or corrupt tail (a crash mid-write) is cut off at the last good record, but a bad
record followed by an intact one is corruption, not a crash: replay refuses to start (`LogCorrupt`,
naming the file and the byte) rather than cut records that were acknowledged.

The log fails stop. A write that fails or comes up short (the disk full) is cut back to the last
good byte (log, segment or archive), so half a record is never followed by later ones, and raises
`LogFailed`; if the cut fails too, or any fsync fails (in a request or in the background), the log
is poisoned for good: every later append, commit or sync raises. A failed fsync is never retried:
the kernel may have dropped the dirty pages and a second fsync can report success for them
(PostgreSQL's and Redis's reason to stop on the first one). The buffer that owns the log stops on
`LogFailed` and is restarted from the log by its supervisor (`buffer.core`). Every file and folder
the log creates has its parent folder synced, so its name survives a machine crash.

A group's payload of at least _INLINE_BYTES (any group at real sizes: 1.8 MB for 16 x 9k tokens)
is not written into the log: it is appended to a payload segment (`<log>.payloads/<n>.seg`, a new
one every `segment_bytes`) and the log's `push` record names it (`blob`: segment, offset, length,
crc32). The segment is written first and synced first, so a record never names bytes that a crash
could lose while keeping the record; a `blob` that cannot be read back intact counts as a torn
tail. Small payloads stay inline.

Compaction rewrites the log as one snapshot plus the live groups, off the request path
(`Compaction`): the snapshot is taken under the buffer's lock (references, no copies), written to
a temporary file by a background thread, the log's tail written since the snapshot is copied after
it, and only the last bit of tail, the sync of that bit and the rename happen under the lock again.
A live group in a segment is written as its `blob` reference, not its bytes, so compaction moves
metadata only; once the new log is durable, every segment older than the snapshot that no live
group names is deleted (a segment is dropped once all its groups are consumed). Disk held: the
log, plus each segment that still holds a live group (the η bound drops a group that waits too
long, so that is the last few segments), plus the current one.

The settled archive (`<log>.settled`, beside the log) keeps what compaction removes from the log:
the `ack` and `drop` records, each naming its groups and their tickets. It is appended (and synced)
just before the log is replaced and never read by the buffer itself; the audit reads it with the
log, so every group the buffer ever settled stays identifiable by id and ticket. A record that is
in both (a kill between the two steps) carries the same settle number `n`: the audit counts it once.
About 100 bytes per settled group.
"""
from __future__ import annotations

import contextlib
import errno
import logging
import os
import shutil
import struct
import threading
import time
import zlib
from collections import deque
from pathlib import Path
from typing import Iterable, Iterator

import msgpack

from buffer.codec import first_frame_span
from buffer.config import LogConfig
from buffer.errors import LogFailed

log = logging.getLogger(__name__)
_HEAD = struct.Struct("<II")
_COPY_CHUNK = 16 << 20  # bytes copied per read while a compaction catches up with the log's tail
_READ_PIECE = 1 << 20  # bytes per read when a payload is checked, not kept
_TAIL_UNDER_LOCK = 256 << 10  # a compaction takes the lock once the tail left to copy is this small
_INLINE_BYTES = 64 << 10  # a group payload at least this big is written from its own buffer
# Every record is a small msgpack map whose first key is "op" (a fixmap header, then this): what a
# scan past a bad record looks for, so random bytes are almost never checked as a record.
_OP_KEY = b"\xa2op"
_SCAN_PIECE = 1 << 20  # bytes read per step when looking for an intact record after a bad one


class LogCorrupt(ValueError):
    """Replay found a bad record with intact records after it: corruption in the middle of the
    log, not a torn tail. Cutting there would drop acknowledged records, so the buffer does not
    start; the message names the file and the byte offsets."""


def _encode(record: dict) -> bytes:
    return b"".join(_encode_parts(record))


def _encode_parts(record: dict) -> list:
    """A record as buffers to write in order: the head, then its msgpack map, whose large `group`
    payload (a pushed group, megabytes at real sizes) is written from the caller's buffer as it
    is, not copied into the map (the bytes on disk are the same as `msgpack.packb(record)`)."""
    payload = record.get("group")
    if payload is None or memoryview(payload).nbytes < _INLINE_BYTES:
        body = msgpack.packb(record, use_bin_type=True)
        return [_HEAD.pack(len(body), zlib.crc32(body)), body]
    packer = msgpack.Packer(use_bin_type=True)
    keys = list(record)
    at = keys.index("group")
    pack = lambda ks: b"".join(packer.pack(k) + packer.pack(record[k]) for k in ks)  # noqa: E731
    size = memoryview(payload).nbytes
    before = packer.pack_map_header(len(record)) + pack(keys[:at]) + packer.pack("group") + _bin_header(size)
    after = pack(keys[at + 1:])
    crc = zlib.crc32(after, zlib.crc32(payload, zlib.crc32(before)))
    return [_HEAD.pack(len(before) + size + len(after), crc), before, payload, after]


def _bin_header(size: int) -> bytes:
    """msgpack's header of a bin of `size` bytes (bin 8/16/32), as packb writes it."""
    if size < 1 << 8:
        return struct.pack(">BB", 0xC4, size)
    if size < 1 << 16:
        return struct.pack(">BH", 0xC5, size)
    return struct.pack(">BI", 0xC6, size)


def settled_path(path: str | os.PathLike) -> Path:
    """The settled archive beside the log at `path`."""
    path = Path(path)
    return path.with_name(path.name + ".settled")


def payloads_dir(path: str | os.PathLike) -> Path:
    """The folder of the payload segments of the log at `path`."""
    path = Path(path)
    return path.with_name(path.name + ".payloads")


def log_paths(path: str | os.PathLike) -> list[Path]:
    """Everything a log at `path` is made of (log, settled archive, payload segments): what moves
    or goes together."""
    return [Path(path), settled_path(path), payloads_dir(path)]


def keep_as_previous(path: str | os.PathLike) -> Path:
    """Move the log at `path` (with its archive and segments) aside to `<path>.prev`, replacing
    an older one; returns the new path. A fresh log can then start at `path`."""
    previous = Path(path).with_name(Path(path).name + ".prev")
    if not Path(path).exists():  # nothing to keep: an older .prev stays whole
        return previous
    for kept, moved in zip(log_paths(path), log_paths(previous)):
        if moved.is_dir():
            shutil.rmtree(moved)
        else:
            moved.unlink(missing_ok=True)  # nothing of the older .prev may stay beside the new one
        if kept.exists():
            kept.replace(moved)
    return previous


def _segment_path(folder: Path, number: int) -> Path:
    return folder / f"{number:08d}.seg"


def _segment_numbers(folder: Path) -> dict[int, int]:
    """Segment number -> size of each segment in `folder`."""
    if not folder.is_dir():
        return {}
    return {int(f.stem): f.stat().st_size for f in folder.glob("*.seg") if f.stem.isdigit()}


def read_payload(folder: Path, blob: list, whole: bool = True) -> bytes | None:
    """The bytes a `blob` reference names, or None if they are missing, short or corrupt.
    `whole=False`: checked all the same (read in pieces), but only its first bytes are returned,
    up to the end of the packed group's header frame."""
    number, offset, length, crc = blob
    try:
        with open(_segment_path(folder, number), "rb") as f:
            f.seek(offset)
            if whole:
                data = f.read(length)
                return data if len(data) == length and zlib.crc32(data) == crc else None
            span = first_frame_span(f.read(8))
            f.seek(offset)
            head = f.read(min(length, span[1] if span else length))
            seen, running = len(head), zlib.crc32(head)
            while seen < length and (piece := f.read(min(_READ_PIECE, length - seen))):
                seen += len(piece)
                running = zlib.crc32(piece, running)
    except FileNotFoundError:
        return None
    return head if seen == length and running == crc else None


def iter_records(path: Path, payloads: bool = True) -> Iterator[tuple[dict, int]]:
    """Each intact record of the file and the offset just after it, read as a stream; stops at
    the first torn record (a crash mid-write), or raises `LogCorrupt` if an intact record follows
    the bad one. A `push` whose payload is in a segment comes with its bytes (`group`) read back;
    one whose payload is not intact counts as torn (with `fsync: interval` a record may outlive its
    payload in a machine crash, so this is cut, never refused). `payloads=False` (a reader that
    needs the groups' headers only, e.g. the audit): such a push comes with the payload's first
    bytes (`group_head`, its header frame included) instead, checked the same."""
    if not path.exists():
        return
    folder = payloads_dir(path)
    with open(path, "rb", buffering=1 << 20) as f:
        size = os.fstat(f.fileno()).st_size  # what a writer appends meanwhile is read next time
        offset = 0
        while offset < size:
            record, length = _next_record(f, offset, size)
            if record is None:
                _refuse_if_intact_after(f, path, offset, size)
                return
            if "blob" in record:
                key = "group" if payloads else "group_head"
                record[key] = read_payload(folder, record["blob"], whole=payloads) if _is_blob(record["blob"]) else None
                if record[key] is None:
                    log.warning("buffer log %s: the payload of the record at byte %d is missing or corrupt (%s)",
                                path, offset, record["blob"])
                    return
            offset += _HEAD.size + length
            yield record, offset


def _next_record(f, offset: int, size: int) -> tuple[dict | None, int]:
    """(the record at `offset`, where `f` is positioned, and its body's length), or (None, 0) if it
    is torn or bad. A length beyond the file's end is bad without reading it (a flipped bit must
    not make replay read gigabytes)."""
    head = f.read(_HEAD.size)
    if len(head) < _HEAD.size:
        return None, 0
    length, crc = _HEAD.unpack(head)
    if not 1 <= length <= size - offset - _HEAD.size:
        return None, 0
    body = f.read(length)
    if len(body) != length or zlib.crc32(body) != crc:
        return None, 0
    return _decode(body), length


def _decode(body: bytes) -> dict | None:
    """A record's map, or None for a body that is not one (zeros after a crash read as a record of
    length 0; a CRC can match bytes that are no record only if someone made them)."""
    try:
        record = msgpack.unpackb(body, raw=False)
    except (ValueError, TypeError, msgpack.UnpackException):  # what msgpack raises for bad input
        return None
    return record if isinstance(record, dict) and isinstance(record.get("op"), str) else None


def _is_blob(blob) -> bool:
    return (isinstance(blob, list) and len(blob) == 4
            and all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in blob))


def _refuse_if_intact_after(f, path: Path, bad: int, size: int) -> None:
    """Raise `LogCorrupt` if an intact record begins after the bad record at byte `bad`."""
    found = _first_intact_after(f, bad, size)
    if found is not None:
        raise LogCorrupt(f"buffer log {path}: the record at byte {bad} is corrupt, but an intact record follows at "
                         f"byte {found} (of {size}): this is damage in the middle of the log, not a torn tail from "
                         f"a crash, so the buffer does not start (cutting there would drop acknowledged records). "
                         f"Check the disk, then keep the log aside and start from the last checkpoint, or cut it "
                         f"at byte {bad} by hand if losing what follows is acceptable")


def _first_intact_after(f, start: int, size: int) -> int | None:
    """The offset of the first intact record beginning after byte `start`, or None. Candidates are
    found by their "op" key (a C-speed search), then checked whole: sane length, CRC, a map."""
    at = start + 1 + _HEAD.size + 1  # where the "op" key of a record beginning at start + 1 would be
    while at < size:
        f.seek(at)
        piece = f.read(min(_SCAN_PIECE, size - at))
        if len(piece) < len(_OP_KEY):
            return None
        hit = piece.find(_OP_KEY)
        while hit >= 0:
            if _intact_at(f, at + hit - _HEAD.size - 1, size):
                return at + hit - _HEAD.size - 1
            hit = piece.find(_OP_KEY, hit + 1)
        at += len(piece) - len(_OP_KEY) + 1  # overlap: a key split across two pieces is still found
    return None


def _intact_at(f, offset: int, size: int) -> bool:
    f.seek(offset)
    head = f.read(_HEAD.size + 1)
    if len(head) < _HEAD.size + 1 or not 0x81 <= head[-1] <= 0x8F:  # a fixmap of 1 to 15 keys
        return False
    length, crc = _HEAD.unpack(head[:_HEAD.size])
    if not 1 <= length <= size - offset - _HEAD.size:
        return False
    f.seek(offset + _HEAD.size)
    seen, running = 0, 0
    while seen < length and (piece := f.read(min(_READ_PIECE, length - seen))):  # a bogus length reads
        seen += len(piece)                                                        # at most the file once
        running = zlib.crc32(piece, running)
    if seen != length or running != crc:
        return False
    f.seek(offset + _HEAD.size)
    return _decode(f.read(length)) is not None


def _intact_length(path: Path) -> int:
    end = 0
    for _, end in iter_records(path):
        pass
    return end


def read_records(path: Path, payloads: bool = True) -> tuple[list[dict], int]:
    """All intact records and the byte length they span (anything after is a torn tail);
    `payloads` as for `iter_records`."""
    records, end = [], 0
    for record, end in iter_records(path, payloads):
        records.append(record)
    return records, end


def _write_all(fd: int, data: bytes, what: str) -> None:
    """A write to a temporary file (a failure abandons the file, nothing to cut)."""
    if os.write(fd, data) != len(data):  # regular files write fully unless the disk is full
        raise OSError(errno.ENOSPC, f"{what}: short write")


def _write_record(fd: int, record: dict, what: str) -> None:
    """A record written to a temporary file (compaction, restore) in one writev."""
    parts = _encode_parts(record)
    if os.writev(fd, parts) != _nbytes(parts):
        raise OSError(errno.ENOSPC, f"{what}: short write")


def _nbytes(parts: list) -> int:
    return sum(memoryview(p).nbytes for p in parts)


class DurableLog:
    def __init__(self, config: LogConfig):
        if config.path is None:
            raise ValueError("DurableLog needs log.path")
        self.config = config
        self.path = Path(config.path)
        self._fsyncs = 0
        self._background_fsyncs = 0  # counted by the background sync thread only
        self._background: threading.Thread | None = None  # the `interval` sync in flight
        self.failed: LogFailed | None = None  # poisoned: set once, never cleared (see the module doc)
        self._sync_turn = threading.Lock()  # fsyncs of the log's and segments' files, one at a time (`_fsync`)
        self.cut_writes = 0  # writes that failed and were cut back (a compaction copying the tail checks it)
        self.compactions = 0
        self.truncated_bytes = 0
        self.longest_compaction_lock_s = 0.0  # the longest the buffer's lock was held by a compaction
        self.compaction_windows: deque[tuple[float, float]] = deque(maxlen=256)  # (start, end), wall clock
        self._dirty = False  # written since the last fsync
        self._must_sync = False  # written a record that must be synced before the request is answered
        self._last_sync = time.monotonic()
        self._fd = -1
        self._end = 0  # the log's last good byte: where a failed write is cut back to
        self.base_bytes = 0  # disk_bytes at open or right after a compaction
        self.payloads = payloads_dir(self.path)
        self._segments: dict[int, int] = {}  # segment number -> bytes written
        self._segment = -1  # the segment payloads go to now (-1: none open yet)
        self._segment_fd = -1
        self._segment_dirty = False
        self._make_folder(self.path.parent)

    def replay(self) -> Iterator[dict]:
        """Yield the stored records (streamed), cutting off a torn tail, then open the log for
        appending. A compaction's leftover temporary file is removed. Raises `LogCorrupt` (before
        anything is cut) if intact records follow a bad one."""
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
        created = not self.path.exists()
        self._fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        self._end = os.fstat(self._fd).st_size
        if created:  # the new file's name must survive a machine crash with the records it gets
            self._sync_folder(self.path.parent)
        if self._segment_fd < 0:  # payloads never go after bytes an earlier process wrote
            self._segments = _segment_numbers(self.payloads)
            self._segment = max(self._segments, default=-1) + 1
        self.base_bytes = self.disk_bytes

    def _compact_path(self) -> Path:
        return self.path.with_name(self.path.name + ".compact")

    @property
    def size(self) -> int:
        """Bytes of the log file itself (records; payloads in segments not counted)."""
        return os.fstat(self._fd).st_size

    @property
    def disk_bytes(self) -> int:
        """The log and its payload segments."""
        return self.size + sum(self._segments.values())

    @property
    def current_segment(self) -> int:
        """The number of the segment payloads go to now (or next, if none is open)."""
        return self._segment

    def current_segment_handle(self) -> int:
        """A new descriptor of the open segment (-1 if none) for syncing it from another thread;
        the caller closes it."""
        return os.dup(self._segment_fd) if self._segment_fd >= 0 else -1

    # ---- failing stop ---------------------------------------------------------------------------

    def check(self) -> None:
        """Raise `LogFailed` if the log is poisoned."""
        if self.failed is not None:
            raise LogFailed(str(self.failed))

    def _poison(self, message: str) -> LogFailed:
        """Poison the log for good (the first cause is kept); the error to raise."""
        if self.failed is None:
            self.failed = LogFailed(f"{message}; the log is poisoned: nothing more is written or synced, and the "
                                    f"buffer must stop and be restarted from it")
            log.critical("%s", self.failed)
        return LogFailed(str(self.failed))

    def _fsync(self, fd: int, what: str, shared: bool = True) -> None:
        """fsync, poisoning the log if it fails: never retried, since a second fsync may report
        success for pages the kernel dropped after the first failed. `shared`: a descriptor of the
        log or a segment (or a dup of one, from another thread): such fsyncs take turns, and none
        runs once one has failed, since the kernel reports a writeback error once per open file,
        so a later fsync through the same file succeeds (found by tests/faults/test_disk_faults.py:
        a compaction's failed fsync of the segment, then the request's own fsync "succeeded" and
        the push was answered, its payload dropped). A temporary file's fd is not shared."""
        with self._sync_turn if shared else contextlib.nullcontext():
            self.check()
            try:
                os.fsync(fd)
            except OSError as exc:
                raise self._poison(f"buffer log {self.path}: fsync of {what} failed ({_describe(exc)})") from exc

    def _sync_folder(self, folder: Path) -> None:
        """Make the names in `folder` durable (a file created or renamed in it)."""
        try:
            fd = os.open(folder, os.O_RDONLY)
        except OSError as exc:
            raise self._poison(f"buffer log {self.path}: cannot open folder {folder} to sync it ({_describe(exc)})") \
                from exc
        try:
            self._fsync(fd, f"folder {folder}")
        finally:
            os.close(fd)

    def _make_folder(self, folder: Path) -> None:
        """Create `folder` and any missing parents, each new one's name synced in its parent."""
        missing = [f for f in (folder, *folder.parents) if not f.exists()]
        for new in reversed(missing):
            new.mkdir(exist_ok=True)
            self._sync_folder(new.parent)

    def _write_or_cut(self, fd: int, parts: list, end: int, what: str) -> int:
        """Write `parts` in one writev at the end of a file whose last good byte is `end`; the
        bytes written. A write that fails or comes up short (a full disk) is cut back to `end`, so
        half a record is never followed by later ones, and LogFailed is raised; if the cut fails
        too, the log is poisoned."""
        self.check()
        size = _nbytes(parts)
        try:
            written = os.writev(fd, parts)
            error = None if written == size else OSError(errno.ENOSPC, f"short write, {written} of {size} bytes")
        except OSError as exc:
            error = exc
        if error is None:
            return size
        try:
            os.ftruncate(fd, end)
        except OSError as exc:
            raise self._poison(f"{what}: a write failed ({_describe(error)}) and cutting the file back to byte {end} "
                               f"failed too ({_describe(exc)})") from error
        self.cut_writes += 1
        raise LogFailed(f"{what}: a write failed ({_describe(error)}); the file was cut back to byte {end}, so no "
                        f"part of the record is kept") from error

    # ---- appending --------------------------------------------------------------------------

    def append(self, record: dict, durable: bool = True) -> list | None:
        """Write one record; `commit` syncs it. `durable=False`: a record whose loss in a machine
        crash the buffer survives (a permit grant: a forgotten permit's push is refused as
        unknown and its ticket issued again, so nothing is lost or trained twice); it is synced
        with the next record that must be, or by the interval. A `group` payload of at least
        _INLINE_BYTES goes to the current segment; the return value is then its `blob` reference.
        Raises LogFailed if the record could not be written (nothing of it is kept)."""
        self.check()
        try:
            record, blob = self._payload_to_segment(record)
            self._end += self._write_or_cut(self._fd, _encode_parts(record), self._end, f"buffer log {self.path}")
        except LogFailed:
            raise
        except OSError as exc:  # a segment that cannot be created (no inode, no descriptor left)
            raise LogFailed(f"buffer log {self.path}: {_describe(exc)}") from exc
        self._dirty = True
        self._must_sync = self._must_sync or durable
        return blob

    def _payload_to_segment(self, record: dict) -> tuple[dict, list | None]:
        """(the record as the log keeps it, its `blob`): a large `group` payload is written to the
        current segment and the record names it instead."""
        if memoryview(record.get("group", b"")).nbytes < _INLINE_BYTES:
            return record, None
        blob = self._write_payload(record["group"])
        return {**{k: v for k, v in record.items() if k != "group"}, "blob": blob}, blob

    def _write_payload(self, payload) -> list:
        if self._segment_fd < 0 or self._segments[self._segment] >= self.config.segment_bytes:
            self._next_segment()
        offset = self._segments[self._segment]
        size = self._write_or_cut(self._segment_fd, [payload], offset,
                                  f"payload segment {_segment_path(self.payloads, self._segment)}")
        self._segments[self._segment] = offset + size  # only once written: a cut write leaves it right
        self._segment_dirty = True
        return [self._segment, offset, size, zlib.crc32(payload)]

    def _next_segment(self) -> None:
        """Close the full segment (synced: records naming it may be synced without it later) and
        start the next, its name made durable before any record can name it."""
        if self._segment_fd >= 0:
            # even if not dirty: a background sync of it may not be done
            self._fsync(self._segment_fd, f"payload segment {self._segment}")
            self._segment_dirty = False
            os.close(self._segment_fd)
            self._segment_fd = -1
            self._segment += 1
        if not self.payloads.is_dir():
            self._make_folder(self.payloads)
        self._segment_fd = os.open(_segment_path(self.payloads, self._segment),
                                   os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        self._segments[self._segment] = os.fstat(self._segment_fd).st_size
        self._sync_folder(self.payloads)

    def _sync_segment(self) -> None:
        if self._segment_dirty:
            self._fsync(self._segment_fd, f"payload segment {self._segment}")
            self._segment_dirty = False

    def drop_segments(self, below: int, keep: set[int]) -> list[Path]:
        """Forget the segments numbered below `below` that are not in `keep` (no record of the log
        names them any more); the caller deletes the returned files."""
        doomed = [n for n in self._segments if n < below and n not in keep]
        for n in doomed:
            del self._segments[n]
        self.base_bytes = self.disk_bytes
        return [_segment_path(self.payloads, n) for n in doomed]

    # ---- syncing ----------------------------------------------------------------------------

    def commit(self) -> None:
        """The end of a request: its records are made durable as the fsync policy says. Raises
        LogFailed if they could not be (the request must not be answered as a success)."""
        if self.config.fsync == "always":
            if self._must_sync:
                self.sync()
            else:
                self.check()
        else:
            self.sync_if_due()

    @property
    def fsyncs(self) -> int:
        return self._fsyncs + self._background_fsyncs

    def sync_if_due(self) -> None:
        """`interval`: once due, the fsyncs run in a thread of their own, so the caller (the
        request loop, under the buffer's lock) never waits for the disk. Safe with appends going
        on meanwhile: the segment is synced before the log, so a record the log's sync may catch
        that names a payload the segment's sync missed was written after the sync began: a crash
        cuts the log there, losing only records of the interval `interval` may lose. (`always`:
        what is due here is records no answer waits for, synced at once as before.) A background
        fsync that failed poisoned the log: this raises."""
        self.check()
        if not self._dirty or (time.monotonic() - self._last_sync) * 1000 < self.config.fsync_interval_ms:
            return
        if self.config.fsync == "always":
            self.sync()
            return
        if self._background is not None and self._background.is_alive():
            return  # one at a time: the next is due once this one is done
        try:
            segment_fd = self.current_segment_handle() if self._segment_dirty else -1
            log_fd = os.dup(self._fd)
        except OSError as exc:  # no descriptor left: the interval's records cannot be synced
            raise LogFailed(f"buffer log {self.path}: cannot start a background sync ({_describe(exc)})") from exc
        self._dirty = self._segment_dirty = self._must_sync = False
        self._last_sync = time.monotonic()
        self._background = threading.Thread(target=self._sync_handles, args=(segment_fd, log_fd),
                                            name="buffer-log-sync", daemon=True)
        self._background.start()

    def _sync_handles(self, segment_fd: int, log_fd: int) -> None:
        try:
            if segment_fd >= 0:
                # first: a synced record must not name bytes a crash can lose
                self._fsync(segment_fd, "payload segment (background sync)")
            self._fsync(log_fd, "the log (background sync)")
            self._background_fsyncs += 1
        except LogFailed:  # the log is poisoned: the next append, commit or tick raises, and the buffer stops
            pass
        finally:
            for fd in (segment_fd, log_fd):
                if fd >= 0:
                    os.close(fd)

    def sync(self) -> None:
        self.check()
        if self._dirty:
            self._sync_segment()  # first: a synced record must not name bytes a crash can lose
            self._fsync(self._fd, "the log")
            self._fsyncs += 1
            self._dirty = False
        self._must_sync = False
        self._last_sync = time.monotonic()

    # ---- archive, rewrite, close ------------------------------------------------------------

    def archive(self, settled: list[dict]) -> None:
        """Append the settled records (acks and drops compacted away) to the archive, synced; a
        failed write is cut back, as in the log."""
        if not settled:
            return
        self.check()
        path = settled_path(self.path)
        created = not path.exists()
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        try:
            if created:
                self._sync_folder(self.path.parent)
            self._write_or_cut(fd, [b"".join(_encode(r) for r in settled)], os.fstat(fd).st_size,
                               f"settled archive {path}")
            self._fsync(fd, f"settled archive {path}")
        finally:
            os.close(fd)

    def rewrite(self, records: Iterable[dict]) -> list[list | None]:
        """Replace the log with `records` at once (a restore into a fresh buffer; compaction goes
        through `Compaction`); large payloads go to segments. Returns each record's `blob` (None
        where its payload is inline or it has none)."""
        self.check()
        tmp = self._compact_path()
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        blobs = []
        try:
            for record in records:
                record, blob = self._payload_to_segment(record)
                blobs.append(blob)
                _write_record(fd, record, f"buffer log {tmp}")
            self._sync_segment()
            self._fsync(fd, f"restored log {tmp}", shared=False)
        except BaseException:
            tmp.unlink(missing_ok=True)  # on a full disk, give its room back
            raise
        finally:
            os.close(fd)
        self._swap_in(tmp)
        return blobs

    def _swap_in(self, tmp: Path, sync_dir: bool = True) -> None:
        os.replace(tmp, self.path)
        if sync_dir:
            self._sync_folder(self.path.parent)
        os.close(self._fd)
        self._open()
        self._dirty = self._must_sync = False
        self.compactions += 1

    def close(self, sync: bool = True) -> None:
        """Sync and close; `sync=False` (or a poisoned log): close only, as a crash would."""
        if self._background is not None:
            self._background.join()
        try:
            if self._fd >= 0 and sync and self.failed is None:
                self.sync()
        finally:
            for name in ("_fd", "_segment_fd"):
                if getattr(self, name) >= 0:
                    os.close(getattr(self, name))
                    setattr(self, name, -1)


def _describe(exc: OSError) -> str:
    """An OSError as `[Errno 28] No space left on device`, or its message."""
    return f"[Errno {exc.errno}] {exc.strerror}" if exc.errno and exc.strerror else str(exc)


class Compaction:
    """One compaction of `log` off the request path. `start` is called under the buffer's lock
    with the snapshot records and the settled records to archive; `run` (a background thread)
    writes them and copies the log's tail written meanwhile; `finish(lock)` takes the buffer's
    lock for the last bit of tail and the swap. It gives up (the log stays as it was) if a write
    to the log failed and was cut back meanwhile: the tail it copied may hold the cut bytes."""

    def __init__(self, log: DurableLog, snapshot: list[dict], settled: list[dict]):
        self.log = log
        self.snapshot = snapshot
        self.settled = settled
        self.offset = log.size  # the log's end at the snapshot: the tail starts here
        self.cut_writes = log.cut_writes
        self.tmp = log._compact_path()
        # Segments the new log can name: the snapshot's groups' and those from now on (the tail's).
        self.keep_segments = {r["blob"][0] for r in snapshot if "blob" in r}
        self.first_new_segment = log.current_segment
        # The snapshot may name payloads in the current segment not yet synced (`interval`): they
        # are synced before the new log is, through this handle (full segments were synced).
        self.segment_fd = log.current_segment_handle()

    def run(self, lock) -> None:
        began = time.time()
        try:
            self._run(lock)
        finally:
            self.log.compaction_windows.append((began, time.time()))
            if self.segment_fd >= 0:
                os.close(self.segment_fd)

    def _run(self, lock) -> None:
        log_ = self.log
        log_.archive(self.settled)
        fd = os.open(self.tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        swapped = False
        try:
            for record in self.snapshot:
                _write_record(fd, record, f"buffer log {self.tmp}")
            self.snapshot = []
            with open(log_.path, "rb") as src:
                self._copy_tail(src, fd, until=None)  # most of the tail, without the lock
                if self.segment_fd >= 0:
                    log_._fsync(self.segment_fd, "payload segment (compaction)")
                log_._fsync(fd, f"compacted log {self.tmp}", shared=False)
                started = time.monotonic()
                # With fsync "always" an answered request must survive a machine crash, so the
                # rename is made durable before anything is appended to the new log; with
                # "interval" that may wait until after the lock (a crash may lose the interval).
                always = log_.config.fsync == "always"
                with lock:  # nothing is appended now: copy the rest and swap
                    log_.check()
                    if log_.cut_writes != self.cut_writes:
                        raise LogFailed(f"buffer log {log_.path}: a write was cut back during the compaction; "
                                        f"the copied tail may hold its bytes, so the log is kept as it is")
                    self._copy_tail(src, fd, until=log_.size)
                    log_._fsync(fd, f"compacted log {self.tmp}", shared=False)
                    os.close(fd)
                    fd = -1
                    log_._swap_in(self.tmp, sync_dir=always)
                    swapped = True
                    log_.longest_compaction_lock_s = max(log_.longest_compaction_lock_s, time.monotonic() - started)
                if not always:
                    log_._sync_folder(log_.path.parent)
                with lock:  # the new log is durable: no record that can be replayed names these
                    doomed = log_.drop_segments(self.first_new_segment, self.keep_segments)
                for segment in doomed:
                    segment.unlink(missing_ok=True)
        finally:
            if fd >= 0:
                os.close(fd)
            if not swapped:
                self.tmp.unlink(missing_ok=True)  # on a full disk, give its room back

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
