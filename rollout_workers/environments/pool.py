"""Environments in child processes: one process per concurrent trajectory, each call timed.

`EnvironmentPool` keeps one child process (`rollout_workers.child_process`) per slot; the agent
loop gives each trajectory of an engine batch its own slot, so the environments of one turn step
in parallel and one that hangs, crashes or returns garbage ends its own trajectory only: its call
comes back as an `EnvOutcome` with `error` set (counted), a hung or dead child is killed and a
fresh one starts for the slot's next trajectory. Processes are reused from one trajectory to the
next (`reset` builds a new environment object in the child).
"""
from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from multiprocessing.connection import wait

from rollout_workers.child_process import ChildProcess, ChildStartFailed
from rollout_workers.data.problems import Problem
from rollout_workers.environments.base import BadEnvironmentResult, checked_reset, checked_step
from rollout_workers.environments.registry import resolve_environment

CHILD_MODULE = "rollout_workers.environments.child"  # what each child process runs


@dataclass
class EnvOutcome:
    """What one environment call gave: reset fills `observation` (the prompt text, or None);
    step fills all four. `error` (non-empty) says why the environment failed."""

    observation: str | None = None
    reward: float = 0.0
    done: bool = False
    info: dict[str, float] = field(default_factory=dict)
    seconds: float = 0.0
    error: str = ""


class EnvironmentPool:
    """Environment calls for many trajectories at once, each slot in its own child process."""

    def __init__(self, spec: str, kwargs: dict | None = None, step_timeout_s: float = 10.0,
                 start_timeout_s: float = 60.0, env_names: tuple[str, ...] = ()) -> None:
        resolve_environment(spec)  # fail fast, in the caller, on a bad spec
        self.spec = spec
        self.kwargs_json = json.dumps(kwargs or {})
        self.step_timeout_s = step_timeout_s
        self.start_timeout_s = start_timeout_s
        self.env_names = tuple(env_names)  # the worker's variables its processes see besides the allow-list
        self.children: list[ChildProcess] = []
        self.counters = dict(env_calls_total=0, env_failures_total=0, env_timeouts_total=0, env_seconds_total=0.0)
        self.last_error = ""

    def reset(self, problems: list[Problem]) -> list[EnvOutcome]:
        """A fresh environment for each problem, slot i for problems[i]."""
        return self._call_all(list(range(len(problems))), [("reset", p) for p in problems])

    def step(self, slots: list[int], actions: list[str]) -> list[EnvOutcome]:
        """One step of the environments in `slots` (each reset before), in parallel."""
        return self._call_all(slots, [("step", a) for a in actions])

    def _call_all(self, slots: list[int], messages: list[tuple]) -> list[EnvOutcome]:
        while len(self.children) <= max(slots, default=-1):
            self.children.append(ChildProcess(CHILD_MODULE, [self.spec, self.kwargs_json], self.start_timeout_s,
                                              env_names=self.env_names))
        outcomes: dict[int, EnvOutcome] = {}
        started = self._start_children(slots, outcomes)
        waiting: dict[object, tuple[int, str, float]] = {}  # connection -> (slot, call, sent at)
        for slot, message in zip(slots, messages):
            if slot in started:
                try:
                    self.children[slot].send(message)
                    waiting[self.children[slot].connection] = (slot, message[0], time.monotonic())
                except OSError as err:
                    outcomes[slot] = self._failed(slot, f"its process died ({type(err).__name__})", 0.0)
        self._collect(waiting, outcomes)
        self.counters["env_calls_total"] += len(slots)
        self.counters["env_seconds_total"] += sum(o.seconds for o in outcomes.values())
        return [outcomes[slot] for slot in slots]

    def _start_children(self, slots: list[int], outcomes: dict[int, EnvOutcome]) -> set[int]:
        """Start the slots' dead children all at once; those that do not start fail their call."""
        cold = [s for s in slots if not self.children[s].alive]
        for slot in cold:
            self.children[slot].kill()
            self.children[slot].launch()
        for slot in cold:
            try:
                self.children[slot].wait_ready()
            except ChildStartFailed as err:
                outcomes[slot] = self._failed(slot, str(err), 0.0)
        return {s for s in slots if s not in outcomes}

    def _collect(self, waiting: dict, outcomes: dict[int, EnvOutcome]) -> None:
        """Replies as they come; a call past its deadline is a timeout (its child is killed)."""
        while waiting:
            oldest = min(sent for _, _, sent in waiting.values())
            ready = wait(list(waiting), timeout=max(0.0, oldest + self.step_timeout_s - time.monotonic()))
            now = time.monotonic()
            for conn in ready:
                slot, call, sent = waiting.pop(conn)
                outcomes[slot] = self._outcome(slot, call, now - sent)
            for conn, (slot, call, sent) in list(waiting.items()):
                if now - sent >= self.step_timeout_s:
                    del waiting[conn]
                    self.counters["env_timeouts_total"] += 1
                    outcomes[slot] = self._failed(slot, f"{call} took longer than {self.step_timeout_s}s", now - sent)

    def _outcome(self, slot: int, call: str, seconds: float) -> EnvOutcome:
        try:
            reply = self.children[slot].connection.recv()
        except (EOFError, OSError) as err:
            return self._failed(slot, f"its process died ({type(err).__name__})", seconds)
        # The child runs the user's code: its reply is checked here again, not trusted for its shape.
        if not (isinstance(reply, list) and len(reply) == 2 and reply[0] in ("ok", "bad", "error")):
            return self._failed(slot, f"{call} answered {reply!r:.80}, not (status, value)", seconds)
        status, value = reply
        if status != "ok":
            return self._failed(slot, f"{call} {'raised ' if status == 'error' else ''}{value!s:.300}", seconds,
                                kill=False)
        try:
            if call == "reset":
                return EnvOutcome(observation=checked_reset(value), seconds=seconds)
            step = checked_step(tuple(value) if isinstance(value, list) else value)  # msgpack has no tuples
        except BadEnvironmentResult as err:
            return self._failed(slot, str(err), seconds)
        return EnvOutcome(step.observation, step.reward, step.done, step.info, seconds)

    def _failed(self, slot: int, why: str, seconds: float, kill: bool = True) -> EnvOutcome:
        if kill:
            self.children[slot].kill()
        return EnvOutcome(done=True, seconds=seconds, error=self.record_failure(why))

    def record_failure(self, why: str) -> str:
        """Count a failure of the environment (also one its caller found) and return its message."""
        self.counters["env_failures_total"] += 1
        self.last_error = f"environment {self.spec!r}: {why}"
        return self.last_error

    def stats(self) -> dict[str, float]:
        return dict(self.counters)

    def close(self) -> None:
        for child in self.children:
            child.kill()
        self.children = []

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass

