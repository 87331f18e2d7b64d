"""Policy losses: dual-clip PPO by hand, the three modes, aggregation with global counts,
micro-batch invariance, KL and entropy terms, the autograd check, staleness, bad input."""
from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from learner.correction import RolloutCorrectionConfig as Cfg
from learner.correction import compute_rollout_correction
from learner.losses import (
    PolicyLossConfig,
    aggregate_loss,
    compute_policy_loss,
    count_tokens_and_sequences,
    kl_penalty,
    ppo_clip_token_loss,
    staleness_metrics,
)

LOSS = PolicyLossConfig()


def rows(*values, dtype=torch.float64):
    return torch.tensor(values, dtype=dtype)


# ---- PPO by hand -------------------------------------------------------------------------------

# (A, r) -> per-token loss with ε = 0.2, c = 3
PPO_CASES = [
    (1.0, 1.5, -1.2, True, False),   # clipped above
    (1.0, 0.5, -0.5, False, False),  # unclipped (pessimistic side)
    (-1.0, 1.5, 1.5, False, False),  # unclipped
    (-1.0, 0.5, 0.8, True, False),   # clipped below
    (-1.0, 5.0, 3.0, False, True),   # dual clip: |A|·r = 5 capped at c·|A| = 3
    (0.0, 2.0, 0.0, False, False),
]


def test_dual_clip_ppo_token_loss_by_hand():
    adv = rows([c[0] for c in PPO_CASES])
    ratio = rows([c[1] for c in PPO_CASES])
    anchor = torch.full_like(ratio, -1.0)
    loss, upper, lower, _ = ppo_clip_token_loss(anchor + torch.log(ratio), anchor, adv, LOSS)
    assert torch.allclose(loss, rows([c[2] for c in PPO_CASES]))
    assert upper.tolist() == [[c[3] for c in PPO_CASES]]
    assert lower.tolist() == [[c[4] for c in PPO_CASES]]


def test_value_loss_by_hand():
    """verl's compute_value_loss: ½·max((V − R)², (clip(V, V_old ± ε) − R)²), token-mean. Token 0
    moved 1.0 from its old value (ε = 0.5): its clipped term is larger and has no gradient; token 1
    did not move: both terms agree (not counted as clipped) and its gradient is (V − R) / N."""
    from learner.losses import value_loss

    predicted = torch.tensor([[1.0, 0.0, 5.0]], dtype=torch.float64, requires_grad=True)
    old = torch.zeros(1, 3, dtype=torch.float64)
    returns = torch.tensor([[2.0, -1.0, 0.0]], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 0]])
    loss, clipfrac = value_loss(predicted, old, returns, mask, 0.5)
    assert loss.item() == pytest.approx(0.5 * (2.25 + 1.0) / 2) and float(clipfrac) == 0.5
    loss.backward()
    assert predicted.grad.tolist() == [[0.0, 0.5, 0.0]]
    loss, _ = value_loss(predicted.detach(), old, returns, mask, 0.5, "token-mean", global_token_count=4)
    assert float(loss) == pytest.approx(0.5 * (2.25 + 1.0) / 4)


def test_decoupled_loss_metrics_by_hand_without_correction():
    adv = rows([c[0] for c in PPO_CASES])
    old = torch.full_like(adv, -1.0)
    log_prob = old + torch.log(rows([c[1] for c in PPO_CASES]))
    loss, m = compute_policy_loss(log_prob, old, old, adv, torch.ones_like(adv), Cfg.disabled(), LOSS)
    assert loss.item() == pytest.approx(sum(c[2] for c in PPO_CASES) / 6)
    assert m["actor/pg_loss"] == pytest.approx(loss.item())
    assert m["actor/pg_clipfrac"] == pytest.approx(2 / 6)
    assert m["actor/pg_clipfrac_lower"] == pytest.approx(1 / 6)
    assert m["actor/ppo_kl"] == pytest.approx(-sum(math.log(c[1]) for c in PPO_CASES) / 6)
    assert m["rollout_corr/kl"] == 0.0  # rollout == old here


def test_asymmetric_clip_and_custom_dual_clip():
    cfg = PolicyLossConfig(clip_ratio_low=0.1, clip_ratio_high=0.28, clip_ratio_c=2.0)
    anchor = torch.zeros(1, 4, dtype=torch.float64)
    ratio = rows([1.5, 0.5, 0.5, 4.0])
    loss, *_ = ppo_clip_token_loss(torch.log(ratio), anchor, rows([1.0, -1.0, 1.0, -1.0]), cfg)
    assert torch.allclose(loss, rows([-1.28, 0.9, -0.5, 2.0]))


def test_decoupled_mode_multiplies_by_detached_is_weights():
    adv = rows([1.0, -1.0, 1.0])
    old = rows([-1.0, -1.0, -1.0])
    rollout = old - torch.log(rows([0.5, 1.5, 3.0]))  # ρ = π_old/π_rollout = 0.5, 1.5, 3 -> capped 2
    log_prob = (old + torch.log(rows([1.1, 1.1, 1.1]))).requires_grad_()
    loss, m = compute_policy_loss(log_prob, old, rollout, adv, torch.ones_like(adv), Cfg.decoupled_token_is(), LOSS)
    assert loss.item() == pytest.approx((0.5 * -1.1 + 1.5 * 1.1 + 2.0 * -1.1) / 3)
    assert m["rollout_corr/rollout_is_mean"] == pytest.approx((0.5 + 1.5 + 2.0) / 3)


