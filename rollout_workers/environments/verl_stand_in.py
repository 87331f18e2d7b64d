"""What a verl tools file imports from verl, stood in while etarl loads it, so that it loads as it is
with verl installed or not: `verl.tools.function_tool`'s decorator always (verl's registers the
function in verl's registry), and, without verl, the classes a BaseTool subclass is written against
(`verl.tools.base_tool.BaseTool`, `verl.tools.schemas`' ToolResponse and OpenAI schema models) and
`verl.utils.rollout_trace.rollout_trace_op` (verl's tracing, here a decorator that changes nothing).
A file importing anything else of verl needs verl installed; the error names what it imported."""
from __future__ import annotations

import contextlib
import importlib.util
import sys
import types
from typing import Any
from uuid import uuid4

from pydantic import BaseModel, Field

FUNCTION_TOOL_MARK = "__etarl_function_tool__"  # (name, schema) set by the stand-in of verl's decorator
# the verl modules stood in (the decorator's always, the others without verl); their packages too
STOOD_IN = ("verl.tools.function_tool", "verl.tools.schemas", "verl.tools.base_tool", "verl.utils.rollout_trace")


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
                    module("verl.utils.rollout_trace", rollout_trace_op=rollout_trace_op)]
    return {m.__name__: m for m in modules}


@contextlib.contextmanager
def verl_stand_in():
    """The stand-ins in `sys.modules` while a tools file loads; whatever those names were before is
    put back afterwards (the loaded code keeps what it imported)."""
    stand_ins = _modules(importlib.util.find_spec("verl") is not None)
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
