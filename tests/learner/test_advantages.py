"""Advantages by hand: GRPO, Dr.GRPO, RLOO, REINFORCE++ (with and without a group baseline),
Pass@k GRPO, OPO and GPG, grouped by id and spread over valid tokens."""
from __future__ import annotations

import math
import statistics

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from learner.advantages import AdvantageConfig, compute_advantages, group_index

EPS = 1e-6


def per_seq(estimator, rewards, ids, mask=None, **kw):
    rewards = torch.tensor(rewards, dtype=torch.float64)
    mask = torch.ones(len(rewards), 3) if mask is None else mask
    adv = compute_advantages(rewards, ids, mask, AdvantageConfig(estimator=estimator, **kw))
    return adv, [float(a) for a in adv[:, 0]]


def test_grpo_uses_group_mean_and_unbiased_std():
    _, adv = per_seq("grpo", [1.0, 0.0, 0.0, 2.0, 4.0], ["a", "a", "a", "b", "b"])
    mean_a, std_a = 1 / 3, statistics.stdev([1.0, 0.0, 0.0])  # stdev is the n−1 estimator
    mean_b, std_b = 3.0, statistics.stdev([2.0, 4.0])
    expected = [(1 - mean_a) / (std_a + EPS), (0 - mean_a) / (std_a + EPS), (0 - mean_a) / (std_a + EPS),
                (2 - mean_b) / (std_b + EPS), (4 - mean_b) / (std_b + EPS)]
    assert adv == pytest.approx(expected)


def test_grpo_group_of_one_has_mean_zero_and_std_one_and_equal_rewards_give_zero():
    _, adv = per_seq("grpo", [0.7, 1.0, 1.0], ["solo", "x", "x"])
    assert adv == pytest.approx([0.7 / (1 + EPS), 0.0, 0.0])


def test_groups_are_found_by_id_wherever_the_rows_are():
    _, interleaved = per_seq("grpo", [1.0, 5.0, 0.0, 3.0], ["a", "b", "a", "b"])
    _, contiguous = per_seq("grpo", [1.0, 0.0, 5.0, 3.0], ["a", "a", "b", "b"])
    assert interleaved == pytest.approx([contiguous[0], contiguous[2], contiguous[1], contiguous[3]])
    assert group_index(["q", 7, "q", (1, 2), 7]).tolist() == [0, 1, 0, 2, 1]
    assert group_index(torch.tensor([4, 4, 9])).tolist() == [0, 0, 1]


def test_dr_grpo_drops_the_std():
    _, adv = per_seq("dr_grpo", [1.0, 0.0, 0.0, 2.0, 4.0, 0.5], ["a", "a", "a", "b", "b", "c"])
    assert adv == pytest.approx([2 / 3, -1 / 3, -1 / 3, -1.0, 1.0, 0.5])


def test_rloo_subtracts_the_mean_of_the_other_samples():
    _, adv = per_seq("rloo", [1.0, 0.0, 0.0, 2.0, 4.0, 0.5], ["a", "a", "a", "b", "b", "c"])
    assert adv == pytest.approx([1 - 0.0, 0 - 0.5, 0 - 0.5, 2 - 4, 4 - 2, 0.5])


def test_reinforce_pp_baseline_whitens_group_centred_rewards_over_valid_tokens():
    mask = torch.tensor([[1, 1, 1], [1, 0, 0], [1, 1, 0], [1, 1, 1]], dtype=torch.float32)
    _, adv = per_seq("reinforce_plus_plus_baseline", [1.0, 0.0, 3.0, 1.0], ["a", "a", "b", "b"], mask)
    centred = [0.5, -0.5, 1.0, -1.0]
    tokens = [3, 1, 2, 3]
    values = [c for c, n in zip(centred, tokens) for _ in range(n)]  # one entry per valid token
    mean, std = statistics.mean(values), statistics.stdev(values)
    assert adv == pytest.approx([(c - mean) / math.sqrt(std ** 2 + 1e-8) for c in centred])


