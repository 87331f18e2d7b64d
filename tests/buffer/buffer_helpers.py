"""Helpers for the buffer tests: group factory, free ports, waiting."""
from __future__ import annotations

import time
from pathlib import Path

import numpy as np

from buffer.sample import Group, Sample, new_id

REPO = Path(__file__).resolve().parents[2]


def make_group(ticket: int, version: int = 0, n: int = 2, tokens: int = 4, rng=None) -> Group:
    """A valid group of n samples for prompt `ticket`, generated with weights `version`."""
    rng = rng or np.random.default_rng(ticket)
    gid = new_id()
    samples = [
        Sample(sample_id=new_id(), group_id=gid, prompt_ids=rng.integers(0, 1000, 3), response_ids=rng.integers(0, 1000, tokens),
               rollout_log_probs=-rng.random(tokens), loss_mask=np.ones(tokens, np.uint8), reward=float(rng.random()),
               weight_version=version, worker_id="w", finish_reason="stop", metadata={"ticket": ticket})
        for _ in range(n)
    ]
    return Group(gid, samples, ticket)


def wait_until(predicate, timeout: float = 10.0, interval: float = 0.02) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return predicate()
