"""The config tree: one YAML file composes every component's pydantic config.

    etarl train --config configs/default.yaml learner.lr=3e-5 buffer.gate.eta=4 mode=async

Overrides are `dotted.key=value`; the value is read as YAML (so `4` is an int, `true` a bool,
`null` None, `[1, 2]` a list) and pydantic then coerces it to the field's type. Unknown keys and
bad values are errors that name the full dotted key.
"""
from __future__ import annotations

import collections.abc
import difflib
import json
import os
import types
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Literal, Optional, Union, get_args, get_origin

import yaml
from pydantic import BaseModel, ConfigDict, Field, Tag, ValidationError, field_validator, model_validator

from rollout_workers.tiny_model import TinyModelSpec
from services.yaml_values import yaml_value


class ConfigError(ValueError):
    """A config file or override that cannot be used; the message names the dotted key."""


class RunConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    steps: int = Field(40, ge=1, description="learner steps (weight versions) to run")
    epochs: Optional[float] = Field(None, gt=0, description="passes over the train prompts (verl's "
                                    "trainer.total_epochs); set, it decides run.steps when the run starts: usable "
                                    "prompts // buffer.gate.batch_size steps an epoch (verl's loader drops a last "
                                    "partial batch) times epochs, rounded down (the saved config then names the "
                                    "steps). A file's prompts only (rollout.task.kind=file)")
    seed: int = Field(0, description="the run's seed: the learner's, the held-out set's, and (unless they are "
                      "set) the train prompts' order (rollout.task.seed) and the sampler's (rollout.sampling.seed)")
    run_dir: Optional[str] = Field(None, description="where logs, plots and checkpoints go; None: runs/<time>")
    model: str = Field("tiny", description="HF model folder, or 'tiny': the built-in warm-started tiny model "
                       "('tiny-moe': the same as a Qwen3 mixture of experts, 8 experts, top-2)")
    cache_dir: str = Field(".cache", description="where the tiny model is built once and reused")
    tiny_model: TinyModelSpec = Field(default_factory=TinyModelSpec, description="the tiny model "
                                      "(model: tiny): its size and how far its supervised warm start goes")
    eval_every: int = Field(10, ge=0, description="evaluate every N steps (0: only at start and end)")
    checkpoint_every: int = Field(0, ge=0, description="checkpoint every N steps (0: only at the end)")
    keep_checkpoints: int = Field(2, ge=1)
    wait_for_workers_s: float = Field(0.0, ge=0, description="before the first step, wait up to this long "
                                      "until every rollout worker's engine is up and has joined the weight "
                                      "channel (every version then goes to all of them); 0: the first step "
                                      "takes the first groups that come and a slower engine joins later")
    stall_report_s: float = Field(300.0, ge=0, description="a step that waits this long for its batch says why "
                                  "(the buffer's counts, whether any group came in), and again every as long; 0: "
                                  "never")
    progress: bool = True


class RayConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    address: str = Field("local", description="'local': an embedded cluster on 127.0.0.1; 'auto' or "
                         "'ray://host:port': join an existing cluster")
    num_cpus: Optional[int] = Field(None, ge=1, description="CPUs of the embedded cluster (None: all)")
    num_gpus: Optional[int] = Field(None, ge=0, description="GPUs of the embedded cluster (None: those Ray "
                                    "detects); declared GPUs need not exist (placement tests on a CPU machine)")
    namespace: str = "etarl"
    worker_max_restarts: int = Field(3, ge=0, description="Ray restarts of a crashed rollout worker")
    worker_num_cpus: float = Field(1.0, ge=0, description="Ray CPUs reserved per rollout worker")
    learner_num_cpus: float = Field(1.0, ge=0, description="Ray CPUs reserved per learner rank")
    layout: Literal["auto", "colocated", "separate"] = Field(
        "auto", description="where the engines and the learner go on GPUs: colocated (engine i and learner rank i "
        "share one GPU; the engine's memory share is rollout.engine.gpu_memory_utilization, the learner takes the "
        "rest), separate (a GPU each), auto: chosen by `etarl plan` from the GPUs found (services/placement.py)")
    placement_timeout_s: float = Field(600.0, gt=0, description="how long to wait for the cluster to free "
                                       "the resources the plan reserves (`etarl plan`) before giving up")
    log_to_driver: bool = Field(False, description="show the actors' logs in this terminal")


class EvalConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    enabled: bool = Field(True, description="evaluate at the start, every run.eval_every steps and at the end")
    num_prompts: int = Field(64, ge=1, description="held-out prompts per evaluation")
    n_samples: int = Field(4, ge=0, description="sampled answers per prompt for pass@k (0: greedy only)")
    k: int = Field(4, ge=1)
    temperature: float = Field(1.0, gt=0)
    max_new_tokens: Optional[int] = Field(None, ge=1, description="None: the rollout setting")
    engine: Optional[Literal["vllm", "hf"]] = Field(None, description="`etarl eval` only (None: the rollout engine "
                                                    "kind); during training a rollout worker's engine evaluates")

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
        hint = ""
        if not sep and Path(text).exists():  # `etarl eval runs/X`, `etarl train my.yaml`
            hint = (": it is a path; a config file goes after --config, a run's folder after --run (eval) or "
                    "--resume (train)")
        raise ConfigError(f"override {text!r} is not of the form dotted.key=value{hint}")
    try:
        value = yaml_value(raw) if raw.strip() else ""
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


def _holds(annotation) -> list[tuple[Optional[str], Any]]:
    """What a field may hold, unwrapped from Optional/Union/Annotated: (its union tag or None, type)."""
    origin = get_origin(annotation)
    if origin is Annotated:
        inner, *meta = get_args(annotation)
        tag = next((m.tag for m in meta if isinstance(m, Tag)), None)
        return [(tag or t, x) for t, x in _holds(inner)]
    if origin in (Union, types.UnionType):
        return [held for arg in get_args(annotation) for held in _holds(arg)]
    return [(None, annotation)]


def _models(holds) -> list[type[BaseModel]]:
    return [t for _, t in holds if isinstance(t, type) and issubclass(t, BaseModel)]


def _is_mapping(t) -> bool:
    return get_origin(t) in (dict, collections.abc.Mapping) or t is dict


@dataclass
class _Place:
    """Where an error is, as a user writes the key: pydantic's location without its union labels
    (`eta.int`, `eta.literal['auto']`, `weight_sync.object_store`), and what was known there."""

    parts: list[str]
    parent: list  # what the value one level up may hold (for an unknown key: the keys it could be)
    form: Optional[tuple[str, str, list]] = None  # a tagged union read as one of its forms: (key, tag, holds)

    @property
    def key(self) -> str:
        return ".".join(self.parts) or "<root>"


def _place(model: type[BaseModel], loc: tuple) -> _Place:
    place = _Place([], [])
    holds: list = [(None, model)]
    for part in loc:
        if isinstance(part, int):  # a list's item
            place.parts[-1:] = [f"{place.parts[-1] if place.parts else ''}[{part}]"]
            holds = [h for _, t in holds if get_origin(t) in (list, tuple) for h in _holds(get_args(t)[0])]
            continue
        # a union's form first: pydantic names the form a value was read as (its tag, or its class)
        # before the form's own keys, and a tag may also be a key of its form (`folder`)
        forms = [(tag, t) for tag, t in holds if len(holds) > 1 and part in (tag, getattr(t, "__name__", None))]
        owner = next((m for m in _models(holds) if part in m.model_fields), None)
        if forms:
            place.form = (place.key, part, holds)
            holds = forms
        elif owner is not None:
            place.parts.append(part)
            place.parent, holds = holds, _holds(owner.model_fields[part].annotation)
        elif _models(holds) or any(_is_mapping(t) for _, t in holds):  # an unknown key, or a mapping's own key
            place.parts.append(str(part))
            place.parent, holds = holds, [(None, Any)]
        # else a union member's label (`int`, `literal['auto']`): not part of the key
    return place


def _keys_below(models: list, name: str, prefix: str = "", depth: int = 4) -> list[str]:
    """The dotted keys below these models whose last part is `name` (a key given at the wrong level)."""
    found = []
    for m in models:
        for field_name, info in m.model_fields.items():
            key = f"{prefix}{field_name}"
            if field_name == name:
                found.append(key)
            elif depth > 1:
                found += _keys_below(_models(_holds(info.annotation)), name, key + ".", depth - 1)
    return list(dict.fromkeys(found))