def test_precomputed_correction_matches_the_internal_one():
    gen = torch.Generator().manual_seed(0)
    lp, old, rollout, adv, mask = random_inputs(gen, 6, 8)
    cfg = Cfg.decoupled_geo_rs_token_tis(rs_threshold=1.2)
    inside, _ = compute_policy_loss(lp, old, rollout, adv, mask, cfg, LOSS)
    w, kept_mask, _ = compute_rollout_correction(old, rollout, mask, cfg)
    outside, m = compute_policy_loss(lp, old, None, adv, mask, cfg, LOSS, precomputed_correction=(w, kept_mask))
    assert outside.item() == pytest.approx(inside.item())
    assert not any(k.startswith("rollout_corr/") for k in m)  # the caller owns those metrics


def test_rejected_tokens_leave_numerator_and_denominator():
    adv = rows([1.0, 1.0], [2.0, 2.0])
    old = torch.full((2, 2), -1.0, dtype=torch.float64)
    rollout = old.clone()
    rollout[1] -= 1.0  # ρ = e for row 1: the geometric filter rejects it
    log_prob = old + 0.05
    cfg = Cfg.decoupled_geo_rs(rs_threshold=1.5)
    loss, m = compute_policy_loss(log_prob, old, rollout, adv, torch.ones_like(adv), cfg, LOSS)
    assert loss.item() == pytest.approx(-math.exp(0.05))  # row 0 only: -A·r averaged over its 2 tokens
    assert m["rollout_corr/rollout_rs_masked_fraction"] == pytest.approx(0.5)


# ---- bypass modes ------------------------------------------------------------------------------


def test_bypass_ppo_clip_anchors_on_rollout_and_ignores_is_weights():
    adv = rows([1.0, -1.0, 1.0])
    rollout = rows([-1.0, -1.0, -1.0])
    log_prob = rollout + torch.log(rows([1.1, 0.7, 1.5]))
    plain, m = compute_policy_loss(log_prob, None, rollout, adv, torch.ones_like(adv), Cfg.bypass_ppo_clip(), LOSS)
    assert plain.item() == pytest.approx((-1.1 + 0.8 - 1.2) / 3)
    assert m["actor/pg_clipfrac"] == pytest.approx(2 / 3)
    with_is, m = compute_policy_loss(log_prob, rows([9.0, 9.0, 9.0]), rollout, adv, torch.ones_like(adv),
                                     Cfg.ppo_is_bypass(), LOSS)  # old_log_prob is ignored in bypass mode
    assert with_is.item() == pytest.approx(plain.item())
    assert m["rollout_corr/rollout_is_mean"] == pytest.approx((1.1 + 0.7 + 1.5) / 3)  # metrics only


def test_bypass_ppo_clip_rejection_still_masks():
    rollout = torch.full((2, 3), -1.0, dtype=torch.float64)
    log_prob = rollout.clone()
    log_prob[1] += 0.5  # π_θ/π_rollout = e^0.5 on row 1: rejected by the K3 filter
    adv = torch.ones_like(rollout)
    loss, m = compute_policy_loss(log_prob, None, rollout, adv, torch.ones_like(adv), Cfg.bypass_ppo_clip_k3_rs(), LOSS)
    assert loss.item() == pytest.approx(-1.0)
    assert m["rollout_corr/rollout_rs_seq_masked_fraction"] == pytest.approx(0.5)


def test_bypass_rejection_masks_the_policy_gradient_term_only_and_decoupled_masks_every_term():
    """As verl: bypass mode rejects inside its policy loss, so the KL and entropy terms average over
    the batch's mask; decoupled mode rejects up front, so they average over the kept tokens."""
    rollout = torch.full((2, 3), -1.0, dtype=torch.float64)
    log_prob = rollout.clone()
    log_prob[1] += 0.5  # row 1 leaves the K3 filter: rejected
    adv, ref = torch.ones_like(rollout), rollout - 0.1
    entropy = rows([1.0, 1.0, 1.0], [4.0, 4.0, 4.0])
    loss_cfg = PolicyLossConfig(kl_coef=1.0, kl_estimator="k1", entropy_coeff=1.0)
    mask = torch.ones_like(adv)
    _, bypass = compute_policy_loss(log_prob, None, rollout, adv, mask, Cfg.bypass_ppo_clip_k3_rs(), loss_cfg,
                                    ref_log_prob=ref, entropy=entropy)
    assert bypass["rollout_corr/rollout_rs_seq_masked_fraction"] == pytest.approx(0.5)
    assert bypass["actor/pg_loss"] == pytest.approx(-1.0)  # row 0 only
    assert bypass["actor/kl_loss"] == pytest.approx((3 * 0.1 + 3 * 0.6) / 6)  # both rows
    assert bypass["actor/entropy"] == pytest.approx(2.5)
    # decoupled, π_old = π_θ here: the same row is rejected up front, and every term loses it
    _, decoupled = compute_policy_loss(log_prob, log_prob.detach(), rollout, adv, mask, Cfg.decoupled_k3_rs(),
                                       loss_cfg, ref_log_prob=ref, entropy=entropy)
    assert decoupled["actor/kl_loss"] == pytest.approx(0.1) and decoupled["actor/entropy"] == pytest.approx(1.0)


