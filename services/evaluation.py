"""Held-out evaluation: greedy accuracy and pass@k with the unbiased estimator.

During training the rollout workers evaluate, on their own engines between their requests, at one
weight version (`RolloutWorker.evaluate_heldout`); `WorkerEvaluations` asks for one every
`run.eval_every` steps without waiting and hands the results to the run loop when they come.
`PolicyEvaluator` (an engine of its own) is `etarl eval`'s, for a model folder or a checkpoint.

pass@k for one prompt with n samples of which c are correct is 1 - C(n-c, k) / C(n, k)
(Chen et al. 2021; ../shared/reference/pass_at_k.md). It is computed as a running product,
1 - prod_{i=n-c+1}^{n} (1 - k/i), which never forms the huge binomials.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np

from rollout_workers.data import Problem

log = logging.getLogger(__name__)


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k estimate for one prompt: n samples drawn, c of them correct."""
    for name, value in (("n", n), ("c", c), ("k", k)):
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
            raise TypeError(f"pass_at_k: {name} must be an int, got {value!r}")
    if k < 1:
        raise ValueError(f"pass_at_k: k must be >= 1, got {k}")
    if n < k:
        raise ValueError(f"pass_at_k: need n >= k samples (n={n}, k={k}); c/k would be biased")
    if not 0 <= c <= n:
        raise ValueError(f"pass_at_k: c must be in [0, n={n}], got {c}")
    if n - c < k:
        return 1.0  # every k-subset holds at least one correct sample
    return float(1.0 - np.prod(1.0 - k / np.arange(n - c + 1, n + 1, dtype=np.float64)))


def mean_pass_at_k(correct_counts: Sequence[int], n: int, k: int) -> float:
    """pass@k of a benchmark: the mean of the per-prompt estimates."""
    if not correct_counts:
        raise ValueError("mean_pass_at_k: no prompts")
    return float(np.mean([pass_at_k(n, int(c), k) for c in correct_counts]))


@dataclass(frozen=True)
class EvalPrompt:
    """One held-out prompt: its token ids and the problem the reward function scores against."""

    prompt_ids: list[int]
    problem: Problem


# generate(prompt_ids_batch, n, temperature, seed) -> per prompt, n lists of response token ids
GenerateFn = Callable[[list[list[int]], int, float, int], list[list[list[int]]]]
# score(prompt, responses' token ids) -> a reward in [0, 1] each; >= correct_threshold counts as
# correct. A prompt's responses are scored together (a batch-form reward: in one call, as in training).
ScoreFn = Callable[[EvalPrompt, list[list[int]]], list[float]]


def evaluate(
    generate: GenerateFn,
    score: ScoreFn,
    prompts: Sequence[EvalPrompt],
    n_samples: int,
    k: int,
    temperature: float,
    seed: int = 0,
    correct_threshold: float = 1.0,
) -> dict[str, float]:
    """Greedy accuracy (one temperature-0 answer per prompt) and pass@k from n_samples sampled
    answers per prompt at `temperature`. Returns metrics under `eval/`."""
    if not prompts:
        raise ValueError("evaluate: the held-out set is empty")
    batch = [p.prompt_ids for p in prompts]
    greedy = generate(batch, 1, 0.0, seed)
    greedy_rewards = [score(p, outs[:1])[0] for p, outs in zip(prompts, greedy)]
    rewards = None
    if n_samples > 0:
        sampled = generate(batch, n_samples, temperature, seed + 1)
        rewards = [list(score(p, outs)) for p, outs in zip(prompts, sampled)]
    return heldout_metrics(greedy_rewards, rewards, k, correct_threshold,
                           sources=[p.problem.data_source for p in prompts])


