"""The critic's value model: the policy's decoder with a scalar head (transformers'
`AutoModelForTokenClassification` with one label, as verl builds its critic), and the value of
the state before each response token.

The head (`score`: weight [1, hidden], bias [1]) is in no policy checkpoint: it starts from
N(0, initializer_range) weights and a zero bias drawn from `seed`, the same numbers whether the
model is loaded whole or sharded and filled from the folder (`value_head`)."""
from __future__ import annotations

import contextlib
import os

import torch

from lm.causal_lm import _implementations, check_model_dir, checkpoint_tensors, on_meta, response_inputs, torch_dtype

HEAD_NAMES = ("score.weight", "score.bias")


def _value_config(path: str | os.PathLike):
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(check_model_dir(path), num_labels=1)
    config.classifier_dropout = 0.0  # no dropout before the head (the learner runs in eval mode anyway)
    return config


def value_head(config, dtype: torch.dtype, seed: int) -> dict[str, torch.Tensor]:
    """The head's starting tensors by name, drawn from `seed` alone."""
    hidden = config.get_text_config().hidden_size
    generator = torch.Generator().manual_seed(seed)
    std = getattr(config, "initializer_range", 0.02)
    weight = torch.randn(1, hidden, generator=generator, dtype=torch.float64) * std
    return {"score.weight": weight.to(dtype), "score.bias": torch.zeros(1, dtype=dtype)}


@contextlib.contextmanager
def _quiet_transformers():
    """transformers reports the head as missing from the checkpoint at every load: it is meant to be."""
    from transformers.utils import logging as hf_logging

    level = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        yield
    finally:
        hf_logging.set_verbosity(level)


def load_value_model(path: str | os.PathLike, dtype: str = "float32", device: str = "cpu",
                     attn_implementation: str | None = None, seed: int = 0):
    """The decoder of the HF folder `path` (a causal LM's) with a fresh value head."""
    from transformers import AutoModelForTokenClassification

    config = _value_config(path)
    with _quiet_transformers():
        model = AutoModelForTokenClassification.from_pretrained(
            check_model_dir(path), config=config, dtype=torch_dtype(dtype),
            **_implementations(dtype, attn_implementation))
    with torch.no_grad():
        for name, tensor in value_head(config, torch_dtype(dtype), seed).items():
            model.get_parameter(name).copy_(tensor)
    return model.to(device)


def value_model_on_meta(path: str | os.PathLike, dtype: str = "float32", attn_implementation: str | None = None):
    """`load_value_model`'s model with its parameters on the meta device (buffers real), for a
    sharded learner: shard it, then fill each rank's shards (`value_model_source` on rank 0)."""
    from transformers import AutoModelForTokenClassification

    config = _value_config(path)
    return on_meta(lambda: AutoModelForTokenClassification.from_config(
        config, dtype=torch_dtype(dtype), **_implementations(dtype, attn_implementation)))


class _WithHead:
    """A source of tensors by name: the folder's decoder tensors and the fresh head."""

    def __init__(self, decoder, head: dict[str, torch.Tensor]):
        self.decoder, self.head = decoder, head

    def __contains__(self, name: str) -> bool:
        return name in self.head or name in self.decoder

    def __getitem__(self, name: str) -> torch.Tensor:
        return self.head[name] if name in self.head else self.decoder[name]


def value_model_source(path: str | os.PathLike, shapes, dtype: str = "float32", seed: int = 0):
    """Rank 0's source for `learner.distributed.fill_shards` (`shapes`: the model's name -> shape):
    the folder's tensors read one by one (`checkpoint_tensors`), else the model loaded whole (one
    copy on the host), with the head of `value_head`."""
    decoder = checkpoint_tensors(path, {n: shape for n, shape in shapes.items() if n not in HEAD_NAMES})
    if decoder is None:
        return load_value_model(path, dtype, seed=seed).state_dict()
    return _WithHead(decoder, value_head(_value_config(path), torch_dtype(dtype), seed))


def response_values(model, prompts, responses, pad_id: int = 0, packed: bool = False,
                    pack_width: int | None = None) -> torch.Tensor:
    """V(s) of the state before each response token (the position that predicts it, as the
    log-probs read it; verl's `values[:, -T - 1 : -1]`), [B, T] float32 (float64 for a float64
    model), zeros at padding. Gradients flow unless the caller disables them."""
    inputs = response_inputs(model, prompts, responses, pad_id, packed, pack_width)
    scores = model(**inputs.forward, use_cache=False).logits[..., 0]
    picked = scores[inputs.in_rows, inputs.in_cols]
    return inputs.scatter(picked.to(torch.promote_types(picked.dtype, torch.float32)))
