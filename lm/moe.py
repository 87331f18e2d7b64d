"""Mixture-of-experts routers, found the same way by the engine that records routing and the
learner that replays it (`learner.routing_replay`).

A router here is transformers 5's top-k router module of an MoE block whose forward maps the
block's input [tokens, hidden] to (router logits [tokens, E], top-k gate weights [tokens, k], top-k
expert ids [tokens, k]) and whose gate weights are one of the functions of the logits at the
chosen experts that `replayed_gate` recomputes (`ROUTER_GATES`). Routers are listed in module
order, which is layer order: index l of a routing array is the l-th MoE layer (dense layers of a
mixed model have none). Routers of other classes (another output, another gate) are not routers
here: their engine records no routing and the learner does not replay them, saying so.
"""
from __future__ import annotations

from typing import NamedTuple

import torch

SOFTMAX = "softmax"  # softmax over every expert, at the top k; renormalised where the router's norm_topk_prob
SOFTMAX_RENORMALISED = "softmax, renormalised"  # the same, always renormalised (GPT-OSS: softmax of the top k)
SIGMOID = "sigmoid"  # DeepSeek-V3's: each expert's sigmoid at the top k (chosen with a correction bias, in
# the best groups), renormalised where norm_topk_prob, times routed_scaling_factor
SIGMOID_RENORMALISED = "sigmoid, renormalised"  # MiniMax-M2's: the top k's sigmoids (chosen with a bias), to sum 1

# Router classes by how their gate weights come from their logits: the replay recomputes them over
# forced experts exactly as the router does (tests/learner/test_moe.py checks each against its own forward).
ROUTER_GATES = {
    "Qwen2MoeTopKRouter": SOFTMAX, "Qwen3MoeTopKRouter": SOFTMAX, "Qwen3NextTopKRouter": SOFTMAX,
    "OlmoeTopKRouter": SOFTMAX, "FlexOlmoTopKRouter": SOFTMAX,
    "MixtralTopKRouter": SOFTMAX_RENORMALISED, "MiniMaxTopKRouter": SOFTMAX_RENORMALISED,
    "Qwen3_5MoeTopKRouter": SOFTMAX_RENORMALISED, "Qwen3VLMoeTextTopKRouter": SOFTMAX_RENORMALISED,
    "GptOssTopKRouter": SOFTMAX_RENORMALISED,
    "DeepseekV3TopkRouter": SIGMOID, "DeepseekV32TopkRouter": SIGMOID, "Glm4MoeTopkRouter": SIGMOID,
    "Glm4MoeLiteTopkRouter": SIGMOID, "Dots1TopkRouter": SIGMOID, "KimiLinearTopkRouter": SIGMOID,
    "ExaoneMoeTopkRouter": SIGMOID, "SolarOpenTopkRouter": SIGMOID, "MiniMaxM2TopKRouter": SIGMOID_RENORMALISED,
}


class RoutingShape(NamedTuple):
    layers: int  # MoE layers (routers)
    top_k: int
    num_experts: int


def routers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The model's top-k routers of a known class (`ROUTER_GATES`) in layer order ([] for a dense model)."""
    return [m for m in model.modules() if type(m).__name__ in ROUTER_GATES]


def other_routers(model: torch.nn.Module) -> list[str]:
    """The class names of the model's router modules that are not known routers."""
    return sorted({type(m).__name__ for m in model.modules()
                   if type(m).__name__.lower().endswith("router") and type(m).__name__ not in ROUTER_GATES})


def routing_shape(model: torch.nn.Module) -> RoutingShape | None:
    """(MoE layers, k, experts) of the model, None for a dense one (or one without known routers)."""
    found = routers(model)
    if not found:
        return None
    return RoutingShape(len(found), int(found[0].top_k), int(found[0].num_experts))


def replayed_gate(router: torch.nn.Module, logits: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
    """The gate weights `router` gives `experts` [tokens, k] from its `logits` [tokens, E], in
    float32, computed as its class computes them (`ROUTER_GATES`)."""
    kind = ROUTER_GATES[type(router).__name__]
    if kind in (SIGMOID, SIGMOID_RENORMALISED):
        gate = logits.float().sigmoid().gather(-1, experts)
        if kind == SIGMOID_RENORMALISED:
            return gate / gate.sum(-1, keepdim=True)
        if router.norm_topk_prob:
            gate = gate / (gate.sum(-1, keepdim=True) + 1e-20)
        return gate * router.routed_scaling_factor
    gate = torch.softmax(logits.float(), dim=-1).gather(-1, experts)
    if kind == SOFTMAX_RENORMALISED or getattr(router, "norm_topk_prob", False):
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

