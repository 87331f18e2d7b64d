"""The built-in `tools` environment: Python functions, or verl's BaseTool classes, as the policy's tools.

    rollout.multi_turn: {environment: tools, environment_kwargs: {path: my_tools.py}}
    rollout.multi_turn: {environment: tools, environment_kwargs: {config: tool_config.yaml}}

`path` (verl's `multi_turn.function_tool_path`): every public function defined in the file (or
module) is a tool, or, where some carry verl's `@function_tool` decorator, those; their schemas,
from the signature and the Google-style docstring (`transformers.utils.get_json_schema`), trimmed to
the fields verl's schema keeps. `config` (verl's `multi_turn.tool_config_path`): the BaseTool classes
its YAML declares (`tool_classes.py`). Both may be given (the classes' tools first, as verl lists
them; a name in both is refused). verl's own files load as they are, verl installed or not
(`verl_stand_in.py`). The schemas go to the chat template as `tools`; a prompt whose extra_info names
`tool_selection` sees and may call those only (verl's per-sample tools). The policy calls them in
hermes form (Qwen's, verl's default), or in qwen3_coder's XML form with `format: qwen3_coder`
(`tool_calls.py`):

    <tool_call>{"name": "calculator", "arguments": {"expression": "(3+4)*5"}}</tool_call>

As verl's tool agent loop does: a block that is no call in its format is passed over; the first
`max_parallel_calls` calls of a turn (1) run together (`fn(**arguments)`, sync functions in
threads; a class tool's create, execute and release, with the prompt's
`extra_info.tools_kwargs[name].create_kwargs`); a function's result is normalised as verl normalises
it (str as is, dict as JSON, `(response, reward[, metrics])`, anything else `str()`) and comes back
as a tool message, cut past `max_tool_response_length` characters (256) on
`tool_response_truncate_side` (middle); an unknown tool or a call that raises answers with verl's
error text (and a tool reward of 0). A turn without a call, or any turn after `max_tool_turns` turns
that called tools (by default one fewer than `rollout.multi_turn.max_turns`, so the last turn is an
answer), is the final answer: the run's reward scores that turn's text, call blocks removed (verl
scores the whole response), with the tools' rewards in its extra_info as `tool_rewards` (where verl
puts them). Info: `correct` (the reward), `tool_calls`, `tool_errors`, `tool_reward`. Tools, reward
and the event loop the tools' coroutines run on are made once per process.
"""
from __future__ import annotations

import asyncio
import contextlib
import inspect
import json
import math
import sys
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from rollout_workers.data.problems import Problem
from rollout_workers.environments.base import Environment, StepResult
from rollout_workers.environments.tool_calls import FORMATS, parsed_calls, without_calls
from rollout_workers.environments.tool_classes import ClassTool, load_tool_classes
from rollout_workers.verl_stand_in import FUNCTION_TOOL_MARK, verl_stand_in
from rollout_workers.rewards import Reward, load_module

_LOADED: dict[str, dict[str, Callable]] = {}  # once per process: a file's top-level code runs once


def load_tools(path: str) -> dict[str, Callable]:
    """{tool name: function} of a tools file or module (see the module doc). ValueError says why not."""
    if path not in _LOADED:
        with verl_stand_in(), contextlib.redirect_stdout(sys.stderr):  # `etarl eval` writes JSON on stdout
            module = load_module(path, path, "tools")
        defined = [fn for fn in vars(module).values()
                   if inspect.isfunction(fn) and fn.__module__ == module.__name__]
        marked = [fn for fn in defined if hasattr(fn, FUNCTION_TOOL_MARK)]
        chosen = marked or [fn for fn in defined if not fn.__name__.startswith("_")]
        if not chosen:
            raise ValueError(f"tools {path!r} defines no public function")
        _LOADED[path] = {getattr(fn, FUNCTION_TOOL_MARK, (fn.__name__, None))[0]: fn for fn in chosen}
    return _LOADED[path]


def _verl_schema(raw: dict) -> dict:
    """A tool schema as verl's OpenAIFunctionToolSchema keeps it (model_dump, unset and None left
    out): per parameter its type, description and enum; no return."""
    function = raw["function"]
    out = {"name": function["name"], "description": function.get("description", "")}
    if "parameters" in function:
        params = function["parameters"]
        out["parameters"] = {"type": params.get("type", "object"), "properties": {
            name: {k: prop[k] for k in ("type", "description", "enum") if prop.get(k) is not None}
            for name, prop in params.get("properties", {}).items()}}
        if "required" in params:
            out["parameters"]["required"] = list(params["required"])
    if "strict" in function:
        out["strict"] = function["strict"]
    return {"type": raw.get("type", "function"), "function": out}


