"""Shared by the learner tests: a tiny random Qwen2 policy saved as an HF folder, and groups of
responses sampled from it with their behaviour log-probs, as the buffer would hand them over."""
from __future__ import annotations

import contextlib
import threading
from pathlib import Path

import numpy as np
import torch

from buffer.sample import Group, Sample
from learner.distributed import LearnerGroup, LearnerRank
from lm.causal_lm import load_causal_lm, response_log_probs

VOCAB = 48


def build_tiny_policy(folder: Path, seed: int = 0, vocab_size: int = VOCAB, intermediate_size: int = 64) -> Path:
    """Odd `vocab_size` or `intermediate_size` make FSDP shards of unequal sizes on 2 ranks."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    config = Qwen2Config(
        vocab_size=vocab_size, hidden_size=32, intermediate_size=intermediate_size, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        tie_word_embeddings=True,
    )
    Qwen2ForCausalLM(config).save_pretrained(folder)
    return folder


def sample_groups(model_dir: Path, n_groups: int = 4, n: int = 4, version: int = 0, seed: int = 0,
                  reward_fn=None, logprob_noise: float = 0.0, max_new_tokens: int = 6) -> list[Group]:
    """Groups of n sampled responses per prompt. Responses have different lengths; the reward is
    `reward_fn(response_ids)` (default: the fraction of even tokens). `logprob_noise` perturbs the
    behaviour log-probs, standing in for a sampler backend that differs from the learner's."""
    gen = torch.Generator().manual_seed(seed)
    model = load_causal_lm(model_dir)
    reward_fn = reward_fn or (lambda ids: float(np.mean([t % 2 == 0 for t in ids])))
    groups = []
    for g in range(n_groups):
        prompt = torch.randint(1, VOCAB, (3 + g % 3,), generator=gen).tolist()
        samples = []
        for i in range(n):
            length = 2 + (g + i) % max_new_tokens
            ids = list(prompt)
            with torch.no_grad():
                for _ in range(length):
                    probs = torch.softmax(model(torch.tensor([ids])).logits[0, -1].float(), -1)
                    ids.append(int(torch.multinomial(probs, 1, generator=gen)))
                response = ids[len(prompt):]
                lp, _ = response_log_probs(model, [prompt], [response])
            lp = lp[0] + logprob_noise * torch.randn(len(response), generator=gen)
            samples.append(Sample(
                sample_id=f"s{g}-{i}", group_id=f"g{g}", prompt_ids=prompt, response_ids=response,
                rollout_log_probs=lp.clamp(max=0).numpy(), loss_mask=np.ones(len(response), np.uint8),
                reward=reward_fn(response), weight_version=version,
            ))
        groups.append(Group(group_id=f"g{g}", samples=samples, prompt_index=g))
    return groups


def params_of(model) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def max_param_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k].float() - b[k].float()).abs().max()) for k in a)


@contextlib.contextmanager
def engine_following(board, engine):
    """A rollout worker's weight loop in a thread: `engine` receives each new version published on
    `board`. Yields the list of errors the loop met; the thread ends with the block."""
    from lm.weight_sync import WeightSubscription

    stop, errors = threading.Event(), []

    def follow():
        subscription = WeightSubscription(board, "worker-0", engine.version)
        while not stop.is_set():
            try:
                if subscription.newest_version() > engine.version:
                    subscription.receive(engine, wait_s=5.0, stop=stop)
            except Exception as err:
                errors.append(f"{type(err).__name__}: {err}")
            stop.wait(0.01)

    loop = threading.Thread(target=follow, daemon=True)
    loop.start()
    try:
        yield errors
    finally:
        stop.set()
        loop.join(30)
        assert not loop.is_alive()


class RebuildableRank(LearnerRank):
    """A learner rank that trades its learner for one of another config, on the process group it
    joined (same world size and backend): a module's two-rank tests share two processes instead of
    starting two each (a rank's start imports torch and transformers: ~9 s of CPU here)."""

    def rebuild(self, config) -> int:
        self.learner.close_weight_sync()
        self.config, self.learner = config, None
        self.learner = self._new_learner()
        return self.learner.version


class SharedRanks(LearnerGroup):
    """A `LearnerGroup` of `RebuildableRank`s: `rebuild(config)` gives every rank a new learner."""

    rank_class = RebuildableRank

    def rebuild(self, config) -> SharedRanks:
        import ray

        have, want = self.config.distributed, config.distributed
        if (want.world_size, want.backend) != (have.world_size, have.backend):
            raise ValueError("a rebuilt learner keeps the ranks' world size and backend")
        ray.get([r.rebuild.remote(config) for r in self.ranks])
        self.config = config
        return self
