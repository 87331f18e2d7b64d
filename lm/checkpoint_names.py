"""Weight names as checkpoints and engines have them, from the names a model has in memory: the
one home of that mapping (the learner's publication and saved policy, the transformers engine's
loads).

transformers 5 fuses an MoE block's experts in memory: `<block>.experts.gate_up_proj` [E, 2I, H]
(each expert's gate rows then its up rows) and `<block>.experts.down_proj` [E, H, I]. Checkpoints
(what `save_pretrained` writes) and engines (vLLM's loader, `expected_weights`) name each expert's
matrices: `<block>.experts.<e>.gate_proj.weight` [I, H], `.up_proj.weight` [I, H] and
`.down_proj.weight` [H, I]. Every other name is the same on both sides, except in families whose
checkpoints name the block and the matrices otherwise (`ExpertNaming`, by the config's model_type):
Mixtral's are `<layer>.block_sparse_moe.experts.<e>.w1.weight` (gate), `.w3` (up), `.w2` (down), its
router `<layer>.block_sparse_moe.gate.weight`, where memory has `<layer>.mlp.`; GPT-OSS's keep the
experts fused as memory has them. Towards checkpoints the caller names the model's naming; from
checkpoints any known naming is read.
"""
from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from typing import NamedTuple

import torch


class ExpertNaming(NamedTuple):
    """How a family's checkpoints name an MoE block (in memory `mlp`) and its experts' matrices, or
    that they keep the experts fused as memory does (`fused`)."""
    block: str
    gate: str
    up: str
    down: str
    fused: bool = False


PER_EXPERT = ExpertNaming("mlp", "gate_proj", "up_proj", "down_proj")  # Qwen-MoE, OLMoE, DeepSeek, GLM, ...
MIXTRAL = ExpertNaming("block_sparse_moe", "w1", "w3", "w2")  # as Mixtral's checkpoints and vLLM's loader have them
FUSED = ExpertNaming("mlp", "", "", "", fused=True)  # GPT-OSS's: gate_up_proj [E, H, 2I], interleaved, as is
_NAMING_BY_MODEL_TYPE = {"mixtral": MIXTRAL, "minimax": MIXTRAL, "minimax_m2": MIXTRAL, "gpt_oss": FUSED}
_OTHER_NAMINGS = tuple(n for n in dict.fromkeys(_NAMING_BY_MODEL_TYPE.values()) if not n.fused)
_PARTS = {n.gate: "gate_proj" for n in _OTHER_NAMINGS} | {n.up: "up_proj" for n in _OTHER_NAMINGS} | {
    n.down: "down_proj" for n in _OTHER_NAMINGS} | {p: p for p in ("gate_proj", "up_proj", "down_proj")}

_FUSED = re.compile(r"^(?P<prefix>.*\.experts)\.(?P<kind>gate_up_proj|down_proj)$")
_PER_EXPERT = re.compile(r"^(?P<prefix>.*\.experts)\.(?P<expert>\d+)\.(?P<part>" + "|".join(map(re.escape, _PARTS))
                         + r")\.weight$")


def expert_naming(config) -> ExpertNaming:
    """The naming of a model's checkpoints, by its config's model_type (a transformers config, or
    config.json as a dict)."""
    model_type = config.get("model_type") if isinstance(config, dict) else getattr(config, "model_type", None)
    return _NAMING_BY_MODEL_TYPE.get(model_type, PER_EXPERT)


def _checkpoint_block(name: str, naming: ExpertNaming) -> str:
    return name if naming.block == "mlp" else name.replace(".mlp.", f".{naming.block}.")


def checkpoint_items(name: str, tensor: torch.Tensor, copy: bool = False,
                     naming: ExpertNaming = PER_EXPERT) -> list[tuple[str, torch.Tensor]]:
    """The checkpoint's (name, tensor) pairs of one in-memory tensor: itself (renamed where the
    `naming` renames its block), or a fused expert tensor cut into its experts' matrices (views of
    it, or with `copy` tensors of their own: a safetensors file refuses views of one storage)."""
    match = _FUSED.match(name)
    if match is None or tensor.dim() != 3 or naming.fused:
        return [(_checkpoint_block(name, naming), tensor)]
    prefix, out = _checkpoint_block(match["prefix"], naming), []
    take = (lambda t: t.clone()) if copy else (lambda t: t)
    for expert in range(tensor.shape[0]):
        if match["kind"] == "down_proj":
            out.append((f"{prefix}.{expert}.{naming.down}.weight", take(tensor[expert])))
        else:
            gate, up = tensor[expert].chunk(2, dim=0)  # the forward's chunk(2, dim=-1) of the output
            out += [(f"{prefix}.{expert}.{naming.gate}.weight", take(gate)),
                    (f"{prefix}.{expert}.{naming.up}.weight", take(up))]
    return out


def to_checkpoint_names(state: Mapping[str, torch.Tensor], copy: bool = False,
                        naming: ExpertNaming = PER_EXPERT) -> dict[str, torch.Tensor]:
    """A state dict under the checkpoint's names (a dense model's is returned as it is)."""
    if naming == PER_EXPERT and not any(_FUSED.match(name) for name in state):
        return dict(state)
    return {k: v for name, tensor in state.items() for k, v in checkpoint_items(name, tensor, copy, naming)}


def checkpoint_shapes(shapes: Mapping[str, tuple[int, ...]],
                      naming: ExpertNaming = PER_EXPERT) -> dict[str, tuple[int, ...]]:
    """In-memory shapes by name as the checkpoint's shapes by name."""
    return {k: tuple(v.shape) for name, shape in shapes.items()
            for k, v in checkpoint_items(name, torch.empty(shape, device="meta"), naming=naming)}


def model_slot(state: Mapping[str, torch.Tensor], name: str) -> tuple[str, torch.Tensor]:
    """(in-memory name, the view of the model's tensor in `state`) that the checkpoint tensor `name`
    (under any known naming) fills: the tensor itself, or one expert's matrix inside a fused one.
    KeyError if none."""
    if name in state:
        return name, state[name]
    for naming in _OTHER_NAMINGS:  # the block as memory names it
        name = name.replace(f".{naming.block}.", ".mlp.")
    if name in state:
        return name, state[name]
    match = _PER_EXPERT.match(name)
    if match is None:
        raise KeyError(name)
    expert, part = int(match["expert"]), _PARTS[match["part"]]
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
