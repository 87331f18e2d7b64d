"""User code in a child process: the isolation rewards and environments share.

The child is a fresh interpreter (`python -m MODULE ARGS...`), not a fork (unsafe in threaded
Ray/vLLM processes) nor a multiprocessing spawn (which re-imports the caller's main script).
Requests go to its stdin (pickled: the parent trusts what it sends itself) and replies come back
on a private copy of its stdout (the user code's prints go to stderr), one request at a time.
The child runs user code, so nothing it says is trusted:
  - replies are msgpack, plain data only (no ext types), at most MAX_REPLY_BYTES; the parent never
    unpickles a byte the child sends (unpickling runs code). Anything else is `BadChildReply`.
  - it starts with a scrubbed environment (`child_environment`: an allow-list, so the CURVE keys,
    tokens and cloud credentials of the worker's environment never reach it), and the variables
    the user names for it (`rollout.reward_env`, `multi_turn.environment_env`: a judge's key).
  - it may run under limits (`ChildLimits`): CPU seconds per request (RLIMIT_CPU: SIGXCPU ends
    the child) and address space (RLIMIT_AS: allocations past it fail with MemoryError), set by
    the child itself before it imports the user's module.
A child that hangs is killed by its parent (`kill`) and started afresh on the next request.
"""
from __future__ import annotations

import json
import math
import numbers
import os
import resource
import signal
import subprocess
import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import msgpack

MAX_REPLY_BYTES = 16 * 2**20  # an environment's observation is at most 1M characters (4 MB of UTF-8)
# What a child may see of its parent's environment: what Python, locales and thread pools need.
ENV_ALLOWED = ("PATH", "HOME", "LANG", "LANGUAGE", "TZ", "TMPDIR", "OMP_NUM_THREADS", "MKL_NUM_THREADS",
               "OPENBLAS_NUM_THREADS", "TOKENIZERS_PARALLELISM")
ENV_ALLOWED_PREFIXES = ("LC_",)
_LIMITS_ENV = "ETARL_CHILD_LIMITS"  # how the parent hands the limits to the child (removed there)


