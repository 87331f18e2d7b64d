"""Reward functions and the runner that calls them safely.

A reward function is `fn(response: str, answer: str) -> float`. Built-ins are named ("math",
"exact"); any other is given by import path "package.module:function".
`RewardRunner` calls the function in a child process with a per-response timeout: a reward that
hangs, crashes, kills its process or returns a non-number is scored `failure_reward`, counted,
and the child is replaced, so the worker never stalls.
"""
from __future__ import annotations

import importlib
import math
import os
import re
import subprocess
import sys
from collections.abc import Callable
from fractions import Fraction

RewardFn = Callable[[str, str], float]

_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?(?:/\d+)?|-?\.\d+")
_BOXED = re.compile(r"\\boxed\{([^{}]*)\}")
_MARKED = re.compile(r"(?:####|answer is|answer:)\s*([^\n]*)", re.IGNORECASE)


def parse_number(text: str) -> Fraction | None:
    """'1,234' -> 1234, '-3/4' -> -3/4, '2.50' -> 5/2; None when it is not a number."""
    try:
        return Fraction(text.replace(",", "").strip())
    except (ValueError, ZeroDivisionError):
        return None


def extract_final_answer(response: str) -> str | None:
    """The final answer in a response: the last \\boxed{...}, else what follows the last
    '####' / 'answer is' / 'answer:', else the last number in the text."""
    for pattern in (_BOXED, _MARKED):
        found = pattern.findall(response)
        if found:
            numbers = _NUMBER.findall(found[-1])
            return numbers[0] if numbers else found[-1].strip()
    numbers = _NUMBER.findall(response)
    return numbers[-1] if numbers else None


def math_reward(response: str, answer: str) -> float:
    """1.0 when the response's final answer equals the reference as a number (exactly, so
    '0.50' == '1/2'), or as text when the reference is not a number; else 0.0."""
    expected = parse_number(answer)
    if expected is None:
        return exact_match_reward(response, answer)
    final = extract_final_answer(response)
    got = None if final is None else parse_number(final)
    return float(got is not None and got == expected)


def exact_match_reward(response: str, answer: str) -> float:
    return float(response.strip() == answer.strip())


BUILTIN_REWARDS: dict[str, RewardFn] = {"math": math_reward, "exact": exact_match_reward}


def resolve_reward(spec: str) -> RewardFn:
    """A built-in name or "module:function"; errors say what is wrong with the spec."""
    if spec in BUILTIN_REWARDS:
        return BUILTIN_REWARDS[spec]
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(
            f"reward {spec!r} is neither a built-in ({sorted(BUILTIN_REWARDS)}) nor 'module:function'"
        )
    try:
        module = importlib.import_module(module_name)
    except ImportError as err:
        raise ValueError(f"reward {spec!r}: cannot import module {module_name!r} ({err})") from None
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise ValueError(f"reward {spec!r}: module {module_name!r} has no callable {attr!r}")
    return fn


def _child_main() -> None:
    """Entry point of the reward process: `python -m rollout_workers.rewards SPEC`. Requests come
    on stdin, replies go out on a private copy of stdout; the reward's own prints go to stderr."""
    from multiprocessing.connection import Connection

    replies = Connection(os.dup(1), readable=False)
    os.dup2(2, 1)
    requests = Connection(os.dup(0), writable=False)
    fn = resolve_reward(sys.argv[1])
    replies.send(("ready", None))
    while True:
        try:
            message = requests.recv()
        except EOFError:
            return
        response, answer = message
        try:
            replies.send(("ok", fn(response, answer)))
        except Exception as err:  # the reward's own bug: report it, keep serving
            replies.send(("error", f"{type(err).__name__}: {err}"))


class RewardRunner:
    """Scores responses in a child process, one response at a time, each within timeout_s.

    The child is a fresh interpreter (`python -m`), not a fork (unsafe in threaded Ray/vLLM
    processes) nor a multiprocessing spawn (which re-imports the caller's main script)."""

    def __init__(
        self, spec: str = "math", timeout_s: float = 5.0, failure_reward: float = 0.0, start_timeout_s: float = 60.0
    ) -> None:
        if timeout_s <= 0:
            raise ValueError(f"reward timeout_s must be > 0, got {timeout_s}")
        resolve_reward(spec)  # fail fast, in the caller, on a bad spec
        self.spec = spec
        self.timeout_s = timeout_s
        self.failure_reward = failure_reward
        self.start_timeout_s = start_timeout_s
        self.calls_total = 0
        self.failures_total = 0
        self.timeouts_total = 0
        self.last_error = ""
        self._proc: subprocess.Popen | None = None
        self._send = self._recv = None

    def _start(self) -> None:
        from multiprocessing.connection import Connection

        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "rollout_workers.rewards", self.spec],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env,
        )
        self._send = Connection(os.dup(self._proc.stdin.fileno()), readable=False)
        self._recv = Connection(os.dup(self._proc.stdout.fileno()), writable=False)
        self._proc.stdin.close()
        self._proc.stdout.close()
        # Starting Python is slow on a loaded machine: wait for it apart from the reward timeout.
        if not self._recv.poll(self.start_timeout_s) or self._recv.recv()[0] != "ready":
            self._kill()
            raise TimeoutError(f"reward process for {self.spec!r} did not start in {self.start_timeout_s}s")

    def _kill(self) -> None:
        if self._proc is not None:
            self._proc.kill()
            self._proc.wait(timeout=5)
        for conn in (self._send, self._recv):
            if conn is not None:
                conn.close()
        self._proc = self._send = self._recv = None

    def _fail(self, why: str) -> float:
        self.failures_total += 1
        self.last_error = why
        return self.failure_reward

    def score_one(self, response: str, answer: str) -> float:
        self.calls_total += 1
        try:
            if self._proc is None or self._proc.poll() is not None:
                self._kill()
                self._start()
            self._send.send((response, answer))
            if not self._recv.poll(self.timeout_s):
                self.timeouts_total += 1
                self._kill()
                return self._fail(f"reward {self.spec!r} took longer than {self.timeout_s}s")
            status, value = self._recv.recv()
        except (EOFError, OSError, TimeoutError) as err:
            self._kill()
            return self._fail(f"reward {self.spec!r} process died ({type(err).__name__})")
        if status != "ok":
            return self._fail(f"reward {self.spec!r} raised {value}")
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            return self._fail(f"reward {self.spec!r} returned {value!r}, not a finite number")
        return float(value)

    def score(self, responses: list[str], answer: str) -> list[float]:
        return [self.score_one(response, answer) for response in responses]

    def stats(self) -> dict[str, float]:
        return {
            "reward_calls_total": self.calls_total,
            "reward_failures_total": self.failures_total,
            "reward_timeouts_total": self.timeouts_total,
        }

    def close(self) -> None:
        self._kill()

    def __del__(self) -> None:
        try:
            self._kill()
        except Exception:
            pass


if __name__ == "__main__":
    _child_main()
