"""The varlen attention (`learner.attn_implementation: varlen`, lm/packed_attention.py): each
sequence of a packed row attends to itself alone, from the row's boundaries, with no mask.

On the CPU the exact fallback runs. PyTorch's flash varlen kernel needs CUDA, which this machine
lacks: the adapter around it (dtype, GQA, head padding, the keywords of each torch release) is
checked against a stand-in kernel that computes what the flash kernel computes, per sequence."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from lm import packed_attention
from lm.packed_attention import _flash, _sequence_by_sequence, packed_attention_kwargs, varlen_attention


def _packed(lengths, heads=4, kv_heads=2, head_dim=16, seed=0, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    total = sum(lengths)
    q = torch.randn(1, heads, total, head_dim, generator=gen, dtype=dtype)
    k = torch.randn(1, kv_heads, total, head_dim, generator=gen, dtype=dtype)
    v = torch.randn(1, kv_heads, total, head_dim, generator=gen, dtype=dtype)
    positions = torch.cat([torch.arange(n) for n in lengths])[None]
    return q, k, v, positions


def test_the_boundaries_come_from_the_position_resets_filler_included():
    positions = torch.tensor([[0, 1, 2, 0, 1, 0, 0, 1, 2, 3]])  # rows of 3, 2, 1 and a filler block of 4
    kwargs = packed_attention_kwargs(positions, torch.device("cpu"))
    assert kwargs["cu_seq_lens_q"].tolist() == [0, 3, 5, 6, 10] and kwargs["cu_seq_lens_q"].dtype == torch.int32
    assert kwargs["max_length_q"] == kwargs["max_length_k"] == 4


def test_each_sequence_attends_to_itself_alone():
    lengths = [5, 1, 7, 3]
    q, k, v, positions = _packed(lengths)
    out, weights = varlen_attention(None, q, k, v, None, **packed_attention_kwargs(positions, q.device))
    assert weights is None and out.shape == (1, sum(lengths), 4, 16)
    start = 0
    for n in lengths:  # each sequence alone, as its own causal attention
        alone = F.scaled_dot_product_attention(q[:, :, start:start + n], k[:, :, start:start + n],
                                               v[:, :, start:start + n], is_causal=True, enable_gqa=True)
        assert torch.allclose(out[0, start:start + n], alone[0].transpose(0, 1), atol=1e-6)
        start += n
    with pytest.raises(ValueError, match="packed micro-batches"):
        varlen_attention(None, q, k, v, torch.ones(1, 1, 16, 16))
    with pytest.raises(ValueError, match="sliding window"):
        varlen_attention(None, q, k, v, None, sliding_window=4, **packed_attention_kwargs(positions, q.device))
    with pytest.raises(ValueError, match="softcap"):  # Gemma2's logit softcapping would be ignored: refused
        varlen_attention(None, q, k, v, None, softcap=30.0, **packed_attention_kwargs(positions, q.device))


def _stand_in(signature: str, calls: list):
    """What the flash varlen kernel computes, with the keywords of one torch release: 2.10 took
    is_causal; later ones window_size, scale and enable_gqa. It records what it was given."""
    def kernel(q, k, v, cu_q, cu_k, max_q, max_k, **kw):
        calls.append({"dtype": q.dtype, "head_dim": q.shape[-1], "kv_heads": k.shape[1], "cu": cu_q.dtype, **kw})
        assert q.shape[-1] % 8 == 0 and q.dtype in (torch.bfloat16, torch.float16) and torch.equal(cu_q, cu_k)
        assert kw.get("window_size", (-1, 0)) == (-1, 0) and kw.get("is_causal", True)
        gqa = kw.get("enable_gqa", False)
        assert gqa or q.shape[1] == k.shape[1]
        return _sequence_by_sequence(q, k, v, cu_q.tolist(), kw.get("scale")).to(q.dtype)

    if signature == "torch-2.10":
        return lambda q, k, v, cu_q, cu_k, max_q, max_k, *, is_causal=False: kernel(
            q, k, v, cu_q, cu_k, max_q, max_k, is_causal=is_causal)
    return lambda q, k, v, cu_q, cu_k, max_q, max_k, *, scale=None, window_size=(-1, -1), enable_gqa=False: kernel(
        q, k, v, cu_q, cu_k, max_q, max_k, window_size=window_size, scale=scale, enable_gqa=enable_gqa)


@pytest.mark.parametrize("signature", ["torch-2.10", "torch-2.13"])
@pytest.mark.parametrize("head_dim", [16, 12])  # 12: padded to 16 for the kernel
def test_the_flash_adapter_gives_the_kernel_what_it_takes(monkeypatch, signature, head_dim):
    import torch.nn.attention.varlen as varlen

    calls = []
    monkeypatch.setattr(varlen, "varlen_attn", _stand_in(signature, calls))
    lengths = [6, 2, 9]
    q, k, v, positions = _packed(lengths, head_dim=head_dim, dtype=torch.bfloat16)
    kwargs = packed_attention_kwargs(positions, q.device)
    cu, longest = kwargs["cu_seq_lens_q"], kwargs["max_length_q"]
    got = _flash(*(t[0].transpose(0, 1) for t in (q, k, v)), cu, longest, head_dim ** -0.5)
    want = _sequence_by_sequence(*(t[0].transpose(0, 1).float() for t in (q, k, v)), cu.tolist(), None)
    assert got.shape == (sum(lengths), 4, head_dim) and got.dtype == torch.bfloat16
    assert float((got.float() - want).abs().max()) < 0.05  # bfloat16 inputs and outputs
    (call,) = calls
    assert call["dtype"] == torch.bfloat16 and call["head_dim"] % 8 == 0 and call["cu"] == torch.int32
    assert call["kv_heads"] == (2 if signature == "torch-2.13" else 4)  # grouped heads expanded where unsupported
    with pytest.raises(ValueError, match="bfloat16 or float16"):  # float32 without autocast: no flash kernel
        _flash(*(t[0].transpose(0, 1).float() for t in (q, k, v)), cu, longest, None)


def test_a_model_computes_no_attention_across_sequences(tmp_path, monkeypatch):
    """A packed row through a real transformers model with attn_implementation="varlen": every
    attention call is one sequence's causal attention with no mask (sdpa would take one [W, W]
    mask and compute the whole row), and the log-probs are the padded path's."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "learner"))
    from learner_helpers import VOCAB, build_tiny_policy

    from lm.causal_lm import load_causal_lm, response_log_probs

    policy = build_tiny_policy(tmp_path / "policy", seed=3)
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(1, VOCAB, (n,), generator=gen).tolist() for n in (3, 8, 2)]
    responses = [torch.randint(1, VOCAB, (n,), generator=gen).tolist() for n in (6, 2, 9)]
    with torch.no_grad():
        want = response_log_probs(load_causal_lm(policy), prompts, responses)[0]
    calls = []
    sdpa = F.scaled_dot_product_attention

    def recorded(q, k, v, attn_mask=None, **kw):
        calls.append((q.shape[-2], attn_mask))
        return sdpa(q, k, v, attn_mask=attn_mask, **kw)

    monkeypatch.setattr(F, "scaled_dot_product_attention", recorded)
    model = load_causal_lm(policy, attn_implementation="varlen")
    with torch.no_grad():
        got = response_log_probs(model, prompts, responses, packed=True, pack_width=32)[0]
    assert float((got - want).abs().max()) < 2e-6
    layers = model.config.num_hidden_layers
    assert len(calls) == 4 * layers  # three rows and the filler block, in every layer
    assert all(mask is None for _, mask in calls)
    assert max(length for length, _ in calls) == 2 + 9  # the longest sequence, never the row's 32
