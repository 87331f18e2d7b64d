"""Data parallelism: two learner ranks (Ray actors, gloo on CPU) make exactly the update one rank
makes on the same batch, because every loss is normalised by the whole minibatch's counts and the
gradients are summed over ranks. (The nccl and FSDP paths need GPUs and are not run here.)"""
from __future__ import annotations

import pytest
import torch

from learner.config import LearnerConfig
from learner.distributed import LearnerGroup
from learner.trainer import Learner
from learner_helpers import build_tiny_policy, max_param_diff, params_of, sample_groups
from lm.weight_sync import resolve_weights


@pytest.fixture(scope="module")
def policy_dir(tmp_path_factory):
    return build_tiny_policy(tmp_path_factory.mktemp("policy"), seed=2)


@pytest.mark.slow
@pytest.mark.parametrize("overrides", [
    # decoupled token-TIS, token-mean; minibatches of 3 and 1 groups (rank 1 sits out the second),
    # micro-batches of 2 sequences
    {"ppo_mini_batch_size": 3, "micro_batch_size": 2},
    # bypass REINFORCE with sequence IS and a sequence-mean aggregation, two epochs
    {"rollout_correction": "bypass_pg_is", "ppo_epochs": 2,
     "policy_loss": {"loss_agg_mode": "seq-mean-token-mean"}},
], ids=["decoupled-uneven-minibatches", "bypass-seq-mean"])
def test_two_gloo_ranks_make_the_update_of_one_rank(policy_dir, ray_cluster, overrides):
    groups = sample_groups(policy_dir, n_groups=4, n=3, seed=4, logprob_noise=0.2)
    config = dict(model_path=str(policy_dir), lr=1e-3, **overrides)

    single = Learner(LearnerConfig(**config))
    group = LearnerGroup(LearnerConfig(**config, distributed={"world_size": 2}), ray_options={"num_cpus": 0})
    try:
        for _ in range(2):
            want = single.train_step(groups)
            got = group.train_step(groups)
            for key in ("actor/pg_loss", "actor/grad_norm", "actor/entropy", "actor/pg_clipfrac"):
                assert got[key] == pytest.approx(want[key], rel=1e-5, abs=1e-7), key
            assert got["learner/num_sequences"] == 12 and got["learner/version"] == want["learner/version"]
        state = group.state_dict()
        assert state["version"] == single.version == 2
        diff = max_param_diff(params_of(single.model), state["model"])
        assert diff < 1e-6, diff

        assert group.publish_weights()["version"] == 2
        payload = group.published(timeout=120)
        assert payload["version"] == 2
        published = resolve_weights(payload)
        assert all(torch.equal(published[k], state["model"][k]) for k in state["model"])
    finally:
        group.shutdown()


def test_a_batch_smaller_than_the_world_is_refused(policy_dir):
    from learner.distributed import LocalComm

    class ThreeRanks(LocalComm):  # the check runs before any collective
        world_size = 3

    learner = Learner(LearnerConfig(model_path=str(policy_dir)), comm=ThreeRanks())
    with pytest.raises(ValueError, match="a batch of 2 groups cannot feed 3 learner ranks"):
        learner.train_step(sample_groups(policy_dir, n_groups=2, n=2))
    assert learner.version == 0
