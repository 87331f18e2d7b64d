"""The learner on a tiny real Qwen2 policy: the step moves log-probs the way the advantages say,
the three proximal log-prob paths, versions, checkpoints, weight publication, micro-batching,
the learning-rate schedule, bad input and config errors."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from pydantic import ValidationError

from buffer.sample import Group, Sample
from learner.advantages import compute_advantages, optimal_token_baseline_advantages, token_level_rewards
from learner.batch import BatchError, build_batch, shape_bucket
from learner.config import LearnerConfig
from learner.optimizer import lr_factor
from learner.trainer import Learner, loglinear_prox_log_prob
from learner_helpers import build_tiny_policy, max_param_diff, params_of, sample_groups
from lm.causal_lm import load_causal_lm, response_log_probs
from lm.weight_sync import resolve_weights


@pytest.fixture(scope="module")
def policy_dir(tmp_path_factory):
    return build_tiny_policy(tmp_path_factory.mktemp("policy"))


@pytest.fixture(scope="module")
def groups(policy_dir):
    return sample_groups(policy_dir, n_groups=4, n=4, seed=1)


def make_learner(policy_dir, **overrides) -> Learner:
    # on the CPU even where a GPU is seen: these tests assert CPU behaviour (exact padding, bit-equal steps)
    return Learner(LearnerConfig(model_path=str(policy_dir), lr=1e-3, **{"device": "cpu", **overrides}))


def group_log_probs(model, groups) -> torch.Tensor:
    """Sum of response log-probs per sample, in batch order."""
    samples = [s for g in groups for s in g.samples]
    with torch.no_grad():
        lp, mask = response_log_probs(model, [s.prompt_ids.tolist() for s in samples],
                                      [s.response_ids.tolist() for s in samples])
    return (lp * mask).sum(-1)


def test_train_step_raises_the_log_prob_of_rewarded_responses(policy_dir, groups):
    learner = make_learner(policy_dir)
    before_params = params_of(learner.model)
    before = group_log_probs(learner.model, groups)
    for step in range(3):
        metrics = learner.train_step(groups)
        assert learner.version == step + 1
    after = group_log_probs(learner.model, groups)
    assert max_param_diff(before_params, params_of(learner.model)) > 1e-4

    batch = build_batch(groups)
    rewards = batch.rewards.view(len(groups), -1)
    above = (rewards > rewards.mean(1, keepdim=True)).flatten()
    below = (rewards < rewards.mean(1, keepdim=True)).flatten()
    change = after - before
    # Every response better than its group's mean got likelier on average, every worse one less likely.
    assert change[above].mean() > 0.2 and change[below].mean() < -0.2
    assert change[above].mean() > change[below].mean() + 0.2
    for key in ("actor/pg_loss", "actor/grad_norm", "actor/lr", "actor/entropy", "actor/pg_clipfrac",
                "rollout_corr/kl", "rollout_corr/rollout_is_eff_sample_size", "timing_s/old_log_prob",
                "timing_s/update_actor", "staleness/mean", "reward/mean", "learner/version"):
        assert key in metrics and np.isfinite(metrics[key]), key
    assert metrics["learner/version"] == 3.0 and metrics["actor/lr"] == pytest.approx(1e-3)


@pytest.mark.parametrize("overrides", [
    {"policy_loss": {"loss_mode": mode, "dro_beta": 0.1}} for mode in
    ("gspo", "cispo", "sapo", "gpg", "dro", "dppo_tv", "dppo_kl", "geo_mean", "clip_cov", "kl_cov")] + [
    {"advantage": {"estimator": est}} for est in ("reinforce_plus_plus", "gpg", "opo", "grpo_passk")],
    ids=lambda o: str(next(iter(o.values()))))
def test_every_loss_mode_and_estimator_trains_the_policy_towards_its_rewards(policy_dir, groups, overrides):
    gain, metrics = gain_of_the_rewarded(make_learner(policy_dir, **overrides), groups, groups)
    assert all(np.isfinite(v) for k, v in metrics.items() if k.startswith("actor/")), metrics
    assert gain > 0.1


def gain_of_the_rewarded(learner, train_groups, scored_groups, steps: int = 3) -> tuple[float, dict]:
    """After `steps` steps on `train_groups`: how much more log-prob the responses above their
    group's mean reward (in `scored_groups`) gained than those below it; and the last metrics."""
    before = group_log_probs(learner.model, train_groups)
    for _ in range(steps):
        metrics = learner.train_step(train_groups)
    change = group_log_probs(learner.model, train_groups) - before
    rewards = build_batch(scored_groups).rewards.view(len(scored_groups), -1)
    above = (rewards > rewards.mean(1, keepdim=True)).flatten()
    below = (rewards < rewards.mean(1, keepdim=True)).flatten()
    return float(change[above].mean() - change[below].mean()), metrics


def test_gdpo_learns_from_the_reward_components_the_samples_carry(policy_dir, groups):
    """The components reach the learner as the samples' reward/<key> metrics (a verl-form reward's
    dict); a sample without one (its reward failed) counts 0 there."""
    from learner.batch import reward_components

    tagged = []
    for group in groups:
        samples = [Sample(**{**{f: getattr(s, f) for f in ("sample_id", "group_id", "prompt_ids", "response_ids",
                                                           "rollout_log_probs", "loss_mask", "weight_version")},
                             "reward": 0.0, "metadata": {"reward/even": s.reward, "reward/flag": True}})
                   for s in group.samples]
        tagged.append(Group(group_id=group.group_id, samples=samples, prompt_index=group.prompt_index))
    parts = reward_components(tagged, ["even", "flag", "absent"])
    assert parts.shape == (3, 16) and parts[0].tolist() == [s.reward for g in groups for s in g.samples]
    assert parts[1:].abs().sum() == 0, "a bool and a missing key count 0"
    learner = make_learner(policy_dir, advantage={"estimator": "gdpo", "gdpo_reward_keys": ["even"]})
    assert gain_of_the_rewarded(learner, tagged, groups)[0] > 0.1  # the reward itself is 0 here: the part teaches


