"""Mixed precision under FSDP2: float32 master weights and optimizer, bfloat16 parameters in the
gathers and the compute, float32 gradient reduction (FSDP's MixedPrecisionPolicy, no autocast on
top); pure bfloat16 weights lose lr-1e-6 updates to rounding. One gloo rank in this process: FSDP2
behaves the same per rank, and the 2-rank tests elsewhere cover the collectives."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from learner.config import LearnerConfig
from learner.trainer import Learner
from learner_helpers import build_tiny_policy, sample_groups


@pytest.fixture(scope="module")
def policy_dir(tmp_path_factory):
    return build_tiny_policy(tmp_path_factory.mktemp("policy"), seed=5)


@pytest.fixture
def one_rank(tmp_path):
    if dist.is_initialized():
        pytest.skip("torch.distributed is already initialised in this process")
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'rendezvous'}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _compute_dtypes(learner: Learner) -> list[torch.dtype]:
    """The dtype of a decoder layer's weight as its forward sees it, one entry per forward."""
    seen = []
    mlp = learner.model.model.layers[0].mlp
    mlp.register_forward_pre_hook(lambda module, args: seen.append(module.gate_proj.weight.dtype))
    return seen


def test_fsdp_mixed_precision_keeps_float32_masters_and_computes_in_bfloat16(policy_dir, one_rank):
    groups = sample_groups(policy_dir, n_groups=2, n=2, seed=1)
    base = dict(model_path=str(policy_dir), lr=1e-6, weight_decay=0.0)
    fsdp = {"strategy": "fsdp"}

    mixed = Learner(LearnerConfig(**base, mixed_precision="bfloat16", distributed=fsdp))
    seen = _compute_dtypes(mixed)
    before = {n: p.detach().full_tensor().clone() for n, p in mixed.model.named_parameters()}
    got = mixed.train_step(groups)
    assert seen and set(seen) == {torch.bfloat16}  # gathered and computed in bfloat16
    assert mixed._autocast()._enabled is False  # no autocast on top of the policy
    for name, p in mixed.model.named_parameters():
        assert p.dtype == torch.float32, name  # the sharded master weights
        assert p.grad is None or p.grad.dtype == torch.float32, name  # reduced in float32
        moment = mixed.optimizer.state[p]["exp_avg"]
        assert moment.dtype == torch.float32, name
    moved = [float((p.detach().full_tensor() - before[n]).abs().max()) for n, p in mixed.model.named_parameters()]
    assert min(moved) > 0.0  # every 1e-6 Adam step landed on the float32 masters

    # Without FSDP the same option is autocast over float32 weights: the same losses to bfloat16 precision.
    plain = Learner(LearnerConfig(**base, mixed_precision="bfloat16"))
    want = plain.train_step(groups)
    assert got["actor/pg_loss"] == pytest.approx(want["actor/pg_loss"], rel=2e-2, abs=2e-3)
    assert got["actor/entropy"] == pytest.approx(want["actor/entropy"], rel=1e-2)

    # float32 under FSDP: gathered in float32, no policy.
    full = Learner(LearnerConfig(**base, distributed=fsdp))
    seen32 = _compute_dtypes(full)
    full.train_step(groups)
    assert set(seen32) == {torch.float32}

    # Pure bfloat16 weights (learner.dtype=bfloat16): the same lr-1e-6 step rounds away nearly everywhere.
    pure = Learner(LearnerConfig(**base, dtype="bfloat16"))
    start = {n: p.detach().clone() for n, p in pure.model.named_parameters()}
    pure.train_step(groups)
    changed = sum(int((p.detach() != start[n]).sum()) for n, p in pure.model.named_parameters())
    total = sum(p.numel() for p in pure.model.parameters())
    assert changed / total < 0.05  # 2.6% here: only weights within ~2e-4 of zero move


def test_fsdp_selective_checkpointing_gives_the_update_without_checkpointing(policy_dir, one_rank):
    """Under FSDP2 and its bfloat16 policy, selective checkpointing re-runs each layer's elementwise
    work in the backward (its parameters gathered again) and keeps its matmul outputs: the same
    update as no checkpointing."""
    groups = sample_groups(policy_dir, n_groups=2, n=2, seed=2)
    base = dict(model_path=str(policy_dir), lr=1e-4, weight_decay=0.0, mixed_precision="bfloat16",
                distributed={"strategy": "fsdp"})
    plain = Learner(LearnerConfig(**base))
    selective = Learner(LearnerConfig(**base, gradient_checkpointing="selective"))
    plain_forwards, forwards = _compute_dtypes(plain), _compute_dtypes(selective)
    want, got = plain.train_step(groups), selective.train_step(groups)
    assert len(forwards) > len(plain_forwards) and set(forwards) == {torch.bfloat16}  # recomputed, gathered again
    assert got["actor/grad_norm"] == pytest.approx(want["actor/grad_norm"], rel=1e-6)
    for (name, p), q in zip(plain.model.named_parameters(), selective.model.parameters()):
        torch.testing.assert_close(q.detach().full_tensor(), p.detach().full_tensor(), rtol=0, atol=1e-7, msg=name)