def test_grpo_passk_rewards_only_each_groups_best_by_its_lead_over_the_second():
    _, adv = per_seq("grpo_passk", [0.0, 1.0, 0.25, 2.0, 2.0, 1.0, 0.3], ["a", "a", "a", "b", "b", "b", "c"])
    lead_a = (1.0 - 0.25) / (statistics.stdev([0.0, 1.0, 0.25]) + EPS)
    # group b ties at the top: the first best gets the lead over the second, 0; a group of one: 0
    assert adv == pytest.approx([0.0, lead_a, 0.0, 0.0, 0.0, 0.0, 0.0])


def test_opo_subtracts_the_length_weighted_group_mean():
    mask = torch.tensor([[1, 1, 1], [1, 0, 0], [1, 1, 0], [1, 1, 1]], dtype=torch.float32)
    _, adv = per_seq("opo", [1.0, 0.0, 3.0, 0.5], ["a", "a", "b", "c"], mask)
    baseline_a = (3 * 1.0 + 1 * 0.0) / 4
    assert adv == pytest.approx([1.0 - baseline_a, 0.0 - baseline_a, 3.0, 0.5])  # groups of one keep r


def test_reinforce_pp_discounts_each_token_by_the_valid_tokens_after_it_then_whitens():
    """γ = 0.5, the reward on the last valid token: a token with k valid tokens after it returns
    γ^k·r; a tool token between turns (mask 0) neither counts nor discounts. No group baseline."""
    mask = torch.tensor([[1, 1, 0, 1], [1, 1, 1, 0]], dtype=torch.float32)
    rewards = torch.tensor([1.0, 2.0], dtype=torch.float64)
    adv = compute_advantages(rewards, ["a", "a"], mask, AdvantageConfig(estimator="reinforce_plus_plus", gamma=0.5))
    returns = [0.25, 0.5, 1.0, 0.5, 1.0, 2.0]  # row 0: 2, 1, 0 valid tokens after; row 1 likewise
    mean, std = statistics.mean(returns), statistics.stdev(returns)
    white = [(x - mean) / math.sqrt(std ** 2 + 1e-8) for x in returns]
    expected = torch.tensor([[white[0], white[1], 0.0, white[2]], [white[3], white[4], white[5], 0.0]],
                            dtype=torch.float64)
    assert torch.allclose(adv, expected)
    undiscounted = compute_advantages(rewards, ["a", "a"], mask, AdvantageConfig(estimator="reinforce_plus_plus"))
    z = 0.5 / statistics.stdev([1.0] * 3 + [2.0] * 3)  # returns 1, 1, 1 and 2, 2, 2: mean 1.5
    assert torch.allclose(undiscounted[:, 0], torch.tensor([-z, z], dtype=torch.float64), atol=1e-6)
    assert torch.equal(undiscounted[0] != 0, mask[0] != 0), "γ = 1: one value per sequence, 0 at tool tokens"
    with pytest.raises(ValidationError, match="gamma"):
        AdvantageConfig(gamma=1.5)


def _verl_reinforce_pp_returns(token_level_rewards, response_mask, gamma):
    """verl's loop in compute_reinforce_plus_plus_outcome_advantage (core_algos.py), column by column:
    an observation token (mask 0) carries the running return through unchanged."""
    returns, running = torch.zeros_like(token_level_rewards), 0
    for t in reversed(range(token_level_rewards.shape[1])):
        new = token_level_rewards[:, t] + gamma * running
        returns[:, t] = new * response_mask[:, t]
        running = new * response_mask[:, t] + running * (1 - response_mask[:, t])
    return returns


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), batch=st.integers(1, 6), tokens=st.integers(1, 600),
       gamma=st.sampled_from([0.0, 0.5, 0.9, 0.99, 1.0]))
