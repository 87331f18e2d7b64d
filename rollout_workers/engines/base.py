"""The generation-engine interface every backend implements (vLLM, transformers).

An engine turns prompt token ids into sampled responses and records, for every sampled token,
its log-prob under the distribution it was actually drawn from (after temperature, top-k and
top-p): that is the behaviour policy μ the learner corrects against.
"""
from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field, replace

import numpy as np
import torch

# Finish reasons: "stop" (EOS or a stop token, included in token_ids), "length" (max_new_tokens),
# "interrupted" (generation cut short by the caller's interrupt check; continue it later).
FINISH_REASONS = ("stop", "length", "interrupted")

Interrupt = Callable[[], bool]
# Weights to load: a state dict, or (name, tensor) pairs as they arrive (a broadcast's stream).
WeightsIn = Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]]


def named_weights(weights: WeightsIn) -> Iterable[tuple[str, torch.Tensor]]:
    return weights.items() if isinstance(weights, Mapping) else weights


@dataclass(frozen=True)
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 = no top-k
    max_new_tokens: int = 16
    stop_token_ids: tuple[int, ...] = ()
    seed: int | None = None

    def __post_init__(self) -> None:
        problems = []
        if self.n < 1:
            problems.append(f"n must be >= 1 (got {self.n})")
        if not (self.temperature >= 0 and math.isfinite(self.temperature)):
            problems.append(f"temperature must be a finite number >= 0 (got {self.temperature})")
        if not 0 < self.top_p <= 1:
            problems.append(f"top_p must be in (0, 1] (got {self.top_p})")
        if self.top_k < 0:
            problems.append(f"top_k must be >= 0 (got {self.top_k})")
        if self.max_new_tokens < 1:
            problems.append(f"max_new_tokens must be >= 1 (got {self.max_new_tokens})")
        if problems:
            raise ValueError("invalid sampling params: " + "; ".join(problems))
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))

    def with_(self, **changes) -> "SamplingParams":
        return replace(self, **changes)


@dataclass
class Completion:
    token_ids: list[int]
    log_probs: list[float]
    finish_reason: str
    metadata: dict = field(default_factory=dict)
    # MoE engines that can say: [tokens, layers, k] expert ids, row t the routing of the position
    # that sampled token t (buffer.sample.Sample.routed_experts); None otherwise.
    routed_experts: np.ndarray | None = None

    def __post_init__(self) -> None:
        if len(self.token_ids) != len(self.log_probs):
            raise ValueError(
                f"completion has {len(self.token_ids)} tokens but {len(self.log_probs)} log-probs"
            )
        if self.routed_experts is not None and len(self.routed_experts) != len(self.token_ids):
            raise ValueError(f"completion has {len(self.token_ids)} tokens but {len(self.routed_experts)} "
                             f"rows of routing")
        if self.finish_reason not in FINISH_REASONS:
            raise ValueError(f"finish_reason must be one of {FINISH_REASONS}, got {self.finish_reason!r}")


def check_prompt(prompt_ids: Iterable[int], vocab_size: int | None = None) -> list[int]:
    ids = [int(t) for t in prompt_ids]
    if not ids:
        raise ValueError("prompt_ids is empty: an engine needs at least one prompt token")
    if vocab_size is not None and (min(ids) < 0 or max(ids) >= vocab_size):
        raise ValueError(f"prompt token ids must be in [0, {vocab_size}), got min {min(ids)} max {max(ids)}")
    return ids


class GenerationEngine(ABC):
    """generate() samples params.n responses per prompt; load_weights() swaps the weights in
    place (from a state dict, or (name, tensor) pairs as a stream delivers them) and sets
    `version` (-1 while a load that failed part-way has left the weights a mix). generate_batch() takes several (prompt, params) requests at once and
    may stop early when `interrupt()` turns true, returning what each response has so far with
    finish_reason "interrupted" (the caller continues it after loading new weights)."""

    version: int = 0

    def generate(self, prompt_ids: list[int], params: SamplingParams) -> list[Completion]:
        return self.generate_batch([(prompt_ids, params)])[0]

    @abstractmethod
    def generate_batch(
        self, requests: list[tuple[list[int], SamplingParams]], interrupt: Interrupt | None = None
    ) -> list[list[Completion]]: ...

    @abstractmethod
    def load_weights(self, version: int, weights: WeightsIn) -> None: ...

    def close(self) -> None:
        """Free the engine's resources (processes, memory); the engine is unusable afterwards."""