def test_remax_learns_against_the_greedy_baseline_the_samples_carry(policy_dir, groups):
    """Each sample carries its group's greedy reward (metadata reward_baseline, from a worker with
    rollout.greedy_baseline); remax trains on r − baseline. A batch whose samples lack it is
    refused naming the sample and the setting (BatchError: the run hands it back and goes on)."""
    from buffer.sample import REWARD_BASELINE

    def with_baseline(group, baseline):
        samples = [Sample(**{**{f: getattr(s, f) for f in Sample.__dataclass_fields__},
                             "metadata": {**s.metadata, REWARD_BASELINE: baseline}}) for s in group.samples]
        return Group(group_id=group.group_id, samples=samples, prompt_index=group.prompt_index)

    tagged = [with_baseline(g, float(np.mean([s.reward for s in g.samples]))) for g in groups]
    learner = make_learner(policy_dir, advantage={"estimator": "remax"})
    gain, metrics = gain_of_the_rewarded(learner, tagged, groups)
    assert gain > 0.1
    # verl's advantage metrics over valid tokens: each sample's r − b on each of its response tokens
    per_token = [s.reward - s.metadata[REWARD_BASELINE] for g in tagged for s in g.samples
                 for _ in range(int(s.loss_mask.sum()))]
    assert metrics["critic/advantages/mean"] == pytest.approx(np.mean(per_token), abs=1e-6)
    assert (metrics["critic/advantages/max"], metrics["critic/advantages/min"]) == pytest.approx(
        (max(per_token), min(per_token)), abs=1e-6)
    assert metrics["critic/reward_baseline/mean"] == pytest.approx(np.mean([s.reward for g in groups for s in g.samples]))
    with pytest.raises(BatchError, match=f"sample {groups[0].samples[0].sample_id} .* no finite reward_baseline .*"
                                         "remax needs the workers' greedy baseline"):
        learner.train_step(groups)
    # baselines above every reward push every response down: a baseline is used as given
    everything_worse = [with_baseline(g, 10.0) for g in groups]
    before = group_log_probs(learner.model, groups)
    learner.train_step(everything_worse)
    assert (group_log_probs(learner.model, groups) - before).mean() < 0


def test_gae_trains_a_critic_towards_the_returns_and_the_policy_by_its_advantages(policy_dir, groups):
    """PPO with a critic: the step's advantages are GAE over the critic's values at the step's start
    (a fresh value head drawn from the seed: the values of `load_value_model`), whitened; the critic
    learns the returns (its loss falls, its values approach them), and the responses above their
    group's mean reward gain log-prob against those below, though no group baseline is used."""
    from learner.advantages import gae_advantages_and_returns
    from lm.value_model import load_value_model, response_values

    learner = make_learner(policy_dir, advantage={"estimator": "gae", "gamma": 0.95, "lam": 0.9},
                           critic={"lr": 1e-3})
    batch = build_batch(groups)
    with torch.no_grad():
        values = response_values(load_value_model(policy_dir), batch.prompts, batch.responses)
    assert torch.equal(learner.critic.values(batch), values)
    _, returns = gae_advantages_and_returns(token_level_rewards(batch.rewards, batch.response_mask), values,
                                            batch.response_mask, 0.95, 0.9)
    mask = batch.response_mask.bool()
    before = group_log_probs(learner.model, groups)
    first = learner.train_step(groups)
    assert first["critic/values/mean"] == pytest.approx(float(values[mask].mean()), abs=1e-6)
    assert first["critic/returns/mean"] == pytest.approx(float(returns[mask].mean()), abs=1e-6)
    assert first["critic/advantages/mean"] == pytest.approx(0.0, abs=1e-6)  # whitened
    for _ in range(5):
        last = learner.train_step(groups)
    for key in ("critic/vf_loss", "critic/vf_clipfrac", "critic/vpred_mean", "critic/grad_norm", "critic/lr",
                "critic/vf_explained_var", "timing_s/values", "timing_s/update_critic"):
        assert np.isfinite(last[key]), key
    assert last["critic/vf_loss"] < 0.5 * first["critic/vf_loss"]
    assert abs(last["critic/values/mean"] - last["critic/returns/mean"]) < \
        0.5 * abs(first["critic/values/mean"] - first["critic/returns/mean"])
    assert last["critic/lr"] == 1e-3 and last["actor/lr"] == 1e-3
    change = group_log_probs(learner.model, groups) - before
    rewards = batch.rewards.view(len(groups), -1)
    above = (rewards > rewards.mean(1, keepdim=True)).flatten()
    below = (rewards < rewards.mean(1, keepdim=True)).flatten()
    assert float(change[above].mean() - change[below].mean()) > 0.1


def test_the_critic_trains_alone_for_its_first_steps(policy_dir, groups):
    """critic.train_alone_steps (verl's critic_warmup): the policy's weights and lr schedule wait, the
    critic learns, the version goes up; then both train."""
    learner = make_learner(policy_dir, advantage={"estimator": "gae"}, critic={"lr": 1e-3, "train_alone_steps": 2},
                           warmup_steps=2)
    policy, critic = params_of(learner.model), params_of(learner.critic.model)
    for step in (1, 2):
        metrics = learner.train_step(groups)
        assert learner.version == step and metrics["actor/optimizer_steps"] == 0.0 and "actor/grad_norm" not in metrics
        assert metrics["actor/lr"] == pytest.approx(1e-3 / 2)  # the warm-up's first lr, still
        assert "rollout_corr/kl" in metrics  # π_old from a proximal pass (no update pass to take it from)
    assert max_param_diff(policy, params_of(learner.model)) == 0.0
    assert max_param_diff(critic, params_of(learner.critic.model)) > 1e-4
    metrics = learner.train_step(groups)
    assert metrics["actor/optimizer_steps"] == 1.0 and np.isfinite(metrics["actor/grad_norm"])
    assert max_param_diff(policy, params_of(learner.model)) > 1e-5


