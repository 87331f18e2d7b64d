"""verl's other policy losses (sapo, gpg, dro, dppo_tv, dppo_kl, geo_mean, clip_cov, kl_cov), each by
hand on a few tokens: value, gradient, metrics, anchors and IS weights, and what each refuses."""
from __future__ import annotations

import math

import pytest
import torch
from pydantic import ValidationError

from learner.correction import RolloutCorrectionConfig as Cfg
from learner.correction import compute_rollout_correction
from learner.losses import LossMode, PolicyLossConfig, compute_policy_loss

MODES = [m for m in LossMode.__args__ if m not in ("vanilla", "gspo", "cispo")]  # those: test_losses.py


def rows(*values):
    return torch.tensor(values, dtype=torch.float64)


def loss_and_grad(mode, log_prob, old, adv, mask=None, correction=None, rollout=None, **kw):
    cfg = PolicyLossConfig(loss_mode=mode, **{"dro_beta": 0.5, **kw})
    theta = log_prob.clone().requires_grad_(True)
    mask = torch.ones_like(adv) if mask is None else mask
    loss, metrics = compute_policy_loss(theta, old, old if rollout is None else rollout, adv, mask,
                                        correction or Cfg.disabled(), cfg)
    (grad,) = torch.autograd.grad(loss, theta)
    return loss.item(), grad, metrics


def test_sapo_gates_the_ratio_softly_with_slope_one_at_r_equal_one():
    """f(r) = sigmoid(τ(r − 1))·4/τ: f(1) = 2/τ and f'(1) = 1, so near r = 1 SAPO's gradient is
    PPO's; far from it the gate flattens (r = e², A > 0: f' = τ·σ(1−σ)·4/τ, small)."""
    old = rows([-1.0, -1.0, -1.0])
    log_prob = old + rows([0.0, 0.0, 2.0])
    adv = rows([1.0, -1.0, 1.0])
    loss, grad, m = loss_and_grad("sapo", log_prob, old, adv, tau_pos=1.0, tau_neg=2.0)
    r = math.exp(2.0)
    s = 1 / (1 + math.exp(-(r - 1.0)))  # sigmoid(τ(r − 1)), τ = 1
    gate = [2 / 1.0, 2 / 2.0, 4 * s]
    assert loss == pytest.approx(-(gate[0] - gate[1] + gate[2]) / 3)
    slope_far = 4 * s * (1 - s) * r  # d f(r) / d log π = f'(r)·r
    assert torch.allclose(grad, rows([-1.0, 1.0, -slope_far]) / 3)
    assert 0 < slope_far < 0.05  # PPO's clip gives this token no gradient at all; SAPO a small one
    assert m["actor/pg_clipfrac"] == 0.0 and m["actor/pg_clipfrac_lower"] == 0.0
    assert m["actor/ppo_kl"] == pytest.approx(-2.0 / 3)


