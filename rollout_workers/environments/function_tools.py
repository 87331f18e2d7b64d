"""The built-in `tools` environment: Python functions as the policy's tools (verl's function tools).

    rollout.multi_turn: {environment: tools, environment_kwargs: {path: my_tools.py}}

Every public function defined in the file (or module) is a tool, or, where some carry verl's
`@function_tool` decorator, those (a verl tools file loads as it is, with or without verl
installed). Their schemas, from the signature and the Google-style docstring
(`transformers.utils.get_json_schema`, as verl), go to the chat template as `tools`, so the prompt
lists them the way the model was taught. The policy calls them as Qwen's and verl's hermes format
writes it:

    <tool_call>{"name": "calculator", "arguments": {"expression": "(3+4)*5"}}</tool_call>

The first `max_parallel_calls` calls of a turn run (`fn(**arguments)`, sync or async; verl's
default, 1) and each result comes back as a tool message, `{"role": "tool", "content": ...}`,
rendered by the chat template: a str as it is, anything else as JSON, cut past
`max_tool_response_length` characters on `tool_response_truncate_side` (verl's keys, defaults and
texts); a `(response, reward)` return's reward is the reward of the step that called it. A call of
an unknown tool, with arguments that are not JSON, or that raises answers with verl's error text,
and the episode goes on; a call block that is not JSON is not a call. A turn without a call, or one
after `max_calls` calls (by default one fewer than `rollout.multi_turn.max_turns`, so that the last
turn is an answer), is the final answer: the run's reward (`rollout.reward`, any of its forms)
scores that turn's text, call blocks removed, against the problem's answer (verl scores the whole
response). Info: `correct` (the reward), `tool_calls`, `tool_errors`.
"""
from __future__ import annotations

import asyncio
import contextlib
import inspect
import json
import re
import sys
import types
from collections.abc import Callable
from typing import Any

from rollout_workers.data.problems import Problem
from rollout_workers.environments.base import Environment, StepResult
from rollout_workers.rewards import Reward, load_module

TOOL_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)
_MARK = "__etarl_function_tool__"  # (name, schema) set by verl's decorator, as etarl stands it in


def _function_tool(fn=None, /, name: str | None = None, schema: Any = None):
    """verl's `@function_tool`, `@function_tool("name")`, `@function_tool(schema=...)`, for loading a
    verl tools file without verl: it marks the function, nothing else."""
    if isinstance(fn, str):
        fn, name = None, fn

    def mark(f):
        setattr(f, _MARK, (name or f.__name__, schema))
        return f

    return mark(fn) if callable(fn) else mark


@contextlib.contextmanager
def _verl_decorator_stand_in():
    """While a tools file loads, `from verl.tools.function_tool import function_tool` gets etarl's
    stand-in (verl installed or not: the tools are plain functions either way); whatever those
    module names were before is put back afterwards."""
    names = ("verl", "verl.tools", "verl.tools.function_tool")
    before = {name: sys.modules.get(name) for name in names}
    for name in names:
        sys.modules[name] = types.ModuleType(name)
    sys.modules["verl.tools.function_tool"].function_tool = _function_tool
    try:
        yield
    finally:
        for name, module in before.items():
            if module is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = module


def load_tools(path: str) -> dict[str, Callable]:
    """{tool name: function} of a tools file or module (see the module doc). ValueError says why not."""
    with _verl_decorator_stand_in():
        module = load_module(path, path, "tools")
    defined = [fn for fn in vars(module).values() if inspect.isfunction(fn) and fn.__module__ == module.__name__]
    marked = [fn for fn in defined if hasattr(fn, _MARK)]
    chosen = marked or [fn for fn in defined if not fn.__name__.startswith("_")]
    tools = {getattr(fn, _MARK, (fn.__name__, None))[0]: fn for fn in chosen}
    if not tools:
        raise ValueError(f"tools {path!r} defines no public function")
    return tools


def tool_schemas(path: str) -> list[dict]:
    """The tools' JSON schemas for the chat template (OpenAI's function form), from each function's
    signature and docstring, or the schema verl's decorator was given. ValueError names a function
    whose docstring or type hints do not make one."""
    from transformers.utils import get_json_schema

    schemas = []
    for name, fn in load_tools(path).items():
        given = getattr(fn, _MARK, (name, None))[1]
        if given is not None:
            schemas.append(given if isinstance(given, dict) else dict(given))
            continue
        try:
            schema = get_json_schema(fn)
        except Exception as err:  # transformers' DocstringParsingException, TypeHintParsingException
            raise ValueError(f"tools {path!r}: {name}: {err} (each tool needs type hints and a docstring with "
                             f"an Args: line for every parameter)") from None
        schema["function"]["name"] = name
        schemas.append(schema)
    return schemas