def test_a_checkpoint_resumes_the_critic_and_refuses_the_other_estimator(policy_dir, groups, tmp_path):
    gae = {"advantage": {"estimator": "gae"}, "critic": {"lr": 1e-3, "warmup_steps": 3}}
    first = make_learner(policy_dir, **gae)
    first.train_step(groups)
    first.save_checkpoint(tmp_path / "ckpt")
    want = first.train_step(groups)
    again = make_learner(policy_dir, **gae)
    again.load_checkpoint(tmp_path / "ckpt")
    got = again.train_step(groups)
    assert got["critic/lr"] == want["critic/lr"] == pytest.approx(1e-3 * 2 / 3)  # the warm-up resumed
    assert got["critic/vf_loss"] == want["critic/vf_loss"]
    assert max_param_diff(params_of(first.critic.model), params_of(again.critic.model)) == 0.0
    assert max_param_diff(params_of(first.model), params_of(again.model)) == 0.0
    with pytest.raises(ValueError, match="has a critic; this learner runs without one"):
        make_learner(policy_dir).load_checkpoint(tmp_path / "ckpt")
    make_learner(policy_dir).save_checkpoint(tmp_path / "grpo")
    with pytest.raises(ValueError, match=r"has no critic; this learner runs with one \(advantage.estimator gae\)"):
        again.load_checkpoint(tmp_path / "grpo")


def test_clip_covs_random_choice_repeats_in_a_run_with_the_same_seed(policy_dir, groups):
    cfg = {"policy_loss": {"loss_mode": "clip_cov", "clip_cov_ratio": 0.2, "clip_cov_lb": -10.0}}
    runs = []
    for seed in (0, 0, 1):
        learner = make_learner(policy_dir, seed=seed, **cfg)
        for _ in range(2):
            learner.train_step(groups)
        runs.append(params_of(learner.model))
    assert max_param_diff(runs[0], runs[1]) == 0.0
    assert max_param_diff(runs[0], runs[2]) > 0.0, "another seed drops other tokens"


def test_the_three_proximal_paths(policy_dir):
    """Behaviour log-probs with noise (a different sampler backend) and versions 2 behind."""
    stale = sample_groups(policy_dir, n_groups=2, n=4, seed=3, version=0, logprob_noise=0.3)
    model = load_causal_lm(policy_dir)
    batch = build_batch(stale)
    with torch.no_grad():
        current, _ = response_log_probs(model, batch.prompts, batch.responses)

    results = {}
    # recompute with its own no-grad pass (one minibatch would otherwise take π_old from the update pass)
    for name, overrides in {"recompute": {"prox_from_update_pass": False}, "loglinear": {"prox_logp": "loglinear"},
                            "bypass": {"rollout_correction": "bypass_ppo_clip"}}.items():
        learner = make_learner(policy_dir, **overrides)
        learner.version = 2
        results[name] = (learner.train_step(stale), params_of(learner.model))

    # recompute: π_old is the learner's own forward pass, so the IS diagnostics measure μ against it.
    mask = batch.response_mask.bool()
    want_kl = float((batch.rollout_log_probs - current)[mask].mean())
    assert results["recompute"][0]["rollout_corr/kl"] == pytest.approx(want_kl, abs=1e-5)
    assert results["recompute"][0]["timing_s/old_log_prob"] > 0
    # bypass and loglinear skip the proximal pass.
    assert results["bypass"][0]["timing_s/old_log_prob"] < results["recompute"][0]["timing_s/old_log_prob"]
    # loglinear with staleness 2: π_old is 2/3 of the way from μ to π_θ, so its KL is 2/3 of recompute's.
    assert results["loglinear"][0]["rollout_corr/kl"] == pytest.approx(want_kl * 2 / 3, abs=1e-5)
    # Three different anchors, three different updates.
    assert max_param_diff(results["recompute"][1], results["bypass"][1]) > 1e-6
    assert max_param_diff(results["recompute"][1], results["loglinear"][1]) > 1e-6


def test_on_policy_data_makes_the_three_paths_agree(policy_dir, groups):
    """When μ is the learner's own policy and the data is fresh, π_old = μ = π_θ on every path."""
    updates = []
    for overrides in ({}, {"prox_logp": "loglinear"}, {"rollout_correction": "bypass_ppo_clip"}):
        learner = make_learner(policy_dir, **overrides)
        learner.train_step(groups)
        updates.append(params_of(learner.model))
    assert max_param_diff(updates[0], updates[1]) < 1e-6
    assert max_param_diff(updates[0], updates[2]) < 1e-6


def test_entropy_metric_and_bonus(policy_dir, groups):
    batch = build_batch(groups)
    model = load_causal_lm(policy_dir)
    with torch.no_grad():
        _, mask, entropy = response_log_probs(model, batch.prompts, batch.responses, with_entropy=True)
    want = float((entropy * mask).sum() / mask.sum())  # token-mean over the batch, before the update

    plain, bonus = make_learner(policy_dir), make_learner(policy_dir, policy_loss={"entropy_coeff": 0.05})
    assert plain.train_step(groups)["actor/entropy"] == pytest.approx(want, rel=1e-5)
    assert bonus.train_step(groups)["actor/entropy"] == pytest.approx(want, rel=1e-5)
    # The bonus is part of the loss only when its coefficient is set: the updates differ.
    assert max_param_diff(params_of(plain.model), params_of(bonus.model)) > 1e-6


