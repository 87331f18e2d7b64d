"""Held-out evaluation: greedy accuracy and pass@k with the unbiased estimator.

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
# score(prompt, response_token_ids) -> reward in [0, 1]; >= correct_threshold counts as correct
ScoreFn = Callable[[EvalPrompt, list[int]], float]


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
    greedy_rewards = [score(p, outs[0]) for p, outs in zip(prompts, greedy)]
    metrics = {
        "eval/accuracy": float(np.mean([r >= correct_threshold for r in greedy_rewards])),
        "eval/greedy_reward": float(np.mean(greedy_rewards)),
        "eval/num_prompts": float(len(prompts)),
    }
    if n_samples > 0:
        sampled = generate(batch, n_samples, temperature, seed + 1)
        rewards = [[score(p, out) for out in outs] for p, outs in zip(prompts, sampled)]
        counts = [sum(r >= correct_threshold for r in row) for row in rewards]
        metrics[f"eval/pass@{k}"] = mean_pass_at_k(counts, n_samples, k)
        metrics["eval/pass@1"] = mean_pass_at_k(counts, n_samples, 1)
        metrics["eval/sampled_reward"] = float(np.mean(rewards))
    return metrics


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
        from rollout_workers.rewards import Reward

        task = cfg.rollout.task
        tokenizer = load_tokenizer(model_dir)
        prompt_format = PromptFormat.for_model(model_dir, task, tokenizer, cfg.rollout.engine.max_model_len)
        problems = heldout_problems(task, cfg.eval.num_prompts, cfg.run.seed, prompt_format, cfg.eval.max_new_tokens)
        prompts = [EvalPrompt(prompt_format.encode(p), p) for p in problems]
        reward = Reward(cfg.rollout.reward)
        failures = []

        def score(prompt: EvalPrompt, response: list[int]) -> float:
            text = tokenizer.decode(response, skip_special_tokens=True)
            try:
                return reward(text, prompt.problem).value
            except Exception as err:  # one bad reward call must not stop the run: a wrong answer
                if not failures:  # logged once: a reward that always fails would fill the screen
                    log.warning("eval: reward %r failed on %s (scored 0; later failures are not logged): %s: %s",
                                reward.spec, prompt.problem.where(), type(err).__name__, err)
                failures.append(prompt.problem.row)
                return 0.0

        engine_cfg = cfg.rollout.engine.model_copy(update={"kind": cfg.eval.engine or cfg.rollout.engine.kind})
        engine = make_engine(engine_cfg, model_dir, seed=cfg.run.seed)
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
        metrics = evaluate(self._generate, self.score, self.prompts, self.cfg.n_samples, self.cfg.k,
                           self.cfg.temperature, seed=self.seed)
        if self.loaded_version is not None:
            metrics["eval/version"] = float(self.loaded_version)
        return metrics

    def close(self) -> None:
        self.engine.close()
