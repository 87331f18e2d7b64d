"""Load causal LMs and compute the log-probs of given tokens, the same way for every caller."""
from __future__ import annotations

import functools
import importlib
import itertools
import json
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from lm import packed_attention

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "float64": torch.float64}
# Response tokens per LM-head chunk: the head's transient memory is about 2 x chunk x vocab x 4 bytes
# (1024 x 151,936: 1.2 GB), whatever the batch.
DEFAULT_CHUNK_TOKENS = 1024


def torch_dtype(name: str) -> torch.dtype:
    try:
        return DTYPES[name]
    except KeyError:
        raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {name!r}") from None


def check_model_dir(path: str | os.PathLike) -> Path:
    """An HF model folder must exist and hold a config.json; say which path is wrong otherwise."""
    folder = Path(path)
    if not folder.is_dir():
        raise FileNotFoundError(f"model path {str(folder)!r} does not exist or is not a folder")
    if not (folder / "config.json").is_file():
        if (folder / "adapter_config.json").is_file():
            raise FileNotFoundError(f"model path {str(folder)!r} holds LoRA adapters (PEFT's adapter_config.json), not "
                                    f"a model: take the merged policy/ beside it (etarl eval --run RUN_DIR does)")
        raise FileNotFoundError(f"model path {str(folder)!r} has no config.json: not an HF model folder")
    return folder


def load_causal_lm(path: str | os.PathLike, dtype: str = "float32", device: str = "cpu",
                   attn_implementation: str | None = None):
    """`attn_implementation`: transformers' attention kernel (None: its default, sdpa)."""
    from transformers import AutoModelForCausalLM

    folder = check_model_dir(path)
    extra = _implementations(dtype, attn_implementation)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch_dtype(dtype), **extra)
    return model.to(device)


def _implementations(dtype: str, attn_implementation: str | None) -> dict:
    """transformers' kernel choices: the attention's if given; float64 MoE experts run eager (the
    default grouped_mm has no float64 kernel; a dense model ignores the choice)."""
    extra = {"attn_implementation": attn_implementation} if attn_implementation else {}
    if attn_implementation == packed_attention.NAME:
        packed_attention.register()  # etarl's, not transformers' own: known once registered
    if dtype == "float64":
        extra["experts_implementation"] = "eager"
    return extra