def test_kl_penalty_to_the_initial_policy(policy_dir, groups):
    learner = make_learner(policy_dir, policy_loss={"kl_coef": 0.1})
    first = learner.train_step(groups)
    second = learner.train_step(groups)
    assert first["actor/kl_loss"] == pytest.approx(0.0, abs=1e-7)  # π_θ = π_ref before the first update
    assert second["actor/kl_loss"] > 1e-4  # after it they differ, and the penalty sees it
    assert second["timing_s/ref"] > 0


def test_loglinear_interpolates_by_staleness():
    mu = torch.tensor([[-1.0, -1.0, -1.0]])
    theta = torch.tensor([[-2.0, -2.0, -2.0]], requires_grad=True)
    versions = torch.tensor([[5, 4, 1]])
    prox = loglinear_prox_log_prob(mu, theta, versions, version=5)
    # staleness 0, 1, 4 -> alpha 0, 1/2, 4/5
    torch.testing.assert_close(prox, torch.tensor([[-1.0, -1.5, -1.8]]))
    assert not prox.requires_grad


def test_micro_batches_and_minibatches(policy_dir, groups):
    whole = make_learner(policy_dir)
    whole.train_step(groups)
    micro = make_learner(policy_dir, micro_batch_size=3)
    micro.train_step(groups)
    # The loss is normalised by the whole minibatch's token count: splitting changes nothing.
    assert max_param_diff(params_of(whole.model), params_of(micro.model)) < 1e-6

    many = make_learner(policy_dir, ppo_mini_batch_size=2, ppo_epochs=2)
    metrics = many.train_step(groups)
    assert metrics["actor/optimizer_steps"] == 4.0 and many.version == 1
    assert metrics["actor/ppo_kl"] != 0.0  # later minibatches see π_θ drift from π_old
    # A pull the buffer shortened (stale groups dropped) ends in a smaller minibatch.
    uneven = make_learner(policy_dir, ppo_mini_batch_size=3)
    assert uneven.train_step(groups)["actor/optimizer_steps"] == 2.0


def longest_sequence(groups) -> int:
    return max(len(s.prompt_ids) + len(s.response_ids) for g in groups for s in g.samples)


NORMALISED_TOKEN_IS = {"rollout_is": "token", "rollout_is_threshold": 1.5, "rollout_is_batch_normalize": True}


@pytest.mark.parametrize("overrides", [
    # decoupled recompute: the proximal pass, the reference pass (KL) and the update in micro-batches
    {"rollout_correction": NORMALISED_TOKEN_IS, "ppo_mini_batch_size": 3, "policy_loss": {"kl_coef": 0.1}},
    # bypass REINFORCE: sequence weights from π_θ, normalised over the minibatch, not the micro-batch
    {"rollout_correction": {"rollout_is": "sequence", "rollout_is_threshold": 1.5, "rollout_is_batch_normalize": True,
                            "bypass_mode": True, "loss_type": "reinforce"},
     "policy_loss": {"loss_agg_mode": "seq-mean-token-mean"}, "ppo_epochs": 2},
    # loglinear: π_old from π_θ per micro-batch, token weights normalised over the minibatch; entropy bonus
    {"prox_logp": "loglinear", "rollout_correction": NORMALISED_TOKEN_IS, "policy_loss": {"entropy_coeff": 0.01}},
], ids=["recompute-kl", "bypass-seq-is", "loglinear-entropy"])
@pytest.mark.parametrize("packing", [True, False], ids=["packed", "padded"])
def test_a_token_budget_gives_the_update_of_one_big_batch(policy_dir, overrides, packing):
    """Float64, two steps on stale data with a noisy sampler: micro-batches of one or two rows make
    the update (and the batch-normalised IS weights) of one pass over the whole minibatch."""
    stale = sample_groups(policy_dir, n_groups=4, n=3, seed=6, logprob_noise=0.3)
    results = {}
    for budget in (None, longest_sequence(stale)):
        learner = make_learner(policy_dir, dtype="float64", max_tokens_per_micro_batch=budget, packing=packing,
                               **overrides)
        learner.version = 1  # the samples are one version old: loglinear moves π_old off μ
        metrics = [learner.train_step(stale) for _ in range(2)]
        results[budget] = (metrics, params_of(learner.model))
    (whole, whole_params), (split, split_params) = results.values()
    assert max_param_diff(whole_params, split_params) < 1e-10
    assert max_param_diff(whole_params, params_of(load_causal_lm(policy_dir, dtype="float64"))) > 1e-4
    for want, got in zip(whole, split):
        for key in ("actor/pg_loss", "actor/entropy", "actor/grad_norm", "rollout_corr/rollout_is_batch_norm_factor"):
            assert got[key] == pytest.approx(want[key], rel=1e-9, abs=1e-12), key
        assert want["rollout_corr/rollout_is_batch_norm_factor"] != 1.0  # the normalisation does something
        if packing:  # packed micro-batches hold no padding, whatever their split
            assert got["perf/padding_fraction"] == want["perf/padding_fraction"] == 0.0


def test_padding_fraction_counts_every_pass(policy_dir, groups):
    batch = build_batch(groups)
    lengths = [len(p) + len(r) for p, r in zip(batch.prompts, batch.responses)]
    metrics = make_learner(policy_dir, max_tokens_per_micro_batch=None, packing=False).train_step(groups)
    # One pass for π_old and one for the update, each over every row padded to the longest.
    assert metrics["perf/padding_fraction"] == pytest.approx(1 - sum(lengths) / (len(lengths) * max(lengths)))
    # packing auto on a CPU learner: the same padded rows (sdpa over a packed row's mask costs more)
    auto = make_learner(policy_dir, max_tokens_per_micro_batch=None)
    assert auto.packing is False and auto.train_step(groups)["perf/padding_fraction"] == metrics["perf/padding_fraction"]
    assert make_learner(policy_dir, max_tokens_per_micro_batch=None, attn_implementation="varlen").packing is True
    # Packed, then packed into shape buckets: the filler up to the bucket is the only padding.
    packed = make_learner(policy_dir, max_tokens_per_micro_batch=None, packing=True)
    assert packed.train_step(groups)["perf/padding_fraction"] == 0
    bucketed = make_learner(policy_dir, max_tokens_per_micro_batch=None, packing=True, shape_buckets="on").train_step(groups)
    assert bucketed["perf/padding_fraction"] == pytest.approx(1 - sum(lengths) / shape_bucket(sum(lengths)))