def test_discounted_returns_equal_verls_loop_over_multi_turn_masks(seed, batch, tokens, gamma):
    """Block matmuls over each row's own tokens (more than one block at 600 tokens) give verl's
    column-by-column returns on rows with tool tokens anywhere between (rewards on policy tokens)."""
    from learner.advantages import discounted_returns

    g = torch.Generator().manual_seed(seed)
    mask = (torch.rand(batch, tokens, generator=g) < 0.8).double()
    rewards = torch.randn(batch, tokens, generator=g, dtype=torch.float64) * (torch.rand(batch, tokens, generator=g) < 0.1)
    rewards = rewards * mask
    ours, verls = discounted_returns(rewards, mask, gamma), _verl_reinforce_pp_returns(rewards, mask, gamma)
    assert torch.allclose(ours, verls, rtol=0, atol=1e-10)


def test_reinforce_pp_credits_each_turn_with_the_step_rewards_from_it_on():
    """A two-turn trajectory: step rewards 1 (turn 1's last token) and 2 (turn 2's), a tool token
    between. γ = 1: turn 1's tokens return 3, turn 2's 2. A reward the steps do not sum to (an
    environment failure's) lands on the last policy token; a sample without step rewards has its
    reward there."""
    from learner.advantages import discounted_returns, token_level_rewards

    mask = torch.tensor([[1, 1, 0, 1, 1], [1, 1, 1, 0, 0]], dtype=torch.bool)
    steps = torch.tensor([[0, 1, 0, 0, 2], [0, 0, 0, 0, 0]], dtype=torch.float32)
    rewards = torch.tensor([3.0, 0.5])
    placed = token_level_rewards(rewards, mask, steps)
    assert placed.tolist() == [[0, 1, 0, 0, 2], [0, 0, 0.5, 0, 0]]
    assert discounted_returns(placed, mask, 1.0).tolist() == [[3, 3, 0, 2, 2], [0.5, 0.5, 0.5, 0, 0]]
    assert discounted_returns(placed, mask, 0.5).tolist() == [[0.75, 1.5, 0, 1, 2], [0.125, 0.25, 0.5, 0, 0]]
    failed = token_level_rewards(torch.tensor([-1.0, 0.5]), mask, steps)  # the environment failed: reward -1
    assert failed[0].tolist() == [0, 1, 0, 0, -2]
    adv = compute_advantages(rewards, ["a", "a"], mask, AdvantageConfig(estimator="reinforce_plus_plus"), steps)
    returns = [3.0, 3.0, 2.0, 2.0, 0.5, 0.5, 0.5]
    mean, std = statistics.mean(returns), statistics.stdev(returns)
    assert adv[0, 0].item() == pytest.approx((3.0 - mean) / std, rel=1e-6)
    assert adv[0, 3].item() == pytest.approx((2.0 - mean) / std, rel=1e-6) and adv[0, 2] == 0


def test_remax_subtracts_each_groups_greedy_reward_from_every_tokens_return():
    """ReMax (verl's compute_remax_outcome_advantage): the return-to-go less the sample's baseline,
    no whitening. An outcome reward: r − b on every valid token; a two-turn trajectory with step
    rewards 1 and 2: turn 1's tokens 3 − b, turn 2's 2 − b, the tool token 0; a KL-penalised
    reward's per-token terms enter the returns as verl's token_level_rewards do."""
    from learner.advantages import kl_penalised_rewards

    remax = AdvantageConfig(estimator="remax")
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0], [1, 1, 1, 1]], dtype=torch.bool)
    rewards, baselines = torch.tensor([1.0, 0.0, 1.0]), torch.tensor([0.5, 0.5, 1.0])
    adv = compute_advantages(rewards, ["a", "a", "b"], mask, remax, reward_baselines=baselines)
    assert adv.tolist() == [[0.5, 0.5, 0.5, 0], [-0.5, -0.5, 0, 0], [0, 0, 0, 0]]
    turns = torch.tensor([[1, 1, 0, 1, 1]], dtype=torch.bool)
    steps = torch.tensor([[0, 1, 0, 0, 2]], dtype=torch.float32)
    adv = compute_advantages(torch.tensor([3.0]), ["a"], turns, remax, steps, reward_baselines=torch.tensor([1.0]))
    assert adv.tolist() == [[2, 2, 0, 1, 1]]
    kl = torch.tensor([[0.2, 0.4, 0.0, 0.0]] * 3, dtype=torch.float32)
    penalised, placed = kl_penalised_rewards(rewards, mask, kl, 0.5)
    adv = compute_advantages(penalised, ["a", "a", "b"], mask, remax, placed, reward_baselines=baselines)
    assert adv[0].tolist() == pytest.approx([1 - 0.3 - 0.5, 1 - 0.2 - 0.5, 1 - 0.5, 0])
    with pytest.raises(ValueError, match=r"remax needs reward_baselines \[3\] .*, got None"):
        compute_advantages(rewards, ["a", "a", "b"], mask, remax)
    with pytest.raises(ValueError, match="not finite"):
        compute_advantages(rewards, ["a", "a", "b"], mask, remax, reward_baselines=torch.tensor([0.0, math.nan, 0.0]))


