"""Weight names as checkpoints and engines have them, from the names a model has in memory: the
one home of that mapping (the learner's publication and saved policy, the transformers engine's
loads).

transformers 5 fuses an MoE block's experts in memory: `<block>.experts.gate_up_proj` [E, 2I, H]
(each expert's gate rows then its up rows) and `<block>.experts.down_proj` [E, H, I]. Checkpoints
(what `save_pretrained` writes) and engines (vLLM's loader, `expected_weights`) name each expert's
matrices: `<block>.experts.<e>.gate_proj.weight` [I, H], `.up_proj.weight` [I, H] and
`.down_proj.weight` [H, I]. Every other name is the same on both sides.
"""
from __future__ import annotations

import re
from collections.abc import Iterable, Mapping

import torch

_FUSED = re.compile(r"^(?P<prefix>.*\.experts)\.(?P<kind>gate_up_proj|down_proj)$")
_PER_EXPERT = re.compile(r"^(?P<prefix>.*\.experts)\.(?P<expert>\d+)\.(?P<part>gate_proj|up_proj|down_proj)\.weight$")


def checkpoint_items(name: str, tensor: torch.Tensor, copy: bool = False) -> list[tuple[str, torch.Tensor]]:
    """The checkpoint's (name, tensor) pairs of one in-memory tensor: itself, or a fused expert
    tensor cut into its experts' matrices (views of it, or with `copy` tensors of their own: a
    safetensors file refuses views of one storage)."""
    match = _FUSED.match(name)
    if match is None or tensor.dim() != 3:
        return [(name, tensor)]
    prefix, out = match["prefix"], []
    take = (lambda t: t.clone()) if copy else (lambda t: t)
    for expert in range(tensor.shape[0]):
        if match["kind"] == "down_proj":
            out.append((f"{prefix}.{expert}.down_proj.weight", take(tensor[expert])))
        else:
            gate, up = tensor[expert].chunk(2, dim=0)  # the forward's chunk(2, dim=-1) of the output
            out += [(f"{prefix}.{expert}.gate_proj.weight", take(gate)),
                    (f"{prefix}.{expert}.up_proj.weight", take(up))]
    return out


def to_checkpoint_names(state: Mapping[str, torch.Tensor], copy: bool = False) -> dict[str, torch.Tensor]:
    """A state dict under the checkpoint's names (a dense model's is returned as it is)."""
    if not any(_FUSED.match(name) for name in state):
        return dict(state)
    return {k: v for name, tensor in state.items() for k, v in checkpoint_items(name, tensor, copy)}


def checkpoint_shapes(shapes: Mapping[str, tuple[int, ...]]) -> dict[str, tuple[int, ...]]:
    """In-memory shapes by name as the checkpoint's shapes by name."""
    return {k: tuple(v.shape) for name, shape in shapes.items()
            for k, v in checkpoint_items(name, torch.empty(shape, device="meta"))}


def model_slot(state: Mapping[str, torch.Tensor], name: str) -> tuple[str, torch.Tensor]:
    """(in-memory name, the view of the model's tensor in `state`) that the checkpoint tensor `name`
    fills: the tensor itself, or one expert's matrix inside a fused one. KeyError if none."""
    if name in state:
        return name, state[name]
    match = _PER_EXPERT.match(name)
    if match is None:
        raise KeyError(name)
    expert, part = int(match["expert"]), match["part"]
    fused = f"{match['prefix']}.{'down_proj' if part == 'down_proj' else 'gate_up_proj'}"
    if fused not in state or expert >= state[fused].shape[0]:
        raise KeyError(name)
    target = state[fused][expert]
    if part != "down_proj":
        target = target.chunk(2, dim=0)[part == "up_proj"]
    return fused, target


def load_by_checkpoint_names(state: Mapping[str, torch.Tensor], weights: Iterable[tuple[str, torch.Tensor]]):
    """Copy (name, tensor) pairs under either naming into the model tensors of `state` (its
    state_dict: views of the parameters), as they come; yields each checkpoint name after its copy.
    A name the model lacks or a shape that differs is a ValueError naming it."""
    with torch.no_grad():
        for name, tensor in weights:
            try:
                _, target = model_slot(state, name)
            except KeyError:
                raise ValueError(f"weights do not fit the model: it has no tensor {name!r}") from None
            if tuple(tensor.shape) != tuple(target.shape):
                raise ValueError(f"weights do not fit the model: tensor {name!r} has shape {list(tensor.shape)}, "
                                 f"the model's is {list(target.shape)}")
            target.copy_(tensor)
            yield name