def test_gradient_checkpointing_and_mixed_precision(policy_dir, groups):
    plain = make_learner(policy_dir, dtype="float64")
    plain.train_step(groups)
    checkpointed = make_learner(policy_dir, dtype="float64", gradient_checkpointing=True,
                                max_tokens_per_micro_batch=longest_sequence(groups))
    checkpointed.train_step(groups)
    assert max_param_diff(params_of(plain.model), params_of(checkpointed.model)) < 1e-10
    selective = make_learner(policy_dir, dtype="float64", gradient_checkpointing="selective",
                             max_tokens_per_micro_batch=longest_sequence(groups))
    selective.train_step(groups)
    assert max_param_diff(params_of(plain.model), params_of(selective.model)) < 1e-10

    reference, mixed = make_learner(policy_dir), make_learner(policy_dir, mixed_precision="bfloat16")
    want, got = reference.train_step(groups), mixed.train_step(groups)
    # bf16 compute, float32 master weights and optimizer state, float32 loss.
    assert all(p.dtype == torch.float32 for p in mixed.model.parameters())
    assert all(v.dtype == torch.float32 for state in mixed.optimizer.state.values() for v in state.values()
               if isinstance(v, torch.Tensor) and v.dim() > 0)
    assert got["actor/entropy"] == pytest.approx(want["actor/entropy"], rel=0.05)
    assert got["rollout_corr/kl"] != want["rollout_corr/kl"]  # it really computed in bf16
    before = params_of(load_causal_lm(policy_dir))
    want_update = {k: v - before[k] for k, v in params_of(reference.model).items()}
    got_update = {k: v - before[k] for k, v in params_of(mixed.model).items()}
    cosine = torch.nn.functional.cosine_similarity(torch.cat([v.flatten() for v in want_update.values()]),
                                                   torch.cat([v.flatten() for v in got_update.values()]), dim=0)
    assert cosine > 0.9


@pytest.mark.parametrize("estimator", ["optimal_token_baseline", "tir_optimal_token_baseline"])
def test_optimal_token_baseline_takes_the_proximal_passs_distribution(policy_dir, groups, monkeypatch, estimator):
    """The estimator's inputs come from the proximal pass: Σp² and π_old of every response token
    equal the model's full softmax (float64), the IS weights are the correction's, and the step
    trains on the advantages it returns. Without a proximal pass (bypass) the config refuses it."""
    import learner.trainer as trainer

    seen = {}

    def spy(*args, **kwargs):
        seen.update(kwargs, args=args)
        seen["advantages"] = compute_advantages(*args, **kwargs)
        return seen["advantages"]

    monkeypatch.setattr(trainer, "compute_advantages", spy)
    learner = make_learner(policy_dir, dtype="float64", advantage={"estimator": estimator},
                           rollout_correction={"rollout_is": "token", "rollout_is_threshold": 1.5})
    model = load_causal_lm(policy_dir, dtype="float64")
    metrics = learner.train_step(groups)
    samples = [s for g in groups for s in g.samples]
    squares = seen["sum_pi_squared"]
    assert squares.shape == seen["old_log_probs"].shape == (len(samples), max(len(s.response_ids) for s in samples))
    with torch.no_grad():
        for row, s in enumerate(samples):
            ids = torch.tensor([list(s.prompt_ids) + list(s.response_ids)])
            probs = torch.softmax(model(ids).logits[0, len(s.prompt_ids) - 1: -1], -1)
            n = len(s.response_ids)
            torch.testing.assert_close(squares[row, :n], probs.square().sum(-1), rtol=0, atol=1e-12)
            torch.testing.assert_close(seen["old_log_probs"][row, :n].exp(),
                                       probs.gather(-1, ids[0, len(s.prompt_ids):, None]).squeeze(-1),
                                       rtol=0, atol=1e-12)
            assert float(squares[row, n:].abs().sum()) == 0.0
    assert seen["is_weights"] is not None and float(seen["is_weights"].max()) <= 1.5
    rewards, index, mask = seen["args"][:3]
    want = optimal_token_baseline_advantages(
        token_level_rewards(rewards, mask), mask, index, seen["old_log_probs"], squares, seen["is_weights"],
        policy_tokens_only=estimator.startswith("tir_"))
    torch.testing.assert_close(seen["advantages"], want, rtol=0, atol=1e-12)
    assert math.isfinite(metrics["actor/pg_loss"]) and learner.version == 1
    with pytest.raises(ValidationError, match=f"{estimator} .* needs prox_logp 'recompute'"):
        LearnerConfig(model_path=str(policy_dir), advantage={"estimator": estimator},
                      rollout_correction={"bypass_mode": True})


