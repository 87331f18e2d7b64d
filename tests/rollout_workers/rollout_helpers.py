"""Helpers for the rollout-worker tests: misbehaving reward functions (imported by path in the
reward child process), a reference for processed (temperature/top-k/top-p) log-probs, pulling from
the buffer, a weight store that publishes when a test arms it, and a bounded wait for a condition."""
from __future__ import annotations

import os
import time

import torch

from lm.weight_sync import WeightStore


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


def slow_reward(response: str, answer: str) -> float:
    """A reward that takes 0.1 s a response: groups are generated faster than they are scored."""
    time.sleep(0.1)
    return 0.0


def zero_reward(response: str, answer: str) -> float:
    return 0.0


def even_answers_alike(response: str, answer: str) -> float:
    """1.0 for every response to a prompt whose answer is even (its groups are uninformative);
    else a random number (they differ even where the responses are the same)."""
    import random

    return 1.0 if int(answer) % 2 == 0 else random.random()


def length_reward(response: str, answer: str) -> float:
    return float(len(response))


def perturbed(state_dict: dict[str, torch.Tensor], scale: float = 0.05, seed: int = 0) -> dict[str, torch.Tensor]:
    """A copy of the weights with every matrix nudged: a stand-in for one learner update. Tied
    tensors (one storage under two names, e.g. a tied lm_head) stay tied: one nudge, one tensor."""
    gen = torch.Generator().manual_seed(seed)
    out, by_storage = {}, {}
    for name, value in state_dict.items():
        key = (value.data_ptr(), tuple(value.shape))
        if key not in by_storage:
            noise = torch.randn(value.shape, generator=gen) * scale if value.dim() == 2 else 0.0
            by_storage[key] = value.clone() + noise
        out[name] = by_storage[key]
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


def check_bf16_engine(model_dir: str) -> None:
    """Body of the bf16 engine test."""
    from lm.causal_lm import load_causal_lm, load_tokenizer, response_log_probs
    from rollout_workers.engines.base import SamplingParams
    from rollout_workers.engines.vllm_engine import VLLMEngine

    def gap(model, prompt, completions):
        with torch.no_grad():
            lp, _ = response_log_probs(model, [prompt] * len(completions), [c.token_ids for c in completions])
        return max(float((torch.tensor(c.log_probs) - lp[i, : len(c.token_ids)]).abs().max())
                   for i, c in enumerate(completions))

    tokenizer, model = load_tokenizer(model_dir), load_causal_lm(model_dir).eval()
    engine = VLLMEngine(model_dir, dtype="bfloat16", kv_cache_bytes=64 * 2**20, tensor_parallel_size=2)
    try:
        prompt = tokenizer("347+589=", add_special_tokens=False)["input_ids"]
        params = SamplingParams(n=8, max_new_tokens=8, stop_token_ids=(tokenizer.eos_token_id,), seed=9)
        out = engine.generate(prompt, params)
        assert 1e-5 < gap(model, prompt, out) < 0.5, gap(model, prompt, out)
        new_weights = perturbed(model.state_dict(), scale=0.2, seed=8)
        model.load_state_dict(new_weights)
        old_gap_to_new = gap(model, prompt, out)
        engine.load_weights(2, new_weights)
        assert engine.version == 2
        after = engine.generate(prompt, params)
        assert gap(model, prompt, after) < min(0.5, old_gap_to_new), (gap(model, prompt, after), old_gap_to_new)

        # vLLM's weight transfer (etarl's gloo engine): both tensor-parallel ranks receive inside
        # vLLM's worker processes, in a group of the learner and the engine's two ranks.
        from lm.weight_sync import BroadcastSender, ParameterGuard, Publication, WeightSubscription

        board, guard = WeightStore(), ParameterGuard()
        sender = BroadcastSender(board, "gloo", "chain", 64 * 1024, 60, 60, "127.0.0.1", dtype=torch.bfloat16)
        publication = Publication(sender, guard, model.state_dict, dtype=torch.bfloat16)
        subscription = WeightSubscription(board, "worker-tp", engine.version)
        try:
            model.load_state_dict(perturbed(new_weights, scale=0.2, seed=9))
            old_gap_to_new = gap(model, prompt, after)
            publication.publish(3)
            deadline = time.monotonic() + 60
            while board.latest_version() < 3 and time.monotonic() < deadline:  # announced by its thread
                time.sleep(0.01)
            assert subscription.receive(engine, wait_s=60) == 3 and engine.engine_weight_version() == "3"
            assert publication.wait_sent(3)["engines"] == 1 and board.members()["worker-tp"]["have"] == 3
            received = engine.generate(prompt, params)
            assert gap(model, prompt, received) < min(0.5, old_gap_to_new), (gap(model, prompt, received),
                                                                             old_gap_to_new)
        finally:
            publication.close()
    finally:
        engine.close()


