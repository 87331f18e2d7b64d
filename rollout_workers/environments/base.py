"""The environment API: what one trajectory's environment is, and the checks on what it returns.

An environment is built per trajectory (`Env(**rollout.multi_turn.environment_kwargs)`), then
    reset(problem) -> str | None      the prompt text (tokenised as is), or None: the problem's own
                                      prompt through the model's prompt format (chat template)
    step(action) -> StepResult        action: the text of the policy's turn (decoded once, for the
                                      environment only; the trajectory keeps the generated ids)
StepResult is (observation text or None, reward, done, info): the observation is tokenised once and
appended with loss mask 0; the reward of the step lands on the last token of the action
(`token_rewards`) and the trajectory's reward is the sum; `info`'s numbers become metrics
`env/<key>` (averaged over a step's samples). A plain 4-tuple works as well as a StepResult.
"""
from __future__ import annotations

import numbers
from typing import Any, NamedTuple

from rollout_workers.data.problems import Problem
from rollout_workers.rewards import is_finite_number

MAX_OBSERVATION_CHARS = 1_000_000
MAX_INFO_METRICS = 16  # info numbers kept per trajectory (they ride in the sample's metadata)


class StepResult(NamedTuple):
    observation: str | None
    reward: float
    done: bool
    info: dict[str, float] = {}


class Environment:
    """Subclass and write `reset` and `step` (see the module doc); kwargs come from the config."""

    def reset(self, problem: Problem) -> str | None:
        return None

    def step(self, action: str) -> StepResult:
        raise NotImplementedError


class BadEnvironmentResult(ValueError):
    """An environment returned something that is not what the API says."""


def checked_reset(value: Any) -> str | None:
    if value is not None and not isinstance(value, str):
        raise BadEnvironmentResult(f"reset returned {type(value).__name__} {value!r:.80}, not text or None")
    if isinstance(value, str) and not value:
        raise BadEnvironmentResult("reset returned empty text (return None to use the problem's prompt)")
    return _checked_text("reset", value)


def checked_step(value: Any) -> StepResult:
    """`value` as a StepResult of plain types (picklable, finite), or BadEnvironmentResult."""
    if not isinstance(value, tuple) or len(value) != 4:
        raise BadEnvironmentResult(f"step returned {value!r:.80}, not (observation, reward, done, info)")
    observation, reward, done, info = value
    if observation is not None and not isinstance(observation, str):
        raise BadEnvironmentResult(f"step's observation is {type(observation).__name__}, not text or None")
    if not is_finite_number(reward):
        raise BadEnvironmentResult(f"step's reward is {reward!r:.60}, not a finite number")
    if not isinstance(done, bool) and not (isinstance(done, numbers.Integral) and done in (0, 1)):
        raise BadEnvironmentResult(f"step's done is {done!r:.60}, not a bool")
    if info is not None and not isinstance(info, dict):
        raise BadEnvironmentResult(f"step's info is {type(info).__name__}, not a dict")
    metrics = {str(k): float(v) for k, v in (info or {}).items() if isinstance(k, str) and is_finite_number(v)}
    return StepResult(_checked_text("step", observation), float(reward), bool(done),
                      dict(list(metrics.items())[:MAX_INFO_METRICS]))


def _checked_text(where: str, text: str | None) -> str | None:
    if text is not None and len(text) > MAX_OBSERVATION_CHARS:
        raise BadEnvironmentResult(f"{where} returned {len(text)} characters (more than {MAX_OBSERVATION_CHARS})")
    return text

