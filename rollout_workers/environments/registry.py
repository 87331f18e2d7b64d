"""Environments by name: built-ins, or user ones as "module:Class" / "path/to/file.py:Class"
(the rewards' convention, `rollout_workers.rewards.resolve_named`)."""
from __future__ import annotations

from rollout_workers.environments.calculator import Calculator
from rollout_workers.environments.function_tools import FunctionTools
from rollout_workers.rewards import resolve_named

BUILTIN_ENVIRONMENTS = {"calculator": Calculator, "tools": FunctionTools}


def resolve_environment(spec: str):
    """The environment class (or factory) a spec names."""
    return resolve_named(spec, BUILTIN_ENVIRONMENTS, "environment", "Class")