def test_bypass_reinforce_is_weighted_log_likelihood_with_weights_from_current_policy():
    rollout = rows([-1.0, -2.0], [-1.0, -1.0])
    log_prob = rollout + rows([0.3, 0.2], [-0.1, -0.1])  # sequence ratios e^0.5 and e^-0.2
    adv = rows([1.0, 1.0], [-2.0, -2.0])
    loss, m = compute_policy_loss(log_prob, None, rollout, adv, torch.ones_like(adv), Cfg.bypass_pg_is(), LOSS)
    w = [math.exp(0.5), math.exp(-0.2)]
    expected = -(w[0] * (-0.7 + -1.8) + w[1] * -2.0 * (-1.1 + -1.1)) / 4
    assert loss.item() == pytest.approx(expected)
    assert m["actor/pg_clipfrac"] == 0.0
    capped, _ = compute_policy_loss(log_prob, None, rollout, adv, torch.ones_like(adv), Cfg.bypass_pg_is(threshold=1.2), LOSS)
    assert capped.item() == pytest.approx(-(1.2 * (-2.5) + w[1] * -2.0 * -2.2) / 4)


def test_bypass_reinforce_without_is_options_is_plain_reinforce():
    rollout = rows([-1.0, -2.0])
    log_prob = rollout + 0.7
    cfg = Cfg(bypass_mode=True, loss_type="reinforce")
    loss, _ = compute_policy_loss(log_prob, None, rollout, rows([2.0, 2.0]), torch.ones(1, 2), cfg, LOSS)
    assert loss.item() == pytest.approx(-2.0 * (-0.3 + -1.3) / 2)


# ---- autograd: the weights carry no gradient ---------------------------------------------------


def policy(theta, tokens):
    return torch.log_softmax(theta, -1).gather(-1, tokens[..., None]).squeeze(-1)


def test_reinforce_gradient_equals_stopgrad_weight_times_advantage_times_grad_log_pi():
    gen = torch.Generator().manual_seed(1)
    B, T, V = 3, 4, 5
    theta = torch.randn(B, T, V, generator=gen, dtype=torch.float64, requires_grad=True)
    tokens = torch.randint(0, V, (B, T), generator=gen)
    mask = torch.ones(B, T)
    mask[2, 2:] = 0
    rollout = policy(theta.detach(), tokens) + 0.3 * torch.randn(B, T, generator=gen, dtype=torch.float64)
    adv = torch.randn(B, 1, generator=gen, dtype=torch.float64).expand(B, T) * mask
    for cfg in (Cfg.bypass_pg_is(threshold=1.5), Cfg.bypass_pg_token_icepop(), Cfg.bypass_pg_geo_rs_token_tis(rs_threshold=1.5)):
        log_prob = policy(theta, tokens)
        loss, _ = compute_policy_loss(log_prob, None, rollout, adv, mask, cfg, LOSS)
        (grad,) = torch.autograd.grad(loss, theta)
        w, kept, _ = compute_rollout_correction(log_prob.detach(), rollout, mask, cfg)
        w = torch.ones_like(rollout) if w is None else w
        # ∇θ log softmax(θ)[a] = onehot(a) − softmax(θ): the analytic gradient, no autograd.
        grad_log_pi = torch.nn.functional.one_hot(tokens, V) - torch.softmax(theta.detach(), -1)
        coeff = -(w * adv * kept) / kept.sum()
        assert torch.allclose(grad, coeff[..., None] * grad_log_pi, atol=1e-12)


def test_decoupled_ppo_gradient_inside_and_outside_the_clip_range():
    gen = torch.Generator().manual_seed(2)
    B, T, V = 2, 3, 4
    theta = torch.randn(B, T, V, generator=gen, dtype=torch.float64, requires_grad=True)
    tokens = torch.randint(0, V, (B, T), generator=gen)
    mask = torch.ones(B, T)
    log_prob = policy(theta, tokens)
    shift = rows([0.05, -0.05, 0.5], [0.1, -0.5, 0.0])  # log π_θ − log π_old: 0.5 / -0.5 are clipped for A > 0 / A < 0
    old = log_prob.detach() - shift
    rollout = old - 0.2 * torch.randn(B, T, generator=gen, dtype=torch.float64)
    adv = rows([1.0, 1.0, 1.0], [-1.0, -1.0, -1.0])
    loss, _ = compute_policy_loss(log_prob, old, rollout, adv, mask, Cfg.decoupled_token_is(), LOSS)
    (grad,) = torch.autograd.grad(loss, theta)
    w, _, _ = compute_rollout_correction(old, rollout, mask, Cfg.decoupled_token_is())
    ratio = torch.exp(shift)
    active = rows([1.0, 1.0, 0.0], [1.0, 0.0, 1.0])  # clipped tokens get no gradient
    grad_log_pi = torch.nn.functional.one_hot(tokens, V) - torch.softmax(theta.detach(), -1)
    coeff = -(w * adv * ratio * active) / (B * T)
    assert torch.allclose(grad, coeff[..., None] * grad_log_pi, atol=1e-12)


# ---- aggregation -------------------------------------------------------------------------------

LOSS_MAT = rows([1.0, 2.0, 3.0], [4.0, 99.0, 99.0], [99.0, 99.0, 99.0])
MASK = torch.tensor([[1, 1, 1], [1, 0, 0], [0, 0, 0]])


