"""User code in a child process: the isolation rewards and environments share.

The child is a fresh interpreter (`python -m MODULE ARGS...`), not a fork (unsafe in threaded
Ray/vLLM processes) nor a multiprocessing spawn (which re-imports the caller's main script).
Requests go to its stdin and replies come back on a private copy of its stdout (the user code's
prints go to stderr), as pickled messages, one request at a time. A child that hangs is killed
by its parent (`kill`) and started afresh on the next request.
"""
from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable
from typing import Any


class ChildStartFailed(RuntimeError):
    """The child did not say "ready" within its start timeout (it is killed)."""


class ChildProcess:
    """One `python -m module args...` child that answers requests over pipes."""

    def __init__(self, module: str, args: list[str], start_timeout_s: float = 60.0) -> None:
        self.module = module
        self.args = list(args)
        self.start_timeout_s = start_timeout_s
        self._proc: subprocess.Popen | None = None
        self._send = self.connection = None

    @property
    def alive(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def launch(self) -> None:
        """Start the interpreter without waiting for it (`wait_ready` waits): several children
        start at once this way."""
        from multiprocessing.connection import Connection

        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
        self._proc = subprocess.Popen([sys.executable, "-m", self.module, *self.args],
                                      stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env)
        self._send = Connection(os.dup(self._proc.stdin.fileno()), readable=False)
        self.connection = Connection(os.dup(self._proc.stdout.fileno()), writable=False)
        self._proc.stdin.close()
        self._proc.stdout.close()

    def wait_ready(self) -> None:
        """Wait (start_timeout_s: starting Python is slow on a loaded machine) for the child's
        "ready"; ChildStartFailed (the child is killed) if it does not come."""
        try:
            ready = self.connection.poll(self.start_timeout_s) and self.connection.recv()[0] == "ready"
        except (EOFError, OSError):
            ready = False
        if not ready:
            self.kill()
            raise ChildStartFailed(f"{self.module} {' '.join(self.args)[:80]} did not start in {self.start_timeout_s}s")

    def ensure_started(self) -> None:
        if not self.alive:
            self.kill()
            self.launch()
            self.wait_ready()

    def send(self, message: Any) -> None:
        self._send.send(message)

    def reply(self, timeout_s: float) -> Any:
        """The next reply; TimeoutError if none comes within timeout_s, EOFError if the child died."""
        if not self.connection.poll(timeout_s):
            raise TimeoutError(f"no reply within {timeout_s}s")
        return self.connection.recv()

    def kill(self) -> None:
        if self._proc is not None:
            self._proc.kill()
            self._proc.wait(timeout=5)
        for conn in (self._send, self.connection):
            if conn is not None:
                conn.close()
        self._proc = self._send = self.connection = None


def serve(make_handler: Callable[[], Callable[[Any], Any]]) -> None:
    """The child's side: build the handler (an import error ends the child before "ready"), then
    answer each request with `handler(request)` until the parent closes the pipe."""
    from multiprocessing.connection import Connection

    replies = Connection(os.dup(1), readable=False)
    os.dup2(2, 1)
    requests = Connection(os.dup(0), writable=False)
    handler = make_handler()
    replies.send(("ready", None))
    while True:
        try:
            message = requests.recv()
        except EOFError:
            return
        replies.send(handler(message))
