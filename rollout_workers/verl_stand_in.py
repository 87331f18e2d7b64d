"""What a verl tools or reward file imports from verl, stood in while etarl loads it (and calls a reward),
so that it loads as it is with verl installed or not: `verl.tools.function_tool`'s decorator always (verl's
registers the function in verl's registry), and, without verl, the classes a BaseTool subclass is written
against (`verl.tools.base_tool.BaseTool`, `verl.tools.schemas`' ToolResponse and OpenAI schema models),
`verl.utils.rollout_trace.rollout_trace_op` (verl's tracing, here a decorator that changes nothing) and
`verl.utils.reward_score`: `default_compute_score` and the GSM8K, MATH (`math_reward`, older verl's
`math`), DAPO (`math_dapo`), Search-R1 (`search_r1_like_qa_em`) and PRIME (`prime_math`, its
`grader.math_equal`; `prime_code`) modules' `compute_score` and helpers,
from etarl's rules (rollout_workers/verl_rewards.py, code_tests.py; where verl asserts, they raise ValueError). A file
importing anything else of verl needs verl installed; the error names what it imported."""
from __future__ import annotations

import contextlib
import functools
import importlib.util
import math
import sys
import types
from typing import Any
from uuid import uuid4

from pydantic import BaseModel, Field

FUNCTION_TOOL_MARK = "__etarl_function_tool__"  # (name, schema) set by the stand-in of verl's decorator
# the verl modules stood in (the decorator's always, the others without verl); their packages too
REWARD_SCORE = "verl.utils.reward_score"
STOOD_IN = ("verl.tools.function_tool", "verl.tools.schemas", "verl.tools.base_tool", "verl.utils.rollout_trace",
            REWARD_SCORE)


def function_tool(name=None, *, schema: Any = None):
    """verl's `@function_tool`, `@function_tool("name")`, `@function_tool(schema=...)`: it marks the
    function and returns it, as verl's returns it."""
    def mark(fn, tool_name=None):
        setattr(fn, FUNCTION_TOOL_MARK, (tool_name or fn.__name__, schema))
        return fn

    if callable(name) and schema is None:
        return mark(name)
    return lambda fn: mark(fn, name)


class ToolResponse(BaseModel):
    """verl's ToolResponse (the text is what etarl uses)."""

    text: str | None = None
    image: list[Any] | None = None
    video: list[Any] | None = None


class OpenAIFunctionPropertySchema(BaseModel):
    type: str | list[str]
    description: str | None = None
    enum: list[Any] | None = None


class OpenAIFunctionParametersSchema(BaseModel):
    type: str
    properties: dict[str, OpenAIFunctionPropertySchema]
    required: list[str] = Field(default_factory=list)


class OpenAIFunctionSchema(BaseModel):
    name: str
    description: str
    parameters: OpenAIFunctionParametersSchema = Field(
        default_factory=lambda: OpenAIFunctionParametersSchema(type="object", properties={}, required=[]))
    strict: bool = False


class OpenAIFunctionToolSchema(BaseModel):
    """A tool's schema in OpenAI's function form, as verl validates it (unknown fields ignored)."""

    type: str
    function: OpenAIFunctionSchema


class BaseTool:
    """verl's BaseTool: a tool class's instance per run, an instance id per call (`create`,
    `execute`, `release`); the subclass overrides what it needs."""

    def __init__(self, config: dict, tool_schema: OpenAIFunctionToolSchema | None):
        self.config = config
        self.tool_schema = tool_schema or self.get_openai_tool_schema()
        if self.tool_schema is None:
            raise ValueError(f"{type(self).__name__}: no tool_schema in the tool config and none from "
                             f"get_openai_tool_schema()")
        self.name = self.tool_schema.function.name

    def get_openai_tool_schema(self) -> OpenAIFunctionToolSchema | None:
        return getattr(self, "tool_schema", None)

    async def create(self, instance_id: str | None = None, **kwargs) -> tuple[str, ToolResponse]:
        return instance_id or str(uuid4()), ToolResponse()

    async def execute(self, instance_id: str, parameters: dict[str, Any], **kwargs) -> tuple[ToolResponse, float, dict]:
        return ToolResponse(text="Updated the tool state."), 0.0, {}

    async def calc_reward(self, instance_id: str, **kwargs) -> float:
        return 0.0

    async def release(self, instance_id: str, **kwargs) -> None:
        return None


def rollout_trace_op(fn):
    """verl's tracing decorator; etarl traces nothing there."""
    return fn


def verl_import_hint(error: str) -> str:
    """A hint for an import error of a file written for verl: what etarl stands in for ("" for another error)."""
    if "No module named 'verl" in error or "from 'verl." in error:
        return (f" (etarl stands in for {', '.join(STOOD_IN)} (default_compute_score; gsm8k, math_reward, math_dapo, "
                "search_r1_like_qa_em, prime_math, prime_code) only: anything else of verl needs verl installed)")
    return ""


