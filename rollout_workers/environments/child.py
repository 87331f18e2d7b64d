"""The environment child process: `python -m rollout_workers.environments.child SPEC KWARGS_JSON`
(started by `EnvironmentPool`; not imported by the package, so `-m` runs it fresh)."""
from __future__ import annotations

import json
import sys

from rollout_workers.child_process import serve
from rollout_workers.environments.base import BadEnvironmentResult, checked_reset, checked_step
from rollout_workers.environments.registry import resolve_environment


def _environment_handler():
    """The child's handler: ("reset", problem) builds a new environment and resets it; ("step",
    action) steps it. Replies ("ok", value) | ("bad" | "error", why)."""
    make = resolve_environment(sys.argv[1])
    kwargs = json.loads(sys.argv[2])
    current = []

    def handle(message):
        call, argument = message
        try:
            if call == "reset":
                current[:] = [make(**kwargs)]
                return "ok", checked_reset(current[0].reset(argument))
            if not current:
                return "error", "step before reset"
            return "ok", tuple(checked_step(current[0].step(argument)))
        except BadEnvironmentResult as err:
            return "bad", str(err)
        except Exception as err:  # the environment's own bug: report it, keep serving
            return "error", f"{type(err).__name__}: {err}"

    return handle


if __name__ == "__main__":
    serve(_environment_handler)