def load_all_tools(path: str | None = None, config: str | None = None) -> dict[str, Callable | ClassTool]:
    """{name: tool} of a tools file and a verl tool config, the config's first (verl's order);
    ValueError says why not."""
    if not path and not config:
        raise ValueError("the tools environment needs environment_kwargs.path (a file of tool functions), "
                         "environment_kwargs.config (verl's tool config YAML of BaseTool classes), or both")
    classes = load_tool_classes(config) if config else {}
    functions = load_tools(path) if path else {}
    clash = sorted(set(classes) & set(functions))
    if clash:
        raise ValueError(f"function tool name(s) {clash} in {path!r} collide with tools declared in {config!r}: "
                         f"each tool name must be unique across the two; rename one")
    return {**classes, **functions}


def tool_schemas(path: str | None = None, config: str | None = None) -> list[dict]:
    """The tools' JSON schemas for the chat template (OpenAI's function form), in `load_all_tools`'
    order: a class's from its tool config or class, a function's from its signature and docstring
    or the schema verl's decorator was given. ValueError names a function whose docstring or type
    hints do not make one."""
    return _schemas(load_all_tools(path, config), path)


def _schemas(tools: dict[str, Callable | ClassTool], path: str | None) -> list[dict]:
    return [tool.schema() if isinstance(tool, ClassTool) else _function_schema(name, tool, path)
            for name, tool in tools.items()]


def _function_schema(name: str, fn: Callable, path: str) -> dict:
    from transformers.utils import get_json_schema

    given = getattr(fn, FUNCTION_TOOL_MARK, (name, None))[1]
    if given is not None:
        raw = given.model_dump(exclude_unset=True, exclude_none=True) if hasattr(given, "model_dump") else given
    else:
        try:
            raw = get_json_schema(fn)
        except Exception as err:  # transformers' DocstringParsingException, TypeHintParsingException
            raise ValueError(f"tools {path!r}: {name}: {err} (each tool needs type hints and a docstring "
                             f"with an Args: line for every parameter)") from None
        raw["function"]["name"] = name
    return _verl_schema(raw)


def normalized(value: Any) -> tuple[str, float]:
    """A tool's return as (text, reward), as verl's `normalize_function_tool_return` takes it; ValueError for
    an image or a video (verl needs a vision model for those, etarl has none)."""
    def text(response: Any) -> str:
        if isinstance(response, str):
            return response
        if isinstance(response, dict):
            return json.dumps(response, ensure_ascii=False)
        if hasattr(response, "text") and hasattr(response, "image"):  # a ToolResponse, verl's or the stand-in
            if response.image or getattr(response, "video", None):
                raise ValueError("it returned an image or a video; etarl's policies read text only")
            return response.text or ""
        return str(response)

    if isinstance(value, tuple):
        if not 1 <= len(value) <= 3:
            raise TypeError(f"@function_tool return tuple must have length 1, 2, or 3 (got length {len(value)}: "
                            f"{value!r:.80}). Use (response,), (response, reward), or (response, reward, metrics).")
        return text(value[0]), 0.0 if len(value) < 2 or value[1] is None else float(value[1])
    return text(value), 0.0


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


_REWARDS: dict[str, Reward] = {}


_LOOP: asyncio.AbstractEventLoop | None = None


def _event_loop() -> asyncio.AbstractEventLoop:
    """The process's one loop for the tools' coroutines: a class tool made once per process may hold
    what belongs to a loop (a client session), so every trajectory's calls run on the same one."""
    global _LOOP
    if _LOOP is None:
        _LOOP = asyncio.new_event_loop()
        asyncio.set_event_loop(_LOOP)  # a tool asking for "the" loop (asyncio.get_event_loop()) gets this one
    return _LOOP


