"""LoRA adapters as weights, what the learner and the engines both read: which linear layers LoRA
adapts (PEFT's matching), an adapter's names, a version of adapters checked against a model, the
merge W + scale · B A, and the PEFT folder (what vLLM's `LoRARequest` and `PeftModel` load).

An adapted layer `<layer>` (weight W [out, in]) has `<layer>.lora_A.weight` (A [r, in]) and
`<layer>.lora_B.weight` (B [out, r]); its output is W x + scale · B A x, scale = alpha / r.
"""
from __future__ import annotations

import json
import re
from pathlib import Path

import torch

ADAPTER_PARTS = ("lora_A", "lora_B")


def is_adapter_name(name: str) -> bool:
    """Whether a state-dict name is an adapter's (`<layer>.lora_A.weight`, `<layer>.lora_B.weight`)."""
    parts = name.split(".")
    return len(parts) >= 3 and parts[-1] == "weight" and parts[-2] in ADAPTER_PARTS


def target_names(model: torch.nn.Module, target_modules, exclude_modules=()) -> list[str]:
    """The linear layers LoRA adapts, by module name, as PEFT picks them: "all-linear" is every
    `nn.Linear` but the output layer (the LM head); a list names modules by their last name parts
    ("q_proj" is every `*.q_proj`); any other string is a regular expression the whole name
    matches. `exclude_modules` (a list or a regular expression) takes names back out. MoE routers
    and fused experts are not `nn.Linear`: they stay frozen."""
    output = model.get_output_embeddings()
    linear = [name for name, m in model.named_modules()
              if isinstance(m, torch.nn.Linear) and m is not output and not name.endswith(ADAPTER_PARTS)]
    picked = [name for name in linear if target_modules == "all-linear" or _matches(name, target_modules)]
    picked = [name for name in picked if not (exclude_modules and _matches(name, exclude_modules))]
    if not picked:
        examples = sorted({name.rsplit(".", 1)[-1] for name in linear})
        hint = (f" (a string is one regular expression of a whole name: several names are a list, "
                f"[{target_modules}])" if isinstance(target_modules, str) and "," in target_modules else "")
        raise ValueError(f"learner.lora.target_modules {target_modules!r} (less exclude_modules {exclude_modules!r}) "
                         f"picks none of {type(model).__name__}'s linear layers; their names end in {examples}{hint}")
    return picked


def _matches(name: str, pattern) -> bool:
    if isinstance(pattern, str):
        return re.fullmatch(pattern, name) is not None
    return any(name == p or name.endswith("." + p) for p in pattern)


def target_shapes(model: torch.nn.Module, target_modules, exclude_modules=()) -> dict[str, tuple[int, int]]:
    """{layer: (out, in)} of the layers `target_names` picks (a model on the meta device will do)."""
    return {name: (model.get_submodule(name).out_features, model.get_submodule(name).in_features)
            for name in target_names(model, target_modules, exclude_modules)}


def adapter_shapes(layers: dict[str, tuple[int, int]], rank: int) -> dict[str, tuple[int, int]]:
    """{adapter name: shape} of rank-`rank` adapters on `layers` ({layer: (out, in)})."""
    return {f"{layer}.{part}.weight": shape for layer, (out_features, in_features) in layers.items()
            for part, shape in (("lora_A", (rank, in_features)), ("lora_B", (out_features, rank)))}


def merged_weight(weight: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor, scale: float,
                  dtype: torch.dtype | None = None) -> torch.Tensor:
    """W + scale · B A, computed in float32 at least, rounded once to `dtype` (default W's)."""
    compute = torch.promote_types(weight.dtype, torch.float32)
    delta = lora_b.to(device=weight.device, dtype=compute) @ lora_a.to(device=weight.device, dtype=compute)
    return (weight.to(compute) + scale * delta).to(dtype or weight.dtype)


def adapter_layers(version: int, weights, layers: dict[str, tuple[int, int]], rank: int
                   ) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """A version sent as adapters ((name, tensor) pairs), checked against the adapted `layers`
    ({layer: (out, in)}) and `rank`: {layer: (A, B)}, every layer's pair present with its shapes, no
    other name. ValueError naming the first tensor that does not fit (the engine keeps its weights)."""
    found: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in weights:
        if not is_adapter_name(name):
            raise ValueError(f"weights v{version}: {name!r} is not a LoRA adapter's tensor, and this engine takes "
                             f"each version as adapters (learner.lora.publish=adapter)")
        layer, part, _ = name.rsplit(".", 2)
        if layer not in layers:
            raise ValueError(f"weights v{version}: {name!r} adapts {layer!r}, which is not one of the "
                             f"{len(layers)} layers learner.lora adapts here")
        out_features, in_features = layers[layer]
        want = (rank, in_features) if part == "lora_A" else (out_features, rank)
        if tuple(tensor.shape) != want:
            raise ValueError(f"weights v{version}: {name!r} has shape {tuple(tensor.shape)}, expected {want} "
                             f"(rank {rank}, layer {out_features} x {in_features})")
        found.setdefault(layer, {})[part] = tensor
    missing = [f"{layer}.{part}.weight" for layer in layers for part in ADAPTER_PARTS
               if part not in found.get(layer, {})]
    if missing:
        raise ValueError(f"weights v{version}: adapters missing: {missing[:4]} ({len(missing)} in all)")
    return {layer: (found[layer]["lora_A"], found[layer]["lora_B"]) for layer in layers}


def peft_target_modules(model: torch.nn.Module | None, layers: list[str]):
    """PEFT's `target_modules` for exactly `layers`: their last names where those pick exactly these
    layers of `model` (always, without a model to check against), else a regular expression of their
    names."""
    suffixes = sorted({name.rsplit(".", 1)[-1] for name in layers})
    if model is None or target_names(model, suffixes) == list(layers):
        return suffixes
    return "^(" + "|".join(re.escape(n) for n in layers) + ")$"


def write_peft_folder(folder: str | Path, adapters: dict[str, torch.Tensor], rank: int, alpha: float,
                      target_modules, base_model: str | Path) -> Path:
    """`adapters` ({`<layer>.lora_A.weight`: tensor, ...}) as a PEFT folder over `base_model`:
    adapter_model.safetensors under PEFT's names (`base_model.model.<layer>.lora_A.weight`) and
    adapter_config.json."""
    from safetensors.torch import save_file

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    stored = {f"base_model.model.{name}": tensor.contiguous() for name, tensor in adapters.items()}
    config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": str(Path(base_model).resolve()),
              "r": rank, "lora_alpha": alpha, "target_modules": target_modules,
              "lora_dropout": 0.0, "bias": "none", "fan_in_fan_out": False, "inference_mode": True,
              "init_lora_weights": True, "use_rslora": False, "use_dora": False, "modules_to_save": None}
    save_file(stored, str(folder / "adapter_model.safetensors"), metadata={"format": "pt"})
    (folder / "adapter_config.json").write_text(json.dumps(config, indent=1), encoding="utf-8")
    return folder
