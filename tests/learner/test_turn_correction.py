"""Rollout correction on multi-turn trajectories (Source 5 of the five-sources reference): the
environment's tokens (loss mask 0) count nowhere, `rollout_is: turn` and the `turn_*` rejection
options isolate turns, the by-turn metrics, policy-token-only staleness, and a learner step on
multi-turn groups."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from pydantic import ValidationError

from buffer.sample import Group, Sample
from learner.config import LearnerConfig
from learner.correction import TURN_RS_OPTIONS, RolloutCorrectionConfig as Cfg, Turns, compute_rollout_correction
from learner.losses import PolicyLossConfig, compute_policy_loss, staleness_metrics
from learner.trainer import Learner
from learner_helpers import build_tiny_policy, max_param_diff, params_of, sample_groups

ENV = 0  # loss mask of an environment token


def trajectories(gen, rows: int, layout: list[tuple[int, int]], spread: float = 0.05):
    """(old, rollout, mask) of `rows` trajectories laid out as [(policy tokens, environment
    tokens), ...] per turn; environment positions hold garbage log-probs (they must not matter)."""
    mask_row = []
    for policy, env in layout:
        mask_row += [1] * policy + [ENV] * env
    mask = torch.tensor([mask_row] * rows, dtype=torch.float32)
    rollout = -torch.rand(mask.shape, generator=gen, dtype=torch.float64) * 3 - 0.01
    old = rollout + torch.randn(mask.shape, generator=gen, dtype=torch.float64) * spread
    garbage = torch.randn(mask.shape, generator=gen, dtype=torch.float64) * 50
    env = mask == 0
    return torch.where(env, garbage, old), torch.where(env, garbage - 7, rollout), mask


def turn_slices(layout):
    out, start = [], 0
    for policy, env in layout:
        out.append(slice(start, start + policy))
        start += policy + env
    return out


LAYOUT = [(3, 2), (4, 3), (2, 0)]  # three turns: 3 policy tokens, 2 env, 4 policy, 3 env, 2 policy


def test_turns_are_the_runs_of_valid_tokens():
    mask = torch.tensor([[1, 1, 0, 1, 0, 0, 1, 1], [0, 0, 1, 1, 1, 0, 0, 0], [0] * 8], dtype=torch.bool)
    turns = Turns(mask)
    assert turns.index.tolist() == [[0, 0, -1, 1, -1, -1, 2, 2], [-1, -1, 0, 0, 0, -1, -1, -1], [-1] * 8]
    assert turns.count == 3 and turns.valid.tolist() == [[True] * 3, [True, False, False], [False] * 3]
    x = torch.arange(8, dtype=torch.float64)[None].expand(3, 8)
    assert turns.sum(x)[0].tolist() == [1.0, 3.0, 13.0] and turns.mean(x)[1].tolist() == [3.0, 0.0, 0.0]
    assert turns.max(x)[0].tolist() == [1.0, 3.0, 7.0] and turns.max(x)[2].tolist() == [0.0, 0.0, 0.0]
    assert Turns(torch.zeros(2, 0, dtype=torch.bool)).count == 1  # an empty batch has no turn, and no error


@pytest.mark.parametrize("rs", [None, "k1", "k3", "max"])
def test_turn_level_equals_trajectory_level_with_one_turn(rs):
    gen = torch.Generator().manual_seed(0)
    old, rollout, mask = trajectories(gen, 6, [(7, 0)], spread=0.2)
    mask[2, 5:] = 0  # shorter responses: padding after the one turn
    mask[4] = 0
    rs_option, threshold = {None: (None, None), "k1": ("mean_k1", 1.05), "k3": ("mean_k3", 0.02),
                            "max": ("max_k3", 0.08)}[rs]
    seq = Cfg(rollout_is="sequence", rollout_rs=rs_option and f"seq_{rs_option}", rollout_rs_threshold=threshold)
    turn = Cfg(rollout_is="turn", rollout_rs=rs_option and f"turn_{rs_option}", rollout_rs_threshold=threshold)
    w_seq, keep_seq, m_seq = compute_rollout_correction(old, rollout, mask, seq)
    w_turn, keep_turn, m_turn = compute_rollout_correction(old, rollout, mask, turn)
    assert torch.equal(w_seq, w_turn) and torch.equal(keep_seq, keep_turn)
    renamed = {k.replace("_turn_", "_seq_"): v for k, v in m_turn.items()}
    assert renamed.keys() == m_seq.keys()
    for key, value in m_seq.items():
        assert renamed[key] == pytest.approx(value, rel=1e-12, abs=1e-12), key
    if rs is not None:
        assert 0 < m_seq["rollout_corr/rollout_rs_seq_masked_fraction"] < 1  # the option did reject some


def test_a_bad_turn_is_rejected_and_reweighted_alone():
    gen = torch.Generator().manual_seed(1)
    old, rollout, mask = trajectories(gen, 2, LAYOUT, spread=0.01)
    first, bad, last = turn_slices(LAYOUT)
    old[0, bad] = rollout[0, bad] + 0.5  # one volatile turn (after a tool output) in row 0
    rs = dict(rollout_rs_threshold=0.01)

    _, keep_turn, metrics = compute_rollout_correction(old, rollout, mask, Cfg(rollout_rs="turn_mean_k3", **rs))
    assert keep_turn[0, bad].sum() == 0 and torch.equal(keep_turn[0, first], mask[0, first])
    assert torch.equal(keep_turn[0, last], mask[0, last]) and torch.equal(keep_turn[1], mask[1])
    assert metrics["rollout_corr/rollout_rs_turn_mean_k3_fraction_high"] == pytest.approx(1 / 6)  # 1 of 6 turns
    _, keep_seq, _ = compute_rollout_correction(old, rollout, mask, Cfg(rollout_rs="seq_mean_k3", **rs))
    assert keep_seq[0].sum() == 0  # the trajectory-level option loses the whole trajectory

    w_turn, _, _ = compute_rollout_correction(old, rollout, mask, Cfg(rollout_is="turn"))
    assert torch.allclose(w_turn[0, bad], torch.full((4,), 2.0, dtype=w_turn.dtype))  # truncated at 2
    for good in (first, last):  # the other turns keep their own (near 1) weights
        expected = torch.exp((old[0, good] - rollout[0, good]).sum())
        assert torch.allclose(w_turn[0, good], expected.expand(w_turn[0, good].shape))
        assert abs(float(expected) - 1) < 0.1
    w_seq, _, _ = compute_rollout_correction(old, rollout, mask, Cfg(rollout_is="sequence"))
    assert torch.all(w_seq[0][mask[0] > 0] == 2.0)  # one weight for the whole trajectory


CONFIGS = [Cfg.decoupled_token_is(), Cfg.decoupled_seq_is_rs(), Cfg.decoupled_geo_rs(),
           Cfg(rollout_is="turn", rollout_rs="turn_max_k2,token_k1", rollout_rs_threshold="0.02,1.5",
               rollout_is_batch_normalize=True, rollout_token_veto_threshold=1e-3, rollout_turn_metrics=3),
           Cfg(rollout_is="turn", rollout_rs="turn_sum_k1", rollout_rs_threshold=1.2)]


@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: f"{c.rollout_is}-{c.rollout_rs}")
def test_environment_tokens_count_nowhere(config):
    """Any value at an environment position (loss mask 0) leaves the weights, the rejection and
    every statistic as they are, and the loss and its gradient too."""
    gen = torch.Generator().manual_seed(2)
    old, rollout, mask = trajectories(gen, 4, LAYOUT, spread=0.1)
    env = mask == 0
    other_old = torch.where(env, old * -3 + 11, old)
    other_rollout = torch.where(env, torch.full_like(rollout, float("nan")), rollout)
    w1, keep1, m1 = compute_rollout_correction(old, rollout, mask, config)
    w2, keep2, m2 = compute_rollout_correction(other_old, other_rollout, mask, config)
    assert torch.equal(keep1, keep2) and torch.all(keep1[env] == 0)
    if w1 is not None:
        assert torch.equal(w1, w2) and torch.all(w1[env] == 0)
    assert m1 == m2

    advantages = torch.randn(mask.shape, generator=gen, dtype=torch.float64)
    losses, grads = [], []
    for o, r in ((old, rollout), (other_old, other_rollout)):
        log_prob = (o + 0.01).clone().requires_grad_(True)
        loss, metrics = compute_policy_loss(log_prob, o, r, torch.where(env, advantages * 100, advantages), mask,
                                            config, PolicyLossConfig())
        loss.backward()
        losses.append(float(loss.detach()))
        grads.append(log_prob.grad)
    assert losses[0] == losses[1] and torch.equal(grads[0], grads[1]) and torch.all(grads[0][env] == 0)


def test_by_turn_metrics_are_the_statistics_of_each_turn_position():
    gen = torch.Generator().manual_seed(3)
    old, rollout, mask = trajectories(gen, 3, LAYOUT, spread=0.2)
    mask[2, turn_slices(LAYOUT)[2]] = 0  # row 2 has two turns (what remains is padding-like env)
    _, _, metrics = compute_rollout_correction(old, rollout, mask, Cfg(rollout_turn_metrics=4))
    log_ratio = old - rollout
    for t, where in enumerate(turn_slices(LAYOUT)):
        rows = [0, 1] if t == 2 else [0, 1, 2]
        values = log_ratio[rows, where]
        assert metrics[f"rollout_corr/kl_by_turn/{t + 1}"] == pytest.approx(float(-values.mean()))
        k3 = torch.exp(values) - values - 1
        assert metrics[f"rollout_corr/k3_kl_by_turn/{t + 1}"] == pytest.approx(float(k3.mean()))
    assert metrics["rollout_corr/kl_by_turn/4"] == 0.0  # no trajectory has a 4th turn
    assert not any("by_turn" in k for k in compute_rollout_correction(old, rollout, mask, Cfg())[2])


def test_turn_options_are_validated():
    assert set(TURN_RS_OPTIONS) == {"turn_sum_k1", "turn_sum_k2", "turn_sum_k3", "turn_mean_k1", "turn_mean_k2",
                                    "turn_mean_k3", "turn_max_k2", "turn_max_k3"}
    (c,) = Cfg(rollout_rs="turn_mean_k1", rollout_rs_threshold="0.9_1.2").rejection_criteria
    assert (c.level, c.lower, c.upper) == ("turn_mean", 0.9, 1.2)
    assert Cfg(rollout_is="turn", rollout_is_batch_normalize=True).uses_turns
    assert not Cfg.decoupled_seq_is().uses_turns
    with pytest.raises(ValidationError, match="unknown option 'turn_max_k1'"):
        Cfg(rollout_rs="turn_max_k1", rollout_rs_threshold=2.0)
    with pytest.raises(ValidationError, match="divergence from above"):
        Cfg(rollout_rs="turn_mean_k3", rollout_rs_threshold="0.1_0.2")
    with pytest.raises(ValidationError):
        Cfg(rollout_is="turns")
    with pytest.raises(ValidationError):
        Cfg(rollout_turn_metrics=1000)


def test_staleness_counts_policy_tokens_only():
    """Turn 1 from version 3, turn 2 from version 5 (weights loaded between turns); the environment
    tokens' versions do not count, whatever they are."""
    mask = torch.tensor([[1, 1, 0, 0, 1, 1, 1]], dtype=torch.float32)
    versions = torch.tensor([[3, 3, 0, 0, 5, 5, 5]])  # env tokens tagged with an impossible old version
    stats = staleness_metrics(versions, 6, mask)
    assert float(stats["staleness/max"]) == 3 and float(stats["staleness/min"]) == 1
    assert float(stats["staleness/mean"]) == pytest.approx((3 + 3 + 1 + 1 + 1) / 5)