def cut_response(text: str, limit: int, side: str = "middle") -> str:
    """A tool's text past `limit` characters cut as verl cuts it (its markers included)."""
    if len(text) <= limit:
        return text
    if side == "left":
        return "(truncated)..." + text[-limit:]
    if side == "right":
        return text[:limit] + "...(truncated)"
    half = limit // 2
    return text[:half] + "...(truncated)..." + text[-half:]


class FunctionTools(Environment):
    def __init__(self, path: str, reward: str = "math", reward_kwargs: dict | None = None, max_calls: int = 3,
                 max_parallel_calls: int = 1, max_tool_response_length: int = 256,
                 tool_response_truncate_side: str = "middle") -> None:
        if tool_response_truncate_side not in ("left", "right", "middle"):
            raise ValueError(f"tool_response_truncate_side must be left, right or middle, "
                             f"got {tool_response_truncate_side!r}")
        self.tools = load_tools(path)
        self.reward = Reward(reward, reward_kwargs)
        self.max_calls = int(max_calls)
        self.max_parallel_calls = int(max_parallel_calls)
        self.max_length = int(max_tool_response_length)
        self.side = tool_response_truncate_side
        self.problem: Problem | None = None
        self.calls = self.errors = 0
        self._loop: asyncio.AbstractEventLoop | None = None

    def reset(self, problem: Problem) -> None:
        self.problem, self.calls, self.errors = problem, 0, 0
        return None  # the problem's prompt, through the chat template (which lists the tools)

    def step(self, action: str) -> StepResult:
        calls = [call for call in map(_parsed, TOOL_CALL.findall(action)) if call is not None]
        if calls and self.calls < self.max_calls:
            calls = calls[: min(self.max_parallel_calls, self.max_calls - self.calls)]
            results = [self._run(name, arguments) for name, arguments in calls]
            self.calls += len(results)
            messages = [{"role": "tool", "content": cut_response(text, self.max_length, self.side)}
                        for text, _ in results]
            return StepResult(messages, float(sum(reward for _, reward in results)), False, {})
        scored = self.reward(TOOL_CALL.sub("", action).strip(), self.problem)
        info = {"correct": scored.value, "tool_calls": float(self.calls), "tool_errors": float(self.errors),
                **{k.removeprefix("reward/"): v for k, v in scored.metrics.items()}}
        return StepResult(None, scored.value, True, info)

    def _run(self, name: str, arguments: Any) -> tuple[str, float]:
        """One call's (text, reward); a call that fails answers with why, in verl's words (counted)."""
        if name not in self.tools:
            self.errors += 1
            return f"Unknown function '{name}'. Available tools: {list(self.tools)}", 0.0
        try:
            if isinstance(arguments, str):  # verl's parser hands the arguments on as a JSON string
                arguments = json.loads(arguments)
            if not isinstance(arguments, dict):
                raise TypeError(f"the arguments are {type(arguments).__name__}, not an object")
        except (ValueError, TypeError) as err:
            self.errors += 1
            return f"Invalid JSON in arguments for '{name}': {err}", 0.0
        reward = 0.0
        try:
            result = self.tools[name](**arguments)
            if inspect.isawaitable(result):
                self._loop = self._loop or asyncio.new_event_loop()
                result = self._loop.run_until_complete(result)
            if isinstance(result, tuple) and 2 <= len(result) <= 3:  # verl's (response, reward[, metrics])
                result, reward = result[0], float(result[1] or 0.0)
        except Exception as err:  # the call's fault or the tool's: the policy reads why
            self.errors += 1
            return f"Error executing tool '{name}': {err}", 0.0
        return (result if isinstance(result, str) else json.dumps(result, ensure_ascii=False, default=str)), reward


def _parsed(block: str) -> tuple[str, Any] | None:
    """(name, arguments) of a hermes call block, None when it is not one (verl skips it too)."""
    try:
        call = json.loads(block)
        return str(call["name"]), call.get("arguments", {})
    except (ValueError, KeyError, TypeError):
        return None
