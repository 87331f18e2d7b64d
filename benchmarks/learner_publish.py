"""What publishing a version costs an FSDP learner: rank 0's peak extra host memory and the time
every rank waits, before (a float32 full state dict gathered to rank 0's CPU, then cast to the
publish dtype on one thread), after (one bucket at a time, each parameter cast on its device, into
a whole version on rank 0's host: `Learner._gathered`, what the pull channels take) and streamed
(the broadcast channel: the send's chunks filled from buckets gathered as it reaches them,
`Learner._publish_streamed`; the socket left out).

    .venv/bin/python benchmarks/learner_publish.py [--quick] [--ranks 2] [--rounds 3]

A Qwen2-shaped policy of --layers x --hidden (default 24 x 1024, vocab 32,000, tied embeddings:
303M parameters, the size of benchmarks/weight_sync.py), float32 master weights sharded by FSDP2
over --ranks gloo processes on this machine, published in bfloat16. Each round measures both
paths on every rank (order alternating); peaks are the resident set above the level at the start
of the phase (sampled every 2 ms; a fixed glibc mmap threshold and a trim between phases, so a
phase's freed tensors do not hide in the heap). The gather is a collective:
its time is on every rank's step path. Prints the numbers and, as its last line, a JSON summary.
Asserts nothing.
"""
from __future__ import annotations

import argparse
import ctypes
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.multiprocessing as mp

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

MB = 2**20
PATHS = ("before", "after", "streamed")
CHUNK_MB = 32  # the gloo send's chunk (learner.weight_sync.bucket_mb's default)
PUBLISH_BUCKET_MB = 64  # learner.distributed.publish_bucket_mb's default: what a gather holds at once


def _trim() -> None:
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except OSError:
        pass