def heldout_metrics(greedy: Sequence[float], sampled: Sequence[Sequence[float]] | None, k: int,
                    correct_threshold: float = 1.0, sources: Sequence[str] | None = None) -> dict[str, float]:
    """The `eval/` metrics from per-prompt rewards: one greedy answer each, and (or None) n sampled.
    With `sources` (each prompt's data_source) naming more than one, also accuracy, pass@1 and
    pass@k of each, as `eval/by_source/<data_source>/...` (verl's per-data-source validation)."""
    if not greedy:
        raise ValueError("evaluate: the held-out set is empty")
    metrics = {
        "eval/accuracy": float(np.mean([r >= correct_threshold for r in greedy])),
        "eval/greedy_reward": float(np.mean(greedy)),
        "eval/num_prompts": float(len(greedy)),
    }
    if sampled:
        n_samples = len(sampled[0])
        counts = [sum(r >= correct_threshold for r in row) for row in sampled]
        metrics[f"eval/pass@{k}"] = mean_pass_at_k(counts, n_samples, k)
        metrics["eval/pass@1"] = mean_pass_at_k(counts, n_samples, 1)
        metrics["eval/sampled_reward"] = float(np.mean(sampled))
    if sources is not None and len(set(sources)) > 1:
        if len(sources) != len(greedy):
            raise ValueError(f"heldout_metrics: {len(sources)} sources for {len(greedy)} prompts")
        for source in sorted(set(sources)):
            rows = [i for i, s in enumerate(sources) if s == source]
            part = heldout_metrics([greedy[i] for i in rows], [sampled[i] for i in rows] if sampled else None, k,
                                   correct_threshold)
            for key in ("accuracy", "num_prompts", "pass@1", f"pass@{k}"):
                if f"eval/{key}" in part:
                    metrics[f"eval/by_source/{source or 'unknown'}/{key}"] = part[f"eval/{key}"]  # verl's name
    return metrics


class RewardScore:
    """A ScoreFn for `evaluate` that scores through a `RewardRunner`, as training does: the reward
    runs in its own process with its timeout and limits, so one that hangs, crashes or goes over a
    limit costs at most its timeout, scores the runner's failure_reward (a wrong answer), is
    counted, and the evaluation goes on. The first failure is logged (a reward that always fails
    would fill the screen)."""

    def __init__(self, runner, tokenizer) -> None:
        self.runner = runner
        self.tokenizer = tokenizer
        self.logged = False

    def __call__(self, prompt: EvalPrompt, responses: list[list[int]]) -> list[float]:
        texts = [self.tokenizer.decode(response, skip_special_tokens=True) for response in responses]
        failures = self.runner.failures_total
        scored = self.runner.score(texts, prompt.problem)
        if self.runner.failures_total > failures and not self.logged:
            self.logged = True
            log.warning("eval: reward %r failed on %s (scored %s; later failures are not logged): %s",
                        self.runner.spec, prompt.problem.where(), self.runner.failure_reward, self.runner.last_error)
        return [s.value for s in scored]

    def stats(self) -> dict[str, float]:
        return self.runner.stats()

    def close(self) -> None:
        self.runner.close()


