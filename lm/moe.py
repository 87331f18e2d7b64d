"""Mixture-of-experts routers, found the same way by the engine that records routing and the
learner that replays it (`learner.routing_replay`).

A router here is transformers 5's top-k router module of an MoE block (`Qwen3MoeTopKRouter`,
`Qwen2MoeTopKRouter`, `OlmoeTopKRouter`, `MixtralTopKRouter`, ...): it maps the block's input
[tokens, hidden] to (router logits [tokens, E], top-k gate weights [tokens, k], top-k expert ids
[tokens, k]), softmax then top-k, renormalised when `norm_topk_prob` (Mixtral's always). Routers
are listed in module order, which is layer order: index l of a routing array is the l-th MoE layer
(dense layers of a mixed model have none).
"""
from __future__ import annotations

from typing import NamedTuple

import torch

# Router classes whose forward is softmax -> top-k -> (renormalise where norm_topk_prob), the same code
# in each: the replay recomputes their gate weights over forced experts exactly as they do (`replayed_gate`;
# tests/learner/test_moe.py checks each against its own forward).
SOFTMAX_TOPK_ROUTERS = ("Qwen3MoeTopKRouter", "Qwen2MoeTopKRouter", "OlmoeTopKRouter", "FlexOlmoTopKRouter",
                        "MixtralTopKRouter")
# those of them that renormalise their top k whatever the config says (they have no norm_topk_prob)
ALWAYS_RENORMALISING_ROUTERS = ("MixtralTopKRouter",)


class RoutingShape(NamedTuple):
    layers: int  # MoE layers (routers)
    top_k: int
    num_experts: int


def routers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The model's top-k routers in layer order ([] for a dense model)."""
    return [m for m in model.modules() if type(m).__name__.endswith("TopKRouter") and hasattr(m, "top_k")]


def routing_shape(model: torch.nn.Module) -> RoutingShape | None:
    """(MoE layers, k, experts) of the model, None for a dense one."""
    found = routers(model)
    if not found:
        return None
    return RoutingShape(len(found), int(found[0].top_k), int(found[0].num_experts))


def replayed_gate(router: torch.nn.Module, logits: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
    """The gate weights a softmax-then-top-k `router` gives `experts` [tokens, k] from its `logits`
    [tokens, E], in float32: the softmax over every expert at those experts, renormalised to sum 1
    where the router renormalises its top k (`norm_topk_prob`, or always)."""
    gate = torch.softmax(logits.float(), dim=-1).gather(-1, experts)
    if getattr(router, "norm_topk_prob", type(router).__name__ in ALWAYS_RENORMALISING_ROUTERS):
        gate = gate / gate.sum(-1, keepdim=True)
    return gate


def config_experts(config: dict) -> int | None:
    """The routed experts an HF config.json names (None: a dense model). transformers 5 writes
    Qwen-MoE's as `num_local_experts`, older configs `num_experts`, DeepSeek's family (GLM-4.5,
    Kimi, dots) `n_routed_experts`; a multimodal one under `text_config`."""
    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else {}
    for source in (config, text):
        for key in ("num_local_experts", "num_experts", "n_routed_experts"):
            if isinstance(source.get(key), int) and source[key] > 0:
                return source[key]
    return None

