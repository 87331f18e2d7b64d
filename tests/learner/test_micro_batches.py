"""The micro-batch planner: a token budget per forward pass, rows of similar length together, and
the same number of passes on every rank."""
from __future__ import annotations

import random

import pytest
import torch

from learner.batch import padding_counts, plan_micro_batches
from learner.distributed import LocalComm


class Rank(LocalComm):
    """One rank of a world whose busiest rank needs `busiest` micro-batches (the MAX all-reduce)."""

    world_size = 2

    def __init__(self, busiest: int):
        self.busiest = busiest
        self.reduced = []

    def all_reduce(self, tensor, op):
        self.reduced.append((tensor.tolist(), op))
        return torch.maximum(tensor, torch.tensor([self.busiest]))


def padded_size(lengths, rows):
    return len(rows) * max(lengths[r] for r in rows)


@pytest.mark.parametrize("seed", range(5))
def test_every_row_once_and_every_micro_batch_within_the_budget(seed):
    rng = random.Random(seed)
    lengths = [rng.randint(1, 300) for _ in range(rng.randint(1, 60))]
    budget = rng.randint(300, 2000)
    plan = plan_micro_batches(lengths, budget, max_rows=rng.choice([None, 3]))
    assert sorted(r for mb in plan for r in mb) == list(range(len(lengths)))
    assert all(mb and padded_size(lengths, mb) <= budget for mb in plan)
    # Longest first: a later micro-batch never holds a row longer than an earlier one's shortest.
    for earlier, later in zip(plan, plan[1:]):
        assert max(lengths[r] for r in later) <= min(lengths[r] for r in earlier)
    # Greedy filling: the next row would not have fit in the micro-batch before it.
    for earlier, later in zip(plan, plan[1:]):
        assert (len(earlier) + 1) * max(lengths[r] for r in earlier) > budget or len(earlier) == 3


def test_similar_lengths_share_a_micro_batch():
    lengths = [10, 100, 11, 98, 12]
    plan = plan_micro_batches(lengths, max_tokens=200)
    assert plan == [[1, 3], [4, 2, 0]]
    real, slots = padding_counts([lengths[r] for r in plan[0]])
    assert (real, slots) == (198, 200)
    assert padding_counts([]) == (0, 0)


def test_no_budget_is_one_pass_or_rows_capped():
    assert plan_micro_batches([5, 3, 9], None) == [[2, 0, 1]]
    assert plan_micro_batches([5, 3, 9], None, max_rows=2) == [[2, 0], [1]]
    assert plan_micro_batches([], 100) == []


def test_a_row_longer_than_the_budget_is_refused_with_its_size():
    with pytest.raises(ValueError, match=r"row 1 has 513 prompt\+response tokens, more than the micro-batch "
                                         r"budget max_tokens_per_micro_batch=512"):
        plan_micro_batches([10, 513], 512)
    with pytest.raises(ValueError, match="max_tokens must be >= 1"):
        plan_micro_batches([1], 0)
    with pytest.raises(ValueError, match="max_rows must be >= 1"):
        plan_micro_batches([1], 10, max_rows=0)
    with pytest.raises(ValueError, match="row 0 has 0 tokens"):
        plan_micro_batches([0], 10)


def test_every_rank_gets_the_count_of_the_busiest():
    lengths = [50, 50, 40, 10]
    mine = plan_micro_batches(lengths, 200)
    assert len(mine) == 1
    rank = Rank(busiest=3)
    spread = plan_micro_batches(lengths, 200, comm=rank)
    assert rank.reduced == [([1], "max")]
    assert len(spread) == 3 and sorted(r for mb in spread for r in mb) == [0, 1, 2, 3]
    assert all(mb for mb in spread)  # enough rows: split, never empty
    # Fewer rows than passes: the rest are empty (the trainer runs a zero-weight pass for them).
    few = plan_micro_batches([7], 200, comm=Rank(busiest=3))
    assert few == [[0], [], []]
    assert plan_micro_batches([], 200, comm=Rank(busiest=2)) == [[], []]