def _rank(rank: int, world: int, folder: str, rendezvous: str, rounds: int, out_file: str) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    import torch.distributed as dist

    from learner.config import LearnerConfig
    from learner.distributed import PeakRSS, ProcessGroupComm
    from learner.trainer import Learner
    from lm.weight_sync.layout import cast

    dist.init_process_group("gloo", init_method=rendezvous, rank=rank, world_size=world)
    config = LearnerConfig(model_path=folder, distributed={"world_size": world, "strategy": "fsdp",
                                                           "publish_bucket_mb": PUBLISH_BUCKET_MB},
                           weight_sync={"dtype": "bfloat16"})
    learner = Learner(config, comm=ProcessGroupComm(rank, world, sum_grads=False))

    def before():
        state = learner.full_state_dict()  # the former path: float32, full, on rank 0's CPU
        gathered = time.perf_counter()
        if rank == 0:
            state = cast(state, torch.bfloat16)  # then cast on one thread (the publication's copy)
        return state, gathered

    def after():
        return learner._gathered(), None

    def streamed():
        """The broadcast channel's path under FSDP (`Learner._publish_streamed`): rank 0 fills the
        send's chunks in layout order from a BucketStream (gathered as the chunks reach each bucket);
        the socket left out, the memory is the send's."""
        from lm.weight_sync.layout import BucketStream, Layout, fill_chunk

        buckets = learner._publish_buckets()  # bfloat16 (weight_sync.dtype), on the host
        if rank != 0:
            for _ in buckets:
                pass
            return {}, None
        layout, stream = Layout.of(buckets.meta().items()), BucketStream(buckets)
        chunk = torch.empty(CHUNK_MB * MB, dtype=torch.uint8)
        for span in layout.chunks(CHUNK_MB * MB):
            fill_chunk(chunk, layout, span, stream)
        stream.drain()
        return {}, None

    rows = []
    for r in range(rounds):
        phases = [("before", before), ("after", after), ("streamed", streamed)]
        for name, fn in (phases if r % 2 == 0 else phases[::-1]):
            _trim()
            dist.barrier()
            start = time.perf_counter()
            with PeakRSS() as peak:
                state, gathered = fn()
                total = time.perf_counter() - start
                nbytes = sum(t.numel() * t.element_size() for t in {id(t): t for t in state.values()}.values())
                del state
            rows.append({"path": name, "round": r, "rank": rank, "peak_extra_mb": peak.peak_bytes / MB,
                         "gather_s": (gathered or time.perf_counter()) - start if name == "before" else total,
                         "total_s": total, "bytes_mb": nbytes / MB})
    dist.barrier()
    Path(out_file).write_text(json.dumps(rows))
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--vocab", type=int, default=32_000)
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="6 x 512 (33M), 2 rounds")
    args = parser.parse_args()
    if args.quick:
        args.layers, args.hidden, args.rounds = 6, 512, 2
    # A fixed mmap threshold: freed large tensors go back to the system at once, so each phase's
    # resident peak is its own (glibc's dynamic threshold would keep them in the heap for reuse).
    os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", str(1 << 20))
    from benchmarks.weight_sync import qwen2_config
    from transformers import Qwen2ForCausalLM

    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / "policy"
        torch.manual_seed(0)
        model = Qwen2ForCausalLM(qwen2_config(args.layers, args.hidden, args.vocab))
        params = sum(p.numel() for p in model.parameters())
        model.save_pretrained(folder)
        del model
        print(f"policy: {args.layers} x {args.hidden}, vocab {args.vocab}: {params / 1e6:.0f}M parameters, "
              f"float32 {params * 4 / MB:.0f} MB, bfloat16 {params * 2 / MB:.0f} MB; {args.ranks} FSDP ranks (gloo)")
        outs = [str(Path(tmp) / f"rank{r}.json") for r in range(args.ranks)]
        procs = [mp.get_context("spawn").Process(target=_rank, args=(r, args.ranks, str(folder),
                                                                      f"file://{tmp}/rendezvous", args.rounds, outs[r]))
                 for r in range(args.ranks)]
        for p in procs:
            p.start()
        for p in procs:
            p.join()
        if any(p.exitcode != 0 for p in procs):
            raise SystemExit(f"a rank failed: exit codes {[p.exitcode for p in procs]}")
        rows = [row for f in outs for row in json.loads(Path(f).read_text())]

    summary = {"params": params, "ranks": args.ranks, "rounds": args.rounds}
    for path in PATHS:
        for rank in range(min(args.ranks, 2)):  # rank 0 and one other (every other rank does the same)
            mine = [r for r in rows if r["path"] == path and r["rank"] == rank]
            peak = statistics.median(r["peak_extra_mb"] for r in mine)
            gather = statistics.median(r["gather_s"] for r in mine)
            total = statistics.median(r["total_s"] for r in mine)
            print(f"{path:6s} rank {rank}: peak extra host memory {peak:7.0f} MB, gather (every rank waits) "
                  f"{gather:5.2f} s, until rank 0 holds the bfloat16 version {total:5.2f} s, holds {mine[0]['bytes_mb']:.0f} MB")
            summary[f"{path}_rank{rank}_peak_extra_mb"] = round(peak, 1)
            summary[f"{path}_rank{rank}_gather_s"] = round(gather, 3)
            summary[f"{path}_rank{rank}_total_s"] = round(total, 3)
    summary["rank0_peak_ratio_after_before"] = round(summary["after_rank0_peak_extra_mb"]
                                                     / max(summary["before_rank0_peak_extra_mb"], 1e-9), 3)
    summary["rank0_total_ratio_after_before"] = round(summary["after_rank0_total_s"]
                                                      / max(summary["before_rank0_total_s"], 1e-9), 3)
    summary["rank0_peak_ratio_streamed_before"] = round(summary["streamed_rank0_peak_extra_mb"]
                                                        / max(summary["before_rank0_peak_extra_mb"], 1e-9), 3)
    summary["streamed_rank0_peak_in_buckets"] = round(summary["streamed_rank0_peak_extra_mb"] / PUBLISH_BUCKET_MB, 2)
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