@pytest.mark.parametrize("mode, kwargs, expected", [
    ("token-mean", {}, 10 / 4),
    ("token-mean", {"global_token_count": 8}, 10 / 8),
    ("token-sum", {"global_token_count": 8}, 10),  # no denominator
    ("seq-mean-token-sum", {}, (6 + 4) / 2),
    ("seq-mean-token-sum", {"global_seq_count": 5}, 10 / 5),
    ("seq-mean-token-mean", {}, (2 + 4) / 2),
    ("seq-mean-token-mean", {"global_seq_count": 4}, 6 / 4),
    ("seq-mean-token-sum-norm", {}, 10 / (2 * 3)),
    ("seq-mean-token-sum-norm", {"loss_scale_factor": 5.0, "global_seq_count": 4}, 10 / 20),
])
def test_aggregation_modes_by_hand(mode, kwargs, expected):
    assert aggregate_loss(LOSS_MAT, MASK, mode, **kwargs).item() == pytest.approx(expected)


def test_aggregation_of_an_empty_batch_is_zero_and_bad_counts_are_refused():
    for mode in ("token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"):
        assert aggregate_loss(LOSS_MAT, torch.zeros(3, 3), mode).item() == 0.0
    with pytest.raises(ValueError, match="global_token_count"):
        aggregate_loss(LOSS_MAT, MASK, "token-mean", global_token_count=float("nan"))
    with pytest.raises(ValueError, match="loss_agg_mode"):
        aggregate_loss(LOSS_MAT, MASK, "sum")
    assert count_tokens_and_sequences(MASK) == (4, 2)


def random_inputs(gen, batch, tokens, dtype=torch.float64):
    rollout = -torch.rand(batch, tokens, generator=gen, dtype=dtype) * 3 - 0.05
    old = rollout + 0.1 * torch.randn(batch, tokens, generator=gen, dtype=dtype)
    log_prob = (old + 0.15 * torch.randn(batch, tokens, generator=gen, dtype=dtype)).requires_grad_()
    lengths = torch.randint(0, tokens + 1, (batch,), generator=gen)
    mask = (torch.arange(tokens)[None, :] < lengths[:, None]).to(torch.float32)
    adv = torch.randn(batch, 1, generator=gen, dtype=dtype).expand(batch, tokens) * mask
    return log_prob, old, rollout, adv, mask


SPLIT_CONFIGS = [Cfg.decoupled_token_is(), Cfg.decoupled_seq_is_rs(), Cfg.bypass_ppo_clip_geo_rs(rs_threshold=1.1),
                 Cfg.bypass_pg_geo_rs_token_tis(rs_threshold=1.1), Cfg.disabled()]


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 2 ** 31 - 1), batch=st.integers(2, 8), tokens=st.integers(1, 7),
       cut=st.lists(st.integers(1, 7), min_size=1, max_size=4), cfg=st.sampled_from(SPLIT_CONFIGS),
       mode=st.sampled_from(["token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-mean",
                             "seq-mean-token-sum-norm"]))
def test_loss_and_gradient_do_not_depend_on_the_micro_batch_split(seed, batch, tokens, cut, cfg, mode):
    gen = torch.Generator().manual_seed(seed)
    log_prob, old, rollout, adv, mask = random_inputs(gen, batch, tokens)
    loss_cfg = PolicyLossConfig(loss_agg_mode=mode, loss_scale_factor=float(tokens), kl_coef=0.1, entropy_coeff=0.01)
    ref = old - 0.05
    entropy = torch.rand(batch, tokens, generator=gen, dtype=torch.float64)
    # The loss mask: rejection is per sequence or per token, so the caller can count it up front.
    loss_mask = compute_rollout_correction(old if not cfg.bypass_mode else log_prob, rollout, mask, cfg)[1]
    n_tok, n_seq = count_tokens_and_sequences(loss_mask)
    kw = dict(global_token_count=n_tok, global_seq_count=n_seq)
    full, _ = compute_policy_loss(log_prob, old, rollout, adv, mask, cfg, loss_cfg, ref_log_prob=ref, entropy=entropy, **kw)
    (g_full,) = torch.autograd.grad(full, log_prob)
    bounds = sorted({0, batch, *[min(c, batch) for c in cut]})
    total = 0.0
    for lo, hi in zip(bounds, bounds[1:]):
        width = max(int(mask[lo:hi].sum(-1).max()), 1)  # each micro-batch trimmed to its own longest row
        sl = (slice(lo, hi), slice(0, width))
        part, _ = compute_policy_loss(log_prob[sl], old[sl], rollout[sl], adv[sl], mask[sl], cfg, loss_cfg,
                                      ref_log_prob=ref[sl], entropy=entropy[sl], **kw)
        total = total + part
    (g_split,) = torch.autograd.grad(total, log_prob)
    assert total.item() == pytest.approx(full.item(), rel=1e-9, abs=1e-12)
    assert torch.allclose(g_split, g_full, rtol=1e-9, atol=1e-12)


# ---- KL penalty and entropy bonus --------------------------------------------------------------


def test_kl_estimators_by_hand():
    lp, ref = rows([math.log(0.5)]), rows([math.log(0.25)])  # log r = log 2
    assert kl_penalty(lp, ref, "k1").item() == pytest.approx(math.log(2))
    assert kl_penalty(lp, ref, "k2").item() == pytest.approx(0.5 * math.log(2) ** 2)
    assert kl_penalty(lp, ref, "k3").item() == pytest.approx(0.5 - 1 + math.log(2))
    assert kl_penalty(ref, ref, "k3").item() == 0.0
    assert kl_penalty(ref, lp, "abs").item() == pytest.approx(math.log(2))
    with pytest.raises(ValueError, match="kl_estimator"):
        kl_penalty(lp, ref, "k4")
    with pytest.raises(ValueError, match="kl_estimator"):
        kl_penalty(lp, ref, "k3++")