# Rewards in verl's form (imported by path in the reward child process, like the ones above).

def verl_exact(data_source, solution_str, ground_truth, extra_info=None):
    """verl's form, a dict: the score, an accuracy metric, and what it was given, as numbers (len:
    extra_info is a dict, as verl gives it, even for a row without one)."""
    return {"score": float(solution_str == ground_truth), "acc": float(solution_str == ground_truth),
            "has_extra": float(len(extra_info) > 0), "source_is_demo": float(data_source == "demo"),
            "pred": solution_str}  # a non-number: not a metric


async def async_verl_exact(data_source, solution_str, ground_truth, extra_info=None):
    import asyncio

    await asyncio.sleep(0)
    return float(solution_str == ground_truth)


async def async_length(response, answer):
    return float(len(response))


def verl_no_score(data_source, solution_str, ground_truth, extra_info=None):
    return {"acc": 1.0}


def three_args(response, answer, extra):
    return 0.0


def pull_all(client, count):
    """`count` groups from the buffer, acked."""
    batch = client.pull_batch(count, timeout=5.0)
    assert batch is not None, client.stats()
    client.ack(batch.lease_id)
    return batch.groups


class PublishWhenArmed(WeightStore):
    """A weight store whose learner moves to the pending version at the first version check after
    the test arms it: as the controller does, it tells the gate the new version, then publishes."""

    def __init__(self, payload: dict, buffer):
        super().__init__()
        self.pending, self.armed, self.buffer = payload, False, buffer

    def latest_version(self) -> int:
        if self.armed and self.pending is not None:
            self.buffer.set_version(self.pending["version"])
            self.publish(self.pending)
            self.pending = None
        return super().latest_version()


# Rewards in verl's batch form (its BatchRewardManager): one call scores a group.

def verl_batch_exact(data_sources, solution_strs, ground_truths, extra_infos, bonus=0.0):
    """A dict per response: the score (plus `bonus`, a reward_kwarg), and how many responses the call held."""
    return [{"score": float(s == g) + bonus, "batch_size": float(len(solution_strs)),
             "source_is_demo": float(d == "demo"), "has_extra": float(len(e) > 0)}  # len: a dict, as verl gives
            for d, s, g, e in zip(data_sources, solution_strs, ground_truths, extra_infos, strict=True)]


def verl_batch_misbehaves(data_sources, solution_strs, ground_truths, extra_infos):
    """Per response "poison" gives a value that is no number; "short" answers one value too few;
    "raise" raises; "hang" never returns; "array" answers a numpy array; else 1.0 each."""
    import numpy as np

    if "hang" in solution_strs:
        hang("", "")
    if "raise" in solution_strs:
        raise RuntimeError("the sandbox is down")
    values = ["not a number" if s == "poison" else 1.0 for s in solution_strs]
    if "short" in solution_strs:
        return values[:-1]
    return np.array(values) if "array" in solution_strs else values


def verl_batch_needs_more(data_sources, solution_strs, ground_truths, extra_infos, tokenizer):
    return [0.0] * len(solution_strs)


def wait_until(condition, timeout: float = 60.0, what: str = "condition not reached") -> None:
    """Poll `condition()` until it holds; fail naming `what` after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.001)


def load_with_mode_wait(engine, prompt, params, version: int, weights) -> tuple[list, list]:
    """A streaming engine's load under pause_mode wait, made while a request is in flight: (that
    request's [(completion, versions)], those of a request submitted after the load)."""
    import threading

    engine.pause_mode = "wait"
    try:
        start = engine.tokens_out_total
        before = engine.submit(prompt, params)
        wait_until(lambda: engine.tokens_out_total - start >= 2 or before.done(), what="the request made no tokens")
        loader = threading.Thread(target=engine.load_weights, args=(version, weights))
        loader.start()
        first = before.result(60)
        loader.join(60)
        return first, engine.submit(prompt, params).result(60)
    finally:
        engine.pause_mode = "keep"
