"""The multi-turn agent loop: turns of the policy and steps of an environment, as one token-exact
trajectory per sample.

Each engine batch's trajectories (groups_per_batch × n of them; at most
`max_concurrent_trajectories`, else in waves of whole prompts) advance together, one turn at a
time: every active trajectory's context goes into one engine batch; a turn ends at EOS, at a
`rollout.multi_turn.stop` token (kept in the turn) or at max_new_tokens; the environments then
step in parallel (`EnvironmentPool`, one child process per trajectory) and each observation is
tokenised once and appended. A trajectory ends when its environment says done, after max_turns,
when the next observation would not leave room for a token within max_total_tokens, or when its
environment fails (failure_reward, counted). Between turns the worker loads new weights if there
are any (no abort, no lost work), so the tokens of later turns carry newer versions.

Token-in, token-out: the ids the engine sampled stay as they are (the action is decoded only to
give the environment its text), with their behaviour log-probs and loss mask 1; observation ids
have loss mask 0, log-prob 0 and the version of the turn before them. A step's reward lands on
the last token of its action (`token_rewards`); the trajectory's reward is their sum. The turns
are the runs of loss-mask-1 tokens (the learner finds them there); `turns` in the metadata counts
the policy's turns.
"""
from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import numpy as np

from buffer.sample import Group, Sample, new_id
from rollout_workers.config import MultiTurnConfig
from rollout_workers.data import Problem, PromptFormat
from rollout_workers.engines.base import Completion, SamplingParams
from rollout_workers.environments import EnvironmentPool, EnvOutcome
from rollout_workers.rewards import ERROR_CHARS

ENV_ERROR = "env_error"  # a trajectory's metadata: why its environment failed (it scored failure_reward)

# generate(requests) -> per request, n (completion, per-token versions): the worker's
# `_generate_with_updates` (weights may change within a turn) or an engine call tagged with its version.
Generate = Callable[[list[tuple[list[int], SamplingParams]]], list[list[tuple[Completion, list[int]]]]]
TURN_SEED_BITS = 16  # a turn's seed: the trajectory's seed shifted left, plus the turn number