def _unknown_key_hint(place: _Place) -> str:
    from services.verl_keys import VERL_SECTIONS

    name, parent_key = place.parts[-1], ".".join(place.parts[:-1])
    if not parent_key and name in VERL_SECTIONS:  # a verl config file
        return (" (a section of verl's config: etarl does not read verl's keys; named on the command line "
                "they are answered with etarl's)")
    prefix = parent_key + "." if parent_key else ""
    known = [k for m in _models(place.parent) for k in m.model_fields]
    close = difflib.get_close_matches(name, known, n=1)
    if close:
        return f" (did you mean {prefix}{close[0]}?)"
    if place.form is not None:
        form_key, tag, holds = place.form

        def selector(form: str, model) -> str:  # the key that selects a form: `channel: Literal["broadcast"]`
            fields = [f for f, info in model.model_fields.items() if get_args(info.annotation) == (form,)]
            return f"{form_key}.{fields[0]}={form}" if fields else f"{form_key} in its {form} form"

        this = next((selector(tag, t) for other, t in holds if other == tag and t in _models(holds)), tag)
        others = [selector(other, t) for other, t in holds if other != tag and t in _models(holds)
                  and name in t.model_fields]
        if others:
            return f" with {this} (a key of {' or '.join(others)})"
    below = _keys_below(_models(place.parent), name)
    if below:
        return f" (did you mean {' or '.join(prefix + k for k in below[:3])}?)"
    return ""


def format_validation_error(exc: ValidationError, model: type[BaseModel], source: str) -> ConfigError:
    by_key: dict[str, list[str]] = {}  # one line per key: a union's members' complaints joined
    got_by_key: dict[str, str] = {}
    for err in exc.errors():
        loc = tuple(err["loc"])
        place = _place(model, loc)
        if err["type"] == "extra_forbidden":
            by_key.setdefault(place.key, []).append("unknown key" + _unknown_key_hint(place))
            continue
        got = err.get("input")
        if not isinstance(got, dict):
            got_by_key.setdefault(place.key, f" (got {got!r})")
        msg = err["msg"].removeprefix("Value error, ")
        by_key.setdefault(place.key if loc else "", []).append(msg)
    lines = [f"  {key + ': ' if key else ''}{'; or '.join(dict.fromkeys(msgs))}{got_by_key.get(key, '')}"
             for key, msgs in by_key.items()]
    return ConfigError(f"invalid config ({source}):\n" + "\n".join(lines))


