"""verl's GSM8K answer tool, as a verl user writes a BaseTool, for etarl's built-in tools environment
(it loads with verl installed or not):

    etarl train rollout.task.kind=file rollout.task.path=gsm8k_tool/train.parquet \
      rollout.multi_turn.environment=tools \
      rollout.multi_turn.environment_kwargs.config=examples/gsm8k_tool_config.yaml \
      rollout.multi_turn.max_turns=3 rollout.reward=math ...

Each row carries its answer for the tool where verl's `gsm8k_tool_agent_loop.py` preprocessing puts
it: `extra_info.tools_kwargs.calc_gsm8k_reward.create_kwargs.ground_truth`. The policy submits an
answer (`<tool_call>{"name": "calc_gsm8k_reward", "arguments": {"answer": "72"}}</tool_call>`), the
tool says whether it is right, with a tool reward of 0 for a right answer and -0.05 for a wrong one
(in the final answer's `extra_info["tool_rewards"]`); the run's reward scores the final answer.
"""
from __future__ import annotations

import re
from typing import Any
from uuid import uuid4

from verl.tools.base_tool import BaseTool
from verl.tools.schemas import OpenAIFunctionToolSchema, ToolResponse

_NUMBER = re.compile(r"-?[0-9][0-9,]*(?:\.[0-9]+)?")


def parsed_answer(text: str) -> str | None:
    """The number after the last `####`, or else the last number, without commas; None without one."""
    tail = text.rsplit("####", 1)[-1]
    numbers = _NUMBER.findall(tail)
    return numbers[-1].replace(",", "").rstrip(".") if numbers else None


class Gsm8kTool(BaseTool):
    def __init__(self, config: dict, tool_schema: OpenAIFunctionToolSchema):
        super().__init__(config, tool_schema)
        self._instances: dict[str, dict[str, Any]] = {}

    async def create(self, instance_id: str | None = None, **kwargs) -> tuple[str, ToolResponse]:
        instance_id = instance_id or str(uuid4())
        create_kwargs = kwargs.get("create_kwargs") or {}
        self._instances[instance_id] = {"ground_truth": create_kwargs.get("ground_truth")}
        return instance_id, ToolResponse()

    async def execute(self, instance_id: str, parameters: dict[str, Any], **kwargs) -> tuple[ToolResponse, float, dict]:
        answer = str(parameters.get("answer", ""))
        reward = await self.calc_reward(instance_id, answer=answer)
        return ToolResponse(text=f"Current parsed answer={parsed_answer(answer)!r} reward={reward}"), \
            0.0 if reward > 0 else -0.05, {}

    async def calc_reward(self, instance_id: str, answer: str = "", **kwargs) -> float:
        truth = self._instances[instance_id]["ground_truth"]
        return float(truth is not None and parsed_answer(answer) == parsed_answer(str(truth)))

    async def release(self, instance_id: str, **kwargs) -> None:
        self._instances.pop(instance_id, None)