def test_gae_discounts_td_errors_over_policy_tokens_and_whitens_over_the_batch():
    """GAE by hand (verl's compute_gae_advantage_return): δ_t = r_t + γ V_{t+1} − V_t,
    A_t = δ_t + γλ A_{t+1}, returns A + V before whitening; a tool token between turns carries no
    TD error and its value is skipped; the advantages are whitened over the batch's policy tokens."""
    from learner.advantages import gae_advantages_and_returns

    mask = torch.tensor([[1, 1, 1]], dtype=torch.bool)
    rewards = torch.tensor([[0.0, 0.0, 1.0]], dtype=torch.float64)
    values = torch.tensor([[0.5, 0.2, 0.4]], dtype=torch.float64)
    _, returns = gae_advantages_and_returns(rewards, values, mask, gamma=0.9, lam=0.8)
    a2 = 1.0 - 0.4
    a1 = 0.9 * 0.4 - 0.2 + 0.72 * a2
    a0 = 0.9 * 0.2 - 0.5 + 0.72 * a1
    assert returns[0].tolist() == pytest.approx([a0 + 0.5, a1 + 0.2, a2 + 0.4])
    # γ = λ = 1: every token's return is the reward to come; a tool token's value (9) is never read
    turns = torch.tensor([[1, 0, 1], [1, 1, 0]], dtype=torch.bool)
    rewards = torch.tensor([[0.0, 0.0, 1.0], [0.0, 2.0, 0.0]], dtype=torch.float64)
    values = torch.tensor([[0.5, 9.0, 0.4], [1.0, 1.5, 7.0]], dtype=torch.float64)
    advantages, returns = gae_advantages_and_returns(rewards, values, turns)
    assert returns.tolist() == [[1.0, 0.0, 1.0], [2.0, 2.0, 0.0]]
    raw = torch.tensor([1.0 - 0.5, 1.0 - 0.4, 2.0 - 1.0, 2.0 - 1.5], dtype=torch.float64)
    assert advantages[turns].tolist() == pytest.approx(((raw - raw.mean()) / raw.std()).tolist(), abs=1e-6)
    assert advantages[~turns].tolist() == [0.0, 0.0]
    with pytest.raises(ValueError, match="gae needs the critic's values"):
        compute_advantages(torch.tensor([1.0]), ["a"], mask, AdvantageConfig(estimator="gae"))