def default_compute_score(data_source, solution_str, ground_truth, extra_info=None, sandbox_fusion_url=None,
                          concurrent_semaphore=None, memory_limit_mb=None, **kwargs):
    """verl's default reward for the data sources etarl has its rules for; code rows run as verl's prime_code
    (where verl would use a Sandbox Fusion server at sandbox_fusion_url, etarl has no client: an error)."""
    from rollout_workers.verl_rewards import verl_default_reward

    if sandbox_fusion_url:
        raise ValueError("default_compute_score(sandbox_fusion_url=...): etarl has no Sandbox Fusion client; leave it "
                         "unset (code rows then run as verl's prime_code does) or install verl")
    return verl_default_reward(data_source, solution_str, ground_truth, extra_info)


def _reward_score_modules(module) -> list[types.ModuleType]:
    """verl.utils.reward_score and its modules of the rules etarl carries, under verl's names."""
    from rollout_workers import verl_rewards as rules
    from rollout_workers.code_tests import prime_code_score

    def dapo_remove_boxed(boxed: str) -> str:
        if not (boxed.startswith("\\boxed{") and boxed.endswith("}")):
            raise ValueError(f"box error: {boxed}")
        return boxed[len("\\boxed{"):-1]

    math_reward = dict(compute_score=rules.hendrycks_math_reward, last_boxed_only_string=rules.last_boxed_math,
                       remove_boxed=rules.unboxed, strip_string=rules.math_normalized,
                       is_equiv=lambda str1, str2, verbose=False: rules.math_equivalent(str1, str2))
    parts = {
        "gsm8k": module(f"{REWARD_SCORE}.gsm8k", compute_score=rules.gsm8k_reward, extract_solution=rules.gsm8k_answer),
        "math_reward": module(f"{REWARD_SCORE}.math_reward", **math_reward),
        "math": module(f"{REWARD_SCORE}.math", **math_reward),
        "math_dapo": module(f"{REWARD_SCORE}.math_dapo", compute_score=rules.math_dapo_reward,
                            last_boxed_only_string=rules.last_boxed, remove_boxed=dapo_remove_boxed,
                            normalize_final_answer=rules.dapo_normalized),
        "search_r1_like_qa_em": module(f"{REWARD_SCORE}.search_r1_like_qa_em", compute_score=rules.search_r1_reward,
                                       normalize_answer=rules.qa_normalized, em_check=rules.exact_match,
                                       extract_solution=rules.search_r1_answer),
        "prime_code": module(f"{REWARD_SCORE}.prime_code", package=True, compute_score=prime_code_score),
    }

    def math_equal(prediction, reference, include_percentage=True, tolerance=1e-4, timeout=10.0, pi=math.pi):
        return rules.tora_equal(prediction, reference, include_percentage, tolerance, pi)

    grader = module(f"{REWARD_SCORE}.prime_math.grader", math_equal=math_equal)
    parts["prime_math"] = module(
        f"{REWARD_SCORE}.prime_math", package=True, compute_score=rules.prime_math_score, grader=grader,
        match_answer=rules.prime_math_answer, math_equal=math_equal,
        grade_answer=lambda given_answer, ground_truth: given_answer is not None and rules.prm800k_equal(
            given_answer, ground_truth))
    package = module(REWARD_SCORE, package=True, default_compute_score=default_compute_score,
                     _default_compute_score=default_compute_score, **parts)
    return [package, *parts.values(), grader]


def _modules(verl_installed: bool) -> dict[str, types.ModuleType]:
    """The stand-in modules by name: the decorator's module always, the rest without verl."""
    def module(name: str, package: bool = False, **names) -> types.ModuleType:
        made = types.ModuleType(name)
        if package:
            made.__path__ = []  # a package: its submodules import
        made.__dict__.update(names)
        return made

    schemas = {cls.__name__: cls for cls in (ToolResponse, OpenAIFunctionPropertySchema,
                                             OpenAIFunctionParametersSchema, OpenAIFunctionSchema,
                                             OpenAIFunctionToolSchema)}
    modules = [module("verl.tools.function_tool", function_tool=function_tool)]
    if not verl_installed:
        modules += [module("verl", package=True), module("verl.tools", package=True),
                    module("verl.tools.schemas", **schemas),
                    module("verl.tools.base_tool", BaseTool=BaseTool, **schemas),
                    module("verl.utils", package=True),
                    module("verl.utils.rollout_trace", rollout_trace_op=rollout_trace_op),
                    *_reward_score_modules(module)]
    return {m.__name__: m for m in modules}


@functools.cache
def _stand_ins() -> dict[str, types.ModuleType]:
    """The stand-ins of this process, made once (a reward's every call is made among them)."""
    return _modules(importlib.util.find_spec("verl") is not None)


@contextlib.contextmanager
def verl_stand_in():
    """The stand-ins in `sys.modules` while a tools or reward file loads (or a reward is called: it may
    import verl then); whatever those names were before is put back afterwards (the loaded code keeps
    what it imported)."""
    stand_ins = _stand_ins()
    before = {name: sys.modules.get(name) for name in stand_ins}
    sys.modules.update(stand_ins)
    try:
        yield
    finally:
        for name, module in before.items():
            if module is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = module