def causal_lm_on_meta(path: str | os.PathLike, dtype: str = "float32", attn_implementation: str | None = None):
    """The model of an HF folder with its parameters on the meta device (no memory, no values)
    and its buffers real (rotary frequencies are computed at construction and are in no
    checkpoint). For a sharded learner: shard it, then fill each rank's shards
    (`learner.distributed.fill_shards`)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(check_model_dir(path))
    return on_meta(lambda: AutoModelForCausalLM.from_config(config, dtype=torch_dtype(dtype),
                                                            **_implementations(dtype, attn_implementation)))


def on_meta(build):
    """`build()`'s model with every parameter on the meta device as it is registered (its CPU
    allocation never written to) and its buffers real: a torch.device("meta") context would put
    the buffers there too."""
    def to_meta(module, name, param):
        if param is None or param.device.type == "meta":
            return None
        return torch.nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)

    handle = torch.nn.modules.module.register_module_parameter_registration_hook(to_meta)
    try:
        model = build()
    finally:
        handle.remove()
    if any(p.device.type != "meta" for p in model.parameters()):
        raise RuntimeError(f"{type(model).__name__} made parameters outside the meta device")
    return model


class CheckpointTensors:
    """The tensors of an HF folder's safetensors files by the model's in-memory names, each read on
    its own when asked (the file opened and closed around it: no mapping of the whole file stays
    resident). A name the checkpoint does not hold as it is (transformers 5's fused MoE experts,
    `experts.gate_up_proj` [E, 2I, H]) is put together from the checkpoint's tensors it is made of
    (each expert's gate, up and down matrices; `lm.checkpoint_names`): one fused tensor at a time."""

    def __init__(self, files_by_name: dict[str, Path], parts: dict[str, tuple[tuple[int, ...], list[str]]]):
        self.files_by_name = files_by_name
        self.parts = parts  # in-memory name -> (shape, the checkpoint names it is made of), where not held as is

    def __contains__(self, name: str) -> bool:
        return name in self.files_by_name or name in self.parts

    def __getitem__(self, name: str) -> torch.Tensor:
        if name in self.files_by_name:
            return self._read(name)
        from lm.checkpoint_names import load_by_checkpoint_names

        shape, names = self.parts[name]
        pieces = self._read_by_file(names)
        first = next(pieces)
        whole = torch.empty(shape, dtype=first[1].dtype)
        for _ in load_by_checkpoint_names({name: whole}, itertools.chain([first], pieces)):
            pass
        return whole

    def _read(self, name: str) -> torch.Tensor:
        ((_, tensor),) = self._read_by_file([name])  # read to its end: the file is closed on return
        return tensor

    def _read_by_file(self, names: list[str]):
        """(name, tensor) of `names`, each file opened once (an MoE block's experts: hundreds of
        tensors, each file's header parsed once, not per tensor)."""
        from safetensors import safe_open

        by_file: dict[Path, list[str]] = {}
        for name in names:
            by_file.setdefault(self.files_by_name[name], []).append(name)
        for file, in_file in by_file.items():
            with safe_open(str(file), framework="pt") as f:
                for name in in_file:
                    yield name, f.get_tensor(name)


def checkpoint_tensors(path: str | os.PathLike, shapes) -> CheckpointTensors | None:
    """The folder's safetensors tensors by the model's names (`shapes`: name -> shape), if they hold
    every one of them, as it is or as the checkpoint's tensors it is made of (a fused MoE expert
    tensor: its experts' matrices); None where they do not (load the model whole instead)."""
    from safetensors import safe_open

    from lm.checkpoint_names import checkpoint_shapes, expert_naming

    folder = check_model_dir(path)
    naming = expert_naming(json.loads((folder / "config.json").read_text()))
    files_by_name: dict[str, Path] = {}
    for file in sorted(folder.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            files_by_name.update(dict.fromkeys(f.keys(), file))
    if not files_by_name:
        return None
    parts = {}
    for name, shape in shapes.items():
        if name in files_by_name:
            continue
        names = list(checkpoint_shapes({name: tuple(shape)}, naming))
        if names == [name] or any(n not in files_by_name for n in names):
            return None
        parts[name] = (tuple(shape), names)
    return CheckpointTensors(files_by_name, parts)


def enable_gradient_checkpointing(model, mode: str = "full") -> None:
    """Recompute each decoder layer in the backward pass instead of keeping its activations.

    - full: keep only the layer's input; the backward re-runs the whole layer (activation memory:
      one layer's worth instead of all of them; the matmuls run three times instead of two).
    - selective: also keep the outputs of its matmuls and of its attention kernel, so the backward
      re-runs only the cheap elementwise work in between (norms, RoPE, SwiGLU, residual adds): about
      a quarter less matmul work per step than full, for about half of the memory that no
      checkpointing would keep (PyTorch's selective activation checkpointing; torchtitan's "op" mode).

    transformers checkpoints a layer only while that layer is in training mode; the learner keeps its
    model in eval mode (no dropout), so only the layer modules themselves are flagged as training:
    their children, dropout included, stay in eval mode. Calling it again switches the mode."""
    from torch.utils.checkpoint import create_selective_checkpoint_contexts
    from transformers.modeling_layers import GradientCheckpointingLayer

    if mode not in ("full", "selective"):
        raise ValueError(f"gradient checkpointing is 'full' or 'selective', got {mode!r}")
    kwargs = {"use_reentrant": False}
    if mode == "selective":
        kwargs["context_fn"] = functools.partial(create_selective_checkpoint_contexts, _keep_matmul_outputs)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    layers = [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer)]
    if not layers:
        raise ValueError(f"{type(model).__name__} has no checkpointable decoder layers")
    for layer in layers:
        layer.training = True  # this module only: Module.train() would reach the dropouts too


@functools.cache
def _kept_ops() -> frozenset:
    """The ops whose outputs selective checkpointing keeps: the linear layers' matmuls and the
    attention kernels (fused ones, and the CPU's; the flash varlen op where this torch has it).
    Not bmm: a math-path attention's bmm output is the [heads, L, L] score matrix. Not MoE experts'
    grouped matmuls: top-k copies of every token's MLP activations; they run again."""
    aten = torch.ops.aten
    names = ("mm", "addmm", "_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
             "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_flash_attention_for_cpu",
             "_flash_attention_forward", "_efficient_attention_forward")
    ops = {getattr(aten, name).default for name in names if hasattr(aten, name)}
    if packed_attention.flash_varlen_available():
        importlib.import_module("torch.nn.attention.varlen")  # registers torch_attn::_varlen_attn
        varlen = getattr(torch.ops.torch_attn, "_varlen_attn", None)  # its name in torch 2.10+
        if varlen is not None:  # another release's name: its attention runs again (slower, still exact)
            ops.add(varlen.default)
    return frozenset(ops)


def _keep_matmul_outputs(ctx, op, *args, **kwargs):
    from torch.utils.checkpoint import CheckpointPolicy

    return CheckpointPolicy.MUST_SAVE if op in _kept_ops() else CheckpointPolicy.PREFER_RECOMPUTE


# Files any one of which holds a tokenizer transformers can load (fast, sentencepiece, BPE, WordPiece).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt", "spiece.model")


def load_tokenizer(path: str | os.PathLike):
    """The tokenizer saved in an HF model folder; a folder without one is a FileNotFoundError that
    says so (AutoTokenizer's own error points at the model hub)."""
    from transformers import AutoTokenizer

    folder = check_model_dir(path)
    if not any((folder / name).is_file() for name in TOKENIZER_FILES):
        raise FileNotFoundError(f"model path {str(folder)!r} has no tokenizer (none of {', '.join(TOKENIZER_FILES)}): "
                                f"copy the tokenizer files of the model it was made from into it "
                                f"(tokenizer.save_pretrained)")
    return AutoTokenizer.from_pretrained(folder)


def _flat_tokens(prompts, responses) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(every row's prompt then response, concatenated [N], prompt lengths [B], response lengths
    [B]); rows may be lists or integer arrays (the learner keeps numpy arrays: no Python ints)."""
    if len(prompts) != len(responses):
        raise ValueError(f"{len(prompts)} prompts but {len(responses)} responses: one response per prompt")
    if not len(prompts):
        raise ValueError("no sequences to pad (zero prompts)")
    p_len = torch.tensor([len(p) for p in prompts], dtype=torch.long)
    r_len = torch.tensor([len(r) for r in responses], dtype=torch.long)
    parts = [np.asarray(x, dtype=np.int64).reshape(-1) for pair in zip(prompts, responses) for x in pair]
    return torch.from_numpy(np.concatenate(parts)), p_len, r_len


def pad_sequences(
    prompts: list[list[int]], responses: list[list[int]], pad_id: int = 0
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """Right-pad prompt+response rows. Returns input_ids [B, L], attention_mask [B, L],
    response_mask [B, T] (1 on real response tokens) and T, the longest response."""
    flat, p_len, r_len = _flat_tokens(prompts, responses)
    lengths = p_len + r_len
    real = torch.arange(int(lengths.max()))[None, :] < lengths[:, None]
    input_ids = torch.full(real.shape, pad_id, dtype=torch.long)
    input_ids[real] = flat  # row-major: each row's tokens fill its first columns
    resp_width = int(r_len.max())
    response_mask = (torch.arange(resp_width)[None, :] < r_len[:, None]).to(torch.float32)
    return input_ids, real.to(torch.long), response_mask, resp_width


def pack_sequences(prompts, responses, width: int | None = None, pad_id: int = 0):
    """The rows concatenated into one packed row: input_ids [1, W] and position_ids [1, W], the
    positions starting at 0 for each row, so attention never crosses a row's boundary (transformers
    reads the resets: a block-diagonal causal mask for sdpa/eager, varlen for flash attention).
    `width` >= the rows' tokens (a shape bucket): the rest is one filler sequence of `pad_id`s,
    its own block, predicting nothing. Returns also each row's start in the packed row [B]."""
    flat, p_len, r_len = _flat_tokens(prompts, responses)
    lengths = p_len + r_len
    starts = torch.cumsum(lengths, 0) - lengths
    total = int(lengths.sum())
    width = total if width is None else int(width)
    if width < total:
        raise ValueError(f"a packed width of {width} cannot hold {total} tokens")
    positions = torch.arange(total) - torch.repeat_interleave(starts, lengths)
    filler = width - total
    input_ids = torch.cat([flat, torch.full((filler,), pad_id, dtype=torch.long)])[None, :]
    position_ids = torch.cat([positions, torch.arange(filler)])[None, :]
    return input_ids, position_ids, starts


