"""Load causal LMs and compute the log-probs of given tokens, the same way for every caller."""
from __future__ import annotations

import os
from pathlib import Path

import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


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
        raise FileNotFoundError(f"model path {str(folder)!r} has no config.json: not an HF model folder")
    return folder


def load_causal_lm(path: str | os.PathLike, dtype: str = "float32", device: str = "cpu"):
    from transformers import AutoModelForCausalLM

    folder = check_model_dir(path)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch_dtype(dtype))
    return model.to(device)


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


def pad_sequences(
    prompts: list[list[int]], responses: list[list[int]], pad_id: int = 0
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """Right-pad prompt+response rows. Returns input_ids [B, L], attention_mask [B, L],
    response_mask [B, T] (1 on real response tokens) and T, the longest response."""
    lengths = [len(p) + len(r) for p, r in zip(prompts, responses)]
    width = max(lengths)
    resp_width = max(len(r) for r in responses)
    input_ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    attention = torch.zeros((len(prompts), width), dtype=torch.long)
    response_mask = torch.zeros((len(prompts), resp_width), dtype=torch.float32)
    for row, (p, r) in enumerate(zip(prompts, responses)):
        input_ids[row, : len(p) + len(r)] = torch.tensor(list(p) + list(r), dtype=torch.long)
        attention[row, : len(p) + len(r)] = 1
        response_mask[row, : len(r)] = 1.0
    return input_ids, attention, response_mask, resp_width


def response_log_probs(
    model,
    prompts: list[list[int]],
    responses: list[list[int]],
    temperature: float = 1.0,
    pad_id: int = 0,
    with_entropy: bool = False,
    entropy_grad: bool = True,
):
    """Log-probs of each response token under `model` (logits divided by temperature), as
    [B, T] right-padded with zeros, and the [B, T] response mask; with `with_entropy`, also the
    [B, T] entropy of the tempered next-token distribution at each response position (the
    learner's entropy bonus and metric; `entropy_grad=False` computes it without a graph, which
    saves a [T, vocab] activation per row when it is only reported). Gradients flow unless the
    caller wraps this in torch.no_grad()."""
    input_ids, attention, response_mask, resp_width = pad_sequences(prompts, responses, pad_id)
    device = next(model.parameters()).device
    logits = model(input_ids=input_ids.to(device), attention_mask=attention.to(device)).logits
    logits = logits.float() / temperature
    # Token t is predicted by position t-1; gather the response slice row by row (prompts differ).
    out = torch.zeros((len(prompts), resp_width), dtype=torch.float32, device=device)
    rows, entropies = [], []
    for row, (p, r) in enumerate(zip(prompts, responses)):
        if not r:
            rows.append(out[row])
            entropies.append(out[row])
            continue
        start = len(p) - 1
        row_logits = logits[row, start : start + len(r)]
        targets = input_ids[row, len(p) : len(p) + len(r)].to(device)
        log_dist = torch.log_softmax(row_logits, dim=-1)
        lp = log_dist.gather(-1, targets[:, None]).squeeze(-1)
        rows.append(torch.nn.functional.pad(lp, (0, resp_width - len(r))))
        if with_entropy:
            with torch.set_grad_enabled(torch.is_grad_enabled() and entropy_grad):
                ent = -(log_dist.exp() * log_dist).sum(-1)
            entropies.append(torch.nn.functional.pad(ent, (0, resp_width - len(r))))
    if with_entropy:
        return torch.stack(rows), response_mask.to(device), torch.stack(entropies)
    return torch.stack(rows), response_mask.to(device)
