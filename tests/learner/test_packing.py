"""Sequence packing: a micro-batch is its rows concatenated, positions restarting per row and
attention stopping at each boundary; log-probs, losses, metrics and the update equal the padded
path. The planner packs by real tokens within the budget, widths snap to a few shape buckets, and
groups go to ranks balanced by tokens."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from learner.batch import balance_groups, build_batch, plan_micro_batches, shape_bucket
from learner.config import LearnerConfig
from learner.trainer import Learner
from learner_helpers import VOCAB, build_tiny_policy, max_param_diff, params_of, sample_groups
from lm.causal_lm import load_causal_lm, pack_sequences, response_log_probs


@pytest.fixture(scope="module")
def policy_dir(tmp_path_factory):
    return build_tiny_policy(tmp_path_factory.mktemp("policy"), seed=9)


def _rows(seed: int, prompt_lengths, response_lengths):
    gen = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(1, VOCAB, (n,), generator=gen).numpy() for n in prompt_lengths]
    responses = [torch.randint(1, VOCAB, (n,), generator=gen).tolist() for n in response_lengths]
    return prompts, responses


@pytest.mark.parametrize("dtype,tol", [("float64", 1e-12), ("float32", 2e-6)])
def test_packed_log_probs_and_entropy_equal_the_padded_ones(policy_dir, dtype, tol):
    model = load_causal_lm(policy_dir, dtype=dtype)
    # rows of many lengths, one with an empty response (it predicts nothing)
    prompts, responses = _rows(1, [1, 7, 3, 2, 11, 4, 1], [9, 1, 5, 0, 2, 13, 3])
    want = response_log_probs(model, prompts, responses, with_entropy=True)
    for width in (None, 128):  # 128: a shape bucket's filler block after the rows
        got = response_log_probs(model, prompts, responses, with_entropy=True, packed=True, pack_width=width)
        assert torch.equal(got[1], want[1])
        assert (got[0] - want[0]).abs().max().item() <= tol
        assert (got[2] - want[2]).abs().max().item() <= tol
    # The eager kernel reads the packed rows' boundaries too (its softmax runs in float32: 1e-7).
    eager = load_causal_lm(policy_dir, dtype=dtype, attn_implementation="eager")
    padded_eager = response_log_probs(eager, prompts, responses)[0]
    packed_eager = response_log_probs(eager, prompts, responses, packed=True, pack_width=128)[0]
    assert (packed_eager - padded_eager).abs().max().item() <= max(tol, 1e-7)
    ids, positions, starts = pack_sequences(prompts[:2], responses[:2], width=22, pad_id=0)
    assert positions.tolist() == [[*range(10), *range(8), *range(4)]] and starts.tolist() == [0, 10]
    assert ids[0, 18:].tolist() == [0] * 4
    with pytest.raises(ValueError, match="a packed width of 5 cannot hold 18 tokens"):
        pack_sequences(prompts[:2], responses[:2], width=5)


@pytest.mark.parametrize("overrides", [
    {"rollout_correction": {"rollout_is": "token", "rollout_is_threshold": 1.5, "rollout_is_batch_normalize": True},
     "policy_loss": {"kl_coef": 0.1, "entropy_coeff": 0.01}, "ppo_mini_batch_size": 2},
    # bypass computes its correction metrics per micro-batch (token-share weighted; perplexities are
    # not linear in the split): one pass each, so both paths split alike
    {"rollout_correction": "bypass_ppo_clip", "policy_loss": {"loss_agg_mode": "seq-mean-token-mean"},
     "shape_buckets": "on", "max_tokens_per_micro_batch": None},
], ids=["decoupled-kl-entropy", "bypass-bucketed"])
def test_a_packed_step_equals_the_padded_step(policy_dir, overrides):
    groups = sample_groups(policy_dir, n_groups=4, n=3, seed=2, logprob_noise=0.3, max_new_tokens=9)
    results = []
    for packing in (False, True):
        config = {"max_tokens_per_micro_batch": 40, **overrides}
        learner = Learner(LearnerConfig(model_path=str(policy_dir), dtype="float64", lr=1e-3, packing=packing,
                                        **config))
        results.append(([learner.train_step(groups) for _ in range(2)], params_of(learner.model)))
    (padded, padded_params), (packed, packed_params) = results
    assert max_param_diff(padded_params, packed_params) < 1e-10
    for want, got in zip(padded, packed):
        assert want["perf/padding_fraction"] > 0.05  # the padded path pads (0.089 here)
        assert got["perf/padding_fraction"] < want["perf/padding_fraction"]
        for key in want:
            if key.startswith(("timing_s/", "perf/")):
                continue
            assert got[key] == pytest.approx(want[key], rel=1e-9, abs=1e-12, nan_ok=True), key


def test_a_varlen_step_equals_the_sdpa_packed_step(policy_dir):
    """attn_implementation varlen (each sequence's attention alone: lm/packed_attention.py; its
    exact fallback on this CPU) trains as sdpa's block-diagonal mask does: same update, same metrics."""
    groups = sample_groups(policy_dir, n_groups=4, n=3, seed=5, logprob_noise=0.3, max_new_tokens=9)
    results = []
    for attention in ("sdpa", "varlen"):
        learner = Learner(LearnerConfig(model_path=str(policy_dir), dtype="float64", lr=1e-3, packing=True,
                                        max_tokens_per_micro_batch=40, shape_buckets="on",
                                        attn_implementation=attention, policy_loss={"kl_coef": 0.1}))
        results.append(([learner.train_step(groups) for _ in range(2)], params_of(learner.model)))
    (sdpa, sdpa_params), (varlen, varlen_params) = results
    assert max_param_diff(sdpa_params, varlen_params) < 1e-10
    for want, got in zip(sdpa, varlen):
        for key in want:
            if not key.startswith("timing_s/"):
                assert got[key] == pytest.approx(want[key], rel=1e-9, abs=1e-12, nan_ok=True), key
    with pytest.raises(ValueError, match="needs packing: true"):
        LearnerConfig(model_path=str(policy_dir), packing=False, attn_implementation="varlen")


