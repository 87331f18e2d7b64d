"""lm/: log-probs of given tokens (the chunked LM head, its gradients and its memory), gradient
checkpointing, model-folder checks and weight payload round trips."""
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from lm.causal_lm import (
    chunked_token_log_probs,
    check_model_dir,
    enable_gradient_checkpointing,
    load_causal_lm,
    pad_sequences,
    response_log_probs,
)
from lm.weight_sync import WeightStore, load_weights_folder, resolve_weights, save_weights_folder


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    config = Qwen2Config(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
    )
    folder = tmp_path_factory.mktemp("model")
    Qwen2ForCausalLM(config).save_pretrained(folder)
    return folder


def test_response_log_probs_match_a_manual_forward_pass(model_dir):
    model = load_causal_lm(model_dir)
    prompts, responses = [[1, 2, 3], [4, 5]], [[6, 7], [8, 9, 10]]
    with torch.no_grad():
        lp, mask = response_log_probs(model, prompts, responses, temperature=0.7)
        assert mask.tolist() == [[1, 1, 0], [1, 1, 1]]
        for row, (p, r) in enumerate(zip(prompts, responses)):
            logits = model(torch.tensor([p + r])).logits[0].float() / 0.7
            want = torch.log_softmax(logits, -1)[len(p) - 1 : len(p) + len(r) - 1]
            want = want.gather(-1, torch.tensor(r)[:, None]).squeeze(-1)
            torch.testing.assert_close(lp[row, : len(r)], want, atol=1e-5, rtol=1e-5)
            assert torch.all(lp[row, len(r):] == 0)


VOCAB = 40  # not the hidden size: tensors of width VOCAB are logits
PROMPTS, RESPONSES = [[1, 2, 3], [4, 5], [9], [7, 8]], [[6, 7], [8, 9, 10, 11], [], [3, 3, 3]]


def full_vocab_log_probs(model, prompts, responses, temperature):
    """The former implementation, kept as the reference: float32 [B, L, V] logits, a row-by-row
    log-softmax, entropy from the full distribution."""
    input_ids, attention, _, width = pad_sequences(prompts, responses)
    logits = model(input_ids=input_ids, attention_mask=attention).logits
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32)) / temperature  # float64 stays float64
    log_probs = torch.zeros(len(prompts), width, dtype=logits.dtype)
    entropies = torch.zeros_like(log_probs)
    for row, (p, r) in enumerate(zip(prompts, responses)):
        log_dist = torch.log_softmax(logits[row, len(p) - 1 : len(p) + len(r) - 1], -1)
        log_probs[row, : len(r)] = log_dist.gather(-1, torch.tensor(r, dtype=torch.long)[:, None]).squeeze(-1)
        entropies[row, : len(r)] = -(log_dist.exp() * log_dist).sum(-1)
    return log_probs, entropies


def gradients(model, loss) -> dict[str, torch.Tensor]:
    model.zero_grad(set_to_none=True)
    loss.backward()
    return {name: p.grad.clone() for name, p in model.named_parameters()}


