"""Environments for the multi-turn tests, imported by name ("env_helpers:Class") in the
environment child processes. `Misbehaving` does what its problem's answer says: ok, hang, crash
(the process dies), raise, garbage (a step result that is not one), forged (a well-formed reply of
the wrong shape written straight into the reply pipe, past the child's own check: the child runs
user code, which can), reset_raise, hang_reset."""
from __future__ import annotations

import os
import time

from rollout_workers.environments import Environment, StepResult


def _hang():
    parent = os.getppid()
    while os.getppid() == parent:  # until the pool kills this process (or its parent is gone)
        time.sleep(0.05)
    os._exit(0)


class Misbehaving(Environment):
    def __init__(self, reward: float = 1.0) -> None:
        self.reward = reward
        self.how = ""

    def reset(self, problem):
        self.how = problem.answer_text
        if self.how == "reset_raise":
            raise RuntimeError("environment bug at reset")
        if self.how == "hang_reset":
            _hang()
        return None

    def step(self, action: str) -> StepResult:
        if self.how == "hang":
            _hang()
        if self.how == "crash":
            os._exit(3)
        if self.how == "raise":
            raise ValueError("environment bug")
        if self.how == "garbage":
            return {"observation": "x"}  # not (observation, reward, done, info)
        if self.how == "forged":
            import gc
            from multiprocessing.connection import Connection

            import msgpack

            for pipe in gc.get_objects():
                if isinstance(pipe, Connection) and pipe.writable and not pipe.readable:
                    pipe.send_bytes(msgpack.packb(["ok", ["x", float("nan"), "maybe", 5]]))
        return StepResult(None, self.reward, True, {"steps": 1.0})


class Echo(Environment):
    """Answers every action with `<r>` + the action's length + `</r>` until `turns` actions."""

    def __init__(self, turns: int = 2) -> None:
        self.turns, self.seen = turns, 0

    def step(self, action: str) -> StepResult:
        self.seen += 1
        done = self.seen >= self.turns
        return StepResult(None if done else f"<r>{len(action)}</r>", 0.5, done, {"seen": float(self.seen)})


class Prompter(Environment):
    """Writes the prompt itself (`text`) and takes the first action as the answer."""

    def __init__(self, text: str) -> None:
        self.text = text

    def reset(self, problem):
        return self.text

    def step(self, action: str) -> StepResult:
        return StepResult(None, 1.0, True, {})


class ReadsVariable(Environment):
    """Its prompt is the value of the environment variable `name` in its process ("unset" when unset)."""

    def __init__(self, name: str) -> None:
        self.name = name

    def reset(self, problem):
        import os

        return os.environ.get(self.name, "unset")

    def step(self, action: str) -> StepResult:
        return StepResult(None, 1.0, True, {})


class ChatTool(Environment):
    """Speaks in chat messages: its prompt is the problem's as a user message, its first step's
    observation a tool message (`result`), and the next action ends the episode with reward 1."""

    def __init__(self, result: str = "<r>5</r>") -> None:
        self.result = result
        self.steps = 0

    def reset(self, problem):
        return [{"role": "user", "content": problem.prompt}]

    def step(self, action: str) -> StepResult:
        self.steps += 1
        if self.steps == 1:
            return StepResult([{"role": "tool", "content": self.result}], 0.0, False, {})
        return StepResult(None, 1.0, True, {})
