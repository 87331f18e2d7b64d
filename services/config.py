"""The config tree: one YAML file composes every component's pydantic config.

    etarl train --config configs/default.yaml learner.lr=3e-5 buffer.eta=2 mode=one_step_off

Overrides are `dotted.key=value`; the value is read as YAML (so `4` is an int, `true` a bool,
`null` None, `[1, 2]` a list) and pydantic then coerces it to the field's type. Unknown keys and
bad values are errors that name the full dotted key.
"""
from __future__ import annotations

import difflib
import os
from pathlib import Path
from typing import Any, Literal, Optional

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator


class ConfigError(ValueError):
    """A config file or override that cannot be used; the message names the dotted key."""


class RunConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    steps: int = Field(40, ge=1, description="learner steps (weight versions) to run")
    seed: int = 0
    run_dir: Optional[str] = Field(None, description="where logs, plots and checkpoints go; None: runs/<time>")
    model: Optional[str] = Field(None, description="HF model folder; None builds the tiny warm-started model")
    eval_every: int = Field(10, ge=0, description="evaluate every N steps (0: only at start and end)")
    checkpoint_every: int = Field(0, ge=0, description="checkpoint every N steps (0: only at the end)")
    keep_checkpoints: int = Field(2, ge=1)
    progress: bool = True


class RayConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    address: str = Field("local", description="'local': an embedded cluster on 127.0.0.1; 'auto' or "
                         "'ray://host:port': join an existing cluster")
    num_cpus: Optional[int] = Field(None, ge=1, description="CPUs of the embedded cluster (None: all)")
    namespace: str = "etarl"
    worker_max_restarts: int = Field(3, ge=0, description="Ray restarts of a crashed rollout worker")


class EvalConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    num_prompts: int = Field(64, ge=1, description="held-out prompts per evaluation")
    n_samples: int = Field(4, ge=0, description="sampled answers per prompt for pass@k (0: greedy only)")
    k: int = Field(4, ge=1)
    temperature: float = Field(1.0, gt=0)
    max_new_tokens: Optional[int] = Field(None, ge=1, description="None: the rollout setting")

    @model_validator(mode="after")
    def _k_within_n(self):
        if self.n_samples and self.k > self.n_samples:
            raise ValueError(f"k={self.k} needs n_samples >= k (got n_samples={self.n_samples})")
        return self


# ---------------------------------------------------------------- generic machinery


def parse_override(text: str) -> tuple[str, Any]:
    """`a.b.c=value` -> ("a.b.c", value read as YAML)."""
    key, sep, raw = text.partition("=")
    key = key.strip()
    if not sep or not key or any(not part for part in key.split(".")):
        raise ConfigError(f"override {text!r} is not of the form dotted.key=value")
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError:
        value = raw  # not YAML (e.g. an unbalanced bracket): keep the string, pydantic judges it
    return key, value


def set_dotted(tree: dict, key: str, value: Any) -> None:
    node = tree
    parts = key.split(".")
    for depth, part in enumerate(parts[:-1]):
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(f"{'.'.join(parts[: depth + 1])} is a value, not a section: cannot set {key}")
        node = child
    node[parts[-1]] = value


def _known_keys(model: type[BaseModel], loc: tuple) -> list[str]:
    """Field names of the sub-model at `loc`, to suggest the key the user meant."""
    for part in loc[:-1]:
        field = model.model_fields.get(str(part)) if isinstance(part, str) else None
        ann = getattr(field, "annotation", None)
        if not (isinstance(ann, type) and issubclass(ann, BaseModel)):
            return []
        model = ann
    return list(model.model_fields)


def format_validation_error(exc: ValidationError, model: type[BaseModel], source: str) -> ConfigError:
    lines = []
    for err in exc.errors():
        loc = tuple(err["loc"])
        key = ".".join(str(p) for p in loc) or "<root>"
        if err["type"] == "extra_forbidden":
            hint = difflib.get_close_matches(str(loc[-1]), _known_keys(model, loc), n=1)
            lines.append(f"  {key}: unknown key" + (f" (did you mean {'.'.join(map(str, loc[:-1] + (hint[0],)))}?)" if hint else ""))
        else:
            got = err.get("input")
            shown = "" if isinstance(got, dict) else f" (got {got!r})"
            lines.append(f"  {key}: {err['msg']}{shown}")
    return ConfigError(f"invalid config ({source}):\n" + "\n".join(lines))


def read_yaml(path: str | os.PathLike) -> dict:
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file {str(path)!r} does not exist")
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except yaml.YAMLError as exc:
        raise ConfigError(f"config file {str(path)!r} is not valid YAML: {exc}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"config file {str(path)!r} must hold a mapping at the top, got {type(data).__name__}")
    return data