def response_log_probs(
    model,
    prompts: list[list[int]],
    responses: list[list[int]],
    temperature: float = 1.0,
    pad_id: int = 0,
    with_entropy: bool = False,
    entropy_grad: bool = True,
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
    packed: bool = False,
    pack_width: int | None = None,
    with_sum_pi_squared: bool = False,
):
    """Log-probs of each response token under `model` (logits divided by temperature), as
    [B, T] float32 right-padded with zeros, and the [B, T] response mask; with `with_entropy`,
    also the [B, T] entropy of the tempered next-token distribution at each response position
    (the learner's entropy bonus and metric; `entropy_grad=False` makes it a constant, for when
    it is only reported); with `with_sum_pi_squared`, last, the [B, T] Σ_v p_v² of that
    distribution (no gradient; optimal_token_baseline's). Gradients flow unless the caller wraps
    this in torch.no_grad().

    One forward pass over the rows (the caller sizes them: see learner.batch.plan_micro_batches):
    right-padded [B, longest], or with `packed` one row of their concatenation (`pack_sequences`,
    `pack_width` tokens wide, default their total) whose attention stops at each row's boundary.
    The LM head runs only on the positions that predict a response token, `chunk_tokens` of them
    at a time, and its [chunk, vocab] logits are recomputed in the backward pass: memory for the
    log-probs is O(chunk_tokens x vocab), never O(rows x length x vocab)."""
    inputs = response_inputs(model, prompts, responses, pad_id, packed, pack_width)
    hidden = _final_hidden_states(model, **inputs.forward)
    # Token t is predicted by position t-1: the hidden state just before each response token.
    picked = hidden[inputs.in_rows, inputs.in_cols]
    head = model.get_output_embeddings()
    targets = inputs.input_ids[inputs.in_rows, inputs.in_cols + 1]
    log_probs, entropy, *sum_pi_squared = chunked_token_log_probs(
        picked, head.weight, getattr(head, "bias", None), targets, temperature, chunk_tokens, with_entropy,
        entropy_grad, with_sum_pi_squared)
    result = [inputs.scatter(log_probs), inputs.response_mask]
    if with_entropy:
        result.append(inputs.scatter(entropy))
    if with_sum_pi_squared:
        result.append(inputs.scatter(sum_pi_squared[0]))
    return tuple(result)