def test_kl_estimators_follow_verls_conventions():
    """As verl's kl_penalty (core_algos): k3 (low_var_kl) is bounded at 10, so a token far below
    the reference (log r = −3: 16.1 unbounded) adds 10 and no gradient; '+' keeps the value and
    takes k2's gradient; kl, mse, low_var_kl are k1, k2, k3."""
    lp = torch.tensor([[-3.0, 0.5, -0.2]], dtype=torch.float64, requires_grad=True)
    ref = torch.zeros_like(lp)
    k3 = kl_penalty(lp, ref, "k3")
    assert k3[0, 0].item() == 10.0 and k3[0, 1].item() == pytest.approx(math.exp(-0.5) - 1 + 0.5)
    (grad,) = torch.autograd.grad(k3.sum(), lp)
    assert grad[0, 0].item() == 0.0 and grad[0, 1].item() == pytest.approx(1 - math.exp(-0.5))
    for plus, base in (("k3+", "k3"), ("k1+", "k1"), ("abs+", "abs"), ("kl+", "k1"), ("low_var_kl+", "k3")):
        value = kl_penalty(lp, ref, plus)
        assert torch.equal(value, kl_penalty(lp, ref, base))
        (grad,) = torch.autograd.grad(value.sum(), lp)
        assert torch.allclose(grad, lp.detach())  # d/dx ½x² = x
    for verl_name, name in (("kl", "k1"), ("mse", "k2"), ("low_var_kl", "k3"), ("low_var_kl+", "k3+"),
                            ("k2+", "k2"), ("mse+", "k2")):  # k2's gradient is k2's already
        assert torch.equal(kl_penalty(lp, ref, verl_name), kl_penalty(lp, ref, name))
    # k1 and k2 are not bounded (only k3 is): a token far from the reference keeps its gradient
    far = torch.tensor([[-25.0]], dtype=torch.float64, requires_grad=True)
    for name, value, slope in (("k1", -25.0, 1.0), ("k2", 312.5, -25.0)):
        penalty = kl_penalty(far, torch.zeros_like(far), name)
        assert penalty.item() == pytest.approx(value)
        assert torch.autograd.grad(penalty.sum(), far)[0].item() == pytest.approx(slope)
    assert PolicyLossConfig(kl_estimator="low_var_kl").kl_estimator == "low_var_kl"


@pytest.mark.parametrize("estimator", ["k1", "k2", "k3"])
def test_kl_penalty_and_entropy_bonus_enter_the_loss(estimator):
    log_prob = rows([math.log(0.5), math.log(0.5)]).requires_grad_()
    ref = rows([math.log(0.25), math.log(0.25)])
    adv = torch.zeros(1, 2, dtype=torch.float64)
    entropy = rows([1.0, 3.0]).requires_grad_()
    cfg = PolicyLossConfig(kl_coef=0.5, kl_estimator=estimator, entropy_coeff=0.1)
    loss, m = compute_policy_loss(log_prob, log_prob.detach(), log_prob.detach(), adv, torch.ones(1, 2),
                                  Cfg.disabled(), cfg, ref_log_prob=ref, entropy=entropy)
    kl = kl_penalty(log_prob.detach(), ref, estimator)[0, 0].item()
    assert loss.item() == pytest.approx(0.5 * kl - 0.1 * 2.0)
    assert m["actor/kl_loss"] == pytest.approx(kl) and m["actor/entropy"] == pytest.approx(2.0)
    loss.backward()
    assert torch.allclose(entropy.grad, rows([-0.05, -0.05]))  # the bonus pushes entropy up


def test_missing_reference_or_entropy_is_an_error_and_entropy_alone_is_a_metric():
    lp, old, rollout, adv, mask = random_inputs(torch.Generator().manual_seed(3), 3, 4)
    with pytest.raises(ValueError, match="ref_log_prob"):
        compute_policy_loss(lp, old, rollout, adv, mask, Cfg.disabled(), PolicyLossConfig(kl_coef=0.1))
    with pytest.raises(ValueError, match="entropy"):
        compute_policy_loss(lp, old, rollout, adv, mask, Cfg.disabled(), PolicyLossConfig(entropy_coeff=0.1))
    base, _ = compute_policy_loss(lp, old, rollout, adv, mask, Cfg.disabled(), LOSS)
    with_entropy, m = compute_policy_loss(lp, old, rollout, adv, mask, Cfg.disabled(), LOSS,
                                          entropy=torch.ones_like(old))
    assert with_entropy.item() == base.item() and m["actor/entropy"] == pytest.approx(1.0 if mask.any() else 0.0)


# ---- staleness ---------------------------------------------------------------------------------


def test_staleness_metrics_per_token_and_per_sequence():
    mask = torch.tensor([[1, 1, 1], [1, 1, 0], [0, 0, 0]])
    per_token = torch.tensor([[5, 6, 7], [7, 7, 0], [9, 9, 9]])
    m = {k: float(v) for k, v in staleness_metrics(per_token, 7, mask).items()}
    assert m == pytest.approx({"staleness/mean": 3 / 5, "staleness/max": 2.0, "staleness/min": 0.0,
                               "staleness/stale_token_fraction": 2 / 5, "staleness/stale_seq_fraction": 1 / 2})
    m = {k: float(v) for k, v in staleness_metrics(torch.tensor([4, 7, 100]), 7, mask).items()}
    assert m["staleness/mean"] == pytest.approx(9 / 5) and m["staleness/stale_seq_fraction"] == 0.5
    with pytest.raises(ValueError, match="version 8 at row 0, token 2, newer than the learner's version 7"):
        staleness_metrics(torch.tensor([[5, 6, 8], [7, 7, 7], [0, 0, 0]]), 7, mask)


