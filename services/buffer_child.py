"""`python -m services.buffer_child serve --config X.yaml`: the buffer service as the child of a
run's controller (`services.buffer_handle.BufferSupervisor`), ending when the controller does.

The child runs in its own session (a Ctrl-C in the terminal must not take the buffer from a run
that is still finishing its step), so nothing else would stop it if the controller were killed:
an orphan would hold the port and keep serving (and logging) a run that is gone. On Linux the
kernel sends it SIGTERM when the thread that started it ends (PR_SET_PDEATHSIG); the service stops
cleanly on SIGTERM.
"""
from __future__ import annotations

import os
import signal
import sys

PARENT_ENV = "ETARL_BUFFER_PARENT_PID"
_PR_SET_PDEATHSIG = 1


def end_with_parent() -> bool:
    """Ask for SIGTERM when the parent ends; False if it has ended already."""
    if sys.platform.startswith("linux"):
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    expected = os.environ.get(PARENT_ENV)
    return not expected or os.getppid() == int(expected)  # else the parent died before prctl


def main(argv: list[str]) -> int:
    if not end_with_parent():
        print("buffer child: the controller that started it is gone; not serving", file=sys.stderr)
        return 1
    from buffer.server import main as serve

    return serve(argv) or 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
