"""Data parallelism: two learner ranks (Ray actors, gloo on CPU) make the update one rank makes on
the same batch, because every loss is normalised by the whole minibatch's counts, batch-normalised
IS weights by the whole batch's factor, and the gradients are summed over ranks. The learners run
in float64 so the comparison checks the algorithm, not the order of float32 sums (which differs
between CPUs). FSDP2 shards the parameters and runs on gloo too; the nccl path needs GPUs."""
from __future__ import annotations

import pytest
import torch

from learner.config import LearnerConfig
from learner.distributed import LearnerGroup
from learner.trainer import Learner
from learner_helpers import build_tiny_policy, engine_following, max_param_diff, params_of, sample_groups
from lm.weight_sync import resolve_weights

# Micro-batches of one or two rows (the longest sequence here has 12 tokens): ranks plan different
# numbers of passes and the short ones make up the difference.
SMALL_BUDGET = 16


@pytest.fixture(scope="module")
def policy_dir(tmp_path_factory):
    return build_tiny_policy(tmp_path_factory.mktemp("policy"), seed=2)


def assert_same_training(single: Learner, group: LearnerGroup, groups, steps: int = 2) -> None:
    for _ in range(steps):
        want = single.train_step(groups)
        got = group.train_step(groups)
        for key in ("actor/pg_loss", "actor/grad_norm", "actor/entropy", "actor/pg_clipfrac"):
            assert got[key] == pytest.approx(want[key], rel=1e-9, abs=1e-12), key
        assert got["learner/num_sequences"] == want["learner/num_sequences"]
        assert got["learner/version"] == want["learner/version"]
        for key in [k for k in want if k.startswith("drift/")]:  # recompute mode: sums over both ranks' rows
            assert got[key] == pytest.approx(want[key], rel=1e-9, abs=1e-12, nan_ok=True), key
        for key in ("critic/advantages/mean", "critic/advantages/max", "critic/advantages/min"):  # over both ranks
            assert got[key] == pytest.approx(want[key], rel=1e-9, abs=1e-12), key
        for key in ("actor/reward_kl_penalty", "actor/reward_kl_penalty_coeff"):  # one β, from the whole batch
            if key in want:
                assert got[key] == pytest.approx(want[key], rel=1e-9, abs=1e-12), key
        for key in [k for k in want if k.startswith("critic/")]:  # gae: the critic's loss and values over both ranks
            assert got[key] == pytest.approx(want[key], rel=1e-9, abs=1e-12), key
        if "rollout_corr/rollout_is_batch_norm_factor" in want:
            assert got["rollout_corr/rollout_is_batch_norm_factor"] == pytest.approx(
                want["rollout_corr/rollout_is_batch_norm_factor"], rel=1e-12)
    state = group.state_dict()
    assert state["version"] == single.version == steps
    # The update moved the weights by ~1e-3 (lr 1e-3, two steps); the two runs agree to float64 rounding.
    assert max_param_diff(params_of(single.model), state["model"]) < 1e-10
    if single.critic is not None:
        assert max_param_diff(params_of(single.critic.model), state["critic_model"]) < 1e-10


@pytest.mark.slow
@pytest.mark.parametrize("overrides", [
    # decoupled token-TIS, batch-normalised (one factor over both ranks' shards), token-mean;
    # shuffled minibatches of 3 and 1 groups over two epochs (rank 1 sits out the 1-group one),
    # micro-batches of at most 2 sequences within the token budget, uneven counts per rank
    # a KL penalty in the reward, adaptive β, discounted REINFORCE++: each rank scores its rows, one
    # all-reduce gives both the batch's KL
    {"rollout_correction": {"rollout_is": "token", "rollout_is_threshold": 1.5, "rollout_is_batch_normalize": True},
     "ppo_mini_batch_size": 3, "micro_batch_size": 2, "max_tokens_per_micro_batch": SMALL_BUDGET,
     "ppo_epochs": 2, "shuffle_minibatches": True,
     "kl_in_reward": {"coef": 0.5, "controller": "adaptive", "horizon": 10},
     "advantage": {"estimator": "reinforce_plus_plus", "gamma": 0.9}},
    # bypass REINFORCE with sequence IS on π_θ, batch-normalised per minibatch over both ranks,
    # a sequence-mean aggregation, two epochs, token-budget micro-batches
    {"rollout_correction": {"rollout_is": "sequence", "rollout_is_threshold": 1.5, "rollout_is_batch_normalize": True,
                            "bypass_mode": True, "loss_type": "reinforce"},
     "ppo_epochs": 2, "policy_loss": {"loss_agg_mode": "seq-mean-token-mean"},
     "max_tokens_per_micro_batch": SMALL_BUDGET, "kl_in_reward": {"coef": 0.2}},
    # the optimal token baseline: per-token baselines from each rank's own proximal pass (its
    # groups are whole), a KL penalty in the reward, shuffled minibatches over two epochs
    {"rollout_correction": {"rollout_is": "token", "rollout_is_threshold": 1.5}, "ppo_mini_batch_size": 3,
     "ppo_epochs": 2, "shuffle_minibatches": True, "max_tokens_per_micro_batch": SMALL_BUDGET,
     "kl_in_reward": {"coef": 0.2}, "advantage": {"estimator": "optimal_token_baseline"}},
    # one minibatch of one epoch: each rank takes π_old from its own update pass (no proximal pass
    # on any rank), sequence IS, token-budget micro-batches of uneven counts per rank
    {"rollout_correction": {"rollout_is": "sequence", "rollout_is_threshold": 1.5},
     "max_tokens_per_micro_batch": SMALL_BUDGET, "policy_loss": {"entropy_coeff": 0.01}},
], ids=["decoupled-uneven-minibatches", "bypass-seq-mean", "optimal-token-baseline", "pi-old-from-the-update-pass"])
def test_two_gloo_ranks_make_the_update_of_one_rank(policy_dir, two_ranks, overrides):
    groups = sample_groups(policy_dir, n_groups=4, n=3, seed=4, logprob_noise=0.2)
    config = dict(model_path=str(policy_dir), lr=1e-3, dtype="float64", **overrides)

    single = Learner(LearnerConfig(**config))
    group = two_ranks(LearnerConfig(**config, distributed={"world_size": 2, "timeout_s": 60}))
    assert_same_training(single, group, groups)
    state = group.state_dict()
    assert group.publish_weights()["version"] == 2
    payload = group.published(timeout=120)
    assert payload["version"] == 2
    published = resolve_weights(payload)
    assert all(torch.equal(published[k], state["model"][k]) for k in state["model"])