def test_compute_policy_loss_reports_staleness_when_versions_are_given():
    lp, old, rollout, adv, mask = random_inputs(torch.Generator().manual_seed(4), 3, 4)
    mask[:] = 1
    _, m = compute_policy_loss(lp, old, rollout, adv, mask, Cfg.decoupled_token_is(), LOSS,
                               token_versions=torch.tensor([3, 2, 3]), current_version=3)
    assert m["staleness/mean"] == pytest.approx(1 / 3) and m["staleness/max"] == 1.0
    with pytest.raises(ValueError, match="current_version"):
        compute_policy_loss(lp, old, rollout, adv, mask, Cfg.decoupled_token_is(), LOSS,
                            token_versions=torch.tensor([3, 2, 3]))


# ---- robustness --------------------------------------------------------------------------------


@pytest.mark.parametrize("cfg", SPLIT_CONFIGS + [Cfg.bypass_pg_is(), Cfg.decoupled_seq_is()])
def test_fully_masked_rows_and_garbage_at_padding_give_finite_loss_and_gradient(cfg):
    lp, old, rollout, adv, mask = random_inputs(torch.Generator().manual_seed(5), 4, 5)
    mask[1] = 0
    old, rollout = old.clone(), rollout.clone()
    old[1], rollout[1] = float("nan"), float("-inf")
    for m_ in (mask, torch.zeros_like(mask)):
        loss, metrics = compute_policy_loss(lp, old, rollout, adv, m_, cfg, PolicyLossConfig(loss_agg_mode="seq-mean-token-mean"))
        (grad,) = torch.autograd.grad(loss, lp)
        assert math.isfinite(loss.item()) and torch.isfinite(grad).all()
        assert torch.all(grad[m_ == 0] == 0)
        assert all(math.isfinite(v) for v in metrics.values())


def test_extreme_ratios_stay_finite():
    old = torch.full((1, 2), -1.0, dtype=torch.float64)
    log_prob = (old + rows([50.0, -50.0])).requires_grad_()
    loss, _ = compute_policy_loss(log_prob, old, old, rows([-1.0, 1.0]), torch.ones(1, 2), Cfg.disabled(), LOSS)
    loss.backward()
    assert loss.item() == pytest.approx((3.0 + -math.exp(-20)) / 2)
    assert torch.isfinite(log_prob.grad).all()


def test_bad_inputs_are_named():
    lp, old, rollout, adv, mask = random_inputs(torch.Generator().manual_seed(6), 3, 4)
    mask[:] = 1
    with pytest.raises(ValueError, match="decoupled mode needs old_log_prob"):
        compute_policy_loss(lp, None, rollout, adv, mask, Cfg.decoupled_token_is(), LOSS)
    with pytest.raises(ValueError, match="bypass mode needs rollout_log_prob"):
        compute_policy_loss(lp, None, None, adv, mask, Cfg.bypass_ppo_clip(), LOSS)
    with pytest.raises(ValueError, match="precomputed_correction is for decoupled mode"):
        compute_policy_loss(lp, None, rollout, adv, mask, Cfg.bypass_pg_is(), LOSS, precomputed_correction=(None, mask))
    with pytest.raises(ValueError, match="keeps tokens that response_mask excludes"):
        mask2 = mask.clone()
        mask2[0, 0] = 0
        compute_policy_loss(lp, old, None, adv, mask2, Cfg.disabled(), LOSS, precomputed_correction=(None, mask))
    bad = lp.detach().clone()
    bad[1, 2] = float("nan")
    with pytest.raises(ValueError, match=r"log_prob is not finite \(nan\) at row 1, token 2"):
        compute_policy_loss(bad, old, rollout, adv, mask, Cfg.disabled(), LOSS)
    with pytest.raises(ValueError, match=r"advantages has shape \(3, 3\)"):
        compute_policy_loss(lp, old, rollout, adv[:, :3], mask, Cfg.disabled(), LOSS)


def test_float32_agrees_with_float64():
    lp, old, rollout, adv, mask = random_inputs(torch.Generator().manual_seed(7), 8, 16)
    for cfg in (Cfg.decoupled_k3_rs_token_tis(rs_threshold=0.05), Cfg.bypass_pg_is()):
        l64, m64 = compute_policy_loss(lp, old, rollout, adv, mask, cfg, PolicyLossConfig(kl_coef=0.1), ref_log_prob=old)
        lp32 = lp.detach().float().requires_grad_()
        l32, m32 = compute_policy_loss(lp32, old.float(), rollout.float(), adv.float(), mask, cfg,
                                       PolicyLossConfig(kl_coef=0.1), ref_log_prob=old.float())
        assert l32.dtype == torch.float32
        assert l32.item() == pytest.approx(l64.item(), rel=1e-5, abs=1e-6)
        for key in ("actor/pg_clipfrac", "actor/ppo_kl", "actor/kl_loss"):
            assert m32[key] == pytest.approx(m64[key], rel=1e-4, abs=1e-6)


