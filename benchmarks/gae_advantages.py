"""GAE at real sizes: verl's column-by-column loop against etarl's blocked suffix sums.

    .venv/bin/python benchmarks/gae_advantages.py                      # 128 groups x 16, 8k-token responses
    .venv/bin/python benchmarks/gae_advantages.py --rows 64 --tokens 512 --repeats 1   # a smoke run

Every learner rank computes the batch's GAE on its host each step (`learner.advantages.
gae_advantages_and_returns`). verl's form walks the T response columns one at a time (T steps of
[B] vector work); etarl's moves each row's policy tokens to the front (single-turn rows already
are) and sums each block of 256 columns with one matmul. Both run here on the same batch (rows of
random lengths up to T, an outcome reward on each row's last token, random values; and a
multi-turn batch with tool tokens between turns), the times are the best of `--repeats`, the
advantages and returns are compared, and the last line is a JSON summary.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from learner.advantages import _whiten, gae_advantages_and_returns  # noqa: E402


def column_loop_gae(rewards, values, mask, gamma, lam):
    """verl's compute_gae_advantage_return, as a reference: one step per response column."""
    mask = mask.to(values.dtype)
    next_value = torch.zeros_like(values[:, 0])
    running = torch.zeros_like(next_value)
    out = []
    for t in reversed(range(values.shape[1])):
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        step = delta + gamma * lam * running
        next_value = values[:, t] * mask[:, t] + (1 - mask[:, t]) * next_value
        running = step * mask[:, t] + (1 - mask[:, t]) * running
        out.append(running)
    raw = torch.stack(out[::-1], dim=1)
    return _whiten(raw, mask) * mask, (raw + values) * mask


def batch(rows: int, tokens: int, turns: bool, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, tokens + 1, (rows,), generator=gen)
    lengths[0] = tokens
    mask = torch.arange(tokens)[None, :] < lengths[:, None]
    if turns:  # a tool's output of 64 tokens after every 512 policy tokens
        mask &= (torch.arange(tokens) % 576 < 512)[None, :]
    rewards = torch.zeros(rows, tokens)
    last = tokens - 1 - mask.flip(-1).to(torch.int8).argmax(-1)
    rewards[torch.arange(rows), last] = torch.randint(0, 2, (rows,), generator=gen).float()
    values = torch.randn(rows, tokens, generator=gen) * 0.3 + 0.5
    return rewards, values, mask


def best_of(repeats: int, fn):
    times, out = [], None
    for _ in range(repeats):
        start = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - start)
    return min(times), out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=128 * 16, help="responses per step (groups x group size)")
    parser.add_argument("--tokens", type=int, default=8192, help="the longest response")
    parser.add_argument("--gamma", type=float, default=1.0)
    parser.add_argument("--lam", type=float, default=0.95)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(1)  # as a learner rank's host thread
    summary = {"rows": args.rows, "tokens": args.tokens, "gamma": args.gamma, "lam": args.lam}
    for name, turns in (("single_turn", False), ("multi_turn", True)):
        rewards, values, mask = batch(args.rows, args.tokens, turns)
        loop_s, (want_adv, want_ret) = best_of(args.repeats, lambda: column_loop_gae(
            rewards, values, mask, args.gamma, args.lam))
        ours_s, (adv, ret) = best_of(args.repeats, lambda: gae_advantages_and_returns(
            rewards, values, mask, args.gamma, args.lam))
        valid = mask.bool()
        diff = max(float((adv - want_adv)[valid].abs().max()), float((ret - want_ret)[valid].abs().max()))
        print(f"{name}: {args.rows} rows x {args.tokens} tokens ({int(valid.sum()):,} policy tokens): "
              f"column loop {loop_s:.3f} s, blocked {ours_s:.3f} s ({loop_s / ours_s:.1f}x); "
              f"max |difference| {diff:.2e}")
        summary[name] = {"column_loop_s": loop_s, "blocked_s": ours_s, "speedup": loop_s / ours_s,
                         "max_abs_difference": diff, "policy_tokens": int(valid.sum())}
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