# ---- a learner step on multi-turn groups -------------------------------------------------------


@pytest.fixture(scope="module")
def policy_dir(tmp_path_factory):
    return build_tiny_policy(tmp_path_factory.mktemp("policy"))


def with_environment_tokens(groups, env_token: int, version_after: int | None = None) -> list[Group]:
    """Each response split into two turns by two environment tokens (loss mask 0) in the middle;
    with `version_after`, the second turn was generated by that version."""
    out = []
    for g in groups:
        samples = []
        for s in g.samples:
            cut = max(1, len(s.response_ids) // 2)
            ids = np.concatenate([s.response_ids[:cut], [env_token, env_token], s.response_ids[cut:]])
            lp = np.concatenate([s.rollout_log_probs[:cut], [0.0, 0.0], s.rollout_log_probs[cut:]])
            mask = np.array([1] * cut + [ENV, ENV] + [1] * (len(s.response_ids) - cut), np.uint8)
            versions = np.full(len(ids), s.weight_version, np.int32)
            if version_after is not None:
                versions[cut:] = version_after
            samples.append(Sample(sample_id=s.sample_id, group_id=s.group_id, prompt_ids=s.prompt_ids,
                                  response_ids=ids, rollout_log_probs=lp, loss_mask=mask, reward=s.reward,
                                  weight_version=s.weight_version, token_versions=versions))
        out.append(Group(group_id=g.group_id, samples=samples, prompt_index=g.prompt_index))
    return out


def test_a_learner_step_on_multi_turn_groups_with_turn_correction(policy_dir):
    """Turn-level IS and rejection run through the learner; the staleness metrics see the second
    turn's newer version; the step is finite and moves the policy."""
    base = sample_groups(policy_dir, n_groups=3, n=4, seed=7, version=0, logprob_noise=0.05)
    groups = with_environment_tokens(base, env_token=5, version_after=1)
    config = Cfg(rollout_is="turn", rollout_rs="turn_mean_k3", rollout_rs_threshold=0.5, rollout_turn_metrics=2)
    learner = Learner(LearnerConfig(model_path=str(policy_dir), lr=1e-3, rollout_correction=config))
    learner.version = 1
    before = params_of(learner.model)
    metrics = learner.train_step(groups)
    assert all(math.isfinite(v) for v in metrics.values())
    # Consumed at version 1: first turns (v0) are one version old, second turns (v1) fresh.
    assert metrics["staleness/max"] == 1 and metrics["staleness/min"] == 0
    assert 0 < metrics["staleness/stale_token_fraction"] < 1
    assert metrics["rollout_corr/kl_by_turn/1"] != 0 and metrics["rollout_corr/kl_by_turn/2"] != 0
    assert metrics["learner/num_tokens"] == sum(int(s.loss_mask.sum()) for g in groups for s in g.samples)
    assert max_param_diff(before, params_of(learner.model)) > 0