@pytest.mark.parametrize("overrides", [
    {},  # the default: decoupled token-TIS
    {"rollout_correction": {"rollout_is": "sequence", "rollout_is_threshold": 2.0}},
    {"policy_loss": {"kl_coef": 0.1, "entropy_coeff": 0.01}, "max_tokens_per_micro_batch": 24},
], ids=["token-is", "sequence-is", "kl-entropy-micro-batches"])
def test_one_minibatch_takes_pi_old_from_its_update_pass_with_the_same_step(policy_dir, overrides):
    """One minibatch of one epoch: the update pass runs the step's starting policy, so π_old comes
    from it and the separate no-grad pass is skipped; two steps on stale samples give the same
    weights and the same metrics (IS weights, rollout_corr/*, drift/*) bit for bit."""
    groups = sample_groups(policy_dir, n_groups=4, n=4, seed=1, logprob_noise=0.3)
    fused = make_learner(policy_dir, dtype="float64", **overrides)
    separate = make_learner(policy_dir, dtype="float64", prox_from_update_pass=False, **overrides)
    passes = {}
    for name, learner in (("fused", fused), ("separate", separate)):
        passes[name] = []
        learner.model.model.layers[0].register_forward_pre_hook(lambda *_, seen=passes[name]: seen.append(1))
    for _ in range(2):
        got, want = fused.train_step(groups), separate.train_step(groups)
    assert max_param_diff(params_of(fused.model), params_of(separate.model)) == 0.0
    assert set(got) == set(want)
    for key in [k for k in want if not k.startswith(("timing_s/", "perf/"))]:
        assert got[key] == want[key] or math.isnan(got[key]) and math.isnan(want[key]), key
    assert any(k.startswith("rollout_corr/") for k in want) and any(k.startswith("drift/") for k in want)
    assert 2 * len(passes["fused"]) == len(passes["separate"])  # one pass per micro-batch, not two

    # Two minibatches: the second's π_old is the step's start, not its own pass's: the pass runs.
    counts = []
    for flag in (True, False):
        two = make_learner(policy_dir, dtype="float64", ppo_mini_batch_size=2, prox_from_update_pass=flag, **overrides)
        counts.append([])
        two.model.model.layers[0].register_forward_pre_hook(lambda *_, seen=counts[-1]: seen.append(1))
        two.train_step(groups)
    assert counts[0] == counts[1]


def test_a_sequence_longer_than_the_budget_is_refused(policy_dir, groups):
    learner = make_learner(policy_dir, max_tokens_per_micro_batch=longest_sequence(groups) - 1)
    with pytest.raises(ValueError, match=r"sample .* has \d+ prompt\+response tokens, more than the micro-batch "
                                         r"budget max_tokens_per_micro_batch"):
        learner.train_step(groups)
    assert learner.version == 0


def test_bad_batches_are_refused_with_the_field_named(policy_dir, groups):
    learner = make_learner(policy_dir)
    good = groups[0].samples[0]

    def variant(**changes):
        fields = dict(sample_id="bad", group_id="gx", prompt_ids=good.prompt_ids, response_ids=good.response_ids,
                      rollout_log_probs=good.rollout_log_probs, loss_mask=good.loss_mask, reward=1.0,
                      weight_version=0)
        fields.update(changes)
        return [Group(group_id="gx", samples=[Sample(**fields)], prompt_index=0)]

    with pytest.raises(BatchError, match="'weight_version': 3 is ahead of the learner \\(version 0\\)"):
        learner.train_step(variant(weight_version=3))
    nan = good.rollout_log_probs.copy()
    nan[0] = np.nan
    with pytest.raises(BatchError, match="'rollout_log_probs': not finite at token 0"):
        learner.train_step(variant(rollout_log_probs=nan))
    with pytest.raises(BatchError, match="'loss_mask': has length"):
        learner.train_step(variant(loss_mask=np.ones(len(good.response_ids) + 1, np.uint8)))
    with pytest.raises(BatchError, match="item 1 of the batch is a dict, not a Group"):
        learner.train_step([groups[0], {"samples": []}])
    with pytest.raises(BatchError, match="zero groups"):
        learner.train_step([])
    assert learner.version == 0  # nothing was trained on


def test_loss_mask_keeps_tool_tokens_out_of_the_loss(policy_dir):
    """A response whose only policy token is the first: the others (tool output) get no gradient
    signal, so changing them alone does not change the update."""
    base = sample_groups(policy_dir, n_groups=1, n=2, seed=5)
    updates = []
    for tool_token in (7, 9):
        samples = []
        for s in base[0].samples:
            response = s.response_ids.copy()
            response[-1] = tool_token  # the last token is tool output: masked, but in the context
            mask = np.ones(len(response), np.uint8)
            mask[-1] = 0
            samples.append(Sample(sample_id=s.sample_id, group_id=s.group_id, prompt_ids=s.prompt_ids,
                                  response_ids=response, rollout_log_probs=s.rollout_log_probs, loss_mask=mask,
                                  reward=s.reward, weight_version=0))
        learner = make_learner(policy_dir, rollout_correction="bypass_ppo_clip")
        learner.train_step([Group(group_id=base[0].group_id, samples=samples, prompt_index=0)])
        updates.append(params_of(learner.model))
    assert max_param_diff(updates[0], updates[1]) < 1e-7


def test_reinforce_pp_takes_a_trajectorys_step_rewards_where_the_sample_put_them(policy_dir):
    """The same samples and rewards, the step rewards placed on the first or on the last policy
    token: REINFORCE++ credits the tokens before each reward, so the updates differ; GRPO reads
    the sample's reward only, so its updates do not."""
    base = sample_groups(policy_dir, n_groups=2, n=3, seed=7, max_new_tokens=5)
    updates = {}
    for estimator in ("reinforce_plus_plus", "grpo"):
        for where in (0, -1):
            groups = []
            for group in base:
                samples = []
                for s in group.samples:
                    steps = np.zeros(len(s.response_ids), np.float32)
                    steps[where] = s.reward
                    samples.append(Sample(sample_id=s.sample_id, group_id=s.group_id, prompt_ids=s.prompt_ids,
                                          response_ids=s.response_ids, rollout_log_probs=s.rollout_log_probs,
                                          loss_mask=s.loss_mask, reward=s.reward, weight_version=0,
                                          token_rewards=steps))
                groups.append(Group(group_id=group.group_id, samples=samples, prompt_index=group.prompt_index))
            learner = make_learner(policy_dir, advantage={"estimator": estimator})
            learner.train_step(groups)
            updates[estimator, where] = params_of(learner.model)
    assert max_param_diff(updates["reinforce_plus_plus", 0], updates["reinforce_plus_plus", -1]) > 1e-5
    assert max_param_diff(updates["grpo", 0], updates["grpo", -1]) == 0.0