@pytest.mark.slow
def test_fsdp_on_two_gloo_ranks_with_unequal_shares(policy_dir, two_ranks):
    """B = 3 groups on 2 ranks: rank 0 trains on 2 groups, rank 1 on 1, in token-budget
    micro-batches, so rank 1 runs zero-weight passes to join every FSDP collective. No hang, and
    the sharded update is the one of a single unsharded rank; PPO with a critic (gae), sharded the
    same way, its values gathered over the ranks for the batch's GAE, its update the single rank's."""
    groups = sample_groups(policy_dir, n_groups=3, n=3, seed=7, logprob_noise=0.2)
    config = dict(model_path=str(policy_dir), lr=1e-3, dtype="float64", max_tokens_per_micro_batch=SMALL_BUDGET,
                  rollout_correction="bypass_pg_is", policy_loss={"entropy_coeff": 0.01},
                  advantage={"estimator": "gae", "gamma": 0.9, "lam": 0.95}, critic={"lr": 1e-3})
    single = Learner(LearnerConfig(**config))
    assert_same_training(single, two_ranks(LearnerConfig(**config, distributed={"world_size": 2, "strategy": "fsdp",
                                                                               "timeout_s": 60})), groups)


@pytest.mark.slow
def test_an_fsdp_learner_streams_each_version_bucket_by_bucket_into_an_engine(policy_dir, ray_cluster):
    """FSDP over two gloo ranks with the broadcast channel: every rank gathers the version a bucket
    at a time (many small buckets here) while rank 0 sends each one down the gloo stream as the
    stream reaches it; the engine (a transformers engine in this process, receiving like a worker)
    ends with exactly the learner's weights in the publish dtype, version by version, and the
    step waited for the send (its blocked time)."""
    import ray

    from lm.weight_sync import WeightStore
    from rollout_workers.engines.hf_engine import HFEngine

    groups = sample_groups(policy_dir, n_groups=2, n=2, seed=5, logprob_noise=0.2)
    board = ray.remote(WeightStore).options(num_cpus=0, max_concurrency=16).remote()
    config = LearnerConfig(model_path=str(policy_dir), lr=1e-3, rollout_correction="bypass_pg_is",
                           distributed={"world_size": 2, "strategy": "fsdp", "timeout_s": 60,
                                        "publish_bucket_mb": 0.02},
                           weight_sync={"channel": "broadcast", "dtype": "bfloat16", "bucket_mb": 0.01,
                                        "address": "127.0.0.1", "timeout_s": 60})
    engine = HFEngine(policy_dir, dtype="bfloat16")
    with engine_following(board, engine) as errors:
        group = LearnerGroup(config, ray_options={"num_cpus": 0})
        try:
            group.attach_weight_board(board)
            for version in (1, 2):
                group.train_step(groups)
                timings = group.publish_weights()  # returns once the engine has the version
                assert timings["version"] == version and timings["engines"] == 1 and timings["blocked_s"] > 0
                assert engine.version == version, errors
                want = group.state_dict()["model"]
                got = engine.model.state_dict()
                assert all(torch.equal(got[k], want[k].to(torch.bfloat16)) for k in want), version
        finally:
            group.shutdown()
    assert not errors


def test_a_batch_smaller_than_the_world_is_refused(policy_dir):
    from learner.distributed import LocalComm

    class ThreeRanks(LocalComm):  # the check runs before any collective
        world_size = 3

    learner = Learner(LearnerConfig(model_path=str(policy_dir)), comm=ThreeRanks())
    with pytest.raises(ValueError, match="a batch of 2 groups cannot feed 3 learner ranks"):
        learner.train_step(sample_groups(policy_dir, n_groups=2, n=2))
    assert learner.version == 0


def test_a_world_of_one_sums_no_gradients():
    """One rank (the one-GPU layout) has nothing to sum: over gloo a GPU's gradients would cross
    the host and back every optimizer step. No collective is called (none could be: no group here)."""
    from learner.distributed import ProcessGroupComm

    param = torch.nn.Parameter(torch.ones(3))
    param.grad = torch.full((3,), 2.0)
    ProcessGroupComm(0, 1).sum_gradients([param])
    assert torch.equal(param.grad, torch.full((3,), 2.0))
    with pytest.raises(ValueError, match="process group"):  # two ranks do sum, and need a group
        ProcessGroupComm(0, 2).sum_gradients([param])