class PolicyEvaluator:
    """Greedy accuracy and pass@k of a policy on held-out prompts, with a generation engine of
    its own (built once; new weights are loaded in place before each evaluation)."""

    def __init__(self, engine, tokenizer, prompts: Sequence[EvalPrompt], score: ScoreFn, eval_config,
                 max_new_tokens: int, stop_token_ids: tuple[int, ...], seed: int = 0):
        self.engine = engine
        self.tokenizer = tokenizer
        self.prompts = list(prompts)
        self.score = score
        self.cfg = eval_config
        self.max_new_tokens = max_new_tokens
        self.stop_token_ids = stop_token_ids
        self.seed = seed
        self.loaded_version: int | None = None

    @classmethod
    def from_config(cls, cfg, model_dir) -> "PolicyEvaluator":
        from lm.causal_lm import load_tokenizer
        from rollout_workers.data import PromptFormat, heldout_problems
        from rollout_workers.engines import make_engine
        from rollout_workers.rewards import RewardRunner

        task = cfg.rollout.task
        tokenizer = load_tokenizer(model_dir)
        prompt_format = PromptFormat.for_rollout(model_dir, cfg.rollout, tokenizer)
        problems = heldout_problems(task, cfg.eval.num_prompts, cfg.run.seed, prompt_format, cfg.eval.max_new_tokens,
                                    cfg.rollout.rows_reward())
        prompts = [EvalPrompt(prompt_format.encode(p, cfg.eval.max_new_tokens), p) for p in problems]
        # Multi-turn episodes are scored by their environment; single-turn answers by the reward,
        # in its own process (made before the engine: a bad spec fails before a model is loaded).
        score = None if cfg.rollout.multi_turn.enabled else RewardScore(RewardRunner.for_rollout(cfg.rollout),
                                                                        tokenizer)
        # the folder is a whole model (a run's policy/ is merged): no adapter on top
        engine_cfg = cfg.rollout.engine.model_copy(update={"kind": cfg.eval.engine or cfg.rollout.engine.kind,
                                                           "lora": None})
        engine = make_engine(engine_cfg, model_dir, seed=cfg.run.seed)
        if cfg.rollout.multi_turn.enabled:
            from rollout_workers.agent_loop import AgentLoop

            agent = AgentLoop.for_rollout(cfg.rollout, tokenizer, prompt_format)
            return AgentEvaluator(agent, engine, tokenizer, prompts, _episode_reward, cfg.eval, cfg.eval.max_new_tokens,
                                  prompt_format.stop_token_ids, cfg.run.seed)
        return cls(engine, tokenizer, prompts, score, cfg.eval, cfg.eval.max_new_tokens, prompt_format.stop_token_ids,
                   cfg.run.seed)

    def _generate(self, batch: list[list[int]], n: int, temperature: float, seed: int) -> list[list[list[int]]]:
        from rollout_workers.engines.base import SamplingParams

        params = SamplingParams(n=n, temperature=temperature, max_new_tokens=self.max_new_tokens,
                                stop_token_ids=self.stop_token_ids, seed=seed)
        outputs = self.engine.generate_batch([(p, params) for p in batch])
        return [[list(c.token_ids) for c in completions] for completions in outputs]

    def evaluate_payload(self, payload: dict | None) -> dict[str, float]:
        """Load the published weights (None: keep the engine's current ones) and evaluate."""
        if payload is not None and payload["version"] != self.loaded_version:
            from lm.weight_sync import resolve_weights

            self.engine.load_weights(payload["version"], resolve_weights(payload))
            self.loaded_version = payload["version"]
        counted = getattr(self.score, "stats", dict)
        before = counted()
        metrics = evaluate(self._generate, self.score, self.prompts, self.cfg.n_samples, self.cfg.k,
                           self.cfg.temperature, seed=self.seed)
        after = counted()
        for key in ("reward_failures_total", "reward_timeouts_total"):  # this evaluation's, scored as wrong
            if key in after:
                metrics[f"eval/{key.removesuffix('_total')}"] = float(after[key] - before[key])
        if self.loaded_version is not None:
            metrics["eval/version"] = float(self.loaded_version)
        return metrics

    def close(self) -> None:
        try:
            self.engine.close()
        finally:
            if hasattr(self.score, "close"):
                self.score.close()


def _episode_reward(prompt: EvalPrompt, episodes: list) -> list[float]:
    return [episode.reward for episode in episodes]