class FunctionTools(Environment):
    def __init__(self, path: str | None = None, config: str | None = None, reward: str = "math",
                 reward_kwargs: dict | None = None, max_tool_turns: int = 3, max_parallel_calls: int = 1,
                 max_tool_response_length: int = 256, tool_response_truncate_side: str = "middle",
                 format: str = "hermes") -> None:
        if tool_response_truncate_side not in ("left", "right", "middle"):
            raise ValueError(f"tool_response_truncate_side must be left, right or middle, "
                             f"got {tool_response_truncate_side!r}")
        if format not in FORMATS:
            raise ValueError(f"format must be {' or '.join(FORMATS)} (the tool calls' form), got {format!r}")
        if config:
            _event_loop()  # before the classes are built: one taking "the" loop in __init__ gets the calls' one
        self.tools = load_all_tools(path, config)
        self.format = format
        # qwen3_coder's parameters are text, typed by the tool's schema
        self.schemas = {s["function"]["name"]: s for s in _schemas(self.tools, path)} if format != "hermes" else {}
        key = json.dumps([reward, reward_kwargs], sort_keys=True)
        if key not in _REWARDS:
            _REWARDS[key] = Reward(reward, reward_kwargs)
        self.reward = _REWARDS[key]
        self.max_tool_turns = int(max_tool_turns)
        self.max_parallel_calls = int(max_parallel_calls)
        self.max_length = int(max_tool_response_length)
        self.side = tool_response_truncate_side
        self.problem: Problem | None = None
        self.active_tools: dict[str, Callable | ClassTool] = self.tools
        self.tools_kwargs: dict[str, dict | None] = {}
        self.tool_turns = self.calls = self.errors = 0
        self.tool_rewards: list[float] = []

    def reset(self, problem: Problem) -> None:
        self.problem, self.tool_turns, self.calls, self.errors, self.tool_rewards = problem, 0, 0, 0, []
        self.active_tools, self.tools_kwargs = prompt_tools(self.tools, problem.extra_info)
        return None  # the problem's prompt, through the chat template (which lists the tools)

    def step(self, action: str) -> StepResult:
        calls = parsed_calls(action, self.format, self.schemas)[: self.max_parallel_calls]
        if calls and self.tool_turns < self.max_tool_turns:
            self.tool_turns += 1
            self.calls += len(calls)
            results = _event_loop().run_until_complete(self._call_all(calls))
            for _, reward in results:  # in the order of the calls, as verl lists them
                if reward is not None:
                    self.tool_rewards.append(reward)
            return StepResult([{"role": "tool", "content": text} for text, _ in results], 0.0, False, {})
        extra = {**(self.problem.extra_info or {}), "tool_rewards": list(self.tool_rewards)}
        scored = self.reward(without_calls(action), replace(self.problem, extra_info=extra))
        info = {"correct": scored.value, "tool_calls": float(self.calls), "tool_errors": float(self.errors),
                "tool_reward": float(sum(self.tool_rewards)),
                **{k.removeprefix("reward/"): v for k, v in scored.metrics.items()}}
        return StepResult(None, scored.value, True, info)

    async def _call_all(self, calls: list[tuple[str, Any]]) -> list[tuple[str, Any]]:
        return await asyncio.gather(*(self._call(name, arguments) for name, arguments in calls))

    async def _call(self, name: str, arguments: Any) -> tuple[str, Any]:
        """One call's (text for the policy, tool reward or None); a call that fails answers with why,
        in verl's words, and a reward of 0 (counted)."""
        if name not in self.active_tools:
            self.errors += 1
            return f"Unknown function '{name}'. Available tools: {list(self.active_tools)}", 0.0
        tool = self.active_tools[name]
        try:
            if isinstance(tool, ClassTool):
                response, reward = await tool.call(arguments, self.tools_kwargs.get(name))
                text = normalized(response)[0]
            elif inspect.iscoroutinefunction(tool):
                text, reward = normalized(await tool(**arguments))
            else:
                text, reward = normalized(await asyncio.to_thread(lambda: tool(**arguments)))
            reward = None if reward is None else float(reward)
            if reward is not None and not math.isfinite(reward):
                raise ValueError(f"its reward is {reward}")
        except Exception as err:  # the call's fault or the tool's: the policy reads why
            self.errors += 1
            return f"Error executing tool '{name}': {err}", 0.0
        return cut_response(text, self.max_length, self.side), reward


def prompt_tools(tools: dict[str, Any], extra_info: dict | None) -> tuple[dict[str, Any], dict[str, dict | None]]:
    """A prompt's tools and their kwargs, from its extra_info, checked: ValueError for a malformed
    `tool_selection` or `tools_kwargs` (the start checks every prompt through this, in its template)."""
    return _selected(tools, extra_info), _tools_kwargs(extra_info)


def _selected(tools: dict[str, Any], extra_info: dict | None) -> dict[str, Any]:
    """The tools a prompt sees: those its `tool_selection` names (verl's per-sample tools; names
    that are no tool are passed over), or all."""
    selection = (extra_info or {}).get("tool_selection")
    if not selection:
        return tools
    if isinstance(selection, str):
        selection = [selection]
    if not isinstance(selection, (list, tuple)):
        raise ValueError(f"extra_info.tool_selection is {selection!r:.80}: a list of tool names")
    selected = {name: tools[name] for name in selection if isinstance(name, str) and name in tools}
    if not selected:  # verl would run the prompt without tools: a mistake in the data, most likely
        raise ValueError(f"extra_info.tool_selection {list(selection)!r:.80} names no tool of this run "
                         f"({', '.join(tools)})")
    return selected


def _tools_kwargs(extra_info: dict | None) -> dict[str, dict | None]:
    """A prompt's `extra_info.tools_kwargs` ({tool name: {create_kwargs: {...}}}, verl's), {} when it
    has none; ValueError when it is not that shape."""
    tools_kwargs = (extra_info or {}).get("tools_kwargs") or {}
    shape = "a mapping of each tool's name to {create_kwargs: {...}}"
    if not isinstance(tools_kwargs, dict):
        text = " (JSON text is not read as one)" if isinstance(tools_kwargs, str) else ""
        raise ValueError(f"extra_info.tools_kwargs is {tools_kwargs!r:.80}, not {shape}{text}")
    for name, kwargs in tools_kwargs.items():
        if not (kwargs is None or isinstance(kwargs, dict) and isinstance(kwargs.get("create_kwargs") or {}, dict)):
            raise ValueError(f"extra_info.tools_kwargs[{name!r}] is {kwargs!r:.80}: {shape}")
    return tools_kwargs
