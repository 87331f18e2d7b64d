"""LoRA for the policy (`learner.lora`): low-rank adapters beside frozen weights, made as PEFT makes
them but without PEFT's module wrappers, so every weight keeps the name the checkpoint and the
engines know.

A target linear layer `m` (weight W [out, in]) gets two children, `m.lora_A` (A [r, in]) and
`m.lora_B` (B [out, r]), in float32 whatever W's dtype (as PEFT keeps them: their small updates
land), and a forward hook that adds scale · B(A(x)) to its output, scale = alpha / r; W and every
other weight of the model are frozen, so the optimizer holds the adapters only. A starts
as PEFT's (Kaiming-uniform, |a| <= 1/sqrt(in)), from a generator seeded by the run's seed and the
layer's name (every rank and world size draws the same), and B as zeros: at the start the policy is
the base model, the engines' version 0.

The saved policy is merged, W + scale · B A (`lm.lora_weights.merged_weight`): a plain HF folder.
So are the versions the engines get (no engine needs LoRA support), or with `publish=adapter` A and
B alone, which vLLM applies as a LoRA adapter (rollout_workers/engines). An engine in bfloat16
computes with round(W + scale · B A), which drops an update entry below half a bfloat16 step of W;
a learner computing in bfloat16 (mixed_precision) drops the same updates where it rounds each
layer's output, y + scale · B(A x): on a 1,024-wide layer (benchmarks/lora_step.py) both keep 2 %
of an update 4e-5 the size of W, 21 % at 4e-4, 96 % at 4e-3, alike (full fine-tuning's bfloat16
compute over float32 master weights drops them the same way; A and B, like master weights, keep
them until they add up). The KL reference is the policy with its adapters off
(`LoraAdapters.disabled`): no second model. The adapters alone also leave as a PEFT folder
(`learner.checkpoint.write_adapter`). What both sides know of LoRA weights (which layers, their
names, the merge, the PEFT folder) lives in `lm/lora_weights.py`.
"""
from __future__ import annotations

import contextlib
import math
import zlib

import torch

from lm.lora_weights import target_names


def initial_value(name: str, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    """An adapter's starting value (float32, CPU): A Kaiming-uniform as PEFT's (bound 1/sqrt(in)),
    B zeros. Depends on the seed, the name and the shape only."""
    if name.split(".")[-2] == "lora_B":
        return torch.zeros(shape)
    generator = torch.Generator().manual_seed((seed * 1_000_003 + zlib.crc32(name.encode())) % 2**63)
    bound = 1.0 / math.sqrt(shape[1])
    return torch.empty(shape).uniform_(-bound, bound, generator=generator)


def merges(model: torch.nn.Module) -> dict[str, tuple[str, str, float]]:
    """{weight name: (its A's name, its B's name, scale)} of the model's adapted layers ({} without
    LoRA): what a full-weight export merges (`learner.distributed.FullWeightBuckets`)."""
    found = {}
    for name, module in model.named_modules():
        if hasattr(module, "lora_scale"):
            found[f"{name}.weight"] = (f"{name}.lora_A.weight", f"{name}.lora_B.weight", module.lora_scale)
    return found


class LoraAdapters:
    """The adapters of one model (see the module doc). Construct before sharding: on a model on the
    meta device the adapters are made there too and take their values with the rest
    (`with_initial_values`); on a real device they start at `initial_value` at once."""

    def __init__(self, model: torch.nn.Module, config, seed: int):
        self.config, self.seed = config, seed
        self.scale = config.alpha / config.rank
        self.names = target_names(model, config.target_modules, config.exclude_modules)
        self.enabled = True
        self.shapes: dict[str, tuple[int, int]] = {}  # adapter name -> shape
        model.requires_grad_(False)
        for name in self.names:
            layer = model.get_submodule(name)
            weight = layer.weight
            dtype = torch.promote_types(weight.dtype, torch.float32)  # a bfloat16 W: float32 adapters
            for part, shape in (("lora_A", (config.rank, layer.in_features)),
                                ("lora_B", (layer.out_features, config.rank))):
                adapter = torch.nn.Linear(shape[1], shape[0], bias=False, device="meta", dtype=dtype)
                self.shapes[f"{name}.{part}.weight"] = shape
                if weight.device.type != "meta":
                    value = initial_value(f"{name}.{part}.weight", shape, seed)
                    adapter.weight = torch.nn.Parameter(value.to(device=weight.device, dtype=dtype))
                adapter.train(layer.training)
                setattr(layer, part, adapter)
            layer.lora_scale = self.scale
            layer.register_forward_hook(self._add_update)

    def _add_update(self, layer, args, output):
        if not self.enabled:
            return output
        x, lora_a = args[0], layer.lora_A  # A's dtype now: float32, or FSDP's bfloat16 gather (mixed precision)
        if not torch.is_autocast_enabled(x.device.type):  # under autocast the matmul casts x itself: no copy
            x = x.to(lora_a.weight.dtype)
        # the scale applied to the rank-wide A x ([tokens, r]), not to the layer-wide update ([tokens, out])
        update = layer.lora_B(lora_a(x) * self.scale)
        return output + update.to(output.dtype)

    @contextlib.contextmanager
    def disabled(self):
        """The base model's passes (the KL reference) through the same modules."""
        self.enabled = False
        try:
            yield
        finally:
            self.enabled = True

    def parameter_count(self) -> int:
        return sum(a * b for a, b in self.shapes.values())

    def with_initial_values(self, source):
        """`source` (tensors by name, for `learner.distributed.fill_shards`) with the adapters'
        starting values added."""
        return _WithAdapters(source, self.shapes, self.seed)


class _WithAdapters:
    def __init__(self, source, shapes: dict[str, tuple[int, int]], seed: int):
        self.source, self.shapes, self.seed = source, shapes, seed

    def __contains__(self, name: str) -> bool:
        return name in self.shapes or name in self.source

    def __getitem__(self, name: str) -> torch.Tensor:
        if name in self.shapes:
            return initial_value(name, self.shapes[name], self.seed)
        return self.source[name]
