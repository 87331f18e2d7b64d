"""Sharded checkpoints: an FSDP learner group (2 gloo ranks, shards of unequal sizes) that stops
after N steps and resumes on fresh ranks makes, over M more steps, the run that never stopped (its
critic too: PPO with gae); every rank writes and reads its own shards, and the HF policy folder is
written file by file."""
from __future__ import annotations

import json

import pytest
import torch

from learner.checkpoint import SHARDS_DIR, write_policy
from learner.config import LearnerConfig
from learner.distributed import FullWeightBuckets, LearnerGroup, plan_buckets
from learner.trainer import Learner
from learner_helpers import build_tiny_policy, max_param_diff, params_of, sample_groups
from lm.causal_lm import load_causal_lm
from lm.weight_sync import resolve_weights


@pytest.fixture(scope="module")
def uneven_policy(tmp_path_factory):
    # vocab 49 and MLP width 63: embeddings, gate and up projections split 25/24 rows over 2 ranks
    return build_tiny_policy(tmp_path_factory.mktemp("uneven"), seed=3, vocab_size=49, intermediate_size=63)


def _config(policy, **extra) -> LearnerConfig:
    # float32, as a run trains; warm-up and cosine decay so the scheduler's state matters too
    return LearnerConfig(model_path=str(policy), lr=1e-3, warmup_steps=1, lr_schedule="cosine", total_steps=8,
                         max_tokens_per_micro_batch=16, rollout_correction="decoupled_token_is",
                         advantage={"estimator": "gae"}, critic={"lr": 1e-3, "warmup_steps": 2}, **extra)


@pytest.mark.slow
def test_fsdp_resume_from_shards_equals_the_uninterrupted_run(uneven_policy, ray_cluster, tmp_path):
    (uneven_policy / "tokenizer.json").write_text("{}")  # stands in for the source's tokenizer
    batches = [sample_groups(uneven_policy, n_groups=3, n=2, seed=s, logprob_noise=0.1) for s in (11, 12)]
    fsdp = {"world_size": 2, "strategy": "fsdp", "timeout_s": 60}
    n_steps, m_steps = 2, 2
    ckpt = tmp_path / "ckpt"

    run = LearnerGroup(_config(uneven_policy, distributed=fsdp), ray_options={"num_cpus": 0})
    try:
        for step in range(n_steps):
            run.train_step(batches[step % 2])
        run.save_checkpoint(str(ckpt))
        at_stop, critic_at_stop = (run.state_dict()[k] for k in ("model", "critic_model"))
        want = [run.train_step(batches[step % 2]) for step in range(n_steps, n_steps + m_steps)]
        uninterrupted, critic_uninterrupted = (run.state_dict()[k] for k in ("model", "critic_model"))
    finally:
        run.shutdown()

    # Each rank wrote its own shard file; the coordinator the metadata, last.
    assert sorted(p.name for p in (ckpt / SHARDS_DIR).glob("*.distcp")) == ["__0_0.distcp", "__1_0.distcp"]
    assert (ckpt / SHARDS_DIR / ".metadata").is_file()

    # (publishing in bfloat16, small buckets: the weights leave the shards a bucket at a time)
    resumed = LearnerGroup(_config(uneven_policy, distributed={**fsdp, "publish_bucket_mb": 0.004},
                                   weight_sync={"dtype": "bfloat16"}), ray_options={"num_cpus": 0})
    try:
        resumed.load_checkpoint(str(ckpt))
        assert resumed.version == n_steps
        got = [resumed.train_step(batches[step % 2]) for step in range(n_steps, n_steps + m_steps)]
        final, critic_final = (resumed.state_dict()[k] for k in ("model", "critic_model"))
        assert resumed.publish_weights()["version"] == n_steps + m_steps
        published = resolve_weights(resumed.published(timeout=120))
    finally:
        resumed.shutdown()
    assert published.keys() == final.keys()  # the tied lm_head too
    assert all(published[k].dtype == torch.bfloat16 and torch.equal(published[k], final[k].to(torch.bfloat16))
               for k in final)
    for w, g in zip(want, got):
        assert g["actor/lr"] == w["actor/lr"]
        assert g["actor/pg_loss"] == pytest.approx(w["actor/pg_loss"], abs=1e-6)
        assert g["critic/lr"] == w["critic/lr"]
        assert g["critic/vf_loss"] == pytest.approx(w["critic/vf_loss"], abs=1e-6)
    assert max_param_diff(uninterrupted, final) <= 1e-6
    assert max_param_diff(critic_uninterrupted, critic_final) <= 1e-6
    assert max_param_diff(critic_uninterrupted, critic_at_stop) > 1e-4
    assert max_param_diff(uninterrupted, at_stop) > 1e-4  # the M steps moved the weights

    # The HF folder holds the weights at the stop (tied head stored once) and the source's files.
    policy = ckpt / "policy"
    assert (policy / "tokenizer.json").read_text() == "{}"
    assert max_param_diff(params_of(load_causal_lm(policy)), at_stop) == 0.0
    # DCP keys shards by name: one unsharded learner resumes the 2-rank checkpoint too.
    single = Learner(_config(uneven_policy))
    single.load_checkpoint(ckpt)
    assert single.version == n_steps
    assert max_param_diff(params_of(single.model), at_stop) == 0.0
    assert max_param_diff(params_of(single.critic.model), critic_at_stop) == 0.0
    assert single.optimizer.state_dict()["state"][0]["step"] == n_steps
    assert single.critic.optimizer.state_dict()["state"][0]["step"] == n_steps


def test_policy_files_and_buckets_hold_one_bucket_at_a_time(uneven_policy, tmp_path):
    assert plan_buckets([4, 4, 9, 1, 1], 8) == [[0, 1], [2], [3, 4]]
    with pytest.raises(ValueError, match="bucket_bytes must be >= 1"):
        plan_buckets([1], 0)
    model = load_causal_lm(uneven_policy)
    buckets = FullWeightBuckets(model, 4096, dtype=torch.bfloat16)
    seen = {}
    for i, bucket in enumerate(buckets):
        assert sum(t.numel() * t.element_size() for t in {id(t): t for t in bucket.values()}.values()) == \
            buckets.bucket_bytes[i]
        assert all(t.dtype == torch.bfloat16 for t in bucket.values())
        seen.update(bucket)
    assert len(buckets) > 3 and max(buckets.bucket_bytes) <= max(4096, 49 * 32 * 2)
    assert seen.keys() == model.state_dict().keys()  # the tied lm_head too, for the engines
    assert seen["lm_head.weight"] is seen["model.embed_tokens.weight"]

    folder = write_policy(tmp_path / "policy", model, str(uneven_policy), rank=0, sharded=False, file_bytes=8192)
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    files = set(index["weight_map"].values())
    assert len(files) > 2 and files == {p.name for p in folder.glob("*.safetensors")}
    assert "lm_head.weight" not in index["weight_map"]
    assert max_param_diff(params_of(load_causal_lm(folder)), params_of(model)) == 0.0