@dataclass
class Trajectory:
    """One sample in the making: the prompt, then turns and observations."""

    problem: Problem
    params: SamplingParams  # n=1; seed: the trajectory's
    started_version: int
    prompt_ids: list[int] = field(default_factory=list)
    response_ids: list[int] = field(default_factory=list)
    log_probs: list[float] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    token_rewards: list[float] = field(default_factory=list)
    turns: int = 0
    reward: float = 0.0
    finish_reason: str = ""  # "" while running; stop | max_turns | length | env_error
    error: str = ""
    env_seconds: float = 0.0
    info: dict[str, float] = field(default_factory=dict)
    last_action: list[int] = field(default_factory=list)  # the ids of the last turn
    routing: list | None = field(default_factory=list)  # MoE: [tokens, layers, k] parts; None once a turn had none

    @property
    def ended(self) -> bool:
        return bool(self.finish_reason)

    @property
    def context(self) -> list[int]:
        return self.prompt_ids + self.response_ids

    def add_turn(self, completion: Completion, versions: list[int]) -> None:
        n = len(completion.token_ids)
        self.response_ids += completion.token_ids
        self.log_probs += completion.log_probs
        self.loss_mask += [1] * n
        self.versions += versions
        self.token_rewards += [0.0] * n
        self.turns += 1
        self.last_action = list(completion.token_ids)
        if self.routing is not None and completion.routed_experts is not None:
            self.routing.append(completion.routed_experts)
        else:
            self.routing = None

    def add_observation(self, ids: list[int]) -> None:
        self.response_ids += ids
        self.log_probs += [0.0] * len(ids)
        self.loss_mask += [0] * len(ids)
        self.versions += [self.versions[-1] if self.versions else self.started_version] * len(ids)
        self.token_rewards += [0.0] * len(ids)
        if self.routing and ids:  # observation tokens carry no routing: zero rows, never replayed
            self.routing.append(np.zeros((len(ids), *self.routing[0].shape[1:]), self.routing[0].dtype))

    def add_step(self, outcome: EnvOutcome) -> None:
        """The environment's answer to the last turn: its reward on the turn's last token."""
        self.env_seconds += outcome.seconds
        self.token_rewards[-1] += outcome.reward
        self.reward += outcome.reward
        self.info.update(outcome.info)

    def fail(self, error: str, failure_reward: float) -> None:
        """The environment failed: the trajectory's reward is failure_reward, on its last policy
        token (the steps' rewards before it no longer count), so the token rewards still sum to it."""
        self.error, self.finish_reason, self.reward = error, "env_error", failure_reward
        self.token_rewards = [0.0] * len(self.token_rewards)
        policy = [i for i, m in enumerate(self.loss_mask) if m]
        if policy:  # a reset that failed leaves no token to carry it
            self.token_rewards[policy[-1]] = failure_reward

    @property
    def weight_version(self) -> int:
        """The version of the first policy token (the oldest): staleness is judged by it."""
        return min((v for v, m in zip(self.versions, self.loss_mask) if m), default=self.started_version)

    def to_sample(self, group_id: str, worker_id: str, metadata: dict) -> Sample:
        return Sample(
            sample_id=new_id(), group_id=group_id,
            prompt_ids=np.asarray(self.prompt_ids, dtype=np.int32),
            response_ids=np.asarray(self.response_ids, dtype=np.int32),
            rollout_log_probs=np.asarray(self.log_probs, dtype=np.float32),
            loss_mask=np.asarray(self.loss_mask, dtype=np.uint8),
            reward=float(self.reward),
            weight_version=self.weight_version,
            token_versions=np.asarray(self.versions, dtype=np.int32),
            token_rewards=np.asarray(self.token_rewards, dtype=np.float32),
            routed_experts=np.concatenate(self.routing) if self.routing else None,
            worker_id=worker_id,
            finish_reason=self.finish_reason,
            metadata={**metadata, "turns": self.turns, "env_seconds": self.env_seconds,
                      "env_failed": bool(self.error), **{f"env/{k}": v for k, v in self.info.items()},
                      **({ENV_ERROR: self.error[:ERROR_CHARS]} if self.error else {})},
        )


def stop_token_ids(tokenizer, stops: list[str]) -> tuple[int, ...]:
    """The id of each stop text; each must be exactly one token (so the engine stops on it)."""
    ids = []
    for text in stops:
        found = tokenizer(text, add_special_tokens=False)["input_ids"]
        if len(found) != 1:
            raise ValueError(f"rollout.multi_turn.stop: {text!r} is {len(found)} tokens of this tokenizer, not one "
                             f"(a turn ends on a token id: use a text that is a single (added) token)")
        ids.append(int(found[0]))
    return tuple(ids)