@pytest.mark.parametrize("factor", [0.0, 0.5, 0.95, 1.0])
def test_discounted_suffix_sums_equal_the_column_loop_across_blocks(factor):
    from learner.advantages import discounted_suffix_sums

    x = torch.randn(3, 11, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    want, running = torch.zeros_like(x), torch.zeros(3, dtype=torch.float64)
    for t in range(10, -1, -1):
        running = x[:, t] + factor * running
        want[:, t] = running
    assert torch.allclose(discounted_suffix_sums(x, factor, block=4), want, rtol=0, atol=1e-12)


def test_gpg_scales_the_group_centred_reward_by_the_share_of_non_zero_rewards():
    # 6 responses, 2 with a non-zero reward: α = 6 / 2 = 3; a group of one keeps α·r
    _, adv = per_seq("gpg", [1.0, 0.0, 0.0, 0.0, 0.0, 0.5], ["a", "a", "b", "b", "b", "c"])
    assert adv == pytest.approx([3 * 0.5, 3 * -0.5, 0.0, 0.0, 0.0, 3 * 0.5])
    _, adv = per_seq("gpg", [0.0, 0.0], ["a", "a"])
    assert adv == [0.0, 0.0]


def test_optimal_token_baseline_weighs_each_groups_returns_by_path_variance_per_token():
    """Group a: lengths 3, 2, 1, rewards 1, 0, 1; every token has π = 0.5 and Σπ² = 0.5, so
    w = 1 − 2·0.5 + 0.5 = 0.5 and W_t = 0.5·(t + 1). B_0 = (1·0.5 + 0·0.5 + 1·0.5) / 1.5 = 2/3,
    B_1 = (1·1 + 0·1) / 2 = 1/2, and row 0 alone reaches t = 2: past the second longest (2) it has
    no baseline. Group b has one response: no baseline at all."""
    mask = torch.tensor([[1, 1, 1], [1, 1, 0], [1, 0, 0], [1, 1, 0]], dtype=torch.float64)
    half = torch.full((4, 3), 0.5, dtype=torch.float64)
    config = AdvantageConfig(estimator="optimal_token_baseline")
    rewards = torch.tensor([1.0, 0.0, 1.0, 2.0], dtype=torch.float64)
    ids = ["a", "a", "a", "b"]
    adv = compute_advantages(rewards, ids, mask, config, old_log_probs=half.log(), sum_pi_squared=half)
    want = [[1 / 3, 1 / 2, 1.0], [-2 / 3, -1 / 2, 0.0], [1 / 3, 0.0, 0.0], [2.0, 2.0, 0.0]]
    torch.testing.assert_close(adv, torch.tensor(want, dtype=torch.float64), rtol=0, atol=1e-7)
    # IS weights scale each token's w by ρ̄²: row 1 with ρ̄ = 2 weighs 4x, B_0 = 1 / (0.5 + 2 + 0.5)
    is_weights = torch.ones(4, 3, dtype=torch.float64)
    is_weights[1] = 2.0
    adv = compute_advantages(rewards, ids, mask, config, old_log_probs=half.log(), sum_pi_squared=half,
                             is_weights=is_weights)
    assert float(adv[0, 0]) == pytest.approx(1 - 1 / 3) and float(adv[1, 0]) == pytest.approx(-1 / 3)
    # Two equally long longest responses: both keep their baseline to the end.
    mask[1, 2] = 1
    adv = compute_advantages(rewards, ids, mask, config, old_log_probs=half.log(), sum_pi_squared=half)
    assert float(adv[0, 2]) == pytest.approx(1 - 1.5 / (1.5 + 1.5))
    with pytest.raises(ValueError, match=r"optimal_token_baseline needs sum_pi_squared \[4, 3\], got None"):
        compute_advantages(rewards, ids, mask, config, old_log_probs=half.log())
    with pytest.raises(ValueError, match=r"needs is_weights \[4, 3\], got \(4, 2\)"):
        compute_advantages(rewards, ids, mask, config, old_log_probs=half.log(), sum_pi_squared=half,
                           is_weights=half[:, :2])


def test_the_multi_turn_optimal_token_baseline_counts_each_rows_own_tokens():
    """Row 0's policy tokens sit in columns 0, 2, 3 (an observation in column 1), row 1's in 0, 1;
    rewards 1 and 0, w = 0.5 everywhere. tir_: the k-th own tokens share a baseline, B = 0.5, 0.5,
    then row 0's third token has no other to compare with. The column form compares column 1 of
    row 1 with nothing of row 0 and gives its token a baseline of 0."""
    mask = torch.tensor([[1, 0, 1, 1], [1, 1, 0, 0]], dtype=torch.float64)
    half = torch.full((2, 4), 0.5, dtype=torch.float64)
    rewards, ids = torch.tensor([1.0, 0.0], dtype=torch.float64), ["a", "a"]
    inputs = dict(old_log_probs=half.log(), sum_pi_squared=half)
    tir = compute_advantages(rewards, ids, mask, AdvantageConfig(estimator="tir_optimal_token_baseline"), **inputs)
    columns = compute_advantages(rewards, ids, mask, AdvantageConfig(estimator="optimal_token_baseline"), **inputs)
    torch.testing.assert_close(tir, torch.tensor([[0.5, 0, 0.5, 1], [-0.5, -0.5, 0, 0]], dtype=torch.float64))
    torch.testing.assert_close(columns, torch.tensor([[0.5, 0, 1, 1], [-0.5, 0, 0, 0]], dtype=torch.float64))


def test_gdpo_normalises_each_reward_component_in_its_groups_before_summing():
    """Two components: format (0/1, a wide spread) and accuracy (0.1 apart). Summed first (GRPO),
    format decides the order; GDPO normalises each in its group, so accuracy counts as much."""
    fmt = [1.0, 0.0, 1.0, 0.0]
    acc = [0.0, 0.1, 0.1, 0.0]
    components = torch.tensor([fmt, acc], dtype=torch.float64)
    mask = torch.ones(4, 2)
    ids = ["a", "a", "a", "a"]
    cfg = AdvantageConfig(estimator="gdpo", gdpo_reward_keys=["format", "accuracy"], gdpo_reward_weights=[1.0, 2.0])
    adv = compute_advantages(torch.zeros(4), ids, mask, cfg, reward_components=components)[:, 0]

    def grpo(values):
        mean, std = statistics.mean(values), statistics.stdev(values)
        return [(v - mean) / (std + EPS) for v in values]

    def whitened(values):  # over the 8 valid tokens: each value twice
        mean = statistics.mean(values)
        var = sum((v - mean) ** 2 for v in values) * 2 / 7
        return [(v - mean) / math.sqrt(var + 1e-8) for v in values]

    total = [f + 2 * a for f, a in zip(grpo(fmt), grpo(acc))]
    assert adv.tolist() == pytest.approx(whitened(total))
    assert adv[2] > adv[0], "the response right on both counts beats the one right on format only"
    no_std = compute_advantages(torch.zeros(4), ids, mask, cfg.model_copy(update={"gdpo_norm_by_std": False}),
                                reward_components=components)[:, 0]
    assert no_std.tolist() == pytest.approx(whitened([0.5 - 0.1, -0.5 + 0.1, 0.5 + 0.1, -0.5 - 0.1]))
    with pytest.raises(ValidationError, match="gdpo needs gdpo_reward_keys"):
        AdvantageConfig(estimator="gdpo")
    with pytest.raises(ValidationError, match="2 weights for 1 gdpo_reward_keys"):
        AdvantageConfig(estimator="gdpo", gdpo_reward_keys=["a"], gdpo_reward_weights=[1.0, 1.0])
    with pytest.raises(ValueError, match=r"gdpo needs reward_components \[2 keys, 4 rows\], got None"):
        compute_advantages(torch.zeros(4), ids, mask, cfg)


def test_kl_in_the_reward_comes_off_every_valid_token_and_an_adaptive_beta_follows_the_kl():
    from learner.advantages import KLRewardConfig, adaptive_kl_coef, kl_penalised_rewards

    mask = torch.tensor([[1, 1, 0], [1, 0, 0]], dtype=torch.bool)
    kl = torch.tensor([[0.2, 0.4, 9.0], [-0.1, 9.0, 9.0]], dtype=torch.float64)  # 9: padding, ignored
    rewards, tokens = kl_penalised_rewards(torch.tensor([1.0, 0.0], dtype=torch.float64), mask, kl, 0.5)
    assert torch.allclose(tokens, torch.tensor([[-0.1, 1.0 - 0.2, 0.0], [0.05, 0.0, 0.0]], dtype=torch.float64))
    assert rewards.tolist() == pytest.approx([1.0 - 0.5 * 0.6, 0.05])
    adaptive = KLRewardConfig(coef=0.1, controller="adaptive", target_kl=0.1, horizon=100)
    assert adaptive_kl_coef(0.1, 0.11, 10, adaptive) == pytest.approx(0.1 * (1 + 0.1 * 0.1))  # KL 10 % high
    assert adaptive_kl_coef(0.1, 0.0, 10, adaptive) == pytest.approx(0.1 * (1 - 0.2 * 0.1))  # error clipped at -0.2
    assert adaptive_kl_coef(0.1, 1.0, 50, adaptive) == pytest.approx(0.1 * (1 + 0.2 * 0.5))  # ... and at +0.2
    assert adaptive_kl_coef(0.1, 1.0, 50, KLRewardConfig(coef=0.1)) == 0.1  # fixed


def test_outcome_advantage_is_spread_over_valid_tokens_only():
    mask = torch.tensor([[1, 1, 0, 0], [1, 1, 1, 1], [0, 0, 0, 0]], dtype=torch.float32)
    adv = compute_advantages(torch.tensor([1.0, 0.0, 5.0]), ["g", "g", "h"], mask, AdvantageConfig())
    a = 0.5 / (statistics.stdev([1.0, 0.0]) + EPS)
    assert torch.allclose(adv, torch.tensor([[a, a, 0, 0], [-a, -a, -a, -a], [0, 0, 0, 0]]))
    assert adv.dtype == torch.float32


@settings(max_examples=40, deadline=None)
@given(rewards=st.lists(st.floats(-10, 10), min_size=1, max_size=12), n_groups=st.integers(1, 4),
       estimator=st.sampled_from(["grpo", "dr_grpo", "rloo", "reinforce_plus_plus_baseline", "grpo_passk", "opo",
                                  "reinforce_plus_plus", "gpg"]))
def test_group_centred_estimators_sum_to_zero_in_every_group_of_two_or_more(rewards, n_groups, estimator):
    ids = [i % n_groups for i in range(len(rewards))]
    adv, values = per_seq(estimator, rewards, ids)
    assert torch.isfinite(adv).all()
    if estimator in ("reinforce_plus_plus_baseline", "grpo_passk", "reinforce_plus_plus"):
        return  # whitened over the batch / only the best learns: not centred per group
    for g in set(ids):
        members = [v for v, i in zip(values, ids) if i == g]
        if len(members) > 1:
            assert sum(members) == pytest.approx(0.0, abs=1e-6)


def test_bad_input_is_named():
    mask = torch.ones(3, 2)
    with pytest.raises(ValueError, match="reward of row 1 is not finite"):
        compute_advantages(torch.tensor([1.0, float("nan"), 0.0]), ["a", "a", "b"], mask)
    with pytest.raises(ValueError, match="group_ids has 2 entries for 3 rewards"):
        compute_advantages(torch.tensor([1.0, 0.0, 0.0]), ["a", "a"], mask)
    with pytest.raises(ValueError, match="response_mask has 2 rows for 3 rewards"):
        compute_advantages(torch.tensor([1.0, 0.0, 0.0]), ["a", "a", "b"], mask[:2])
    with pytest.raises(ValueError, match=r"one scalar per sequence"):
        compute_advantages(torch.ones(3, 2), ["a", "a", "b"], mask)
    with pytest.raises(ValueError, match="1-D integer tensor"):
        group_index(torch.tensor([0.5, 1.0]))
    with pytest.raises(ValidationError, match="estimator"):
        AdvantageConfig(estimator="vtrace")
    with pytest.raises(ValidationError, match="eps"):
        AdvantageConfig(eps=0.0)