class AgentEvaluator(PolicyEvaluator):
    """Held-out evaluation of a multi-turn task (`rollout.multi_turn`): each held-out problem is an
    episode of the agent loop, scored by its environment (accuracy: a reward >= 1). The greedy
    episodes' environment info is reported too, as `eval/env/<key>` (the calculator's
    `tool_success`, `tool_calls`, `correct`), with `eval/turns_mean`."""

    def __init__(self, agent, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.agent = agent
        self._greedy: list = []

    def _generate(self, batch: list[list[int]], n: int, temperature: float, seed: int) -> list[list]:
        """Episodes instead of responses, for `evaluate`: one list of n per held-out prompt (in order)."""
        from rollout_workers.engines.base import SamplingParams

        if len(batch) != len(self.prompts):
            raise ValueError(f"the agent evaluator runs its {len(self.prompts)} prompts together, got {len(batch)}")
        params = SamplingParams(n=n, temperature=temperature, max_new_tokens=self.max_new_tokens,
                                stop_token_ids=self.stop_token_ids, seed=seed)
        version = self.engine.version

        def generate(requests):
            return [[(c, [version] * len(c.token_ids)) for c in completions]
                    for completions in self.engine.generate_batch(requests)]

        episodes = self.agent.run([(p.problem, params) for p in self.prompts], generate, version=version)
        if temperature == 0:
            self._greedy = [row[0] for row in episodes]
        return episodes

    def evaluate_payload(self, payload: dict | None) -> dict[str, float]:
        metrics = super().evaluate_payload(payload)
        keys = sorted({k for e in self._greedy for k in e.info})
        metrics.update({f"eval/env/{k}": float(np.mean([e.info.get(k, 0.0) for e in self._greedy])) for k in keys})
        metrics["eval/turns_mean"] = float(np.mean([e.turns for e in self._greedy]))
        return metrics

    def close(self) -> None:
        self.agent.close()
        super().close()


class WorkerEvaluations:
    """Held-out evaluations of a training run on its rollout workers' engines (the worker's
    `evaluate_heldout`, services never gives evaluation a GPU of its own). `request(step, version)`
    sends one and returns at once; the run loop goes on training, and `collect()` returns the
    evaluations that have finished, each as the metrics of the step that asked for it, with the
    version it evaluated (`eval/version`: at least that step's, the one the worker had loaded when
    it began; a step or so later when the worker was mid-batch) and `eval/reported_at_step`.
    Requests go to the workers in turn; a worker that died while evaluating loses that evaluation
    (logged and counted in `failed`), the run goes on."""

    def __init__(self, cfg, workers: list):
        self.cfg = cfg
        self.workers = workers
        self.pending: list[tuple[int, int, object]] = []  # (step, version asked for, ObjectRef)
        self.sent = 0
        self.failed = 0

    def spec(self, version: int) -> dict:
        ev = self.cfg.eval
        wait_s = max(self.cfg.rollout.weight_wait_s, 600.0)  # a vLLM engine may take minutes to start
        return {"num_prompts": ev.num_prompts, "seed": self.cfg.run.seed, "n_samples": ev.n_samples,
                "temperature": ev.temperature, "max_new_tokens": ev.max_new_tokens, "min_version": int(version),
                "wait_s": wait_s}

    def request(self, step: int, version: int) -> None:
        worker = self.workers[self.sent % len(self.workers)]
        self.sent += 1
        self.pending.append((step, version, worker.evaluate_heldout.remote(self.spec(version))))

    def asked(self, step: int) -> bool:
        return any(s == step for s, _, _ in self.pending)

    def collect(self, now_step: int, timeout: float = 0.0) -> list[dict]:
        """The evaluations finished within `timeout` seconds (0: those done now; None: all), in
        the order they were asked for."""
        import ray

        if not self.pending:
            return []
        refs = [ref for _, _, ref in self.pending]
        done, _ = ray.wait(refs, num_returns=len(refs), timeout=timeout)
        done_ids = {id(ref) for ref in done}
        results, still = [], []
        for step, version, ref in self.pending:
            if id(ref) not in done_ids:
                still.append((step, version, ref))
                continue
            try:
                out = ray.get(ref)
            except Exception as exc:  # the worker died mid-evaluation (Ray restarts it): this one is lost
                self.failed += 1
                log.warning("eval @ step %d lost: %s: %s", step, type(exc).__name__, exc)
                continue
            metrics = heldout_metrics(out["greedy"], out["sampled"], self.cfg.eval.k, sources=out.get("sources"))
            metrics.update({"eval/reward_failures": out["reward_failures"],
                            "eval/reward_timeouts": out["reward_timeouts"], "eval/version": float(out["version"]),
                            "eval/seconds": out["seconds"], "eval/reported_at_step": float(now_step)})
            metrics.update({f"eval/env/{k}": v for k, v in out["env"].items()})
            if out["turns_mean"] is not None:
                metrics["eval/turns_mean"] = out["turns_mean"]
            results.append({"step": step, **metrics})
        self.pending = still
        return results
