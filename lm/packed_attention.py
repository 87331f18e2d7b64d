"""Variable-length attention for packed micro-batches: `learner.attn_implementation: varlen`.

A packed micro-batch is one row of many sequences (`lm.causal_lm.pack_sequences`). transformers'
sdpa reads the sequences from the position resets and builds a block-diagonal [W, W] mask, and
the kernel then computes the whole W x W attention, masked blocks included: at a 16k-token budget
that is as many attention FLOPs as the model's own matmuls, most of them thrown away. This
attention, registered with transformers under the name `varlen`, takes the sequences' boundaries
instead (`cu_seq_lens_q/_k`, `max_length_q/_k`: the keywords transformers' packed flash attention
reads) and computes each sequence's causal attention alone:

- on CUDA, PyTorch's own flash kernel over the cumulative lengths (`torch.nn.attention.varlen.
  varlen_attn`; no flash-attn package needed), in the autocast dtype (flash computes in bfloat16 or
  float16: with float32 weights it needs `learner.mixed_precision: bfloat16`);
- elsewhere, the exact fallback: each sequence's causal sdpa in turn (the CPU suite's reference).

No mask is built (transformers builds none for an attention it does not know). The boundaries come
from the packed row's positions (`packed_attention_kwargs`), so the filler block of a shape bucket
is a sequence of its own, as it is for sdpa.
"""
from __future__ import annotations

import inspect

import torch
import torch.nn.functional as F

NAME = "varlen"


def register() -> None:
    """Make `attn_implementation="varlen"` known to transformers (idempotent)."""
    from transformers import AttentionInterface

    AttentionInterface.register(NAME, varlen_attention)


def flash_varlen_available() -> bool:
    """Whether this torch has the flash varlen kernel (torch >= 2.10; etarl allows 2.9)."""
    from importlib.util import find_spec

    return find_spec("torch.nn.attention.varlen") is not None


def uses_varlen(model) -> bool:
    return getattr(getattr(model, "config", None), "_attn_implementation", None) == NAME


def packed_attention_kwargs(position_ids: torch.Tensor, device: torch.device) -> dict:
    """The packed row's sequences, where its positions restart at 0, as transformers' packed
    attention keywords: cumulative lengths (int32, on `device`) and the longest length."""
    positions = position_ids.reshape(-1)
    starts = torch.nonzero(positions == 0).flatten()
    cu = torch.cat([starts, torch.tensor([positions.numel()])]).to(torch.int32)
    longest = int((cu[1:] - cu[:-1]).max())
    cu = cu.to(device)
    return {"cu_seq_lens_q": cu, "cu_seq_lens_k": cu, "max_length_q": longest, "max_length_k": longest}


def varlen_attention(module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     attention_mask: torch.Tensor | None, scaling: float | None = None, dropout: float = 0.0,
                     sliding_window: int | None = None, cu_seq_lens_q: torch.Tensor | None = None,
                     cu_seq_lens_k: torch.Tensor | None = None, max_length_q: int | None = None,
                     max_length_k: int | None = None, **kwargs) -> tuple[torch.Tensor, None]:
    """transformers' attention interface: query [B, Hq, T, D], key and value [B, Hkv, T, D] ->
    ([B, T, Hq, D], no weights). Causal within each sequence of the packed row (B = 1), or, with
    no boundaries given and no mask, within each whole row."""
    if attention_mask is not None:
        raise ValueError("attn_implementation 'varlen' runs packed micro-batches (learner.packing: true), "
                         "not padded rows with a mask")
    unsupported = {k: v for k, v in kwargs.items() if k in ("softcap", "s_aux") and v is not None}
    if sliding_window is not None or dropout or unsupported:
        raise ValueError(f"attn_implementation 'varlen' has no sliding window ({sliding_window}), attention "
                         f"dropout ({dropout}) or {sorted(unsupported) or 'logit softcap / attention sinks'}; "
                         "use sdpa for this model")
    if cu_seq_lens_q is None:
        out = F.scaled_dot_product_attention(query, key, value, is_causal=True, scale=scaling,
                                             enable_gqa=query.shape[1] != key.shape[1])
        return out.transpose(1, 2).contiguous(), None
    if query.shape[0] != 1:
        raise ValueError(f"a packed micro-batch is one row; got {query.shape[0]}")
    if cu_seq_lens_k is not cu_seq_lens_q and not torch.equal(cu_seq_lens_q, cu_seq_lens_k):  # no sync per call
        raise ValueError("varlen attention here is self-attention: the query and key boundaries must match")
    q, k, v = (t[0].transpose(0, 1) for t in (query, key, value))  # [T, H, D]
    if q.is_cuda:
        out = _flash(q, k, v, cu_seq_lens_q, int(max_length_q), scaling)
    else:
        out = _sequence_by_sequence(q, k, v, cu_seq_lens_q.tolist(), scaling)
    return out.unsqueeze(0), None


def _sequence_by_sequence(q, k, v, cu: list[int], scaling: float | None) -> torch.Tensor:
    """The exact fallback: each sequence's causal attention on its own, [T, Hq, D]."""
    gqa = q.shape[1] != k.shape[1]
    parts = []
    for start, end in zip(cu[:-1], cu[1:]):
        qs, ks, vs = (t[start:end].transpose(0, 1) for t in (q, k, v))  # [H, L, D]
        parts.append(F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=scaling,
                                                    enable_gqa=gqa).transpose(0, 1))
    return torch.cat(parts)


def _flash(q, k, v, cu: torch.Tensor, longest: int, scaling: float | None) -> torch.Tensor:
    """PyTorch's flash varlen kernel, [T, Hq, D] in the compute dtype. Its keywords changed over
    releases (torch 2.10: is_causal; later: window_size, scale, enable_gqa): read from its signature."""
    from torch.nn.attention.varlen import varlen_attn

    dtype = torch.get_autocast_dtype("cuda") if torch.is_autocast_enabled("cuda") else q.dtype
    if dtype not in (torch.bfloat16, torch.float16):
        raise ValueError(f"attn_implementation 'varlen' on CUDA computes in bfloat16 or float16 (flash kernels), "
                         f"not {dtype}: set learner.mixed_precision=bfloat16 (or learner.dtype=bfloat16)")
    # Autocast does not reach a custom op, and RoPE leaves q and k in the residual stream's float32.
    q, k, v = (t.to(dtype) for t in (q, k, v))
    params = inspect.signature(varlen_attn).parameters
    extra: dict = {"window_size": (-1, 0)} if "window_size" in params else {"is_causal": True}
    head_dim = q.shape[-1]
    if scaling is not None and abs(scaling - head_dim ** -0.5) > 1e-12:
        if "scale" not in params:
            raise ValueError(f"this torch's varlen_attn has no scale argument; the model scales by {scaling}")
        extra["scale"] = scaling
    if q.shape[1] != k.shape[1]:
        if "enable_gqa" in params:
            extra["enable_gqa"] = True
        else:  # query head h reads key head h // group, as transformers' repeat_kv arranges them
            group = q.shape[1] // k.shape[1]
            k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    pad = -head_dim % 8  # flash kernels take head dims in multiples of 8
    if pad:  # zeros add nothing to q.k; the scale must stay the unpadded dim's
        wanted = head_dim ** -0.5 if scaling is None else scaling
        if "scale" in params:
            extra["scale"] = wanted
        else:
            q = q * (wanted * (head_dim + pad) ** 0.5)
        q, k, v = (F.pad(t, (0, pad)) for t in (q, k, v))
    out = varlen_attn(q, k, v, cu, cu, longest, longest, **extra)
    return out[..., :head_dim] if pad else out