# A learner of one process saves and loads without a process group on purpose: no DCP warning of it.
@pytest.mark.filterwarnings("error:torch.distributed is disabled:UserWarning")
def test_checkpoint_round_trip_gives_the_identical_next_step(policy_dir, groups, tmp_path):
    (policy_dir / "tokenizer.json").write_text("{}")  # stands in for the source's tokenizer
    first = make_learner(policy_dir, warmup_steps=2, lr_schedule="cosine", total_steps=10)
    first.train_step(groups)
    state = first.state_dict()
    first.save_checkpoint(tmp_path / "ckpt")
    expected = first.train_step(groups)
    want = params_of(first.model)

    for restore in ("state_dict", "folder"):
        again = make_learner(policy_dir, warmup_steps=2, lr_schedule="cosine", total_steps=10)
        if restore == "state_dict":
            again.load_state_dict(state)
        else:
            again.load_checkpoint(tmp_path / "ckpt")
        assert again.version == 1
        got = again.train_step(groups)
        assert got["actor/lr"] == expected["actor/lr"] and again.version == 2
        assert max_param_diff(want, params_of(again.model)) == 0.0, restore

    # The policy folder is a loadable HF model and keeps the source's non-weight files.
    reloaded = load_causal_lm(tmp_path / "ckpt" / "policy")
    assert (tmp_path / "ckpt" / "policy" / "tokenizer.json").read_text() == "{}"
    assert max_param_diff(params_of(reloaded), state["model"]) == 0.0
    with pytest.raises(FileNotFoundError, match="has no trainer.pt"):
        again.load_checkpoint(tmp_path)


def test_a_kl_penalty_in_the_reward_steers_an_adaptive_beta_and_resumes_with_it(policy_dir, groups, tmp_path):
    """Step 1: π_old is the reference itself, KL 0 and β falls by the clipped 20 %·rows/horizon;
    later steps measure KL(π_old ‖ π_ref) > 0 and lower the rewards by β·KL. A checkpoint keeps
    β, so a resumed run's next step is the uninterrupted one's."""
    kl_cfg = {"coef": 0.5, "controller": "adaptive", "target_kl": 1e-4, "horizon": 32, "estimator": "k3"}
    first = make_learner(policy_dir, kl_in_reward=kl_cfg)
    m1 = first.train_step(groups)
    assert m1["actor/reward_kl_penalty"] == 0.0 and m1["actor/reward_kl_penalty_coeff"] == 0.5
    m2 = first.train_step(groups)
    assert m2["actor/reward_kl_penalty_coeff"] == pytest.approx(0.5 * (1 - 0.2 * 16 / 32))
    assert m2["actor/reward_kl_penalty"] > 1e-4, "the policy moved away from the reference"
    first.save_checkpoint(tmp_path / "ckpt")
    m3 = first.train_step(groups)
    assert m3["actor/reward_kl_penalty_coeff"] == pytest.approx(m2["actor/reward_kl_penalty_coeff"] * (1 + 0.2 * 16 / 32))
    again = make_learner(policy_dir, kl_in_reward=kl_cfg)
    again.load_checkpoint(tmp_path / "ckpt")
    assert again.train_step(groups)["actor/reward_kl_penalty_coeff"] == m3["actor/reward_kl_penalty_coeff"]
    assert max_param_diff(params_of(first.model), params_of(again.model)) == 0.0
    plain, fixed = make_learner(policy_dir), make_learner(policy_dir, kl_in_reward={"coef": 50.0, "estimator": "k3"})
    for step in range(2):
        metrics = plain.train_step(groups)
        fixed.train_step(groups)
        moved = max_param_diff(params_of(plain.model), params_of(fixed.model))
        assert moved == 0.0 if step == 0 else moved > 1e-5, "KL 0 at step 1; then the penalty changes the update"
    assert "actor/reward_kl_penalty" not in metrics


def test_weights_published_through_the_object_store_and_a_folder(policy_dir, groups, tmp_path, ray_cluster,
                                                                 monkeypatch):
    """Publication goes out in the learner's own thread; the live payload of the last version holds
    exactly the policy's weights. A folder no reader claims is deleted once a newer version is live.
    A GPU learner publishes host copies it owns (cast on the GPU, a bucket at a time): forced here,
    on the CPU, for the object store's third round, in bfloat16 (this machine has no GPU)."""
    batch = build_batch(groups)
    rounds = ({"channel": "object_store"}, {"channel": "folder", "folder": str(tmp_path / "weights")},
              {"channel": "object_store", "dtype": "bfloat16"})
    for i, sync in enumerate(rounds):
        if i == 2:
            monkeypatch.setattr(Learner, "_publishes_host_copies", lambda self: True)
        learner = make_learner(policy_dir, weight_sync=sync)
        try:
            if i == 2:  # copies, not views of the parameters; a tied weight stays one tensor
                owned = learner._publishable()
                live = {p.data_ptr() for p in learner.model.parameters()}
                assert not any(t.data_ptr() in live for t in owned.values())
                if learner.model.config.tie_word_embeddings:
                    assert owned["lm_head.weight"] is owned["model.embed_tokens.weight"]
            for _ in range(3):
                learner.train_step(groups)
                timings = learner.publish_weights()
                assert timings["version"] == learner.version and timings["publish_s"] >= 0
                payload = learner.published(timeout=120)
            assert payload["version"] == 3
            if i == 2:
                got = resolve_weights(payload)
                want = learner.model.state_dict()
                assert sorted(got) == sorted(want)
                assert all(torch.equal(got[k], v.to(torch.bfloat16)) for k, v in want.items())
                continue
            fresh = load_causal_lm(policy_dir)
            result = fresh.load_state_dict(resolve_weights(payload), strict=True)
            assert not result.missing_keys and not result.unexpected_keys
            with torch.no_grad():
                want, _ = response_log_probs(learner.model, batch.prompts, batch.responses)
                got, _ = response_log_probs(fresh, batch.prompts, batch.responses)
            assert torch.equal(want, got)
            if sync["channel"] == "folder":
                assert sorted(p.name for p in (tmp_path / "weights").iterdir()) == ["v000003"]
        finally:
            learner.close_weight_sync()


