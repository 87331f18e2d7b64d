"""verl's GSM8K answer tool (its `Gsm8kTool`, removed from verl's tree since), as a verl user writes a
BaseTool, for etarl's built-in tools environment (it loads with verl installed or not):

    etarl train rollout.task.kind=file rollout.task.path=gsm8k_tool/train.parquet \
      rollout.multi_turn.environment=tools \
      rollout.multi_turn.environment_kwargs.config=examples/gsm8k_tool_config.yaml \
      rollout.multi_turn.max_turns=3 rollout.reward=gsm8k ...

Each row carries its answer for the tool where verl's `gsm8k_tool_agent_loop.py` preprocessing puts
it: `extra_info.tools_kwargs.calc_gsm8k_reward.create_kwargs.ground_truth`. The policy submits an
answer (`<tool_call>{"name": "calc_gsm8k_reward", "arguments": {"answer": "72"}}</tool_call>`); the
tool grades "#### <answer>" with verl's GSM8K rule, flexible (etarl's built-in `gsm8k` reward), and
says so, with a tool reward of 0 for a right answer and -0.05 for another (verl's tool compares with
the instance's earlier reward, and verl makes an instance per call); the tool rewards reach the
final answer's reward in `extra_info["tool_rewards"]`.
"""
from __future__ import annotations

from typing import Any
from uuid import uuid4

from verl.tools.base_tool import BaseTool
from verl.tools.schemas import OpenAIFunctionToolSchema, ToolResponse

from rollout_workers.verl_rewards import gsm8k_reward


class Gsm8kTool(BaseTool):
    def __init__(self, config: dict, tool_schema: OpenAIFunctionToolSchema):
        super().__init__(config, tool_schema)
        self._instances: dict[str, dict[str, Any]] = {}

    async def create(self, instance_id: str | None = None, **kwargs) -> tuple[str, ToolResponse]:
        instance_id = instance_id or str(uuid4())
        create_kwargs = kwargs.get("create_kwargs") or {}
        self._instances[instance_id] = {"ground_truth": create_kwargs.get("ground_truth"), "reward": 0.0}
        return instance_id, ToolResponse()

    async def execute(self, instance_id: str, parameters: dict[str, Any], **kwargs) -> tuple[ToolResponse, float, dict]:
        answer = str(parameters.get("answer", ""))
        instance = self._instances[instance_id]
        instance["response"] = answer if answer.startswith("#### ") else "#### " + answer
        reward = await self.calc_reward(instance_id)
        tool_reward = 0.0 if reward > instance["reward"] else -0.05  # no better than before: a penalty
        instance["reward"] = reward
        return ToolResponse(text=f"Current parsed {answer=} {reward=}"), tool_reward, {}

    async def calc_reward(self, instance_id: str, **kwargs) -> float:
        instance = self._instances[instance_id]
        return gsm8k_reward(instance["response"], str(instance["ground_truth"]), method="flexible")

    async def release(self, instance_id: str, **kwargs) -> None:
        self._instances.pop(instance_id, None)