def read_yaml(path: str | os.PathLike) -> dict:
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file {str(path)!r} does not exist")
    try:
        data = yaml_value(path.read_text(encoding="utf-8"))
    except yaml.YAMLError as exc:
        raise ConfigError(f"config file {str(path)!r} is not valid YAML: {exc}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"config file {str(path)!r} must hold a mapping at the top, got {type(data).__name__}")
    if "apiVersion" in data and "kind" in data:  # a Kubernetes manifest, e.g. deploy/k8s/etarl-config.yaml
        return _config_in_manifest(path, data)
    return data


def _config_in_manifest(path: Path, manifest: dict) -> dict:
    """The etarl config a ConfigMap carries as its one YAML entry (`data: {etarl.yaml: |...}`), so
    the ConfigMap a cluster mounts is the file `etarl plan --config` checks."""
    entries = manifest.get("data") if manifest.get("kind") == "ConfigMap" else None
    texts = [v for k, v in (entries or {}).items() if str(k).endswith((".yaml", ".yml")) and isinstance(v, str)]
    if len(texts) != 1:
        raise ConfigError(f"config file {str(path)!r} is a Kubernetes {manifest.get('kind')} manifest, not an etarl "
                          "config: give the config itself, or a ConfigMap with one .yaml entry holding it")
    try:
        data = yaml_value(texts[0])
    except yaml.YAMLError as exc:
        raise ConfigError(f"the ConfigMap {str(path)!r}'s config is not valid YAML: {exc}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"the ConfigMap {str(path)!r}'s config must hold a mapping at the top")
    return data


TRACKERS = ("wandb", "tensorboard")  # experiment trackers etarl feeds (services/trackers.py)


class MetricsConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    port: Optional[int] = Field(None, ge=0, le=65535, description="serve /metrics for Prometheus on this "
                                "port (0: any free port; None: off)")
    host: str = "127.0.0.1"
    trackers: list[Literal[TRACKERS]] = Field(
        default_factory=list, description="experiment trackers that also get every step's and evaluation's "
        "metrics (verl's trainer.logger): wandb (Weights & Biases; WANDB_API_KEY, or WANDB_MODE=offline, in the "
        "driver's environment), tensorboard (RUN_DIR/tensorboard)")
    project: str = Field("etarl", description="the W&B project (verl's trainer.project_name)")
    experiment: Optional[str] = Field(None, description="the run's name in W&B (verl's trainer.experiment_name); "
                                      "None: the run folder's name")

    @field_validator("trackers")
    @classmethod
    def _each_tracker_once(cls, value: list[str]) -> list[str]:
        return list(dict.fromkeys(value))  # one named twice would get every metric twice


# ---------------------------------------------------------------- the tree

from buffer.config import BufferConfig, GateConfig  # noqa: E402  (after the generic part on purpose: it needs none of it)
from learner.config import LearnerConfig  # noqa: E402
from learner.correction import RolloutCorrectionConfig  # noqa: E402
from rollout_workers.config import VLLM_LORA_RANKS, EngineLora, RolloutConfig  # noqa: E402

TINY_MODEL = "tiny"
TINY_MOE_MODEL = "tiny-moe"  # run.tiny_model as a mixture of experts (TinyModelSpec.moe)


def is_builtin_model(model: str) -> bool:
    """Whether run.model names a model etarl builds at start (run.tiny_model), not an HF folder."""
    return model in (TINY_MODEL, TINY_MOE_MODEL)


MODES = {"synchronous": 0, "one_step_off": 1}


class RunBufferConfig(BufferConfig):
    """The run's `buffer:` section: the buffer's own settings (`buffer.config.BufferConfig`) plus
    how the run keeps it alive. `service_config()` is the part the buffer itself takes."""

    max_restarts: int = Field(3, ge=0, description="restarts of a buffer that died (the ZMQ service child, "
                              "or the Ray actor) before the run stops; each restart replays the buffer's "
                              "durable log, so nothing accepted is lost (RUN_DIR/buffer-actor.log, or for zmq "
                              "buffer.log.path, by default RUN_DIR/buffer-service.log); 0: no restart, and no "
                              "log unless buffer.log.path names one")

    @model_validator(mode="after")
    def _ray_log_lives_in_the_run(self):
        if self.transport == "ray" and self.log.path is not None:
            raise ValueError("buffer.log.path is the ZMQ service's log; with buffer.transport=ray the run keeps "
                             "the buffer actor's log in RUN_DIR/buffer-actor.log (drop buffer.log.path, or use "
                             "buffer.transport=zmq)")
        return self

    def service_config(self) -> BufferConfig:
        """The settings the buffer service or actor takes (the run-only keys left out)."""
        return BufferConfig.model_validate(self.model_dump(exclude={"max_restarts"}))


class EtarlConfig(BaseModel):
    """The whole run. `run.model` is the one home of the model path (the learner and the workers
    get it from here); `buffer.gate.eta` the one home of η; `mode` is a named η."""

    model_config = ConfigDict(extra="forbid")

    mode: Literal["synchronous", "one_step_off", "async"] = Field(
        "async", description="synchronous: eta=0; one_step_off: eta=1; async: eta from buffer.gate.eta (>= 1 or null)")
    run: RunConfig = Field(default_factory=RunConfig)
    ray: RayConfig = Field(default_factory=RayConfig)
    buffer: RunBufferConfig = Field(default_factory=lambda: RunBufferConfig(transport="ray"))
    rollout: RolloutConfig = Field(default_factory=RolloutConfig)
    learner: LearnerConfig
    eval: EvalConfig = Field(default_factory=EvalConfig)
    metrics: MetricsConfig = Field(default_factory=MetricsConfig)

    @model_validator(mode="before")
    @classmethod
    def _fill_shared_values(cls, data: Any):
        """Copy the values with one home (model path, η of a named mode, seed) into the
        components that need them; an explicit contradiction is an error naming both keys."""
        if not isinstance(data, dict):
            return data
        data = {k: (dict(v) if isinstance(v, dict) else v) for k, v in data.items()}
        run = data.get("run") if isinstance(data.get("run"), dict) else {}
        learner = data.setdefault("learner", {})
        if isinstance(learner, dict):
            model = run.get("model", TINY_MODEL) or TINY_MODEL
            if "model_path" in learner and learner["model_path"] != model:
                raise ValueError(f"learner.model_path ({learner['model_path']!r}) differs from run.model "
                                 f"({model!r}); set the model once, in run.model")
            learner["model_path"] = model
            learner.setdefault("seed", run.get("seed", 0))
        rollout = data.setdefault("rollout", {})
        if isinstance(rollout, dict):  # one seed varies the whole run: prompts and samples too
            for part in ("sampling", "task"):
                section = rollout.get(part) or {}
                if isinstance(section, dict):
                    rollout[part] = {"seed": run.get("seed", 0), **section}
        mode = data.get("mode", "async")
        if mode in MODES:
            buffer = data.setdefault("buffer", {"transport": "ray"})
            if isinstance(buffer, dict):
                gate = dict(buffer.get("gate") or {})
                if "eta" in gate and gate["eta"] != MODES[mode]:
                    raise ValueError(f"mode={mode} means buffer.gate.eta={MODES[mode]}, but buffer.gate.eta="
                                     f"{gate['eta']!r}; drop one of them")
                gate["eta"] = MODES[mode]
                buffer["gate"] = gate
        _move_diagnostics(data, learner)
        return data

    @model_validator(mode="after")
    def _consistent(self):
        if self.mode == "async" and self.buffer.gate.eta == 0:
            raise ValueError("mode=async with buffer.gate.eta=0 is synchronous; use mode=synchronous")
        if self.eval.max_new_tokens is None:
            self.eval.max_new_tokens = self.rollout.sampling.max_new_tokens
        if abs(self.learner.temperature - self.rollout.sampling.temperature) > 1e-9:
            raise ValueError(
                f"learner.temperature ({self.learner.temperature}) must equal rollout.sampling.temperature "
                f"({self.rollout.sampling.temperature}): the learner's log-probs must describe the sampler")
        if self.learner.routing_replay == "r3":
            rollout = self.rollout
            rollout.engine.return_routing = True  # r3 replays the engine's experts: the samples must carry them
            aborts = rollout.interrupt_on_update and (not rollout.streaming or rollout.multi_turn.environment)
            if rollout.engine.kind == "vllm" and aborts:
                raise ValueError("learner.routing_replay=r3 with vLLM: a request aborted for new weights "
                                 "(rollout.interrupt_on_update with rollout.streaming=false or multi-turn) comes back "
                                 "without its experts (vLLM returns them with a finished request only); use "
                                 "rollout.streaming=true (vLLM pauses requests in place), interrupt_on_update=false, "
                                 "or r2")
        sync, engine = self.learner.weight_sync, self.rollout.engine
        self._engine_lora(sync, engine)
        if sync.channel == "broadcast" and sync.backend != "auto":
            if engine.weight_transfer not in ("auto", sync.backend):
                raise ValueError(f"learner.weight_sync.backend={sync.backend} but rollout.engine.weight_transfer="
                                 f"{engine.weight_transfer}: both ends of vLLM's weight transfer use one backend")
            engine.weight_transfer = sync.backend
        sampling = self.rollout.sampling
        if self.learner.advantage.estimator == "remax":
            self.rollout.greedy_baseline = True  # remax's baseline: the group's greedy response's reward
        if self.rollout.greedy_baseline and self.rollout.multi_turn.enabled:
            raise ValueError("rollout.greedy_baseline (learner.advantage.estimator=remax) is single-turn: a "
                             "multi-turn rollout has no one greedy response to score; use another estimator "
                             "(grpo, rloo, tir_optimal_token_baseline, ...) with rollout.multi_turn")
        if self.learner.advantage.estimator == "grpo_passk" and sampling.n < 2:
            raise ValueError("learner.advantage.estimator=grpo_passk compares each group's best response with its "
                             f"second best: rollout.sampling.n must be >= 2, got {sampling.n}")
        if self.learner.advantage.estimator == "gdpo":
            from rollout_workers.rewards import BUILTIN_REWARDS

            without = ("multi-turn rollouts take their rewards from the environment" if self.rollout.multi_turn.environment
                       else f"rollout.reward={self.rollout.reward} is one score" if self.rollout.reward in BUILTIN_REWARDS
                       else None)
            if without:
                raise ValueError(f"learner.advantage.estimator=gdpo normalises the parts of a reward one by one, but "
                                 f"{without}, with no parts: use a verl-form reward whose dict holds "
                                 f"{self.learner.advantage.gdpo_reward_keys}")
        if self.run.epochs is not None and self.rollout.task.kind != "file":
            raise ValueError(f"run.epochs counts passes over a prompt file (rollout.task.kind=file); the built-in "
                             f"{self.rollout.task.kind} task has no fixed size: set run.steps")
        if self.run.epochs is None:  # with epochs, checked once the steps are worked out (services/inputs.py)
            self.learner.check_decay_span(self.run.steps, f"the run's {self.run.steps} steps")
        if sampling.top_p < 1.0 or sampling.top_k > 0:
            raise ValueError(
                f"rollout.sampling.top_p={sampling.top_p} / top_k={sampling.top_k} truncate the sampler's distribution: "
                "vLLM reports log-probs of the truncated distribution while the learner scores the full vocabulary, "
                "so every IS weight and PPO ratio would be biased; use top_p=1.0 and top_k=0 (temperature alone)")
        return self

    def _engine_lora(self, sync, engine) -> None:
        """learner.lora.publish=adapter: the engines take each version as adapters, so they are told the
        adapters' layers and scale (rollout.engine.lora, derived here: a value given is replaced)."""
        lora = self.learner.lora
        if lora is None or lora.publish != "adapter":
            engine.lora = None
            return
        if sync.channel == "broadcast":
            raise ValueError("learner.lora.publish=adapter sends A and B to engines that load them as a LoRA "
                             "adapter, but learner.weight_sync.channel=broadcast is vLLM's weight transfer, which "
                             "loads model weights only: use the object_store or folder channel (a version is "
                             "rank x (in + out) per adapted layer: 0.3 GB at rank 64 on a 7B model), or "
                             "learner.lora.publish=merged")
        if engine.kind == "vllm" and lora.rank > max(VLLM_LORA_RANKS):
            raise ValueError(f"learner.lora.rank={lora.rank}: vLLM takes LoRA adapters up to rank "
                             f"{max(VLLM_LORA_RANKS)} (max_lora_rank); use learner.lora.publish=merged")
        engine.lora = EngineLora(**lora.model_dump(exclude={"publish"}))

    @property
    def eta(self) -> Optional[int]:
        return self.buffer.gate.eta

    def learner_for_run(self, model_dir) -> LearnerConfig:
        """The learner's config as a run builds it: its model folder, and a decay without total_steps spanning
        the run's steps (worked out here, not saved: a resumed run with more steps stretches it, as verl's
        decay spans the total steps of the run it resumes)."""
        learner = self.learner
        update: dict[str, Any] = {"model_path": str(model_dir)}
        if learner.lr_schedule != "constant" and learner.total_steps is None:
            update["total_steps"] = self.run.steps
        return learner.model_copy(update=update)

    @property
    def batch_size(self) -> int:
        """Groups per learner step (B of the η gate)."""
        return self.buffer.gate.batch_size

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.model_dump(mode="json"), sort_keys=False)

    # presets ---------------------------------------------------------------------------
    @classmethod
    def synchronous(cls, **overrides: Any) -> "EtarlConfig":
        """η = 0: every sample comes from the current weights; generation and training alternate."""
        return build_config({"mode": "synchronous"}, overrides)

    @classmethod
    def one_step_off(cls, **overrides: Any) -> "EtarlConfig":
        """η = 1: generation of step i+1 overlaps training of step i."""
        return build_config({"mode": "one_step_off"}, overrides)

    @classmethod
    def fully_async(cls, eta: Optional[int] = 4, **overrides: Any) -> "EtarlConfig":
        """Workers never wait for the learner beyond the η bound (None: unbounded)."""
        return build_config({"mode": "async", "buffer": {"transport": "ray", "gate": {"eta": eta}}}, overrides)


def _move_diagnostics(data: dict, learner) -> None:
    """`diagnostics` is written at the top level and runs in the learner: move it there, with the
    versions the exact drift probe keeps sized to the staleness window (η + 1, or eta_max + 1). A
    saved config holds it as learner.diagnostics: the top level's keys (a resume's overrides) win."""
    if "diagnostics" not in data or not isinstance(learner, dict):
        return
    diagnostics = data.pop("diagnostics")
    saved = learner.get("diagnostics")
    if isinstance(saved, dict) and isinstance(diagnostics, dict):  # keep_versions: sized anew below
        diagnostics = {**{k: v for k, v in saved.items() if k != "keep_versions"}, **diagnostics}
    if isinstance(diagnostics, dict) and "keep_versions" not in diagnostics:
        buffer = data.get("buffer") if isinstance(data.get("buffer"), dict) else {}
        gate = buffer.get("gate") if isinstance(buffer.get("gate"), dict) else {}
        fields = GateConfig.model_fields
        eta = gate.get("eta", fields["eta"].default)
        window = gate.get("eta_max", fields["eta_max"].default) if eta == "auto" else eta
        window = window if isinstance(window, int) else None  # unbounded: the default count
        if window is not None:
            diagnostics = {**diagnostics, "keep_versions": int(window) + 1}
    learner["diagnostics"] = diagnostics


def fill_sample_limits(cfg: EtarlConfig, model_dir: str | os.PathLike) -> None:
    """The buffer's sample limits that depend on the model, once its folder is known (a tiny model
    is built at start): `buffer.limits.vocab_size` from its config's vocabulary (a token id beyond
    it is a device-side assert in the learner), `buffer.limits.max_sequence_tokens` from the
    rollout engine's context (`rollout.engine.max_model_len`, else the model's) and, for an MoE
    policy, `buffer.limits.num_experts` (an expert id in a sample's routing must be below it). A value set in
    the config stays if it is within the model's (stricter on purpose); beyond it is an error
    naming both."""
    from lm.moe import config_experts
    from rollout_workers.data import model_context_len

    path = Path(model_dir) / "config.json"
    try:
        model = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ConfigError(f"run.model: cannot read the model's vocabulary size from {path}: {exc}") from None
    text = model.get("text_config") if isinstance(model.get("text_config"), dict) else {}
    vocab = model.get("vocab_size", text.get("vocab_size"))
    experts = config_experts(model)  # an MoE policy's routed experts (None: dense)
    context = cfg.rollout.engine.max_model_len or model_context_len(model_dir)
    limits = cfg.buffer.limits
    update = {}
    for key, model_value, source in (("vocab_size", vocab, f"the vocabulary of {path}"),
                                     ("max_sequence_tokens", context, "the rollout engine's context"),
                                     ("num_experts", experts, f"the experts of {path}")):
        if not isinstance(model_value, int) or model_value < 1:
            continue  # the model does not say: the configured value (or none) stands
        set_value = getattr(limits, key)
        if set_value is None:
            update[key] = model_value
        elif set_value > model_value:
            raise ConfigError(f"buffer.limits.{key}={set_value} exceeds {source} ({model_value}): samples the "
                              f"model cannot take would be accepted; drop buffer.limits.{key} (it is filled from "
                              "the model) or lower it")
    if update:
        cfg.buffer.limits = limits.model_copy(update=update)


def _open_preset(tree: dict, key: str) -> None:
    """A key set below a section given as a preset's name (`learner.rollout_correction:
    decoupled_token_is`), or left to its default, opens the preset into its keys first: the
    override then changes that key alone (`learner.rollout_correction.rollout_is_threshold=3` keeps
    token-level IS), as it would in a section written out."""
    section = "learner.rollout_correction"
    if not key.startswith(section + "."):
        return
    learner = tree.setdefault("learner", {})
    if not isinstance(learner, dict):
        return  # `learner: 5`: the validation error names it
    name = learner.get("rollout_correction")
    if name is None or isinstance(name, str):
        try:
            preset = (RolloutCorrectionConfig.preset(name) if name is not None
                      else LearnerConfig.model_fields["rollout_correction"].default_factory())
        except ValueError as err:
            raise ConfigError(f"{section}: {err}") from None
        learner["rollout_correction"] = preset.model_dump(mode="json")


def build_config(tree: dict, overrides: dict[str, Any] | list[str] | None = None, source: str = "config") -> EtarlConfig:
    """Validate a config tree after applying dotted overrides (`{"a.b": v}` or `["a.b=v"]`)."""
    import copy

    from services.verl_keys import verl_keys_message

    tree = copy.deepcopy(tree)
    items = list(overrides.items()) if isinstance(overrides, dict) else [parse_override(o) for o in overrides or []]
    verl = verl_keys_message(items)
    if verl:
        raise ConfigError(f"invalid config ({source}): {verl}")
    for key, value in items:
        _open_preset(tree, key)
        set_dotted(tree, key, value)
    try:
        return EtarlConfig.model_validate(tree)
    except ValidationError as exc:
        raise format_validation_error(exc, EtarlConfig, source) from None


DEFAULT_CONFIG = Path(__file__).resolve().parents[1] / "configs" / "default.yaml"


def load_config(path: str | os.PathLike | None = None, overrides: list[str] | None = None) -> EtarlConfig:
    """A YAML file (default: configs/default.yaml, the embedded default) plus `key=value` overrides."""
    path = Path(path) if path else DEFAULT_CONFIG
    tree = read_yaml(path)
    source = f"{path}" + (f" + {len(overrides)} override(s)" if overrides else "")
    return build_config(tree, overrides, source=source)


def with_absolute_paths(cfg: EtarlConfig, base: str | os.PathLike | None = None) -> EtarlConfig:
    """`cfg` with its relative file paths made absolute against `base` (default: the working folder): the
    run folder's config.yaml then names the same files when the run is resumed from another folder, and
    every node of a cluster reads the files the driver checked. Paths are joined, not resolved: a symbolic
    link a cluster mounts stays the path given; `~` is expanded, as the loaders of these files expand it.
    URLs and module names ("pkg.mod:fn") are left as given: files and modules told apart as the loaders do."""
    from rollout_workers.rewards import is_file_spec

    base = Path.cwd() if base is None else Path(base)

    def absolute(path: str) -> str:
        return path if "://" in path else os.path.normpath(os.path.join(base, os.path.expanduser(path)))

    def absolute_file(spec: str) -> str:  # "path/to/file.py:Name" (a reward, an environment)
        file, sep, name = spec.rpartition(":")
        return f"{absolute(file)}:{name}" if sep and file and is_file_spec(file) else spec

    run, task, multi_turn = cfg.run, cfg.rollout.task, cfg.rollout.multi_turn
    model = run.model if is_builtin_model(run.model) else absolute(run.model)
    run = run.model_copy(update={"run_dir": run.run_dir and absolute(run.run_dir), "model": model,
                                 "cache_dir": absolute(run.cache_dir)})
    task = task.model_copy(update={
        key: [absolute(p) for p in value] if isinstance(value, list) else value and absolute(value)
        for key in ("path", "heldout_path") for value in [getattr(task, key)]})
    kwargs = dict(multi_turn.environment_kwargs)
    if isinstance(kwargs.get("path"), str) and is_file_spec(kwargs["path"]):  # or a module's name
        kwargs["path"] = absolute(kwargs["path"])
    if isinstance(kwargs.get("config"), str):  # the tools' YAML
        kwargs["config"] = absolute(kwargs["config"])
    multi_turn = multi_turn.model_copy(update={
        "environment": multi_turn.environment and absolute_file(multi_turn.environment),
        "environment_kwargs": kwargs})
    rollout = cfg.rollout.model_copy(update={"task": task, "multi_turn": multi_turn,
                                             "reward": absolute_file(cfg.rollout.reward)})
    learner = cfg.learner.model_copy(update={"model_path": model})  # run.model's copy: a saved config must agree
    if getattr(learner.weight_sync, "folder", None):
        learner = learner.model_copy(update={"weight_sync": learner.weight_sync.model_copy(
            update={"folder": absolute(learner.weight_sync.folder)})})
    return cfg.model_copy(update={"run": run, "rollout": rollout, "learner": learner})