@pytest.mark.parametrize("chunk", [1, 3, 1024])
def test_chunked_log_probs_and_entropy_equal_the_full_log_softmax(model_dir, chunk):
    """Same values to 1e-6 in float32 and the same gradients, through log-probs and entropy both."""
    model = load_causal_lm(model_dir)
    weights = torch.randn(len(PROMPTS), 4, generator=torch.Generator().manual_seed(0))

    def loss(lp, ent):
        return (lp * weights).sum() + (ent * weights.flip(0)).sum()

    lp, mask, ent = response_log_probs(model, PROMPTS, RESPONSES, temperature=0.7, with_entropy=True,
                                       chunk_tokens=chunk)
    want_lp, want_ent = full_vocab_log_probs(model, PROMPTS, RESPONSES, 0.7)
    assert lp.dtype == ent.dtype == torch.float32 and mask.tolist()[2] == [0, 0, 0, 0]
    torch.testing.assert_close(lp, want_lp, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(ent, want_ent, atol=1e-6, rtol=1e-6)
    got, want = gradients(model, loss(lp, ent)), gradients(model, loss(want_lp, want_ent))
    for name in want:
        torch.testing.assert_close(got[name], want[name], atol=1e-5, rtol=1e-5, msg=name)

    # In float64 the two agree to rounding: the chunked backward is the same derivative.
    model64 = load_causal_lm(model_dir, dtype="float64")
    lp, _, ent = response_log_probs(model64, PROMPTS, RESPONSES, temperature=0.7, with_entropy=True,
                                    chunk_tokens=chunk)
    got = gradients(model64, loss(lp, ent))
    want = gradients(model64, loss(*full_vocab_log_probs(model64, PROMPTS, RESPONSES, 0.7)))
    assert max(float((got[k] - want[k]).abs().max()) for k in want) < 1e-12


@pytest.mark.parametrize("chunk", [1, 3, 1024])
def test_the_head_gives_each_tokens_sum_of_squared_probabilities_without_changing_the_rest(model_dir, chunk):
    """optimal_token_baseline's Σ_v p_v² of the tempered next-token distribution, next to the
    log-probs and entropy (unchanged), padded with zeros, carrying no gradient."""
    model = load_causal_lm(model_dir)
    lp, mask, ent, squares = response_log_probs(model, PROMPTS, RESPONSES, temperature=0.7, with_entropy=True,
                                                chunk_tokens=chunk, with_sum_pi_squared=True)
    want_lp, want_ent = full_vocab_log_probs(model, PROMPTS, RESPONSES, 0.7)
    input_ids, attention, _, width = pad_sequences(PROMPTS, RESPONSES)
    probs = torch.softmax(model(input_ids=input_ids, attention_mask=attention).logits / 0.7, -1)
    want = torch.zeros(len(PROMPTS), width)
    for row, (p, r) in enumerate(zip(PROMPTS, RESPONSES)):
        want[row, : len(r)] = probs[row, len(p) - 1 : len(p) + len(r) - 1].square().sum(-1)
    torch.testing.assert_close(squares, want, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(lp, want_lp, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(ent, want_ent, atol=1e-6, rtol=1e-6)
    assert not squares.requires_grad and lp.requires_grad
    lp_only, _, squares_only = response_log_probs(model, PROMPTS, RESPONSES, temperature=0.7, chunk_tokens=chunk,
                                                  with_sum_pi_squared=True)
    assert torch.equal(squares_only, squares) and torch.equal(lp_only, lp)


def test_the_chunked_head_passes_gradcheck_with_a_bias():
    gen = torch.Generator().manual_seed(1)
    hidden = torch.randn(5, 4, dtype=torch.float64, generator=gen, requires_grad=True)
    weight = torch.randn(7, 4, dtype=torch.float64, generator=gen, requires_grad=True)
    bias = torch.randn(7, dtype=torch.float64, generator=gen, requires_grad=True)
    targets = torch.tensor([0, 6, 3, 3, 1])

    def head(h, w, b):
        lp, ent = chunked_token_log_probs(h, w, b, targets, temperature=1.3, chunk_tokens=2, with_entropy=True)
        return lp, ent

    assert torch.autograd.gradcheck(head, (hidden, weight, bias))
    # Entropy reported only: no gradient flows through it.
    _, ent = chunked_token_log_probs(hidden, weight, bias, targets, with_entropy=True, entropy_grad=False)
    assert not ent.requires_grad


class LargestVocabTensor(TorchDispatchMode):
    """Records the largest tensor with a vocabulary-sized last dimension made by any op (the
    [vocab, hidden] weight and its gradient aside)."""

    def __init__(self, vocab: int):
        super().__init__()
        self.vocab, self.largest = vocab, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func.is_view:  # a view (the weight's transpose) allocates nothing
            return out
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(t, torch.Tensor) and t.dim() >= 2 and t.shape[-1] == self.vocab and t.shape[0] != self.vocab:
                self.largest = max(self.largest, t.numel())
        return out


def test_no_pass_holds_more_than_a_chunk_of_logits(model_dir):
    """Forward and backward: nothing of shape [..., vocab] is bigger than chunk x vocab (the full
    logits would be rows x length x vocab, 4 x 7 x 40 here)."""
    model = load_causal_lm(model_dir)
    with LargestVocabTensor(VOCAB) as seen:
        lp, _, ent = response_log_probs(model, PROMPTS, RESPONSES, with_entropy=True, chunk_tokens=2)
        (lp.sum() + ent.sum()).backward()
    assert 0 < seen.largest <= 2 * VOCAB


def test_bad_inputs_name_what_is_wrong(model_dir):
    model = load_causal_lm(model_dir)
    with pytest.raises(ValueError, match="2 prompts but 1 responses"):
        response_log_probs(model, [[1], [2]], [[3]])
    with pytest.raises(ValueError, match="row 1 has a response but an empty prompt"):
        response_log_probs(model, [[1], []], [[3], [4]])
    with pytest.raises(ValueError, match="chunk_tokens must be >= 1"):
        response_log_probs(model, [[1]], [[3]], chunk_tokens=0)
    with pytest.raises(ValueError, match="zero prompts"):
        pad_sequences([], [])


def test_gradient_checkpointing_recomputes_each_layer_with_the_same_gradients(tmp_path):
    """A layer runs twice per forward+backward (the recompute), dropout stays off (the model has
    attention dropout 0.5: checkpointed passes are deterministic) and gradients are unchanged."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    Qwen2ForCausalLM(Qwen2Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                 num_attention_heads=4, num_key_value_heads=2, attention_dropout=0.5)
                     ).save_pretrained(tmp_path)
    plain, checkpointed = load_causal_lm(tmp_path, dtype="float64").eval(), load_causal_lm(tmp_path, dtype="float64").eval()
    enable_gradient_checkpointing(checkpointed)
    calls = []
    # A pre-hook: the recompute stops as soon as the last saved tensor is back, before the
    # MLP would finish.
    checkpointed.model.layers[0].mlp.register_forward_pre_hook(lambda *_: calls.append(1))

    lp, _ = response_log_probs(checkpointed, PROMPTS, RESPONSES)
    again, _ = response_log_probs(checkpointed, PROMPTS, RESPONSES)
    got = gradients(checkpointed, lp.sum())
    assert len(calls) == 3  # two forwards, one recompute in the backward
    assert torch.equal(lp, again)
    want = gradients(plain, response_log_probs(plain, PROMPTS, RESPONSES)[0].sum())
    assert max(float((got[k] - want[k]).abs().max()) for k in want) < 1e-12


class OpCounter(TorchDispatchMode):
    """Counts the matmuls and attention kernels that run (a selective checkpoint's recompute hands
    back the kept outputs without running them)."""

    def __init__(self):
        super().__init__()
        self.matmuls = self.attention = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        self.matmuls += name in ("mm", "addmm")
        self.attention += name.startswith("_scaled_dot_product") and not name.endswith("_backward")
        return func(*args, **(kwargs or {}))


def test_selective_checkpointing_recomputes_only_the_elementwise_work_with_the_same_gradients(model_dir):
    """full re-runs every matmul and attention of the layers in the backward; selective keeps their
    outputs: the same matmul and attention count as no checkpointing, and the same gradients
    (bit for bit: the kept outputs are the forward's). Switching back to full works."""
    want = None
    counts = {}
    for mode in (None, "full", "selective", "full"):
        model = load_causal_lm(model_dir, dtype="float64").eval()
        if mode:
            enable_gradient_checkpointing(model, mode)
        with OpCounter() as counter:
            grads = gradients(model, response_log_probs(model, PROMPTS, RESPONSES)[0].sum())
        counts[mode] = (counter.matmuls, counter.attention)
        want = want or grads
        assert all(torch.equal(grads[k], want[k]) for k in want), mode
    # q, k, v, o, gate, up in each of the 2 layers: the recompute stops once the last tensor the
    # backward needs is back, before down_proj would run
    layer_matmuls = 6 * 2
    assert counts["selective"] == counts[None]
    assert counts["full"] == (counts[None][0] + layer_matmuls, counts[None][1] + 2)
    with pytest.raises(ValueError, match="'full' or 'selective'"):
        enable_gradient_checkpointing(model, "some")
    # The flash varlen op the packed learner runs on GPUs is among the kept ones (its name is found
    # in this torch: a rename would make selective re-run the GPU's attention, silently slower).
    from lm import causal_lm

    assert "torch_attn._varlen_attn.default" in {str(op) for op in causal_lm._kept_ops()}


def test_bf16_autocast_keeps_float32_log_probs_and_weights(model_dir):
    model = load_causal_lm(model_dir)
    want, _ = response_log_probs(model, PROMPTS, RESPONSES)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        lp, _ = response_log_probs(model, PROMPTS, RESPONSES, chunk_tokens=3)
    grads = gradients(model, lp.sum())
    assert lp.dtype == torch.float32 and all(g.dtype == torch.float32 for g in grads.values())
    assert 0 < float((lp - want).detach().abs().max()) < 0.1  # bf16 compute: close, not equal


def test_pad_sequences_shapes():
    ids, attention, mask, width = pad_sequences([[1], [2, 3]], [[4, 5, 6], [7]], pad_id=0)
    assert ids.tolist() == [[1, 4, 5, 6], [2, 3, 7, 0]]
    assert attention.tolist() == [[1, 1, 1, 1], [1, 1, 1, 0]]
    assert width == 3 and mask.tolist() == [[1, 1, 1], [1, 0, 0]]


def test_missing_model_folder_says_which_path(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        check_model_dir(tmp_path / "nope")
    with pytest.raises(FileNotFoundError, match="no config.json"):
        check_model_dir(tmp_path)


def test_weights_folder_round_trip_and_store(model_dir, tmp_path):
    state = load_causal_lm(model_dir).state_dict()
    folder = save_weights_folder(state, tmp_path / "v000003", version=3)
    version, loaded = load_weights_folder(folder)
    assert version == 3 and set(loaded) == set(state)
    assert all(torch.equal(loaded[k], state[k]) for k in state)
    again = resolve_weights({"version": 3, "kind": "folder", "path": str(folder)})
    assert torch.equal(again["model.embed_tokens.weight"], state["model.embed_tokens.weight"])

    store = WeightStore()
    assert store.latest_version() == -1 and store.latest() is None
    store.publish({"version": 3, "kind": "folder", "path": str(folder)})
    with pytest.raises(ValueError, match="backwards"):
        store.publish({"version": 2, "kind": "folder", "path": str(folder)})
    assert store.latest_version() == 3


def test_unknown_payload_kind_is_refused():
    with pytest.raises(ValueError, match="unknown weight payload kind"):
        resolve_weights({"version": 1, "kind": "carrier-pigeon"})