@settings(max_examples=60, deadline=None, derandomize=True)
@given(lengths=st.lists(st.integers(1, 50), min_size=1, max_size=30), slack=st.integers(0, 60),
       max_rows=st.one_of(st.none(), st.integers(1, 5)))
def test_the_packed_plan_covers_every_row_once_within_the_budget(lengths, slack, max_rows):
    budget = max(lengths) + slack
    plan = plan_micro_batches(lengths, budget, max_rows=max_rows, packed=True)
    assert sorted(r for mb in plan for r in mb) == list(range(len(lengths)))
    assert all(sum(lengths[r] for r in mb) <= budget for mb in plan)
    assert all(max_rows is None or len(mb) <= max_rows for mb in plan)
    padded = plan_micro_batches(lengths, budget, max_rows=max_rows)
    assert len(plan) <= len(padded)  # real tokens never cost more than padded slots
    width = shape_bucket(sum(lengths[r] for r in plan[0]), budget)
    assert sum(lengths[r] for r in plan[0]) <= width <= max(budget, sum(lengths[r] for r in plan[0]))


def test_shape_buckets_are_few_and_waste_at_most_a_quarter():
    widths = {shape_bucket(n) for n in range(1, 16385)}
    assert len(widths) <= 4 * 14 + 4
    assert all(n <= shape_bucket(n) <= 1.25 * n for n in range(1, 16385))
    assert shape_bucket(15000, max_tokens=16384) == 16384 and shape_bucket(16384, max_tokens=16384) == 16384


def test_groups_go_to_ranks_balanced_by_tokens(policy_dir):
    assert balance_groups([100, 10, 10, 10, 10, 90], 2) == [[0, 2, 4], [1, 3, 5]]  # 120 vs 110 tokens
    assert balance_groups([5, 5, 5], 2) == [[0, 2], [1]]
    assert balance_groups([7], 3) == [[0], [], []]
    # round-robin would give rank 0 the two long groups; balanced, neither waits on the other long
    groups = sample_groups(policy_dir, n_groups=4, n=2, seed=5, max_new_tokens=9)
    tokens = build_batch(groups).group_tokens()
    parts = balance_groups(tokens, 2)
    loads = [sum(tokens[g] for g in p) for p in parts]
    round_robin = [sum(tokens[0::2]), sum(tokens[1::2])]
    assert max(loads) <= max(round_robin) and sorted(g for p in parts for g in p) == [0, 1, 2, 3]