class AgentLoop:
    """Runs engine batches of multi-turn trajectories (see the module doc)."""

    def __init__(self, config: MultiTurnConfig, tokenizer, prompt_format: PromptFormat,
                 environment_kwargs: dict | None = None, environment_env: tuple[str, ...] | None = None) -> None:
        """`environment_kwargs` and `environment_env`: RolloutConfig.environment_arguments() and
        .environment_env() (None: the MultiTurnConfig's own)."""
        if not config.enabled:
            raise ValueError("rollout.multi_turn.environment is not set: there is no environment to run")
        self.config = config
        self.tokenizer = tokenizer
        self.prompt_format = prompt_format
        self.stop_ids = stop_token_ids(tokenizer, config.stop)
        kwargs = config.environment_kwargs if environment_kwargs is None else environment_kwargs
        names = config.environment_env if environment_env is None else environment_env
        self.envs = EnvironmentPool(config.environment, kwargs, config.step_timeout_s, env_names=tuple(names))
        limits = [x for x in (config.max_total_tokens, prompt_format.context_len) if x]
        self.budget = min(limits) if limits else math.inf
        self.turns_total = 0

    @classmethod
    def for_rollout(cls, rollout, tokenizer, prompt_format: PromptFormat) -> "AgentLoop":
        """The agent loop of a RolloutConfig: its environment built with the run's arguments."""
        return cls(rollout.multi_turn, tokenizer, prompt_format, rollout.environment_arguments(),
                   rollout.environment_env())

    def run(self, requests: list[tuple[Problem, SamplingParams]], generate: Generate,
            between_turns: Callable[[], None] = lambda: None, version: int = 0) -> list[list[Trajectory]]:
        """params.n trajectories per (problem, params), turn by turn; per request, its trajectories.
        `between_turns()` runs before every turn but the first, and between waves (the worker loads
        new weights there); `version` tags a trajectory that ends before its first token."""
        out = []
        for i, wave in enumerate(self._waves(requests)):
            if i:
                between_turns()
            out += self._run_wave(wave, generate, between_turns, version)
        return out

    def _waves(self, requests: list[tuple[Problem, SamplingParams]]) -> list[list]:
        """Consecutive runs of requests with at most max_concurrent_trajectories trajectories in
        all (a request with more is a wave of its own): the environments' processes are bounded."""
        waves, size = [], math.inf
        for request in requests:
            n = request[1].n
            if size + n > self.config.max_concurrent_trajectories:
                waves.append([])
                size = 0
            waves[-1].append(request)
            size += n
        return waves

    def _run_wave(self, requests: list[tuple[Problem, SamplingParams]], generate: Generate,
                  between_turns: Callable[[], None], version: int) -> list[list[Trajectory]]:
        episodes = [Trajectory(problem, self._episode_params(params, i), version)
                    for problem, params in requests for i in range(params.n)]
        self._reset(episodes)
        turn = 0
        while active := [e for e in episodes if not e.ended]:
            if turn:
                between_turns()
            self._turn(active, generate, turn)
            self._step(episodes, active)
            turn += 1
        out, start = [], 0
        for _, params in requests:
            out.append(episodes[start : start + params.n])
            start += params.n
        return out

    def _episode_params(self, params: SamplingParams, index: int) -> SamplingParams:
        stops = params.stop_token_ids + tuple(t for t in self.stop_ids if t not in params.stop_token_ids)
        return params.with_(n=1, stop_token_ids=stops, seed=None if params.seed is None else params.seed + index)

    def _reset(self, episodes: list[Trajectory]) -> None:
        for e, outcome in zip(episodes, self.envs.reset([e.problem for e in episodes])):
            e.env_seconds += outcome.seconds
            given = outcome.observation is not None
            ids, why = self._observation_ids(outcome.observation, prompt_of=e) if given else ([], "")
            # a sample's prompt is never empty; cut to leave its first turn room (rollout.task.truncation)
            e.prompt_ids = ids or self.prompt_format.encode(e.problem, e.params.max_new_tokens)
            if outcome.error:
                e.fail(outcome.error, self.config.failure_reward)
            elif why:
                e.fail(self.envs.record_failure(why), self.config.failure_reward)
            elif given and not ids:
                e.fail(self.envs.record_failure("reset's prompt text is 0 tokens of this tokenizer"),
                       self.config.failure_reward)
            elif len(e.prompt_ids) >= self.budget:
                e.finish_reason = "length"

    def _turn(self, active: list[Trajectory], generate: Generate, turn: int) -> None:
        """One turn of every active trajectory, in one engine batch."""
        requests = []
        for e in active:
            seed = None if e.params.seed is None else (e.params.seed << TURN_SEED_BITS) + turn
            room = min(e.params.max_new_tokens, self.budget - len(e.context))
            requests.append((e.context, e.params.with_(max_new_tokens=int(room), seed=seed)))
        for e, ((completion, versions),) in zip(active, generate(requests)):
            e.add_turn(completion, versions)
        self.turns_total += len(active)

    def _step(self, episodes: list[Trajectory], stepping: list[Trajectory]) -> None:
        """The environments' answers to the turn just generated, in parallel."""
        slot = {id(e): i for i, e in enumerate(episodes)}
        actions = [self.tokenizer.decode(e.last_action, skip_special_tokens=True) for e in stepping]
        for e, outcome in zip(stepping, self.envs.step([slot[id(e)] for e in stepping], actions)):
            if outcome.error:
                e.env_seconds += outcome.seconds
                e.fail(outcome.error, self.config.failure_reward)
                continue
            e.add_step(outcome)
            observation, why = ([], "") if outcome.done else self._observation_ids(outcome.observation or "")
            if why:
                e.fail(self.envs.record_failure(why), self.config.failure_reward)
            elif outcome.done:
                e.finish_reason = "stop"
            elif e.turns >= self.config.max_turns:
                e.finish_reason = "max_turns"
            elif len(e.context) + len(observation) >= self.budget:
                e.finish_reason = "length"  # no room for a token after the observation
            else:
                e.add_observation(observation)

    def _observation_ids(self, observation, prompt_of: Trajectory | None = None) -> tuple[list[int], str]:
        """(token ids, "") of an environment's text or chat messages, or ([], why) when the chat template
        cannot render them. Messages from reset are a prompt (`prompt_of`'s, cut as its prompt would
        be); from step, the turns that follow the policy's (`PromptFormat.encode_followup`)."""
        try:
            if isinstance(observation, str):
                return self.tokenizer(observation, add_special_tokens=False)["input_ids"], ""
            if prompt_of is not None:
                problem = replace(prompt_of.problem, prompt=observation)
                return self.prompt_format.encode(problem, prompt_of.params.max_new_tokens), ""
            return self.prompt_format.encode_followup(observation), ""
        except ValueError as err:
            return [], f"{'reset' if prompt_of else 'step'}'s messages: {err}"

    def stats(self) -> dict[str, float]:
        return {"turns_total": self.turns_total, **self.envs.stats()}

    def close(self) -> None:
        self.envs.close()