def test_half_precision_log_probs_are_summed_in_float32():
    lp, old, rollout, adv, mask = random_inputs(torch.Generator().manual_seed(8), 4, 6)
    lp16 = lp.detach().to(torch.bfloat16).requires_grad_()
    loss, _ = compute_policy_loss(lp16, old.float(), rollout.float(), adv.to(torch.bfloat16), mask,
                                  Cfg.decoupled_token_is(), LOSS)
    loss.backward()
    assert loss.dtype == torch.float32 and lp16.grad.dtype == torch.bfloat16 and torch.isfinite(lp16.grad).all()


def test_policy_loss_config_validation():
    with pytest.raises(ValidationError, match="clip_ratio_c"):
        PolicyLossConfig(clip_ratio_c=1.0)
    with pytest.raises(ValidationError, match="loss_agg_mode"):
        PolicyLossConfig(loss_agg_mode="mean")
    with pytest.raises(ValidationError, match="clip_ratio"):
        PolicyLossConfig(clip_ratio=0.2)
    with pytest.raises(ValidationError, match="kl_estimator"):
        PolicyLossConfig(kl_estimator="k4")  # verl's names are taken (low_var_kl: k3), unknown ones are not
    assert PolicyLossConfig().clip_ratio_high == 0.2 and PolicyLossConfig().clip_ratio_c == 3.0


# ---- GSPO (verl's compute_policy_loss_gspo) ------------------------------------------------------
GSPO = PolicyLossConfig(loss_mode="gspo")


def verl_gspo(old_log_prob, log_prob, advantages, response_mask, clip_low=0.2, clip_high=0.2, weights=None):
    """verl's GSPO loss, written out as verl's core_algos writes it (the reference of the parity
    test): the sequence log-ratio, its straight-through token form, clamp at 10, the clip, the IS
    weights, seq-mean-token-mean."""
    negative_approx_kl = log_prob - old_log_prob
    seq_lengths = torch.sum(response_mask, dim=-1).clamp(min=1)
    negative_approx_kl_seq = torch.sum(negative_approx_kl * response_mask, dim=-1) / seq_lengths
    log_seq_importance_ratio = log_prob - log_prob.detach() + negative_approx_kl_seq.detach().unsqueeze(-1)
    seq_importance_ratio = torch.exp(torch.clamp(log_seq_importance_ratio, max=10.0))
    pg_losses1 = -advantages * seq_importance_ratio
    pg_losses2 = -advantages * torch.clamp(seq_importance_ratio, 1 - clip_low, 1 + clip_high)
    pg_losses = torch.maximum(pg_losses1, pg_losses2)
    if weights is not None:
        pg_losses = pg_losses * weights
    per_seq = (pg_losses * response_mask).sum(-1) / response_mask.sum(-1).clamp(min=1)
    pg_loss = per_seq.sum() / response_mask.any(-1).sum().clamp(min=1)
    clipfrac = ((pg_losses2 > pg_losses1).float() * response_mask).sum() / response_mask.sum()
    ppo_kl = (-negative_approx_kl * response_mask).sum() / response_mask.sum()
    return pg_loss, clipfrac, ppo_kl


def test_gspo_by_hand_the_sequence_ratio_is_the_geometric_mean_and_is_clipped_per_sequence():
    # Sequence 0: token ratios 1.5 and 1/1.5 -> geometric mean 1 (unclipped, though 1.5 alone would clip);
    # sequence 1: ratios 1.44 and 1.44 -> 1.44, clipped at 1.2 for A > 0.
    old = rows([-1.0, -1.0], [-2.0, -2.0])
    log_prob = old + torch.log(rows([1.5, 1 / 1.5], [1.44, 1.44]))
    adv = rows([1.0, 1.0], [1.0, 1.0])
    loss, m = compute_policy_loss(log_prob, old, old, adv, torch.ones_like(adv), Cfg.disabled(), GSPO)
    assert loss.item() == pytest.approx((-1.0 + -1.2) / 2)
    assert m["actor/pg_clipfrac"] == pytest.approx(0.5) and m["actor/pg_clipfrac_lower"] == 0.0
    vanilla, _ = compute_policy_loss(log_prob, old, old, adv, torch.ones_like(adv), Cfg.disabled(), LOSS)
    assert vanilla.item() != pytest.approx(loss.item()), "token-level PPO clips token 0 of sequence 0"


