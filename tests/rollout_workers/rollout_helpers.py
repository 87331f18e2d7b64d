"""Helpers for the rollout-worker tests: misbehaving reward functions (imported by path in the
reward child process) and a reference for processed (temperature/top-k/top-p) log-probs."""
from __future__ import annotations

import os
import time

import torch


def hang(response: str, answer: str) -> float:
    """Never returns (until its parent process is gone)."""
    parent = os.getppid()
    while os.getppid() == parent:
        time.sleep(0.05)
    os._exit(0)


def crash(response: str, answer: str) -> float:
    raise RuntimeError("reward bug")


def die(response: str, answer: str) -> float:
    os._exit(3)


def not_a_number(response: str, answer: str):
    return "1.0"


def length_reward(response: str, answer: str) -> float:
    return float(len(response))


def perturbed(state_dict: dict[str, torch.Tensor], scale: float = 0.05, seed: int = 0) -> dict[str, torch.Tensor]:
    """A copy of the weights with every matrix nudged: a stand-in for one learner update."""
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for name, value in state_dict.items():
        noise = torch.randn(value.shape, generator=gen) * scale if value.dim() == 2 else 0.0
        out[name] = value.clone() + noise
    return out


@torch.no_grad()
def processed_log_probs(model, prompt: list[int], response: list[int], temperature: float, top_k: int, top_p: float):
    """Log-probs of `response` under the sampled distribution: logits / T, then top-k, then top-p
    (keep the smallest set of most likely tokens whose mass reaches top_p), renormalised."""
    ids = torch.tensor([prompt + response])
    logits = model(input_ids=ids).logits[0, len(prompt) - 1 : len(prompt) - 1 + len(response)].float()
    logits = logits / temperature
    if top_k > 0:
        kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        mass_before = torch.cumsum(probs, dim=-1) - probs
        drop_sorted = mass_before >= top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return torch.log_softmax(logits, dim=-1).gather(-1, torch.tensor(response)[:, None]).squeeze(-1)