def agent_group(ticket: int, trajectories: list[Trajectory], worker_id: str) -> Group:
    """The group of one prompt's trajectories (metadata as the single-turn samples have it)."""
    group_id = new_id()
    problem = trajectories[0].problem
    metadata = {"ticket": int(ticket), "family": problem.family, "difficulty": int(problem.difficulty)}
    return Group(group_id=group_id, samples=[t.to_sample(group_id, worker_id, metadata) for t in trajectories],
                 prompt_index=int(ticket))


def multi_turn_metrics(groups) -> dict[str, float]:
    """A step's multi-turn statistics from its samples' metadata ({} for single-turn samples):
    turns per trajectory, environment seconds per trajectory, the fraction whose environment
    failed, and the mean of every `env/<key>` the environments reported."""
    samples = [s for g in groups for s in g.samples if "turns" in s.metadata]
    if not samples:
        return {}
    turns = [float(s.metadata["turns"]) for s in samples]
    out = {
        "multi_turn/turns_mean": float(np.mean(turns)),
        "multi_turn/turns_max": float(max(turns)),
        "multi_turn/env_seconds_mean": float(np.mean([float(s.metadata["env_seconds"]) for s in samples])),
        "multi_turn/env_failure_fraction": float(np.mean([bool(s.metadata["env_failed"]) for s in samples])),
        "multi_turn/policy_token_fraction": float(sum(int(s.loss_mask.sum()) for s in samples)
                                                  / max(1, sum(len(s.loss_mask) for s in samples))),
    }
    keys = sorted({k for s in samples for k in s.metadata if k.startswith("env/")})
    for key in keys:
        values = [float(s.metadata[key]) for s in samples if key in s.metadata]
        out[key] = float(np.mean(values))
    return out
