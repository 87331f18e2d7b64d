"""The built-in multi-turn task: arithmetic with a calculator tool.

    prompt    347+589=
    policy    <calc>347+589</calc>        (the turn ends at the `</calc>` token)
    env       <r>936</r>
    policy    936<eos>                    (an action that is not a tool call is the final answer)

The reward is 1 when the final answer equals the problem's answer (the text, stripped), else 0;
a tool call earns nothing by itself. An expression the calculator cannot read gets `<r></r>`. After
`max_calls` calls, a further call counts as a (wrong) final answer. The episode's info:
`correct`, `tool_calls` and `tool_success` (1 when a call returned the problem's answer).
"""
from __future__ import annotations

import re

from rollout_workers.data.problems import Problem
from rollout_workers.environments.base import Environment, StepResult

CALL = re.compile(r"\s*<calc>(.*)</calc>\s*", re.DOTALL)
EXPRESSION = re.compile(r"\s*[-+]?\d{1,18}(?:\s*[-+]\s*\d{1,18}){0,15}\s*")
TERM = re.compile(r"([-+]?)\s*(\d+)")


def calculate(expression: str) -> int | None:
    """The value of integers joined by + and -, or None for anything else."""
    if not EXPRESSION.fullmatch(expression):
        return None
    return sum(int(digits) * (-1 if sign == "-" else 1) for sign, digits in TERM.findall(expression))


class Calculator(Environment):
    def __init__(self, max_calls: int = 2) -> None:
        self.max_calls = int(max_calls)
        self.answer = ""
        self.calls = 0
        self.tool_success = False

    def reset(self, problem: Problem) -> None:
        self.answer = problem.answer_text.strip()
        return None  # the problem's own prompt

    def step(self, action: str) -> StepResult:
        call = CALL.fullmatch(action)
        if call is not None and self.calls < self.max_calls:
            self.calls += 1
            value = calculate(call.group(1))
            self.tool_success = self.tool_success or str(value) == self.answer
            return StepResult(f"<r>{'' if value is None else value}</r>", 0.0, False, {})
        correct = action.strip() == self.answer
        info = {"correct": float(correct), "tool_calls": float(self.calls), "tool_success": float(self.tool_success)}
        return StepResult(None, float(correct), True, info)
