"""What the content check of a weight version costs (lm/weight_sync/integrity.py), at real size.

A Qwen2-shaped policy of --layers x --hidden (default 24 x 1024, vocab 32,000, tied embeddings:
the 304M parameters of benchmarks/weight_sync.py) in bfloat16 (608 MB), random values. Measured in
one process, one thread (what one side of a channel spends), medians over --rounds:
  digest     the digest (integrity.ALGORITHM) over every tensor's bytes (a pull sender's or reader's share), MB/s
  chunks     the digest over the version cut into --bucket-mb chunks (a broadcast sender's or
             receiver's share), MB/s
  finite     the NaN/inf check of every floating tensor (a receiver's share), MB/s
  copy       copying the version into a second set of tensors (what an engine's load costs at
             least), MB/s
and the ratio (digest + finite) / copy: what the check adds to a receiver next to its load.
The last line printed is a JSON summary.

    .venv/bin/python benchmarks/weight_integrity.py [--layers 24] [--hidden 1024] [--rounds 3]
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from lm.weight_sync import integrity  # noqa: E402
from lm.weight_sync.layout import Layout, fill_chunk  # noqa: E402


def state(layers: int, hidden: int, vocab: int) -> dict[str, torch.Tensor]:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(vocab_size=vocab, hidden_size=hidden, intermediate_size=hidden * 11 // 4,  # as weight_sync.py
                         num_hidden_layers=layers, num_attention_heads=max(1, hidden // 64),
                         num_key_value_heads=max(1, hidden // 256), tie_word_embeddings=True)
    with torch.device("meta"):
        shapes = {k: v.shape for k, v in Qwen2ForCausalLM(config).state_dict().items()}
    gen = torch.Generator().manual_seed(0)
    out = {k: torch.randn(s, generator=gen).to(torch.bfloat16) for k, s in shapes.items() if k != "lm_head.weight"}
    out["lm_head.weight"] = out["model.embed_tokens.weight"]  # tied: one storage, hashed once
    return out


def timed(fn, rounds: int) -> float:
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--vocab", type=int, default=32_000)
    parser.add_argument("--bucket-mb", type=float, default=32.0)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(1)

    tensors = state(args.layers, args.hidden, args.vocab)
    layout = Layout.of(tensors.items())
    params = sum(m.nbytes for m in layout.stored) // 2
    mb = layout.total_bytes / 1e6
    spans = layout.chunks(int(args.bucket_mb * 2**20))
    chunks = []
    for span in spans:
        buf = torch.empty(span[1] - span[0], dtype=torch.uint8)
        fill_chunk(buf, layout, span, tensors)
        chunks.append(buf)
    copies = {k: torch.empty_like(v) for k, v in tensors.items()}

    def copy():
        for name, tensor in tensors.items():
            copies[name].copy_(tensor)

    s = {"digest": timed(lambda: integrity.tensor_digests(tensors.items()), args.rounds),
         "chunks": timed(lambda: [integrity.digest(c) for c in chunks], args.rounds),
         "finite": timed(lambda: integrity.first_nonfinite(tensors.items()), args.rounds),
         "copy": timed(copy, args.rounds)}
    print(f"{params / 1e6:.0f}M parameters, bfloat16, {mb:.0f} MB, {len(spans)} chunks of {args.bucket_mb:g} MB; "
          f"one thread, median of {args.rounds}")
    for name, seconds in s.items():
        print(f"  {name:7s} {seconds:6.3f} s   {mb / seconds:8.0f} MB/s")
    ratio = (s["digest"] + s["finite"]) / s["copy"]
    print(f"check (digest + finite) / copy = {ratio:.2f}")
    print(json.dumps({"params": params, "mb": round(mb, 1), "seconds": {k: round(v, 4) for k, v in s.items()},
                      "mb_per_s": {k: round(mb / v) for k, v in s.items()}, "check_over_copy": round(ratio, 2)}))


if __name__ == "__main__":
    main()
