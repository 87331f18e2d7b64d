"""Learner memory at the real vocabulary size: the token budget bounds it, not the batch.

    .venv/bin/python benchmarks/learner_memory.py [--quick] [--device cpu|cuda]

Builds a Qwen2-architecture policy from config with Qwen's vocabulary (151,936 tokens) and a
hidden size this machine can train (default 512 wide, 4 layers; --quick: 128 wide, 2 layers), and
random sequences of 512 to 4,096 tokens (--quick: 32 to 160), the first quarter of the shortest
the prompt. Every measurement runs in a process of its own, so each peak is its own:

  * one learner step (decoupled token-TIS: proximal pass, update, optimizer step) at batch sizes
    8, 32 and 128 sequences and one token budget: peak memory (resident set on CPU, allocated on
    CUDA), tokens/s and the padding fraction; the old path (one pass per minibatch, float32
    [B, L, vocab] log-softmax) at the smallest batch where it fits, for the others its logits' size;
  * log-prob memory: the chunked head's forward+backward over the response tokens of a full
    micro-batch, against the float32 [B, L, vocab] logits of the old path (and, measured, the old
    head on that micro-batch);
  * tokens/s of the learner's forward+backward over the planned micro-batches against a plain
    transformers forward+backward (`labels` loss over the response tokens) over the same ones, and
    of the learner's whole step at that batch size against a plain transformers step (a no-grad
    forward, the forward+backward, an AdamW step: the baseline issue 27 was measured against).

Each step runs twice on the same lengths: the first on new shapes (on CUDA after a step of other
lengths at the same batch size, as a running job meets them; before 2026-11-26 straight after a
short warm-up, so its first-step allocations counted too), the second warm (their speed ratio;
issue 27's goal >= 0.95 on a GPU), and model TFLOP/s (8 x parameters x tokens / warm step);
--repeats N does that on N sets of new lengths and sums the times (since 2026-11-28; one pair of
steps was one sample of a noisy ratio). The peak memory is the highest of all of them.
Micro-batches are packed (learner.packing; --no-packing: right-padded), so the padding fraction is
0 on CPU (shape buckets, on with CUDA, add at most 25 % filler); the throughput child also checks
packed against padded log-probs of one micro-batch (max |diff|). --mixed-precision and
--checkpointing [full|selective] set the learner's options of those names; the plain pass
checkpoints as transformers does (full) whenever the learner checkpoints, and with selective the
learner's pass also runs with full (the gain of keeping the matmul outputs, on the same batch);
without --checkpointing the plain pass also runs with full (what a plain run short of memory gets).
The throughput passes run max(2, --repeats) times each, taking turns, and the fastest counts.

Goals (issue 17): peak at B=128 within 1.15x of B=8; log-prob memory at most 1/8 of the naive
float32 [B, L, V]; tokens/s at least 0.9x the plain pass (issue 27 on a GPU with packing: 1.3x at
B=32). Prints the numbers and, as its last line, a JSON summary. Asserts nothing.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from buffer.sample import Group, Sample  # noqa: E402
from learner.batch import build_batch, plan_micro_batches  # noqa: E402
from lm.causal_lm import chunked_token_log_probs, load_causal_lm, pad_sequences, response_log_probs  # noqa: E402

QWEN_VOCAB = 151_936
BATCH_SIZES = (8, 32, 128)
GROUP_SIZE = 8
GiB = 2**30


# ---------------------------------------------------------------- the model and the data

# --shape presets: Qwen2.5's (hidden, layers, intermediate, attention heads, key/value heads)
SHAPES = {"qwen2.5-0.5b": (896, 24, 4864, 14, 2), "qwen2.5-1.5b": (1536, 28, 8960, 12, 2),
          "qwen2.5-7b": (3584, 28, 18944, 28, 4)}


def build_policy(folder: Path, vocab: int, hidden: int, layers: int, max_len: int, intermediate: int | None = None,
                 heads: int | None = None, kv_heads: int = 1) -> Path:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate or hidden * 11 // 4,
                         num_hidden_layers=layers, num_attention_heads=heads or max(1, hidden // 64),
                         num_key_value_heads=kv_heads, max_position_embeddings=max_len, tie_word_embeddings=True)
    Qwen2ForCausalLM(config).save_pretrained(folder)
    return folder


def random_groups(batch_size: int, min_len: int, max_len: int, vocab: int, seed: int = 0) -> list[Group]:
    """Groups of GROUP_SIZE sequences; prompts of min_len / 4 tokens, one per group; totals spread
    evenly over [min_len, max_len] and shuffled, so every batch size holds the longest sequences
    and its largest micro-batch is the budget's (random tokens: the cost does not depend on them)."""
    rng = np.random.default_rng(seed)
    totals = rng.permutation(np.linspace(min_len, max_len, batch_size).round().astype(int))
    prompt_len = max(1, min_len // 4)
    groups = []
    for g in range(max(1, batch_size // GROUP_SIZE)):
        prompt = rng.integers(1, vocab, prompt_len)
        samples = []
        for i in range(min(GROUP_SIZE, batch_size)):
            n = max(1, int(totals[g * GROUP_SIZE + i]) - prompt_len)
            samples.append(Sample(sample_id=f"{g}-{i}", group_id=f"g{g}", prompt_ids=prompt,
                                  response_ids=rng.integers(1, vocab, n),
                                  rollout_log_probs=-rng.exponential(3.0, n).astype(np.float32),
                                  loss_mask=np.ones(n, np.uint8), reward=float(rng.random()), weight_version=0))
        groups.append(Group(group_id=f"g{g}", samples=samples, prompt_index=g))
    return groups


def former_response_log_probs(model, prompts, responses, temperature=1.0, pad_id=0, with_entropy=False,
                              entropy_grad=True, chunk_tokens=None, packed=False, pack_width=None,
                              with_sum_pi_squared=False):
    """The log-probs as etarl computed them before the chunked head: float32 [B, L, V] logits of
    every position, a log-softmax per row (the old path, for comparison; chunk_tokens is ignored,
    the old step never packs, and its advantages never need Σp²)."""
    assert not with_sum_pi_squared, "the old path's step runs grpo"
    input_ids, attention, response_mask, width = pad_sequences(prompts, responses, pad_id)
    device = next(model.parameters()).device
    logits = model(input_ids=input_ids.to(device), attention_mask=attention.to(device)).logits.float() / temperature
    rows, entropies = [], []
    for row, (p, r) in enumerate(zip(prompts, responses)):
        log_dist = torch.log_softmax(logits[row, len(p) - 1 : len(p) + len(r) - 1], dim=-1)
        targets = input_ids[row, len(p) : len(p) + len(r)].to(device)
        rows.append(torch.nn.functional.pad(log_dist.gather(-1, targets[:, None]).squeeze(-1), (0, width - len(r))))
        if with_entropy:
            with torch.set_grad_enabled(torch.is_grad_enabled() and entropy_grad):
                ent = -(log_dist.exp() * log_dist).sum(-1)
            entropies.append(torch.nn.functional.pad(ent, (0, width - len(r))))
    if with_entropy:
        return torch.stack(rows), response_mask.to(device), torch.stack(entropies)
    return torch.stack(rows), response_mask.to(device)


# ---------------------------------------------------------------- peak memory, per process

class PeakMemory:
    """Peak resident memory on CPU (Linux VmHWM, reset through /proc/self/clear_refs) or peak
    allocated CUDA memory, in bytes, from `start()` on."""

    def __init__(self, device: str):
        self.cuda = device.startswith("cuda")

    @staticmethod
    def _status(field: str) -> int:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
        raise RuntimeError(f"/proc/self/status has no {field}")

    def now(self) -> int:
        return torch.cuda.memory_allocated() if self.cuda else self._status("VmRSS")

    def start(self) -> int:
        if self.cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        else:
            Path("/proc/self/clear_refs").write_text("5")  # the high-water mark restarts from here
        return self.now()

    def peak(self) -> int:
        if self.cuda:
            torch.cuda.synchronize()
            return torch.cuda.max_memory_allocated()
        return self._status("VmHWM")


# ---------------------------------------------------------------- the child measurements

def child_step(spec: dict) -> dict:
    """One learner step at batch size B; `old` swaps in the former log-probs and one pass per minibatch."""
    import learner.trainer as trainer
    from learner.config import LearnerConfig

    packing = spec["packing"] and not spec["old"]
    config = LearnerConfig(model_path=spec["model"], device=spec["device"], lr=1e-5,
                           max_tokens_per_micro_batch=None if spec["old"] else spec["budget"],
                           logprob_chunk_tokens=spec["chunk"], packing=packing,
                           mixed_precision=spec["mixed_precision"],
                           gradient_checkpointing={None: False, "full": True, "selective": "selective"}[
                               spec["checkpointing"]],
                           attn_implementation=spec["attn"] if packing else None)
    if spec["old"]:
        trainer.response_log_probs = former_response_log_probs
    learner = trainer.Learner(config)
    # A warm-up step on one short group: the optimizer's state exists and one-time set-up is done
    # before the measured step, whose peak then is the step's own on top of a trained model.
    learner.train_step(random_groups(GROUP_SIZE, spec["min_len"], spec["min_len"], spec["vocab"], seed=1))
    if spec["device"].startswith("cuda"):
        # A running job has met other lengths at this batch size before: one step of them, so the
        # measured step's new lengths find the allocator's blocks cached, as in a run (on a CPU the
        # resident-set peak would then hide the step's own memory in the heap it left: not done).
        learner.train_step(random_groups(spec["batch"], spec["min_len"], spec["max_len"], spec["vocab"],
                                         seed=spec["batch"] + 1))
    memory = PeakMemory(spec["device"])
    base = memory.start()
    seconds = warm = 0.0
    tokens, longest, padding = 0, 0, []
    for repeat in range(spec.get("repeats", 1)):  # each repeat new lengths: one step's timing is noisy
        groups = random_groups(spec["batch"], spec["min_len"], spec["max_len"], spec["vocab"],
                               seed=spec["batch"] + 1000 * repeat)
        start = time.perf_counter()
        metrics = learner.train_step(groups)
        seconds += time.perf_counter() - start  # new shapes: the first step of these lengths
        start = time.perf_counter()
        learner.train_step(groups)  # the same lengths again: shapes warm
        warm += time.perf_counter() - start
        batch = build_batch(groups)
        tokens += sum(len(p) + len(r) for p, r in zip(batch.prompts, batch.responses))
        longest = max([longest] + [len(p) + len(r) for p, r in zip(batch.prompts, batch.responses)])
        padding.append(metrics["perf/padding_fraction"])
    peak = memory.peak()
    params = sum(p.numel() for p in learner.model.parameters())
    return {"peak_bytes": peak, "base_bytes": base, "step_s": seconds, "warm_step_s": warm, "tokens": tokens,
            "tokens_per_s": tokens / seconds, "warm_tokens_per_s": tokens / warm,
            "padding_fraction": sum(padding) / len(padding),
            "model_tflops": 8 * params * tokens / warm / 1e12, "longest": longest}


def child_head(spec: dict) -> dict:
    """Forward+backward of the head alone (a random [vocab, hidden] weight) over `rows` x `length`
    tokens, `resp` of each a response: the chunked head on the response positions, or the former
    full-vocabulary one on every position."""
    rows, length, resp = spec["rows"], spec["length"], spec["resp"]
    gen = torch.Generator().manual_seed(0)
    # The weight's own gradient is the parameters' memory, the same on both paths: left out.
    weight = (torch.randn(spec["vocab"], spec["hidden"], generator=gen) * 0.02).to(spec["device"])
    memory = PeakMemory(spec["device"])
    if spec["kind"] == "chunked":
        hidden = torch.randn(rows * resp, weight.shape[1], generator=gen).to(spec["device"]).requires_grad_()
        targets = torch.randint(0, spec["vocab"], (rows * resp,), generator=gen).to(spec["device"])
        base = memory.start()
        log_probs, entropy = chunked_token_log_probs(hidden, weight, None, targets, chunk_tokens=spec["chunk"],
                                                     with_entropy=True, entropy_grad=False)
        log_probs.sum().backward()
    else:
        hidden = torch.randn(rows, length, weight.shape[1], generator=gen).to(spec["device"]).requires_grad_()
        targets = torch.randint(0, spec["vocab"], (rows, resp), generator=gen).to(spec["device"])
        base = memory.start()
        logits = (hidden @ weight.T).float()
        log_dist = torch.log_softmax(logits[:, length - resp - 1 : length - 1], -1)
        log_dist.gather(-1, targets[..., None]).sum().backward()
    return {"head_bytes": memory.peak() - base}


def child_throughput(spec: dict) -> dict:
    """Seconds of forward+backward over the same micro-batches: the learner's log-probs (chunked
    head on response positions; packed into shape-bucket widths on CUDA, as the learner packs, with
    its attention kernel) and a plain transformers pass with a `labels` loss (padded, sdpa). Both
    under the same autocast (--mixed-precision); the plain pass with transformers' full
    checkpointing where the learner checkpoints (--checkpointing full|selective); with selective,
    the learner's pass with full too ("ours_full"); without checkpointing, the plain pass with full
    too ("plain_full": what a plain run that must save memory gets). And a plain transformers step,
    issue 27's baseline for the learner's whole step: a no-grad forward, the forward+backward with
    `labels` and an AdamW step over the same padded micro-batches ("plain_step"). A pass that runs
    out of device memory is left out (its error reported), the others still measured."""
    from learner.batch import shape_bucket
    from lm.causal_lm import enable_gradient_checkpointing

    groups = random_groups(spec["batch"], spec["min_len"], spec["max_len"], spec["vocab"], seed=spec["batch"])
    batch = build_batch(groups)
    model = load_causal_lm(spec["model"], device=spec["device"], attn_implementation=spec["attn"])
    cuda = spec["device"].startswith("cuda")
    autocast = torch.autocast("cuda" if cuda else "cpu", torch.bfloat16, enabled=spec["mixed_precision"] is not None)
    lengths = [len(p) + len(r) for p, r in zip(batch.prompts, batch.responses)]
    plan = plan_micro_batches(lengths, spec["budget"])  # the plain pass: padded micro-batches
    packed_plan = plan_micro_batches(lengths, spec["budget"], packed=spec["packing"])
    ours_attention = spec["attn"] or "sdpa"
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-9)  # the plain step's; a tiny lr keeps the model

    def ours(rows):
        width = shape_bucket(sum(lengths[r] for r in rows), spec["budget"]) if cuda and spec["packing"] else None
        lp, mask = response_log_probs(model, [batch.prompts[r] for r in rows], [batch.responses[r] for r in rows],
                                      chunk_tokens=spec["chunk"], packed=spec["packing"], pack_width=width)
        (-(lp * mask).sum() / mask.sum()).backward()

    def padded(rows):  # a plain micro-batch: (input ids, attention mask) on the device, right-padded
        ids, attention_mask, _, _ = pad_sequences([batch.prompts[r] for r in rows], [batch.responses[r] for r in rows])
        return ids.to(spec["device"]), attention_mask.to(spec["device"])

    def plain(rows):
        ids, attention_mask = padded(rows)
        labels = ids.clone()
        labels[attention_mask == 0] = -100
        for i, r in enumerate(rows):
            labels[i, : len(batch.prompts[r])] = -100  # the loss on response tokens, as the learner's
        model(input_ids=ids, attention_mask=attention_mask, labels=labels).loss.backward()

    def plain_step(rows_list):
        with torch.no_grad():
            for rows in rows_list:
                ids, attention_mask = padded(rows)
                model(input_ids=ids, attention_mask=attention_mask)
        for rows in rows_list:
            plain(rows)
        optimizer.step()

    def over(fn):  # one pass: fn on each micro-batch
        def run(rows_list):
            for rows in rows_list:
                fn(rows)
        return run

    # name: (one pass over the micro-batches, the micro-batches, attention, checkpointing)
    plain_checkpointing = spec["checkpointing"] and "full"
    passes = {"ours": (over(ours), packed_plan, ours_attention, spec["checkpointing"]),
              "plain": (over(plain), plan, "sdpa", plain_checkpointing),
              "plain_step": (plain_step, plan, "sdpa", plain_checkpointing)}
    if spec["checkpointing"] == "selective":
        passes["ours_full"] = (over(ours), packed_plan, ours_attention, "full")
    elif not spec["checkpointing"]:
        passes["plain_full"] = (over(plain), plan, "sdpa", "full")
    seconds = {name: [] for name in passes}
    errors = {}
    for _ in range(spec["repeats"]):
        for name, (run, micro_batches, attention, checkpointing) in passes.items():  # taking turns: load hits all
            if name in errors:
                continue
            model.set_attn_implementation(attention)
            if checkpointing:
                enable_gradient_checkpointing(model, checkpointing)
            elif model.is_gradient_checkpointing:
                model.gradient_checkpointing_disable()
            model.zero_grad(set_to_none=True)
            start = time.perf_counter()
            try:
                with autocast:
                    run(micro_batches)
                if cuda:
                    torch.cuda.synchronize()
            except torch.OutOfMemoryError as error:
                errors[name] = f"out of memory: {str(error).splitlines()[0]}"
                model.zero_grad(set_to_none=True)
                torch.cuda.empty_cache()
                continue
            seconds[name].append(time.perf_counter() - start)
    model.set_attn_implementation("sdpa")
    tokens = sum(lengths)
    best = {name: min(values) for name, values in seconds.items() if name not in errors}
    # Packed (the learner's kernel) against padded (sdpa) log-probs of the largest padded
    # micro-batch, no gradients, under the same autocast.
    rows = max(plan, key=len)
    with torch.no_grad(), autocast:
        args = ([batch.prompts[r] for r in rows], [batch.responses[r] for r in rows])
        padded, _ = response_log_probs(model, *args, chunk_tokens=spec["chunk"])
        model.set_attn_implementation(ours_attention)
        packed, _ = response_log_probs(model, *args, chunk_tokens=spec["chunk"], packed=True)
    return {"tokens": tokens, "micro_batches": len(plan), "packed_micro_batches": len(packed_plan),
            **{f"{name}_tokens_per_s": tokens / best[name] for name in best},
            **{f"{name}_error": why for name, why in errors.items()},
            "packed_vs_padded_max_abs_diff": float((packed - padded).abs().max())}


# What the measurements' processes fork from: a server that imported these (and the running script)
# once. A fresh interpreter per measurement spent ~9 s of CPU importing them before measuring anything;
# a forked one is still a process of its own, so its peak memory is its own. The server never
# touches CUDA (forking after CUDA starts is not allowed): each measurement starts its own.
PRELOAD = ("__main__", "transformers", "learner.trainer")


def run_child(measure, spec: dict) -> dict:
    """`measure(spec)` in a process of its own: what it returns, or {"error": why it failed}."""
    import multiprocessing

    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(list(PRELOAD))
    receive, send = context.Pipe(duplex=False)
    process = context.Process(target=_measure_in_child, args=(measure, spec, send))
    process.start()
    send.close()
    try:
        result = receive.recv()
    except EOFError:  # it died (killed, out of memory, a crash in a kernel) before replying
        result = None
    process.join()
    return result if result is not None else {"error": f"exit {process.exitcode}: ended without a result"}


def _measure_in_child(measure, spec: dict, send) -> None:
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    try:
        result = measure(spec)
    except Exception as exc:  # noqa: BLE001 - a failed measurement is reported, the others go on
        result = {"error": f"{type(exc).__name__}: {exc}"[:1000]}
    send.send(result)
    send.close()


# ---------------------------------------------------------------- the run

def mem_available() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    return 0


def fits(nbytes: int, device: str) -> bool:
    """Whether a float32 [B, L, V] path (about three such tensors) fits in half this machine's free memory."""
    free = torch.cuda.mem_get_info()[0] if device.startswith("cuda") else mem_available()
    return 3 * nbytes < 0.5 * free


def measure_steps(common: dict, batch_sizes, old: bool) -> dict[int, dict]:
    results = {}
    for batch in batch_sizes:
        logits = batch * common["max_len"] * common["vocab"] * 4
        label = "old step" if old else "step"
        if old and not fits(logits, common["device"]):
            print(f"  {label} B={batch:4d}: not run, its float32 [B, L, V] logits alone are {logits / GiB:.1f} GiB")
            continue
        r = results[batch] = run_child(child_step, {**common, "batch": batch, "old": old,
                                                    "repeats": 1 if old else common["repeats"]})
        print(f"  {label} B={batch:4d}: " + (r.get("error") or
              f"peak {r['peak_bytes'] / GiB:6.3f} GiB (before the step {r['base_bytes'] / GiB:.3f}), "
              f"{r['tokens_per_s']:8.0f} tokens/s new shapes, {r['warm_tokens_per_s']:8.0f} warm, "
              f"{r['tokens']} tokens, padding {r['padding_fraction']:.3f}, "
              f"warm/new shapes {r['step_s'] / r['warm_step_s']:.2f}x, model {r['model_tflops']:.3f} TFLOP/s"))
    return results


def measure_head(common: dict) -> dict:
    """The head on the largest micro-batch the budget allows: rows x the longest sequence."""
    rows, length = max(1, common["budget"] // common["max_len"]), common["max_len"]
    resp = length - length // 8
    spec = {**common, "rows": rows, "length": length, "resp": resp}
    chunked = run_child(child_head, {**spec, "kind": "chunked"})
    former_logits = rows * length * common["vocab"] * 4
    former = (run_child(child_head, {**spec, "kind": "naive"}) if fits(former_logits, common["device"])
              else {"error": "not run"})
    show = lambda r: r.get("error") or f"{r['head_bytes'] / GiB:.3f} GiB"  # noqa: E731
    print(f"  log-prob head, {rows} x {length} tokens ({resp} of them response): chunked {show(chunked)}, "
          f"former {show(former)}; float32 [b, L, V] of this micro-batch {former_logits / GiB:.2f} GiB")
    return {"chunked": chunked, "former": former, "rows": rows}


def measure_throughput(common: dict, batch: int) -> dict:
    r = run_child(child_throughput, {**common, "batch": batch, "repeats": max(2, common["repeats"])})
    speed = lambda name: (f"{r[name + '_tokens_per_s']:.0f} tokens/s" if name + "_tokens_per_s" in r  # noqa: E731
                          else r.get(name + "_error", "not run"))
    print("  " + (r.get("error") or f"forward+backward, {r['tokens']} tokens: learner {speed('ours')} "
          f"over {r['packed_micro_batches']} micro-batches (packed: {common['packing']}), plain transformers "
          f"{speed('plain')} over {r['micro_batches']} padded ones"
          + (f"; the learner with full checkpointing {speed('ours_full')}" if common["checkpointing"] == "selective"
             else "")
          + (f"; plain transformers with full checkpointing {speed('plain_full')}" if not common["checkpointing"]
             else "")
          + f"; a plain transformers step (no-grad forward, forward+backward, AdamW) {speed('plain_step')}; "
          f"packed vs padded log-probs "
          f"of the largest micro-batch: max |diff| {r['packed_vs_padded_max_abs_diff']:.2e} (packed attention "
          f"{common['attn'] or 'sdpa'}, B={batch})"))
    return r


def summarize(setup: dict, steps: dict, old: dict, head: dict, throughput: dict) -> dict:
    sizes = setup["batch_sizes"]
    small, large = steps.get(sizes[0], {}), steps.get(sizes[-1], {})
    measured = "peak_bytes" in small and "peak_bytes" in large
    peak_ratio = large["peak_bytes"] / small["peak_bytes"] if measured else None
    step_ratio = ((large["peak_bytes"] - large["base_bytes"]) / (small["peak_bytes"] - small["base_bytes"])
                  if measured else None)
    # The old path's [B, L, V] for the smallest batch (its actual longest sequence).
    naive = sizes[0] * small.get("longest", setup["max_len"]) * setup["vocab"] * 4
    head_bytes = head["chunked"].get("head_bytes")
    head_fraction = head_bytes / naive if head_bytes else None
    speed = (throughput["ours_tokens_per_s"] / throughput["plain_tokens_per_s"]
             if "ours_tokens_per_s" in throughput and "plain_tokens_per_s" in throughput else None)
    learner_step = steps.get(setup["throughput_batch"], {}).get("warm_tokens_per_s")
    plain_step = throughput.get("plain_step_tokens_per_s")
    step_speed = learner_step / plain_step if learner_step and plain_step else None
    gib = lambda x: round(x / GiB, 3)  # noqa: E731
    return {
        "benchmark": "learner_memory", **{k: v for k, v in setup.items() if k != "batch_sizes"},
        "batch_sizes": list(sizes),
        "peak_gib": {str(b): gib(r["peak_bytes"]) for b, r in steps.items() if "peak_bytes" in r},
        "step_increase_gib": {str(b): gib(r["peak_bytes"] - r["base_bytes"]) for b, r in steps.items()
                              if "peak_bytes" in r},
        "old_peak_gib": {str(b): gib(r["peak_bytes"]) for b, r in old.items() if "peak_bytes" in r},
        "old_logits_gib": {str(b): gib(b * setup["max_len"] * setup["vocab"] * 4) for b in sizes},
        "tokens_per_s": {str(b): round(r["tokens_per_s"], 1) for b, r in steps.items() if "tokens_per_s" in r},
        "warm_tokens_per_s": {str(b): round(r["warm_tokens_per_s"], 1) for b, r in steps.items()
                              if "warm_tokens_per_s" in r},
        "old_tokens_per_s": {str(b): round(r["tokens_per_s"], 1) for b, r in old.items() if "tokens_per_s" in r},
        "padding_fraction": {str(b): round(r["padding_fraction"], 4) for b, r in steps.items()
                             if "padding_fraction" in r},
        "new_shapes_vs_warm_speed": {str(b): round(r["warm_step_s"] / r["step_s"], 3) for b, r in steps.items()
                                     if "warm_step_s" in r},
        "model_tflops_warm": {str(b): round(r["model_tflops"], 4) for b, r in steps.items() if "model_tflops" in r},
        "packed_vs_padded_max_abs_diff": throughput.get("packed_vs_padded_max_abs_diff"),
        "peak_ratio_largest_vs_smallest": peak_ratio and round(peak_ratio, 3),
        "step_increase_ratio_largest_vs_smallest": step_ratio and round(step_ratio, 3),
        "logprob_head_gib": head_bytes and gib(head_bytes),
        "former_head_gib_one_micro_batch": head["former"].get("head_bytes") and gib(head["former"]["head_bytes"]),
        "naive_logits_gib_smallest_batch": gib(naive),
        "logprob_fraction_of_naive": head_fraction and round(head_fraction, 4),
        "tokens_per_s_learner_fwd_bwd": throughput.get("ours_tokens_per_s") and round(throughput["ours_tokens_per_s"], 1),
        "tokens_per_s_plain_fwd_bwd": throughput.get("plain_tokens_per_s") and round(throughput["plain_tokens_per_s"], 1),
        "tokens_per_s_vs_plain": speed and round(speed, 3),
        "tokens_per_s_learner_full_checkpointing": throughput.get("ours_full_tokens_per_s") and round(
            throughput["ours_full_tokens_per_s"], 1),
        "tokens_per_s_plain_full_checkpointing": throughput.get("plain_full_tokens_per_s") and round(
            throughput["plain_full_tokens_per_s"], 1),
        "throughput_errors": {k: v for k, v in throughput.items() if k.endswith("error")},
        # issue 27's measure: the learner's whole step (warm, at the throughput batch) against a plain step
        "tokens_per_s_plain_step": throughput.get("plain_step_tokens_per_s") and round(
            throughput["plain_step_tokens_per_s"], 1),
        "learner_step_vs_plain_step": step_speed and round(step_speed, 3),
        "goals": {"peak_within_1.15x": peak_ratio is not None and peak_ratio <= 1.15,
                  "logprob_at_most_1/8_naive": head_fraction is not None and head_fraction <= 1 / 8,
                  "tokens_per_s_at_least_0.9x_plain": speed is not None and speed >= 0.9},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="a smaller model, shorter sequences (< 3 min on 2 cores)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--vocab", type=int, default=QWEN_VOCAB)
    parser.add_argument("--shape", choices=sorted(SHAPES), help="a Qwen2.5 model's shape (hidden, layers, "
                        "intermediate, heads, key/value heads); the options below override it")
    parser.add_argument("--hidden", type=int)
    parser.add_argument("--layers", type=int)
    parser.add_argument("--intermediate", type=int, help="MLP width (default 11/4 x hidden)")
    parser.add_argument("--heads", type=int, help="attention heads (default hidden / 64)")
    parser.add_argument("--kv-heads", type=int, help="key/value heads (default 1)")
    parser.add_argument("--min-len", type=int)
    parser.add_argument("--max-len", type=int)
    parser.add_argument("--budget", type=int, help="max_tokens_per_micro_batch (default: 2 x the longest sequence)")
    parser.add_argument("--chunk", type=int, help="logprob_chunk_tokens (default: budget / 16)")
    parser.add_argument("--batch-sizes", default=",".join(map(str, BATCH_SIZES)), help="sequences per step")
    parser.add_argument("--no-packing", action="store_true", help="right-padded micro-batches (learner.packing=false)")
    parser.add_argument("--mixed-precision", action="store_true", help="learner.mixed_precision=bfloat16")
    parser.add_argument("--checkpointing", nargs="?", const="full", choices=("full", "selective"),
                        help="learner.gradient_checkpointing: true (full, the default of the flag) or selective")
    parser.add_argument("--attn", choices=("sdpa", "varlen", "flash_attention_2", "eager"),
                        help="learner.attn_implementation of the packed passes (default sdpa)")
    parser.add_argument("--throughput-batch", type=int, help="sequences of the learner-vs-plain forward+backward "
                        "(default the smallest of --batch-sizes; issue 27's goal is at 32)")
    parser.add_argument("--no-old", action="store_true", help="skip the former path's step")
    parser.add_argument("--repeats", type=int, default=1, help="steps on new lengths per batch size, each then "
                        "repeated warm: the new-shapes and warm times are their sums (one step's time is noisy)")
    args = parser.parse_args()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))

    quick = args.quick
    max_len = args.max_len or (160 if quick else 4096)
    budget = args.budget or 2 * max_len
    shape = dict(zip(("hidden", "layers", "intermediate", "heads", "kv_heads"), SHAPES[args.shape])) if args.shape else {}
    setup = {"quick": quick, "device": args.device, "vocab": args.vocab,
             "hidden": args.hidden or shape.get("hidden") or (128 if quick else 512),
             "layers": args.layers or shape.get("layers") or (2 if quick else 4),
             "intermediate": args.intermediate or shape.get("intermediate"), "heads": args.heads or shape.get("heads"),
             "kv_heads": args.kv_heads or shape.get("kv_heads") or 1, "attn": args.attn,
             "min_len": args.min_len or (32 if quick else 512),
             "max_len": max_len, "budget": budget,
             "chunk": args.chunk or max(1, budget // 16),  # the config defaults' proportion (16,384 / 1,024)
             "batch_sizes": sorted(int(b) for b in args.batch_sizes.split(",")), "packing": not args.no_packing,
             "mixed_precision": "bfloat16" if args.mixed_precision else None, "checkpointing": args.checkpointing,
             "repeats": args.repeats}
    started = time.perf_counter()
    print(f"Qwen2 vocab {setup['vocab']}, hidden {setup['hidden']}, {setup['layers']} layers (MLP "
          f"{setup['intermediate'] or setup['hidden'] * 11 // 4}, heads {setup['heads'] or max(1, setup['hidden'] // 64)}"
          f"/{setup['kv_heads']} key-value); sequences "
          f"{setup['min_len']}-{max_len} tokens; budget {budget} tokens per micro-batch, LM-head chunks of "
          f"{setup['chunk']}; device {args.device}, {torch.get_num_threads()} torch thread(s)")
    with tempfile.TemporaryDirectory() as tmp:
        model = str(build_policy(Path(tmp) / "policy", setup["vocab"], setup["hidden"], setup["layers"], max_len + 8,
                                 setup["intermediate"], setup["heads"], setup["kv_heads"]))
        common = {"model": model, **{k: setup[k] for k in ("device", "vocab", "hidden", "min_len", "max_len", "budget",
                                                           "chunk", "packing", "mixed_precision", "checkpointing",
                                                           "attn", "repeats")}}
        steps = measure_steps(common, setup["batch_sizes"], old=False)
        # The old path at the smallest batch only: its cost and memory grow with B x L x V.
        old = {} if args.no_old else measure_steps(common, setup["batch_sizes"][:1], old=True)
        for batch in setup["batch_sizes"][0 if args.no_old else 1:]:
            print(f"  old step B={batch:4d}: not run, its float32 [B, L, V] logits alone are "
                  f"{batch * max_len * setup['vocab'] * 4 / GiB:.1f} GiB")
        head = measure_head(common)
        setup["throughput_batch"] = args.throughput_batch or setup["batch_sizes"][0]
        throughput = measure_throughput(common, setup["throughput_batch"])
    summary = summarize(setup, steps, old, head, throughput)
    summary["wall_s"] = round(time.perf_counter() - started, 1)
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