def test_sapo_geo_mean_and_gspo_average_within_sequences_whatever_the_aggregation_says():
    old = rows([-1.0, -1.0, -1.0], [-1.0, -1.0, -1.0])
    log_prob = old + 0.1
    adv = rows([1.0, 1.0, 1.0], [-1.0, -1.0, -1.0])
    mask = rows([1.0, 1.0, 1.0], [1.0, 0.0, 0.0])
    for mode in ("sapo", "geo_mean"):
        per_mode = {agg: loss_and_grad(mode, log_prob, old, adv, mask, loss_agg_mode=agg)[0]
                    for agg in ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean")}
        assert len({round(v, 12) for v in per_mode.values()}) == 1, (mode, per_mode)


def test_gpg_is_plain_reinforce_and_dro_adds_a_quadratic_pull_to_the_anchor():
    old = rows([-1.0, -2.0])
    log_prob = old + rows([0.5, -0.3])
    adv = rows([1.0, -2.0])
    loss, grad, m = loss_and_grad("gpg", log_prob, old, adv)
    assert loss == pytest.approx(float(-(adv * log_prob).mean()))
    assert torch.allclose(grad, -adv / 2)
    assert m["actor/ppo_kl"] == pytest.approx(-0.1)
    loss, grad, _ = loss_and_grad("dro", log_prob, old, adv, dro_beta=0.5)
    log_ratio = rows([0.5, -0.3])
    assert loss == pytest.approx(float((-(adv * log_prob) + 0.25 * log_ratio ** 2).mean()))
    assert torch.allclose(grad, (-adv + 0.5 * log_ratio) / 2)


def test_dro_needs_its_beta_and_clip_cov_its_band():
    with pytest.raises(ValidationError, match="dro needs dro_beta"):
        PolicyLossConfig(loss_mode="dro")
    with pytest.raises(ValidationError, match="clip_cov_lb"):
        PolicyLossConfig(clip_cov_lb=5.0, clip_cov_ub=1.0)
    with pytest.raises(ValidationError, match="loss_mode"):
        PolicyLossConfig(loss_mode="dppo")


def test_dppo_tv_drops_tokens_whose_probability_moved_past_the_region():
    """p_old = 0.5 everywhere; ε_high = 0.1, ε_low = 0.2. A > 0 keeps p − p_old <= 0.1; A <= 0
    keeps p − p_old >= −0.2. Kept tokens: −A·min(r, c)·log π (the weight detached)."""
    old = torch.full((1, 5), math.log(0.5), dtype=torch.float64)
    p = rows([0.55, 0.65, 0.35, 0.25, 0.9])
    adv = rows([1.0, 1.0, -1.0, -1.0, -1.0])
    loss, grad, m = loss_and_grad("dppo_tv", torch.log(p), old, adv, clip_ratio_low=0.2, clip_ratio_high=0.1,
                                  clip_ratio_c=1.5)
    kept = torch.tensor([[True, False, True, False, True]])
    weight = (p / 0.5).clamp(max=1.5)  # token 4: r = 1.8 truncated at 1.5
    assert loss == pytest.approx(float((-adv * weight * torch.log(p) * kept).sum() / 5))
    assert torch.allclose(grad, -adv * weight * kept / 5)
    assert m["actor/pg_clipfrac"] == pytest.approx(2 / 5)
    assert m["actor/pg_clipfrac_lower"] == pytest.approx(1 / 5)  # kept and truncated: token 4


def test_dppo_kl_bounds_the_bernoulli_kl_and_always_keeps_a_move_the_safe_way():
    old = torch.full((1, 4), math.log(0.5), dtype=torch.float64)
    p = rows([0.6, 0.9, 0.1, 0.45])
    adv = rows([1.0, 1.0, 1.0, -1.0])

    def binary_kl(q, p_):  # KL(Bernoulli(q) ‖ Bernoulli(p_))
        return q * math.log(q / p_) + (1 - q) * math.log((1 - q) / (1 - p_))

    assert binary_kl(0.5, 0.6) < 0.05 < binary_kl(0.5, 0.9)
    _, grad, m = loss_and_grad("dppo_kl", torch.log(p), old, adv, clip_ratio_low=0.05, clip_ratio_high=0.05)
    # token 1 moved up too far for A > 0; token 2 moved down with A > 0: kept however far
    assert (grad[0] != 0).tolist() == [True, False, True, True]
    assert m["actor/pg_clipfrac"] == pytest.approx(1 / 4)


def test_geo_mean_is_the_geometric_mean_of_pessimistically_clipped_token_ratios():
    """GMPO, ε = 0.4 on the log-ratio: A > 0 caps each log r at 0.4 (a lower one stays), the
    sequence ratio is exp(mean), the loss −Ā·ratio once per sequence."""
    old = rows([-1.0, -1.0, -1.0], [-1.0, -1.0, -1.0])
    log_ratio = rows([0.9, -0.6, 0.3], [0.9, -0.6, 0.3])
    adv = rows([1.0, 1.0, 1.0], [-2.0, -2.0, -2.0])
    loss, grad, m = loss_and_grad("geo_mean", old + log_ratio, old, adv, clip_ratio_low=0.4, clip_ratio_high=0.4)
    ratio_pos = math.exp((0.4 - 0.6 + 0.3) / 3)  # A > 0: 0.9 capped at 0.4, −0.6 kept
    ratio_neg = math.exp((0.9 - 0.4 + 0.3) / 3)  # A < 0: −0.6 raised to −0.4, 0.9 kept
    assert loss == pytest.approx((-1.0 * ratio_pos + 2.0 * ratio_neg) / 2)
    # d loss / d log π_t = −Ā·ratio/|y| where t is unclipped, 0 where its clip binds
    expected = rows([0.0, -ratio_pos / 3, -ratio_pos / 3], [2 * ratio_neg / 3, 0.0, 2 * ratio_neg / 3]) / 2
    assert torch.allclose(grad, expected)
    assert m["actor/pg_clipfrac"] == pytest.approx(2 / 6) and m["actor/pg_clipfrac_lower"] == pytest.approx(2 / 6)


def test_geo_mean_weighs_a_sequence_by_the_geometric_mean_of_its_is_weights():
    old = rows([-1.0, -1.0])
    rollout = old - torch.log(rows([0.5, 2.0]))  # token IS weights 0.5 and 2: geometric mean 1
    adv = rows([1.0, 1.0])
    weighted, *_ = loss_and_grad("geo_mean", old, old, adv, correction=Cfg.decoupled_token_is(4.0), rollout=rollout)
    plain, *_ = loss_and_grad("geo_mean", old, old, adv)
    assert weighted == pytest.approx(plain) == pytest.approx(-1.0)
    weights, *_ = compute_rollout_correction(old, rollout, torch.ones_like(old), Cfg.decoupled_token_is(4.0))
    assert weights.tolist() == [[0.5, 2.0]], "an arithmetic mean would weigh this sequence 1.25"


def test_clip_cov_drops_the_gradient_of_a_share_of_the_high_covariance_tokens():
    torch.manual_seed(0)
    batch, tokens = 8, 50
    old = -torch.rand(batch, tokens, dtype=torch.float64) * 3
    log_prob = old + 0.01 * torch.randn(batch, tokens, dtype=torch.float64)  # inside the clip band
    adv = torch.randn(batch, 1, dtype=torch.float64).expand(batch, tokens).contiguous() * 3
    cfg = dict(clip_cov_ratio=0.01, clip_cov_lb=0.5, clip_cov_ub=50.0)
    cov = (adv - adv.mean()) * (log_prob - log_prob.mean())
    candidates = (cov > 0.5) & (cov < 50.0)
    assert int(candidates.sum()) > 4, "the case has more candidates than the quota"
    theta = log_prob.clone().requires_grad_(True)
    loss, m = compute_policy_loss(theta, old, old, adv, torch.ones_like(adv), Cfg.disabled(),
                                  PolicyLossConfig(loss_mode="clip_cov", **cfg),
                                  generator=torch.Generator().manual_seed(1))
    (grad,) = torch.autograd.grad(loss, theta)
    dropped = grad == 0
    assert int(dropped.sum()) == 4  # int(0.01 · 400)
    assert bool(candidates[dropped].all()), "only tokens inside the covariance band are dropped"
    assert m["actor/pg_clipfrac"] == pytest.approx(4 / 400)
    ratio = torch.exp(log_prob - old)
    assert torch.allclose(grad[~dropped], (-adv * ratio)[~dropped] / 400)
    again, _ = compute_policy_loss(log_prob, old, old, adv, torch.ones_like(adv), Cfg.disabled(),
                                   PolicyLossConfig(loss_mode="clip_cov", **cfg),
                                   generator=torch.Generator().manual_seed(1))
    assert again.item() == loss.item(), "a seeded generator repeats the choice"


def test_kl_cov_penalises_the_tokens_of_largest_covariance_with_abs_log_ratio():
    old = rows([-1.0, -1.0, -1.0, -1.0])
    log_prob = rows([-0.3, -2.0, -1.2, -0.9])
    adv = rows([2.0, -1.0, 0.5, 0.0])
    # covariance (A − Ā)(log π − mean log π): Ā = 0.375, mean log π = −1.1: 1.3 at token 0, 1.24 at 1
    cov = (adv - 0.375) * (log_prob + 1.1)
    assert int(cov.argmax()) == 0
    loss, grad, m = loss_and_grad("kl_cov", log_prob, old, adv, kl_cov_ratio=0.25, ppo_kl_coef=0.5)
    ratio = torch.exp(log_prob - old)
    penalty = rows([0.5 * 0.7, 0.0, 0.0, 0.0])
    assert loss == pytest.approx(float((-adv * ratio + penalty).mean()))
    assert torch.allclose(grad, (-adv * ratio + rows([0.5, 0.0, 0.0, 0.0])) / 4)
    assert m["actor/ppo_kl"] == pytest.approx(float((log_prob - old).abs().mean()))  # verl reports |log r| here


@pytest.mark.parametrize("mode", MODES)
def test_every_mode_anchors_on_rollout_in_bypass_and_is_refused_with_bypass_reinforce(mode):
    torch.manual_seed(2)
    old = -torch.rand(3, 4, dtype=torch.float64)
    rollout = old - 0.2
    log_prob = old + 0.05 * torch.randn(3, 4, dtype=torch.float64)
    adv = torch.randn(3, 1, dtype=torch.float64).expand(3, 4).contiguous()
    bypass, _, _ = loss_and_grad(mode, log_prob, None, adv, correction=Cfg.bypass_ppo_clip(), rollout=rollout)
    anchored, _, _ = loss_and_grad(mode, log_prob, rollout, adv)
    assert bypass == pytest.approx(anchored)
    with pytest.raises(ValueError, match=f"loss_mode {mode} is a policy-gradient loss of its own"):
        loss_and_grad(mode, log_prob, None, adv, correction=Cfg.bypass_pg_is(), rollout=rollout)


@pytest.mark.parametrize("mode", MODES)
def test_every_mode_is_finite_at_extreme_ratios_padding_and_an_empty_batch(mode):
    old = torch.full((3, 3), -1.0, dtype=torch.float64)
    log_prob = old + rows([50.0, -50.0, 0.1], [0.0, 0.0, 0.0], [-0.2, 30.0, 0.0])
    adv = rows([-1.0, 1.0, 1.0], [2.0, 2.0, 2.0], [1.0, -1.0, 0.5])
    mask = rows([1.0, 1.0, 1.0], [0.0, 0.0, 0.0], [1.0, 1.0, 0.0])
    for m_ in (mask, torch.zeros_like(mask)):
        loss, grad, metrics = loss_and_grad(mode, log_prob, old, adv, m_)
        assert math.isfinite(loss) and torch.isfinite(grad).all(), mode
        assert torch.all(grad[m_ == 0] == 0)
        assert all(math.isfinite(v) for v in metrics.values())
