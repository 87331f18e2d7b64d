"""Publication off the learner's critical path.

`Learner.publish_weights` hands the new version to a `Publication` and returns at once; the
publication thread sends it through the channel while the learner starts its next step. The
parameters must not change under the send: the send holds a read lease on the `ParameterGuard`,
which the optimizer step takes for writing, so only an optimizer step that comes before the send
has finished waits (its wait is the learner's blocked time, reported per step). With `snapshot`
the send first copies the weights (in the publish dtype) and frees the parameters at once, at the
cost of one model copy in memory.

A restarted or late engine that asks for the live version while nothing new is being published
gets a catch-up send of it: from the snapshot, or from the parameters if no optimizer step has
touched them since (else it gets the next version).
"""
from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections import deque
from collections.abc import Callable

import torch

from lm.weight_sync.group import call
from lm.weight_sync.layout import copy_into

log = logging.getLogger(__name__)


class ParameterGuard:
    """Readers (sends) and one writer (the optimizer step) of the learner's parameters."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._readers = 0
        self._writing = False
        self.writes = 0  # optimizer steps so far: a version's parameters are unchanged while it holds
        self._blocked_s = 0.0

    @contextlib.contextmanager
    def writing(self):
        """Around the optimizer step: waits for the sends that read the parameters."""
        with self._cond:
            if self._readers:
                start = time.perf_counter()
                self._cond.wait_for(lambda: self._readers == 0)
                self._blocked_s += time.perf_counter() - start
            self._writing = True
        try:
            yield
        finally:
            with self._cond:
                self._writing, self.writes = False, self.writes + 1
                self._cond.notify_all()

    def read(self, writes: int | None = None) -> Callable[[], None] | None:
        """A read lease (call the returned function to release it, once or more); None if
        `writes` is given and an optimizer step has happened since."""
        with self._cond:
            self._cond.wait_for(lambda: not self._writing)
            if writes is not None and writes != self.writes:
                return None
            self._readers += 1
        released = []

        def release() -> None:
            with self._cond:
                if not released:
                    released.append(True)
                    self._readers -= 1
                    self._cond.notify_all()

        return release

    @property
    def readers(self) -> int:
        """Read leases held now (sends or copies reading the parameters)."""
        with self._cond:
            return self._readers

    def take_blocked_s(self) -> float:
        """Seconds optimizer steps waited for sends since the last call."""
        with self._cond:
            blocked, self._blocked_s = self._blocked_s, 0.0
            return blocked


class _Job:
    def __init__(self, version: int, tensors: dict, release, writes: int, owned: bool):
        self.version, self.tensors, self.release, self.writes, self.owned = version, tensors, release, writes, owned
        self.published_at = time.perf_counter()
        self.copy_s = 0.0
        self.snapshot = False  # its tensors are one of the two snapshot buffers


class Publication:
    """The publication threads of the learner's rank 0 around one channel's sender: a sender
    thread, and with `snapshot` a copier thread ahead of it, so a version handed over while the
    last one is still being sent is copied (and the parameters freed) at once. A version not yet
    sent when a newer one is ready is skipped: engines get the newest. Snapshots live in two
    buffers, reused: the live one (being sent, or the last sent: catch-ups read it) and the other
    (being copied, or waiting for the sender)."""

    def __init__(self, sender, guard: ParameterGuard, named_tensors: Callable[[], dict],
                 snapshot: bool = False, dtype: torch.dtype | None = None, catch_ups: bool = True):
        self.sender, self.guard, self.named_tensors = sender, guard, named_tensors
        self.snapshot, self.dtype = snapshot, dtype
        self.catch_ups = catch_ups  # off where the weights exist only while a send gathers them
        self._sending = threading.Lock()  # one send at a time on the channel: the thread's or send_now's
        self._cond = threading.Condition()
        self._to_copy: _Job | None = None  # handed over, to be copied (snapshot)
        self._to_send: _Job | None = None  # the next version to send
        self._live: _Job | None = None  # the version being sent or last sent (its tensors only if owned)
        self._spare: dict | None = None  # the snapshot buffer that is neither live nor waiting
        self._closed = False
        self.last: dict = {}  # timings of the last finished send
        self.recent: deque[dict] = deque(maxlen=64)  # and of the ones before
        self.failures = 0
        self._threads = [threading.Thread(target=self._send_loop, name="weight-send", daemon=True)]
        if snapshot:
            self._threads.append(threading.Thread(target=self._copy_loop, name="weight-copy", daemon=True))
        for thread in self._threads:
            thread.start()

    def publish(self, version: int, tensors: dict | None = None) -> None:
        """Hand over `version` (the current parameters, or `tensors` the caller owns, e.g.
        gathered from FSDP shards) and return."""
        owned = tensors is not None
        release = (lambda: None) if owned else self.guard.read()
        job = _Job(version, tensors if owned else self.named_tensors(), release, self.guard.writes, owned)
        with self._cond:
            if self.snapshot and not owned:
                if self._to_copy is not None:
                    self._to_copy.release()  # superseded before it was copied
                self._to_copy = job
            else:
                self._supersede_waiting()
                self._to_send = job
            self._cond.notify_all()

    def _supersede_waiting(self) -> None:
        """(Under the lock.) Drop the version waiting for the sender: a newer one replaces it. Its
        snapshot buffer becomes the spare."""
        waiting, self._to_send = self._to_send, None
        if waiting is not None and waiting.snapshot:
            self._spare = waiting.tensors
        elif waiting is not None:
            waiting.release()

    def _copy_loop(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._to_copy is not None or self._closed)
                if self._closed:
                    return
                job, self._to_copy = self._to_copy, None
                self._supersede_waiting()
                buffer, self._spare = self._spare, None
            start = time.perf_counter()
            try:
                job.tensors = copy_into(buffer, job.tensors, self.dtype)
                job.owned, job.snapshot, job.copy_s = True, True, time.perf_counter() - start
            except Exception:
                self.failures += 1
                log.exception("copying weights v%d for publication failed; the next version goes out", job.version)
                with self._cond:
                    self._spare = buffer
                continue
            finally:
                job.release()
            with self._cond:
                self._supersede_waiting()
                self._to_send = job
                self._cond.notify_all()

    def _send_loop(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._to_send is not None or self._closed,
                                    timeout=self.sender.catch_up_poll_s)
                if self._closed:
                    return
                job, self._to_send = self._to_send, None
                if job is not None:
                    self._make_live(job)
            try:
                if job is not None:
                    self._send(job, catch_up=False)
                elif self.sender.catch_up_poll_s is not None and self.catch_ups:
                    self._catch_up()
            except Exception:
                self.failures += 1
                log.exception("weight publication failed (the run goes on; engines that missed a version get "
                              "the next one)")

    def _make_live(self, job: _Job) -> None:
        """(Under the lock.) `job` is the live version from now on, even if its send fails (the
        engines that miss it catch up to it); the old live snapshot buffer becomes the spare."""
        old, self._live = self._live, job
        if old is not None and old.snapshot:
            self._spare = old.tensors

    def _send(self, job: _Job, catch_up: bool) -> None:
        try:
            with self._sending:
                if catch_up:
                    self.sender.send(job.version, job.tensors, job.release, catch_up=True)
                else:
                    stats = self.sender.send(job.version, job.tensors, job.release)
                    self._record(stats, job.version, job.published_at, job.copy_s)
        finally:
            job.release()
            if not job.owned:
                job.tensors = None  # views of the parameters: a catch-up reads them afresh

    def _record(self, stats: dict, version: int, published_at: float, copy_s: float = 0.0) -> None:
        with self._cond:
            self.last = {**stats, "copy_s": copy_s, "sync_s": time.perf_counter() - published_at, "version": version}
            self.recent.append(self.last)
            self._cond.notify_all()

    def wait_sent(self, version: int, timeout: float = 60.0) -> dict:
        """The timings of the send of `version` (or a newer one) once it has finished: the board
        shows a version live as the send ends, a moment before its timings are recorded here."""
        with self._cond:
            if not self._cond.wait_for(lambda: self.last.get("version", -1) >= version, timeout=timeout):
                raise TimeoutError(f"weights v{version} not sent within {timeout:.0f}s (last: {self.last})")
            return self.last

    def send_now(self, version: int, tensors, layout) -> dict:
        """Send `version` in the caller's thread and return when it is served: for weights that
        exist only while the send reads them (an FSDP learner's buckets, gathered as the send asks:
        `layout.BucketStream`). Its timings are the last send's."""
        started = time.perf_counter()
        with self._cond:
            self._supersede_waiting()  # an older version still waiting would go out after this one
        with self._sending:
            stats = self.sender.send(version, tensors, lambda: None, layout=layout)
            self._record(stats, version, started)
        return self.last

    def _catch_up(self) -> None:
        live = self._live
        if live is None or not call(self.sender.board, "behind", live.version):
            return
        if live.owned:
            self._send(_Job(live.version, live.tensors, lambda: None, live.writes, True), catch_up=True)
            return
        release = self.guard.read(writes=live.writes)
        if release is None:
            return  # the parameters have moved on: the engine gets the next version
        self._send(_Job(live.version, self.named_tensors(), release, live.writes, False), catch_up=True)

    def close(self, timeout: float = 30.0) -> None:
        with self._cond:
            self._closed = True
            for job in (self._to_copy, self._to_send):
                if job is not None:
                    job.release()
            self._to_copy = self._to_send = None
            self._cond.notify_all()
        for thread in self._threads:
            thread.join(timeout)
        self.sender.close()
