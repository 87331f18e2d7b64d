"""The environment API: what one trajectory's environment is, and the checks on what it returns.

An environment is built per trajectory (`Env(**rollout.multi_turn.environment_kwargs)`), then
    reset(problem) -> str | list[dict] | None
                                      the prompt text (tokenised as is), chat messages (through the
                                      model's chat template), or None: the problem's own prompt
    step(action) -> StepResult        action: the text of the policy's turn (decoded once, for the
                                      environment only; the trajectory keeps the generated ids)
StepResult is (observation or None, reward, done, info): the observation, text (tokenised as is) or
chat messages such as [{"role": "tool", "content": "..."}] (rendered by the model's chat template as
the turns that follow the policy's, its generation prompt included), is tokenised once and
appended with loss mask 0; the reward of the step lands on the last token of the action
(`token_rewards`) and the trajectory's reward is the sum; `info`'s numbers become metrics
`env/<key>` (averaged over a step's samples). A plain 4-tuple works as well as a StepResult.
"""
from __future__ import annotations

import numbers
from typing import Any, NamedTuple

from rollout_workers.child_process import is_finite_number
from rollout_workers.data.problems import Problem

MAX_OBSERVATION_CHARS = 1_000_000
MAX_INFO_METRICS = 16  # info numbers kept per trajectory (they ride in the sample's metadata)


Observation = str | list[dict[str, str]] | None


class StepResult(NamedTuple):
    observation: Observation
    reward: float
    done: bool
    info: dict[str, float] = {}


class Environment:
    """Subclass and write `reset` and `step` (see the module doc); kwargs come from the config."""

    def reset(self, problem: Problem) -> Observation:
        return None

    def step(self, action: str) -> StepResult:
        raise NotImplementedError


class BadEnvironmentResult(ValueError):
    """An environment returned something that is not what the API says."""


def checked_reset(value: Any) -> Observation:
    if isinstance(value, str) and not value:
        raise BadEnvironmentResult("reset returned empty text (return None to use the problem's prompt)")
    return _checked_observation("reset", value)


def checked_step(value: Any) -> StepResult:
    """`value` as a StepResult of plain types (picklable, finite), or BadEnvironmentResult."""
    if not isinstance(value, tuple) or len(value) != 4:
        raise BadEnvironmentResult(f"step returned {value!r:.80}, not (observation, reward, done, info)")
    observation, reward, done, info = value
    if not is_finite_number(reward):
        raise BadEnvironmentResult(f"step's reward is {reward!r:.60}, not a finite number")
    if not isinstance(done, bool) and not (isinstance(done, numbers.Integral) and done in (0, 1)):
        raise BadEnvironmentResult(f"step's done is {done!r:.60}, not a bool")
    if info is not None and not isinstance(info, dict):
        raise BadEnvironmentResult(f"step's info is {type(info).__name__}, not a dict")
    metrics = {str(k): float(v) for k, v in (info or {}).items() if isinstance(k, str) and is_finite_number(v)}
    return StepResult(_checked_observation("step", observation), float(reward), bool(done),
                      dict(list(metrics.items())[:MAX_INFO_METRICS]))


def _checked_observation(where: str, value: Any) -> Observation:
    """Text, None, or chat messages: a non-empty list of dicts of text with a role and a content
    (msgpack brings tuples back as lists); at most MAX_OBSERVATION_CHARS characters."""
    if value is None:
        return None
    if isinstance(value, str):
        chars = len(value)
    elif isinstance(value, (list, tuple)) and value and all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
            and all(isinstance(k, str) and isinstance(v, str) for k, v in m.items()) for m in value):
        value = [dict(m) for m in value]
        chars = sum(len(v) for m in value for v in m.values())
    else:
        raise BadEnvironmentResult(f"{where} returned {type(value).__name__} {value!r:.80}, not text, chat messages "
                                   f"([{{'role': ..., 'content': ...}}, ...], text values) or None")
    if chars > MAX_OBSERVATION_CHARS:
        raise BadEnvironmentResult(f"{where} returned {chars} characters (more than {MAX_OBSERVATION_CHARS})")
    return value

