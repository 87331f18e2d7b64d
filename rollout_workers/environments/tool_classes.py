"""verl's BaseTool classes, declared in verl's tool config YAML (`multi_turn.tool_config_path`), as tools
of the built-in `tools` environment (`environment_kwargs.config`):

    tools:
      - class_name: my_tools.Gsm8kTool        # an importable module's class (or path/file.py.Class)
        config: {type: native, any: setting}  # passed to the class; type native (verl's only one)
        tool_schema: {type: function, function: {name: calc_gsm8k_reward, description: ..., parameters: ...}}

As verl's tool agent loop does, each call makes its own instance: `create(create_kwargs=...)` with
the prompt's `extra_info.tools_kwargs[<tool name>].create_kwargs`, `execute(instance_id,
arguments)` -> (ToolResponse, reward, metrics), then `release(instance_id)` whatever happened.
verl's `agent_data` (its loop's state) is not passed to `execute`. A class is built once per process."""
from __future__ import annotations

import contextlib
import logging
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from rollout_workers.verl_stand_in import verl_import_hint, verl_stand_in
from rollout_workers.rewards import is_file_spec, load_module

_INTERPOLATION = re.compile(r"\$\{[^}]*\}")
log = logging.getLogger(__name__)


@dataclass
class ClassTool:
    """One BaseTool instance of the run, called the way verl calls it."""

    instance: Any

    @property
    def name(self) -> str:
        return self.instance.name

    def schema(self) -> dict:
        schema = self.instance.tool_schema
        return schema.model_dump(exclude_unset=True, exclude_none=True) if hasattr(schema, "model_dump") \
            else dict(schema)

    async def call(self, arguments: Any, tool_kwargs: dict | None) -> tuple[Any, Any]:
        """(the tool's response, its reward) of one call; raises what create or execute raised. A
        release that raises is logged and changes nothing of the call's outcome."""
        create_kwargs = (tool_kwargs or {}).get("create_kwargs") or {}
        instance_id = None
        try:
            created = await self.instance.create(create_kwargs=create_kwargs)
            instance_id = created[0] if isinstance(created, tuple) else created
            result = await self.instance.execute(instance_id, arguments)
            if not (isinstance(result, tuple) and len(result) == 3):
                raise TypeError(f"execute returned {result!r:.80}, not (ToolResponse, reward, metrics)")
            return result[0], result[1]
        finally:
            if instance_id is not None:
                try:
                    await self.instance.release(instance_id)
                except Exception as err:  # the tool's own clean-up: the call's answer stands
                    log.warning("tool %r: release(%r) raised %s: %s", self.name, instance_id, type(err).__name__, err)


def _interpolations(value: Any, where: str) -> None:
    """OmegaConf's ${...} is verl's; etarl reads the YAML as it is, so one left in is refused."""
    if isinstance(value, dict):
        for key, item in value.items():
            _interpolations(item, f"{where}.{key}")
    elif isinstance(value, list):
        for i, item in enumerate(value):
            _interpolations(item, f"{where}[{i}]")
    elif isinstance(value, str) and _INTERPOLATION.search(value):
        raise ValueError(f"{where}: {value!r} is an OmegaConf interpolation, which etarl does not resolve: write "
                         f"the value (a secret: read it from the environment in the tool, and name the variable "
                         f"in rollout.multi_turn.environment_env)")


def _tool_class(class_name: str, where: str):
    """The class `module.Class` (or `path/file.py.Class`) names, its module loaded with verl stood in."""
    module_name, _, attr = class_name.rpartition(".")
    key = _key(module_name)
    if key not in _MODULES:  # several classes of one file: the file runs once, as an import would
        # what the module prints goes to stderr (`etarl eval` writes JSON on stdout)
        with verl_stand_in(), contextlib.redirect_stdout(sys.stderr):
            try:
                _MODULES[key] = load_module(module_name, class_name, "tool class")
            except ValueError as err:
                raise ValueError(f"{where}: {err}{_import_hint(str(err))}") from None
    module = _MODULES[key]
    found = getattr(module, attr, None)
    if not isinstance(found, type):
        raise ValueError(f"{where}: module {module_name!r} has no class {attr!r}")
    return found