def test_lr_schedule_warms_up_then_decays():
    assert [lr_factor(s, 4, "constant", None, 0.0) for s in (0, 1, 3, 9)] == [0.25, 0.5, 1.0, 1.0]
    assert lr_factor(2, 2, "linear", 12, 0.1) == pytest.approx(1.0)
    assert lr_factor(7, 2, "linear", 12, 0.1) == pytest.approx(0.1 + 0.9 * 0.5)
    assert lr_factor(12, 2, "linear", 12, 0.1) == pytest.approx(0.1)
    assert lr_factor(7, 2, "cosine", 12, 0.0) == pytest.approx(0.5)
    assert lr_factor(50, 2, "cosine", 12, 0.0) == pytest.approx(0.0)
    from learner.optimizer import adamw_with_schedule

    with pytest.raises(ValueError, match="lr_schedule 'cosine' needs total_steps"):  # a learner built alone
        adamw_with_schedule([torch.nn.Parameter(torch.zeros(1))], 1e-3, (0.9, 0.999), 1e-8, 0.0, 0, "cosine", None)


def test_a_resumed_schedule_takes_its_rate_from_this_runs_schedule_not_the_saved_one():
    from learner.optimizer import adamw_with_schedule, load_schedule

    def schedule(total):
        return adamw_with_schedule([torch.nn.Parameter(torch.zeros(1))], 1e-3, (0.9, 0.999), 1e-8, 0.0, 0, "cosine",
                                   total)

    optimizer, scheduler = schedule(3)
    for _ in range(3):
        optimizer.step()
        scheduler.step()
    saved, saved_lr = scheduler.state_dict(), optimizer.param_groups[0]["lr"]
    assert saved_lr == pytest.approx(0.0)  # the end of a 3-step decay
    same_optimizer, same = schedule(3)
    load_schedule(same, saved)
    assert same_optimizer.param_groups[0]["lr"] == saved_lr and same.get_last_lr() == [saved_lr]  # the same run
    longer_optimizer, longer = schedule(5)  # resumed with run.steps=5: step 4 of a 5-step decay
    load_schedule(longer, saved)
    expected = 1e-3 * lr_factor(3, 0, "cosine", 5, 0.0)
    assert expected > 0 and longer_optimizer.param_groups[0]["lr"] == pytest.approx(expected)


def test_config_errors_name_the_field(policy_dir):
    with pytest.raises(ValidationError, match="ppo_epoch"):
        LearnerConfig(model_path=str(policy_dir), ppo_epoch=2)
    with pytest.raises(ValidationError, match="bypass mode"):
        LearnerConfig(model_path=str(policy_dir), prox_logp="loglinear", rollout_correction="bypass_pg_is")
    with pytest.raises(ValidationError, match="unknown rollout-correction preset"):
        LearnerConfig(model_path=str(policy_dir), rollout_correction="decoupled_magic")
    with pytest.raises(ValidationError, match=r"weight_sync.folder.folder\n  Field required"):
        LearnerConfig(model_path=str(policy_dir), weight_sync={"channel": "folder"})
    with pytest.raises(ValidationError, match="weight_sync.channel must be object_store, folder or broadcast"):
        LearnerConfig(model_path=str(policy_dir), weight_sync={"channel": "carrier-pigeon"})
    with pytest.raises(ValidationError, match=r"weight_sync.object_store.keep_last\n  Extra inputs"):
        LearnerConfig(model_path=str(policy_dir), weight_sync={"keep_last": 2})
    with pytest.raises(ValidationError, match="set dtype float32"):
        LearnerConfig(model_path=str(policy_dir), dtype="bfloat16", mixed_precision="bfloat16")
    with pytest.raises(ValidationError, match="max_tokens_per_micro_batch"):
        LearnerConfig(model_path=str(policy_dir), max_tokens_per_micro_batch=0)
    with pytest.raises(ValidationError, match="loss_mode sapo is a policy-gradient loss of its own"):
        LearnerConfig(model_path=str(policy_dir), rollout_correction="bypass_pg_is", policy_loss={"loss_mode": "sapo"})
    with pytest.raises(ValidationError, match="the penalty would do nothing"):
        LearnerConfig(model_path=str(policy_dir), kl_in_reward={"coef": 0.1},
                      advantage={"estimator": "gdpo", "gdpo_reward_keys": ["a"]})
    with pytest.raises(ValidationError, match="dro needs dro_beta"):
        LearnerConfig(model_path=str(policy_dir), policy_loss={"loss_mode": "dro"})
    cfg = LearnerConfig(model_path=str(policy_dir), rollout_correction="decoupled_seq_is")
    assert cfg.rollout_correction.rollout_is == "sequence" and not cfg.bypass_mode
    assert LearnerConfig.model_validate_json(cfg.model_dump_json()) == cfg  # survives YAML/JSON and pickling
    with pytest.raises(FileNotFoundError, match="does not exist"):
        Learner(LearnerConfig(model_path=str(policy_dir / "missing")))
