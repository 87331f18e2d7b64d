"""How etarl reads a YAML value: a config file, an override's right-hand side, and the check that
a value written back into an override reads the same (services/verl_keys.py)."""
from __future__ import annotations

import re
from typing import Any

import yaml


class _YamlLoader(yaml.SafeLoader):
    """YAML as PyYAML reads it, but for numbers in exponent form ('1e-6', '1.5e3'), which
    YAML 1.2 (and Hydra) read as floats and PyYAML as strings: a free-form value (reward_kwargs,
    environment_kwargs) would get the string."""


_YamlLoader.add_implicit_resolver("tag:yaml.org,2002:float",
                                  re.compile(r"^[-+]?[0-9][0-9_]*(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"),
                                  list("-+0123456789"))


def yaml_value(text: str) -> Any:
    return yaml.load(text, Loader=_YamlLoader)  # noqa: S506 (a SafeLoader)