def _import_hint(error: str) -> str:
    if "relative import" in error:
        return (" (a file copied out of verl/tools/ imports its neighbours relatively: write "
                "`from verl.tools.base_tool import BaseTool`, and the same for schemas)")
    return verl_import_hint(error)


def _key(spec: str) -> str:
    """A cache key: a file's resolved path (the same file by any relative path), a module's name."""
    return str(Path(spec).expanduser().resolve()) if is_file_spec(spec) else spec


_MODULES: dict[str, Any] = {}
_LOADED: dict[str, dict[str, ClassTool]] = {}  # once per process: a class's set-up runs once


def _entries(config_path: str) -> list[dict]:
    """The tool config's `tools:` entries, each with a class_name and a native config; ValueError
    says what is wrong."""
    where = f"tool config {config_path!r}"
    try:
        declared = yaml.safe_load(Path(config_path).expanduser().read_text(encoding="utf-8"))
    except (OSError, yaml.YAMLError) as err:
        raise ValueError(f"{where}: {err}") from None
    entries = declared.get("tools") if isinstance(declared, dict) else None
    if not isinstance(entries, list) or not all(isinstance(e, dict) for e in entries):
        raise ValueError(f"{where}: needs `tools:`, a list of {{class_name, config, tool_schema}}")
    if not entries:
        raise ValueError(f"{where}: declares no tool")
    _interpolations(entries, where + ": tools")
    for i, entry in enumerate(entries):
        at = f"{where}: tools[{i}]"
        unknown = sorted(set(entry) - {"class_name", "config", "tool_schema"})
        if unknown:
            raise ValueError(f"{at}: {', '.join(unknown)}: not a key of a tool (class_name, config, tool_schema)")
        config = entry.get("config")
        if not isinstance(entry.get("class_name"), str) or "." not in entry["class_name"] \
                or not isinstance(config, dict):
            raise ValueError(f"{at}: needs class_name (module.Class) and config (a mapping with type: native)")
        if config.get("type") != "native":
            raise ValueError(f"{at}: config.type is {config.get('type')!r}: etarl runs native tools only (verl's "
                             f"newest too; its mcp tools are not carried over)")
    return entries


def class_modules(config_path: str) -> list[str]:
    """The modules (or files) of the tool config's classes: what workers must be able to import."""
    return list(dict.fromkeys(entry["class_name"].rpartition(".")[0] for entry in _entries(config_path)))


def load_tool_classes(config_path: str) -> dict[str, ClassTool]:
    """{tool name: tool} of a verl tool config; ValueError says what in it is wrong."""
    key = str(Path(config_path).expanduser().resolve())
    if key in _LOADED:
        return _LOADED[key]
    tools: dict[str, ClassTool] = {}
    for i, entry in enumerate(_entries(config_path)):
        at = f"tool config {config_path!r}: tools[{i}]"
        config = entry["config"]
        cls = _tool_class(entry["class_name"], at)
        # the schema model is the one the class was written against; verl's BaseTool prints the schema,
        # which goes to stderr (`etarl eval` writes JSON on stdout)
        with verl_stand_in(), contextlib.redirect_stdout(sys.stderr):
            from verl.tools.schemas import OpenAIFunctionToolSchema

            try:
                schema = entry.get("tool_schema")
                schema = None if schema is None else OpenAIFunctionToolSchema.model_validate(schema)
                tool = ClassTool(cls(config=config, tool_schema=schema))
                tool.schema()  # what the template needs of it
                if not isinstance(tool.name, str):
                    raise TypeError(f"its name is {tool.name!r}, not a string")
            except Exception as err:  # a schema that does not validate, or the class's own set-up
                raise ValueError(f"{at}: {entry['class_name']}: {type(err).__name__}: {err}") from None
        if tool.name in tools:
            raise ValueError(f"{at}: a second tool named {tool.name!r}")
        tools[tool.name] = tool
    _LOADED[key] = tools
    return tools

