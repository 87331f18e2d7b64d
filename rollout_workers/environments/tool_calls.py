"""The tool calls in a policy's turn, in the formats verl's tool agent loop reads
(`rollout.multi_turn.environment_kwargs.format`, verl's `multi_turn.format`):

    hermes (Qwen2.5, Qwen3; verl's default):
        <tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call>
    qwen3_coder (Qwen3-Coder, Qwen3.5):
        <tool_call>
        <function=add>
        <parameter=a>
        2
        </parameter>
        </function>
        </tool_call>

hermes: a block that is not JSON with a name and arguments is no call. qwen3_coder: a block (the
last may be unclosed: a turn cut at its token limit) holds functions, each its name and parameters;
a parameter's text becomes the type its tool's schema gives it (integer, number, boolean, object,
anything else a Python literal, "null" None), or stays text where it is a string, where the schema
does not name it or where it does not convert, as verl's parser does.
"""
from __future__ import annotations

import ast
import json
import re
from typing import Any

FORMATS = ("hermes", "qwen3_coder")
CALL_BLOCK = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)
_OPEN_BLOCK = re.compile(r"<tool_call>(.*?)</tool_call>|<tool_call>(.*?)$", re.DOTALL)
_FUNCTION = re.compile(r"<function=(.*?)</function>|<function=(.*)$", re.DOTALL)
_PARAMETER = re.compile(r"<parameter=(.*?)</parameter>|<parameter=(.*?)$", re.DOTALL)
_TEXT_TYPES = ("string", "str", "text", "varchar", "char", "enum")
_INTEGER_TYPES = ("int", "uint", "long", "short", "unsigned")


def parsed_calls(action: str, format: str = "hermes", schemas: dict[str, dict] | None = None) -> list[tuple[str, Any]]:
    """(name, arguments) of each call of a turn, in order; `schemas` ({name: OpenAI function schema})
    types qwen3_coder's parameters."""
    if format == "hermes":
        return _hermes(action)
    if format == "qwen3_coder":
        return _qwen3_coder(action, schemas or {})
    raise ValueError(f"tool call format {format!r}: etarl reads {', '.join(FORMATS)}")


def without_calls(action: str) -> str:
    """The turn's text with its call blocks removed (what the reward scores of an answer turn)."""
    return CALL_BLOCK.sub("", action).strip()


def _hermes(action: str) -> list[tuple[str, Any]]:
    calls = []
    for block in CALL_BLOCK.findall(action):
        try:
            call = json.loads(block)
            calls.append((call["name"], call["arguments"]))
        except (ValueError, KeyError, TypeError):
            continue
    return calls


def _qwen3_coder(action: str, schemas: dict[str, dict]) -> list[tuple[str, Any]]:
    if "<tool_call>" not in action:
        return []
    calls = []
    for closed, open_ in _OPEN_BLOCK.findall(action):
        for function_closed, function_open in _FUNCTION.findall(closed or open_):
            text = function_closed or function_open
            name, sep, body = text.partition(">")
            if not sep:
                continue  # a name that never ended: nothing to call
            properties = schemas.get(name, {}).get("function", {}).get("parameters", {}).get("properties", {})
            arguments = {}
            for parameter_closed, parameter_open in _PARAMETER.findall(body):
                key, sep, value = (parameter_closed or parameter_open).partition(">")
                if sep:
                    value = value.removeprefix("\n").removesuffix("\n")
                    arguments[key] = _typed(value, properties.get(key))
            calls.append((name, arguments))
    return calls


def _typed(value: str, schema: dict | None) -> Any:
    """A parameter's text as its schema's type says, text where it does not convert (verl's rules)."""
    if value.lower() == "null":
        return None
    if schema is None:
        return value
    kind = str(schema.get("type", "string")).strip().lower()
    if kind in _TEXT_TYPES:
        return value
    if kind.startswith(_INTEGER_TYPES):
        try:
            return int(value)
        except ValueError:
            return value
    if kind.startswith(("num", "float")):
        try:
            number = float(value)
            return int(number) if number == int(number) else number
        except (ValueError, OverflowError):  # not a number, or inf / nan
            return value
    if kind in ("boolean", "bool", "binary"):
        return value.lower() == "true"
    if kind == "object" or kind.startswith("dict"):
        try:
            return json.loads(value)
        except ValueError:
            pass
    try:
        return ast.literal_eval(value)  # literals only: the text is the model's, never code to run
    except Exception:  # ValueError, SyntaxError, RecursionError ...: it stays text
        return value