def is_finite_number(value: Any) -> bool:
    """Whether a value user code returned (a reward, an environment's) is a real, finite number."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value)


class ChildStartFailed(RuntimeError):
    """The child did not say "ready" within its start timeout (it is killed), or exited first."""


class BadChildReply(OSError):
    """The child sent something that is not a plain-data msgpack message (refused). An
    OSError, so a caller that treats a broken pipe as a dead child does the same here."""


@dataclass(frozen=True)
class ChildLimits:
    """Resource limits a child sets on itself. cpu_s: CPU seconds per request (all its threads;
    RLIMIT_CPU counts whole seconds, so a request gets between cpu_s and cpu_s + 1); memory_mb:
    address space of the process (the interpreter and the user's imports included). None: no limit."""

    cpu_s: float | None = None
    memory_mb: int | None = None


def child_environment(passed: tuple[str, ...] = ()) -> dict[str, str]:
    """The environment a child starts with: the allow-listed names of this process's environment
    and the `passed` ones (those set here), PYTHONPATH = this process's sys.path (so the child
    imports what the parent can: the user's module, the job's py_modules), one thread per pool
    unless set."""
    env = {k: v for k, v in os.environ.items()
           if k in ENV_ALLOWED or k.startswith(ENV_ALLOWED_PREFIXES) or k in passed}
    env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
    for name in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
        env.setdefault(name, "1")  # one request at a time: a thread pool per core buys nothing
    return env


def _refuse_ext(code: int, data: bytes):
    raise ValueError(f"msgpack extension type {code} (only plain data is accepted)")


def decode_reply(data: bytes) -> Any:
    """A child's reply as plain data (dicts, lists, str, bytes, numbers, bool, None); BadChildReply
    if it is not exactly one msgpack message of those."""
    try:
        return msgpack.unpackb(data, raw=False, strict_map_key=False, ext_hook=_refuse_ext,
                               timestamp=2)  # msgpack's one built-in ext (a timestamp) as plain int nanoseconds
    except (ValueError, TypeError, msgpack.UnpackException) as err:  # ExtraData, FormatError, StackError,
        # the ext refusal; TypeError: an unhashable map key
        raise BadChildReply(f"not plain data (one msgpack message); refused: {type(err).__name__}: "
                            f"{str(err)[:120]}") from None


class _Replies:
    """The parent's end of the reply pipe: poll, recv (decoded msgpack) and fileno (so
    `multiprocessing.connection.wait` takes it, as the environment pool does)."""

    def __init__(self, fd: int) -> None:
        from multiprocessing.connection import Connection

        self._conn = Connection(fd, writable=False)

    def fileno(self) -> int:
        return self._conn.fileno()

    def poll(self, timeout: float) -> bool:
        return self._conn.poll(timeout)

    def recv(self) -> Any:
        """The next reply; EOFError if the child died, BadChildReply if it is not plain data or
        longer than MAX_REPLY_BYTES."""
        try:
            data = self._conn.recv_bytes(MAX_REPLY_BYTES)
        except OSError as err:
            if "bad message length" in str(err):  # the length prefix says more than we accept
                raise BadChildReply(f"longer than {MAX_REPLY_BYTES} bytes; refused unread") from None
            raise
        return decode_reply(data)

    def close(self) -> None:
        self._conn.close()


class ChildProcess:
    """One `python -m module args...` child that answers requests over pipes."""

    def __init__(self, module: str, args: list[str], start_timeout_s: float = 60.0,
                 limits: ChildLimits | None = None, env_names: tuple[str, ...] = ()) -> None:
        self.module = module
        self.args = list(args)
        self.start_timeout_s = start_timeout_s
        self.limits = limits or ChildLimits()
        self.env_names = tuple(env_names)  # the worker's variables it sees besides the allow-list
        self.units = 1  # the last request's share of CPU seconds (serve's `units`): what a SIGXCPU was over
        self._proc: subprocess.Popen | None = None
        self._send = self.connection = None

    @property
    def alive(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def launch(self) -> None:
        """Start the interpreter without waiting for it (`wait_ready` waits): several children
        start at once this way."""
        from multiprocessing.connection import Connection

        env = child_environment(self.env_names)
        env[_LIMITS_ENV] = json.dumps(asdict(self.limits))
        self._proc = subprocess.Popen([sys.executable, "-m", self.module, *self.args],
                                      stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env)
        self._send = Connection(os.dup(self._proc.stdin.fileno()), readable=False)
        self.connection = _Replies(os.dup(self._proc.stdout.fileno()))
        self._proc.stdin.close()
        self._proc.stdout.close()

    def wait_ready(self) -> None:
        """Wait (start_timeout_s: starting Python is slow on a loaded machine) for the child's
        "ready"; ChildStartFailed (the child is killed) if it does not come."""
        try:
            ready = self.connection.poll(self.start_timeout_s) and self.connection.recv() == ["ready", None]
        except (EOFError, OSError):
            ready = False
        if not ready:
            why = self.exit_reason() or f"did not start in {self.start_timeout_s}s"
            self.kill()
            raise ChildStartFailed(f"{self.module} {' '.join(self.args)[:80]} {why}")

    def ensure_started(self) -> None:
        if not self.alive:
            self.kill()
            self.launch()
            self.wait_ready()

    def send(self, message: Any, units: int = 1) -> None:
        """A request; `units`: its CPU budget in limits.cpu_s, as the child's `serve(units=)` counts it."""
        self.units = units
        self._send.send(message)

    def reply(self, timeout_s: float) -> Any:
        """The next reply; TimeoutError if none comes within timeout_s, EOFError if the child died,
        BadChildReply if it is not plain data."""
        if not self.connection.poll(timeout_s):
            raise TimeoutError(f"no reply within {timeout_s}s")
        return self.connection.recv()

    def exit_reason(self, wait_s: float = 1.0) -> str:
        """Why the child ended ("exited with code 3", "was killed by SIGXCPU (over its limit of 2
        CPU seconds)"), "" if it still runs after wait_s (its pipe may close just before it exits)."""
        if self._proc is None:
            return ""
        try:
            code = self._proc.wait(timeout=wait_s)
        except subprocess.TimeoutExpired:
            return ""
        if code >= 0:
            return f"exited with code {code}"
        try:
            name = signal.Signals(-code).name
        except ValueError:  # a signal number Python has no name for
            name = f"signal {-code}"
        if -code == signal.SIGXCPU:
            return f"was killed by {name} (over its limit of {self.limits.cpu_s * self.units:g} CPU seconds)"
        return f"was killed by {name}"

    def kill(self) -> None:
        if self._proc is not None:
            self._proc.kill()
            self._proc.wait(timeout=5)
        for conn in (self._send, self.connection):
            if conn is not None:
                conn.close()
        self._proc = self._send = self.connection = None


def _apply_limits() -> ChildLimits:
    """The child's side of ChildLimits: no core files (a CPU kill would write one), the address
    space capped. Returns the limits (RLIMIT_CPU is set per request, by `_cpu_budget`)."""
    limits = ChildLimits(**json.loads(os.environ.pop(_LIMITS_ENV, "{}")))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    if limits.memory_mb:
        size = limits.memory_mb * 2**20
        resource.setrlimit(resource.RLIMIT_AS, (size, size))
    return limits


def _cpu_budget(cpu_s: float) -> None:
    """Allow cpu_s more CPU seconds from now. RLIMIT_CPU counts the process's whole life, so the
    soft limit moves up before each request; the hard limit stays (an unprivileged process cannot
    raise it again), so this bounds runaway code, not code that raises its own soft limit."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    soft = math.ceil(usage.ru_utime + usage.ru_stime + cpu_s)
    _, hard = resource.getrlimit(resource.RLIMIT_CPU)
    resource.setrlimit(resource.RLIMIT_CPU, (soft if hard == resource.RLIM_INFINITY else min(soft, hard), hard))


def _pack(reply: Any) -> bytes:
    """A reply as msgpack; a reply that is not plain data becomes ("bad", why), so the user code's
    mistake fails its request, not the child."""
    try:
        return msgpack.packb(reply, use_bin_type=True)
    except (TypeError, ValueError, OverflowError) as err:
        return msgpack.packb(["bad", f"replied with something that is not plain data (msgpack): {err}"[:300]])


def serve(make_handler: Callable[[], Callable[[Any], Any]], units: Callable[[Any], int] | None = None) -> None:
    """The child's side: set the limits, build the handler (an import error ends the child before
    "ready"), then answer each request with `handler(request)` until the parent closes the pipe.
    A request may take `units(request)` times the CPU seconds of one (a batch of responses)."""
    from multiprocessing.connection import Connection

    limits = _apply_limits()
    replies = Connection(os.dup(1), readable=False)
    os.dup2(2, 1)
    requests = Connection(os.dup(0), writable=False)
    handler = make_handler()
    replies.send_bytes(_pack(["ready", None]))
    while True:
        try:
            message = requests.recv()
        except EOFError:
            return
        if limits.cpu_s:
            _cpu_budget(limits.cpu_s * (units(message) if units else 1))
        replies.send_bytes(_pack(handler(message)))