@dataclass
class ResponseInputs:
    """One forward pass's input for a set of rows and where each response token sits in it (the
    log-probs' and the critic's values' common part: both read the position just before each
    response token)."""

    input_ids: torch.Tensor  # [B, L] padded or [1, W] packed, on the model's device
    forward: dict  # the model's keyword arguments (ids, mask or positions, packed attention's boundaries)
    rows: torch.Tensor  # each response token's row and column in the [B, T] output
    cols: torch.Tensor
    in_rows: torch.Tensor  # where the position that predicts it sits in the forward's input
    in_cols: torch.Tensor
    response_mask: torch.Tensor  # [B, T] float32

    def scatter(self, values: torch.Tensor) -> torch.Tensor:
        """[N] per response token -> [B, T], zeros at padding."""
        out = torch.zeros(self.response_mask.shape, dtype=values.dtype, device=values.device)
        return out.index_put((self.rows, self.cols), values)


def response_inputs(model, prompts, responses, pad_id: int = 0, packed: bool = False,
                    pack_width: int | None = None) -> ResponseInputs:
    """The rows right-padded to [B, longest], or with `packed` one row of their concatenation
    (`pack_sequences`, `pack_width` tokens wide, default their total) whose attention stops at each
    row's boundary; on the model's device."""
    device = next(model.parameters()).device
    if packed:
        input_ids, position_ids, starts = pack_sequences(prompts, responses, pack_width, pad_id)
        boundaries = packed_attention.packed_attention_kwargs(position_ids, device) \
            if packed_attention.uses_varlen(model) else {}
        forward = {"position_ids": position_ids.to(device), **boundaries}
    else:
        input_ids, attention, _, _ = pad_sequences(prompts, responses, pad_id)
        forward = {"attention_mask": attention.to(device)}
    input_ids = input_ids.to(device)
    rows, cols, positions = _response_positions(prompts, responses)
    r_len = torch.tensor([len(r) for r in responses], dtype=torch.long)
    response_mask = (torch.arange(int(r_len.max()))[None, :] < r_len[:, None]).to(torch.float32)
    # (row, column) padded, (0, the row's start + column) packed
    in_rows, in_cols = (torch.zeros_like(rows), starts[rows] + positions) if packed else (rows, positions)
    return ResponseInputs(input_ids, {"input_ids": input_ids, **forward}, rows.to(device), cols.to(device),
                          in_rows.to(device), in_cols.to(device), response_mask.to(device))