@pytest.mark.parametrize("mode", ["decoupled", "decoupled_is", "bypass"])
def test_gspo_loss_gradient_and_metrics_equal_verls_formula(mode):
    torch.manual_seed(3)
    batch, tokens = 16, 7
    mask = torch.ones(batch, tokens)
    mask[0, 4:] = 0
    mask[2, 1:] = 0
    mask[4, 0] = 0  # a multi-turn row: a tool token in front
    rollout = -torch.rand(batch, tokens, dtype=torch.float64) * 3
    old = rollout + 0.3 * torch.randn(batch, tokens, dtype=torch.float64)
    theta = (old + 0.8 * torch.randn(batch, tokens, dtype=torch.float64)).requires_grad_(True)
    adv = torch.randn(batch, 1, dtype=torch.float64).expand(batch, tokens).contiguous()
    cfg = {"decoupled": Cfg.disabled(), "decoupled_is": Cfg.decoupled_token_is(2.0),
           "bypass": Cfg.bypass_ppo_clip()}[mode]
    loss, m = compute_policy_loss(theta, old, rollout, adv, mask.bool(), cfg, GSPO)
    (grad,) = torch.autograd.grad(loss, theta)
    anchor = rollout if mode == "bypass" else old
    weights = None
    if mode == "decoupled_is":
        weights, _, _ = compute_rollout_correction(old, rollout, mask.bool(), cfg)
    theta_ref = theta.detach().clone().requires_grad_(True)
    ref, clipfrac, ppo_kl = verl_gspo(anchor, theta_ref, adv, mask.double(), weights=weights)
    (ref_grad,) = torch.autograd.grad(ref, theta_ref)
    assert loss.item() == pytest.approx(ref.item(), rel=1e-12)
    assert torch.allclose(grad, ref_grad, rtol=1e-10, atol=1e-14)
    assert m["actor/pg_clipfrac"] == pytest.approx(clipfrac.item())
    assert m["actor/ppo_kl"] == pytest.approx(ppo_kl.item())
    assert 0 < m["actor/pg_clipfrac"] < 1, "the case exercises the clip"


@pytest.mark.parametrize("loss_mode", ["gspo", "sapo", "geo_mean"])
def test_a_sequence_level_loss_fixes_its_own_aggregation_not_that_of_kl_and_entropy(loss_mode):
    """verl's GSPO, SAPO and GMPO aggregate their policy-gradient term per sequence whatever
    loss_agg_mode says; the actor's KL and entropy terms take loss_agg_mode (verl's
    workers/utils/losses.py ppo_loss, and dp_actor before it)."""
    torch.manual_seed(5)
    mask = torch.tensor([[1, 1, 1, 1], [1, 0, 0, 0], [1, 1, 0, 0]], dtype=torch.bool)
    old = -torch.rand(3, 4, dtype=torch.float64) * 2
    theta = (old + 0.1 * torch.randn(3, 4, dtype=torch.float64)).requires_grad_(True)
    ref = old + 0.3 * torch.randn(3, 4, dtype=torch.float64)
    entropy = torch.rand(3, 4, dtype=torch.float64) * 3
    adv = torch.randn(3, 1, dtype=torch.float64).expand(3, 4).contiguous()
    by_mode = {}
    for agg_mode in ("token-mean", "seq-mean-token-sum"):
        cfg = PolicyLossConfig(loss_mode=loss_mode, loss_agg_mode=agg_mode, kl_coef=0.5, entropy_coeff=0.1)
        alone = PolicyLossConfig(loss_mode=loss_mode, loss_agg_mode=agg_mode)
        loss, m = compute_policy_loss(theta, old, old, adv, mask, Cfg.disabled(), cfg, ref_log_prob=ref,
                                      entropy=entropy)
        pg, _ = compute_policy_loss(theta, old, old, adv, mask, Cfg.disabled(), alone)
        kl = aggregate_loss(kl_penalty(theta.detach(), ref, "k3"), mask, agg_mode)
        ent = aggregate_loss(entropy, mask, agg_mode)
        assert m["actor/kl_loss"] == pytest.approx(kl.item()) and m["actor/entropy"] == pytest.approx(ent.item())
        assert loss.item() == pytest.approx(pg.item() + 0.5 * kl.item() - 0.1 * ent.item())
        by_mode[agg_mode] = pg.item()
    assert by_mode["token-mean"] == pytest.approx(by_mode["seq-mean-token-sum"])  # the pg term's own aggregation


def test_cispo_weights_every_tokens_log_likelihood_by_its_clipped_detached_ratio():
    """CISPO (verl's compute_policy_loss_cispo): −sg(clip(r, 1−ε_low, 1+ε_high))·A·log π_θ, so a
    token whose ratio left the band keeps a gradient, scaled by the bound."""
    old = rows([-1.0, -1.0, -1.0])
    log_prob = (old + rows([0.5, 0.0, -0.5])).requires_grad_(True)  # r = e^0.5 (clipped at 1.2), 1, e^-0.5
    adv = rows([1.0, 1.0, -1.0])
    cfg = PolicyLossConfig(loss_mode="cispo", clip_ratio_low=0.2, clip_ratio_high=0.2)
    loss, m = compute_policy_loss(log_prob, old, old, adv, torch.ones_like(adv), Cfg.disabled(), cfg)
    weight = torch.tensor([1.2, 1.0, 0.8], dtype=torch.float64)  # e^-0.5 = 0.61 clipped up to 0.8
    assert loss.item() == pytest.approx(float(-(weight * adv * log_prob.detach()).mean()))
    (grad,) = torch.autograd.grad(loss, log_prob)
    assert torch.allclose(grad, -weight * adv / 3)  # every token, the clipped ones too
    assert m["actor/pg_clipfrac"] == pytest.approx(2 / 3) and m["actor/pg_clipfrac_lower"] == 0.0
    with pytest.raises(ValueError, match="loss_mode cispo is a policy-gradient loss of its own"):
        compute_policy_loss(log_prob, None, old, adv, torch.ones_like(adv), Cfg.bypass_pg_is(), cfg)


def test_gspo_with_bypass_reinforce_is_refused():
    adv = rows([1.0, -1.0])
    with pytest.raises(ValueError, match="loss_mode gspo is a policy-gradient loss of its own"):
        compute_policy_loss(adv * 0 - 1, None, adv * 0 - 1, adv, torch.ones_like(adv), Cfg.bypass_pg_is(), GSPO)