def _response_positions(prompts, responses) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(row, response column, input position of the predicting token) of every response token."""
    p_len = torch.tensor([len(p) for p in prompts], dtype=torch.long)
    r_len = torch.tensor([len(r) for r in responses], dtype=torch.long)
    bad = torch.nonzero((p_len == 0) & (r_len > 0)).flatten()
    if len(bad):
        raise ValueError(f"row {int(bad[0])} has a response but an empty prompt: its first token has no context")
    rows = torch.repeat_interleave(torch.arange(len(prompts)), r_len)
    cols = torch.arange(int(r_len.sum())) - torch.repeat_interleave(torch.cumsum(r_len, 0) - r_len, r_len)
    positions = torch.repeat_interleave(p_len - 1, r_len) + cols
    return rows, cols, positions


_NO_POSITIONS = torch.empty(0, dtype=torch.long)


def _final_hidden_states(model, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                         position_ids: torch.Tensor | None = None, **attention_kwargs) -> torch.Tensor:
    """The decoder's last hidden states [B, L, H] (after the final norm). The whole model's
    forward runs, so wrappers that act in its hooks (FSDP gathers the root's parameters there)
    still see a normal call, but its LM head gets no position: the caller applies the head.
    `attention_kwargs` reach every attention call (a packed row's boundaries for varlen)."""
    captured = {}

    def keep(_module, _args, output):
        captured["hidden"] = output[0] if isinstance(output, tuple) else output.last_hidden_state

    handle = model.base_model.register_forward_hook(keep)
    try:
        # no cache: transformers reads packed rows from the position resets only without one
        model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=False,
              logits_to_keep=_NO_POSITIONS.to(input_ids.device), **attention_kwargs)
    finally:
        handle.remove()
    return captured["hidden"]


def chunked_token_log_probs(hidden, weight, bias, targets, temperature: float = 1.0,
                            chunk_tokens: int = DEFAULT_CHUNK_TOKENS, with_entropy: bool = False,
                            entropy_grad: bool = True, with_sum_pi_squared: bool = False):
    """log softmax((hidden @ weight.T + bias) / T)[target] and, optionally, the entropy and Σ_v p_v²
    (no gradient) per token ([N, H] hidden, [V, H] weight, [N] targets -> [N] float32 each; entropy
    and Σp² None unless asked).
    The logits are made `chunk_tokens` rows at a time in the weight's dtype (or autocast's) and
    reduced in float32; the backward pass makes them again instead of keeping them."""
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be >= 1, got {chunk_tokens}")
    if hidden.dim() != 2 or targets.shape != hidden.shape[:1]:
        raise ValueError(f"hidden must be [tokens, hidden] and targets [tokens], got {tuple(hidden.shape)} and "
                         f"{tuple(targets.shape)}")
    log_probs, entropy, sum_pi_squared = _ChunkedLogProbs.apply(
        hidden, weight, bias, targets, float(temperature), int(chunk_tokens), with_entropy, entropy_grad,
        with_sum_pi_squared)
    if with_sum_pi_squared:
        return log_probs, (entropy if with_entropy else None), sum_pi_squared
    return log_probs, (entropy if with_entropy else None)


def _compute_dtype(hidden: torch.Tensor, weight: torch.Tensor) -> torch.dtype:
    """The dtype the head's matmuls run in: autocast's when it is on, else the weight's."""
    device_type = hidden.device.type
    return torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else weight.dtype


class _ChunkedLogProbs(torch.autograd.Function):
    """The LM head, log-softmax and entropy of a token set, chunk by chunk (prime-rl's
    FusedOutputLinear, without the vocabulary split). With z = logits / T, p = softmax(z),
    H = -Σ p log p:  d log p_target / dz = onehot(target) - p;  dH / dz = -p (log p + H). Σ p²
    (optimal_token_baseline's path variance) has no gradient.
    At most two [chunk, vocab] buffers (float32, or float64 for a float64 model) serve every
    chunk of a call, and each chunk makes few passes over them: at this size the elementwise
    work, not the matmul, sets the speed on CPU, and fresh buffers would page-fault every time."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, temperature, chunk, with_entropy, entropy_grad,
                with_sum_pi_squared):
        compute = _compute_dtype(hidden, weight)
        w, b = weight.to(compute), None if bias is None else _scaled(bias, temperature, compute)
        n = hidden.shape[0]
        dtype = torch.promote_types(compute, torch.float32)  # float64 stays float64 (exactness tests)
        log_probs = torch.empty(n, dtype=dtype, device=hidden.device)
        lse = torch.empty_like(log_probs)
        entropy = torch.zeros_like(log_probs)
        sum_pi_squared = torch.zeros_like(log_probs)
        z_buf, p_buf = (_vocab_buffer(min(chunk, n), weight.shape[0], dtype, hidden.device) for _ in range(2))
        for start in range(0, n, chunk):
            end = min(n, start + chunk)
            z = _tempered_logits(z_buf[: end - start], _scaled(hidden[start:end], temperature, compute), w, b)
            z_max = z.amax(-1, keepdim=True)
            z.sub_(z_max)  # shifted: exp cannot overflow
            p = torch.exp(z, out=p_buf[: end - start])  # unnormalised
            total = p.sum(-1)
            log_total = total.log()
            lse[start:end] = z_max.squeeze(-1) + log_total
            log_probs[start:end] = z.gather(-1, targets[start:end, None]).squeeze(-1) - log_total
            if with_sum_pi_squared:  # Σ (p/S)² as a batched dot product: no [chunk, vocab] temporary
                sum_pi_squared[start:end] = torch.bmm(p[:, None, :], p[:, :, None]).view(-1) / total.square()
            if with_entropy:  # H = log S - Σ p z / S (p is not needed after this)
                entropy[start:end] = log_total - p.mul_(z).sum(-1) / total
        ctx.save_for_backward(hidden, weight, bias, targets, lse, entropy)
        ctx.temperature, ctx.chunk, ctx.compute = temperature, chunk, compute
        ctx.entropy_grad = with_entropy and entropy_grad
        ctx.mark_non_differentiable(sum_pi_squared, *([] if ctx.entropy_grad else [entropy]))
        return log_probs, entropy, sum_pi_squared

    @staticmethod
    def backward(ctx, grad_log_probs, grad_entropy, grad_sum_pi_squared):
        hidden, weight, bias, targets, lse, entropy = ctx.saved_tensors
        want_hidden, want_weight, want_bias = ctx.needs_input_grad[:3]
        compute, temperature = ctx.compute, ctx.temperature
        w, b = weight.to(compute), None if bias is None else _scaled(bias, temperature, compute)
        grad_hidden = torch.zeros_like(hidden) if want_hidden else None
        grad_weight = torch.zeros_like(weight, dtype=lse.dtype) if want_weight else None
        grad_bias = torch.zeros_like(bias, dtype=lse.dtype) if want_bias else None
        if grad_log_probs is None:
            grad_log_probs = torch.zeros_like(lse)
        with_entropy = ctx.entropy_grad and grad_entropy is not None
        n, vocab = hidden.shape[0], weight.shape[0]
        z_buf = _vocab_buffer(min(ctx.chunk, n), vocab, lse.dtype, hidden.device)
        p_buf = _vocab_buffer(min(ctx.chunk, n), vocab, lse.dtype, hidden.device) if with_entropy else None
        for start in range(0, n, ctx.chunk):
            end = min(n, start + ctx.chunk)
            h = _scaled(hidden[start:end], temperature, compute)
            log_p = _tempered_logits(z_buf[: end - start], h, w, b).sub_(lse[start:end, None])
            g = grad_log_probs[start:end, None]
            # d loss / dz = -p (g + g_H (log p + H)) + g onehot(target), built in place.
            if with_entropy:
                p = torch.exp(log_p, out=p_buf[: end - start])
                coef = log_p.add_(entropy[start:end, None]).mul_(grad_entropy[start:end, None]).add_(g)
                grad_z = coef.mul_(p).neg_()
            else:
                grad_z = log_p.exp_().mul_(-g)
            grad_z = grad_z.scatter_add_(-1, targets[start:end, None], g).to(compute)
            # z = (h/T) W^T + b/T: the temperature scales the [chunk, hidden] side, never [chunk, vocab].
            if want_hidden:
                grad_hidden[start:end] = (grad_z @ w).div_(temperature).to(hidden.dtype)
            if want_weight:
                if grad_z.dtype == grad_weight.dtype:
                    grad_weight.addmm_(grad_z.T, h)  # in place: no [vocab, hidden] temporary
                else:
                    grad_weight += grad_z.T @ h
            if want_bias:
                grad_bias += grad_z.sum(0) / temperature
        grad_weight = grad_weight.to(weight.dtype) if want_weight else None
        grad_bias = grad_bias.to(bias.dtype) if want_bias else None
        return grad_hidden, grad_weight, grad_bias, None, None, None, None, None, None


def _vocab_buffer(rows: int, vocab: int, dtype: torch.dtype, device) -> torch.Tensor:
    return torch.empty(rows, vocab, dtype=dtype, device=device)


def _scaled(x: torch.Tensor, temperature: float, dtype: torch.dtype) -> torch.Tensor:
    """x / T in the compute dtype (no copy when T = 1 and the dtype already matches)."""
    return (x if temperature == 1.0 else x / temperature).to(dtype)


def _tempered_logits(out: torch.Tensor, scaled_hidden, weight, scaled_bias) -> torch.Tensor:
    """A chunk's logits / T, from hidden / T and bias / T, written into `out` (float32 or float64)."""
    if weight.dtype == out.dtype:
        torch.mm(scaled_hidden, weight.T, out=out)
        if scaled_bias is not None:
            out.add_(scaled_bias)
    else:  # bfloat16 / float16 compute: the logits are made in that dtype, reduced in float32
        out.copy_(torch.nn.functional.linear(scaled_hidden, weight, scaled_bias))
    return out
