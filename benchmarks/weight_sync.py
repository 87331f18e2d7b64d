"""Weight sync at real sizes: every channel, 1, 2 and 4 receiving engines, measured in one run.

A Qwen2-shaped policy of --layers x --hidden (default 24 x 1024, vocab 32,000, tied embeddings:
304M parameters, built from its config) trains in this process in float32 (forward and backward
of --tokens tokens, then an SGD step under the parameter guard), and after every step publishes
its weights in bfloat16 (what a run with bf16 engines sends; 608 MB) through the real channel
code of `lm/weight_sync`: the board is the run's `WeightStore` actor, each engine a Ray actor
holding a bfloat16 transformers engine whose weight loop receives every version the way a rollout
worker does at its interrupt points. Channels:
  broadcast   gloo weight group, chunks of --bucket-mb down a chain (engine r forwards to r + 1),
              sent from a bfloat16 snapshot (the default with gloo: the optimizer step waits only
              for the copy); an engine may hold --ahead-mb received but not yet forwarded and
              loaded (default a whole version, as with gloo: the learner's send is not held up by
              the engines further down)
  guard       the same without the snapshot: the optimizer step waits until the send has read
              the parameters (the default with NCCL, where a send is short next to a step)
  star        the chain's group with gloo's own broadcast (a binomial tree: the root sends each byte
              to ranks 1, 2, 4, ...: about log2(engines + 1) times)
  object      one shared object per version in the Ray object store
  folder      one safetensors folder per version
Per channel and engine count, medians over --rounds steps (after one warm-up step):
  own    the learner's own time per sync (the send / put / write, in its publication thread)
  served from the hand-over until every engine serves the version
  blocked the learner's blocked time per step (its optimizer step waiting for a send)
  wrote  the bytes the learner's process wrote per sync (sockets and files, /proc's wchar): what
         its own share of the work grows with, whatever the cores (a chain 1x the version, gloo's
         broadcast about log2(engines + 1) x)
and the ratios 4 engines / 1 engine. Goals (broadcast): own(4)/own(1) <= 2 (a star would be ~4),
served(4)/served(1) <= 2, blocked <= 10 % of served. On this machine every engine's copy into
its model and every hop's forwarding share the same few cores with the learner; see the README
for what a GPU cluster would see. The last line printed is a JSON summary.

    .venv/bin/python benchmarks/weight_sync.py [--quick] [--engines 1 2 4] [--rounds 5]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil
import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from lm.weight_sync import (  # noqa: E402
    BroadcastSender,
    FolderSender,
    ObjectStoreSender,
    ParameterGuard,
    Publication,
    WeightStore,
    WeightSubscription,
)

CHANNELS = ("broadcast", "guard", "star", "object", "folder")


def qwen2_config(layers: int, hidden: int, vocab: int):
    from transformers import Qwen2Config

    return Qwen2Config(vocab_size=vocab, hidden_size=hidden, intermediate_size=hidden * 11 // 4,
                       num_hidden_layers=layers, num_attention_heads=max(1, hidden // 64),
                       num_key_value_heads=max(1, hidden // 256), max_position_embeddings=512,
                       tie_word_embeddings=True)


class EngineActor:
    """One rollout engine reduced to its weight loop (a Ray actor): a bfloat16 engine (transformers,
    or vLLM's AsyncLLM whose worker process receives through etarl's gloo weight-transfer plugin)
    that receives each newer version between (empty) engine steps."""

    def __init__(self, model_dir: str, kind: str = "hf"):
        torch.set_num_threads(1)
        if kind == "vllm":
            from rollout_workers.engines.vllm_engine import VLLMEngine

            self.engine = VLLMEngine(model_dir, dtype="bfloat16", max_model_len=128, kv_cache_bytes=32 * 2**20)
        else:
            from rollout_workers.engines.hf_engine import HFEngine

            self.engine = HFEngine(model_dir, dtype="bfloat16")
        self.loaded_at: dict[int, float] = {}
        self.errors: list[str] = []
        self._stop = threading.Event()
        self._thread = None

    def start(self, board, name: str) -> None:
        """Join `board` as `name`, behind every version, and follow it until stop()."""
        self.engine.version, self.loaded_at, self._stop = -1, {}, threading.Event()  # wants version 0 on
        subscription = WeightSubscription(board, name, self.engine.version)
        self._thread = threading.Thread(target=self._loop, args=(subscription,), daemon=True)
        self._thread.start()

    def _loop(self, subscription: WeightSubscription) -> None:
        while not self._stop.is_set():
            if subscription.newest_version() > self.engine.version:
                try:
                    version = subscription.receive(self.engine, wait_s=300.0, stop=self._stop)
                    if version is not None:
                        self.loaded_at[version] = time.time()
                except Exception as err:  # counted and reported; the run goes on
                    self.errors.append(f"{type(err).__name__}: {err}")
            self._stop.wait(0.005)

    def loaded(self) -> dict[int, float]:
        return dict(self.loaded_at)

    def paused_s(self) -> float:
        """The time weight updates held the engine's generation paused so far (vLLM)."""
        return float(getattr(self.engine, "pause_s_total", 0.0))

    def stop(self) -> dict:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(60)
        return {"loaded_at": self.loaded_at, "errors": self.errors}


SNAPSHOT = {"broadcast": True, "star": True}  # as the config's default for gloo; "guard" turns it off


class TrainingLearner:
    """The learner's side: float32 parameters trained step by step, the guard around the
    optimizer step, and a publication thread around the channel's sender."""

    def __init__(self, config, tokens: int):
        from transformers import Qwen2ForCausalLM

        torch.manual_seed(0)
        self.model = Qwen2ForCausalLM(config).train()
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=1e-4)
        self.guard = ParameterGuard()
        self.batch = torch.randint(0, config.vocab_size, (1, tokens))
        self.publication: Publication | None = None

    def use(self, sender, snapshot: bool) -> None:
        if self.publication is not None:
            self.publication.close()
        self.publication = Publication(sender, self.guard, self.model.state_dict, snapshot, torch.bfloat16)

    def step(self) -> float:
        """One training step; its compute seconds (forward, backward, optimizer step)."""
        start = time.perf_counter()
        loss = self.model(input_ids=self.batch, labels=self.batch).loss
        loss.backward()
        with self.guard.writing():
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return time.perf_counter() - start


def make_sender(channel: str, board, folder: Path, bucket_bytes: int, ahead_bytes: int | None):
    dtype = torch.bfloat16
    if channel in ("broadcast", "guard", "star"):
        return BroadcastSender(board, "gloo", "star" if channel == "star" else "chain", bucket_bytes,
                               ready_timeout_s=120, timeout_s=300, dtype=dtype, ahead_bytes=ahead_bytes)
    if channel == "object":
        return ObjectStoreSender(board, dtype)
    return FolderSender(board, str(folder), dtype)


def measure(channel: str, engines: list, learner: TrainingLearner, rounds: int, folder: Path,
            bucket_bytes: int, ahead_bytes: int | None) -> dict:
    """Two phases on one board, a warm-up version first (the group forms, caches fill):
    syncs    `rounds` times: a training step, then its version is published and waited for until
             every engine serves it: the channel's own time and the time until served;
    training `rounds` steps back to back, each version handed over as its step ends and sent
             while the next step runs: the learner's blocked time per step (a version still
             unsent when a newer one is ready is skipped: the engines get the newest)."""
    import ray

    board = ray.remote(WeightStore).options(num_cpus=0, max_concurrency=64).remote()
    ray.get([e.start.remote(board, f"engine-{i}") for i, e in enumerate(engines)])
    learner.use(make_sender(channel, board, folder, bucket_bytes, ahead_bytes), SNAPSHOT.get(channel, False))
    published_at, served_at, own, copy, compute, blocked, written = {}, {}, [], [], [], [], []
    me = psutil.Process()
    paused_before = sum(ray.get([e.paused_s.remote() for e in engines]))

    def publish(version: int) -> None:
        published_at[version] = time.time()
        learner.publication.publish(version)

    try:
        for version in range(rounds + 1):  # syncs, version 0 the warm-up
            learner.step()
            chars = me.io_counters().write_chars
            publish(version)
            served_at[version] = _served(engines, version)
            _wait(lambda: learner.publication.last.get("version") == version)
            written.append(me.io_counters().write_chars - chars)
            own.append(learner.publication.last["own_s"])
            copy.append(learner.publication.last.get("copy_s", 0.0))
        learner.guard.take_blocked_s()
        last = 2 * rounds + 1
        for version in range(rounds + 1, last + 1):  # training, the first step's wait is the warm-up's
            compute.append(learner.step())
            blocked.append(learner.guard.take_blocked_s())
            publish(version)
        _served(engines, last)
        skipped = last - rounds - len({s["version"] for s in learner.publication.recent if s["version"] > rounds})
        paused_s = sum(ray.get([e.paused_s.remote() for e in engines])) - paused_before
        reports = ray.get([e.stop.remote() for e in engines])
    finally:
        learner.publication.close()
        learner.publication = None
        ray.kill(board)
    errors = [err for r in reports for err in r["errors"]]
    if errors:
        raise RuntimeError(f"{channel} x {len(engines)}: an engine failed: {errors[0]}")
    served = [served_at[v] - published_at[v] for v in range(1, rounds + 1)]
    return {"channel": channel, "engines": len(engines), "own_s": statistics.median(own[1:]),
            "copy_s": statistics.median(copy[1:]), "served_s": statistics.median(served),
            "blocked_s": statistics.median(blocked[1:]), "step_s": statistics.median(compute[1:]),
            "learner_written_mb": statistics.median(written[1:]) / 1e6,
            "skipped_versions": skipped,
            # per engine and update: how long generation was held paused (vLLM: from start to finish)
            "pause_s": paused_s / max(1, sum(len(r["loaded_at"]) for r in reports))}


def _served(engines: list, version: int) -> float:
    """Wait until every engine serves `version` or newer; the wall time the last one did."""
    import ray

    _wait(lambda: all(any(u >= version for u in got) for got in ray.get([e.loaded.remote() for e in engines])))
    return max(min(t for u, t in got.items() if u >= version) for got in ray.get([e.loaded.remote() for e in engines]))


def _wait(condition, timeout: float = 900.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError("weight sync benchmark: a version never arrived")
        time.sleep(0.02)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="a 33M-parameter model, 3 rounds (under 3 minutes)")
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--tokens", type=int, default=64, help="tokens per training step of the learner")
    parser.add_argument("--engines", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--channels", nargs="+", default=list(CHANNELS), choices=CHANNELS)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--engine", choices=("hf", "vllm"), default="hf",
                        help="the receiving engines: transformers (the gloo receiver in the actor's process) or "
                             "vLLM-CPU (the same receiver inside vLLM's worker process, through its weight transfer)")
    parser.add_argument("--bucket-mb", type=float, default=32.0)
    parser.add_argument("--ahead-mb", type=float, default=None,
                        help="what an engine may hold received but not yet forwarded and loaded "
                             "(learner.weight_sync.receive_ahead_mb; default: a whole version, as with gloo)")
    args = parser.parse_args()
    if args.quick:
        args.layers, args.hidden, args.rounds, args.tokens, args.bucket_mb = 6, 512, 3, 32, 4.0
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))

    import ray

    from services.local_ray import init_local_ray

    config = qwen2_config(args.layers, args.hidden, args.vocab)
    with tempfile.TemporaryDirectory(prefix="etarl-weight-sync-") as tmp:
        learner = TrainingLearner(config, args.tokens)
        params = sum(p.numel() for p in learner.model.parameters())
        model_dir = Path(tmp) / "model"
        learner.model.to(torch.bfloat16).save_pretrained(model_dir)
        learner.model.float()
        mb = params * 2 / 1e6
        print(f"policy: {args.layers} layers x {args.hidden}, vocab {args.vocab}: {params / 1e6:.0f}M parameters, "
              f"{mb:.0f} MB per version in bfloat16; learner step: {args.tokens} tokens, float32; "
              f"torch threads {torch.get_num_threads()}, {os.cpu_count()} cores")
        init_local_ray(num_cpus=max(args.engines) + 1, log_to_driver=False,
                       runtime_env={"env_vars": {"OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}})
        try:
            actor = ray.remote(EngineActor).options(num_cpus=0, max_concurrency=4)
            pool = [actor.remote(str(model_dir), args.engine) for _ in range(max(args.engines))]
            results = []
            for channel in args.channels:
                for n in args.engines:
                    row = measure(channel, pool[:n], learner, args.rounds, Path(tmp) / f"folders-{channel}-{n}",
                                  int(args.bucket_mb * 2**20),
                                  None if args.ahead_mb is None else int(args.ahead_mb * 2**20))
                    results.append(row)
                    print(f"  {channel:9s} x{n}: own {row['own_s']:6.2f} s (+ copy {row['copy_s']:.2f} s)  served "
                          f"{row['served_s']:6.2f} s  | training: blocked {row['blocked_s']:5.2f} s per "
                          f"{row['step_s']:.2f} s step, {row['skipped_versions']} of {args.rounds} versions "
                          f"skipped | the learner wrote {row['learner_written_mb']:.0f} MB | an engine paused "
                          f"{row['pause_s']:.2f} s per update", flush=True)
        finally:
            ray.shutdown()
    print(json.dumps(summarize(results, args, params, mb)))


def summarize(results: list[dict], args, params: int, mb: float) -> dict:
    by = {(r["channel"], r["engines"]): r for r in results}
    lo, hi = min(args.engines), max(args.engines)
    ratios = {}
    for channel in args.channels:
        if (channel, lo) in by and (channel, hi) in by:
            for key in ("own_s", "served_s", "learner_written_mb"):
                low = by[(channel, lo)][key]
                ratios[f"{channel}_{key.rsplit('_', 1)[0]}_{hi}_over_{lo}"] = (
                    round(by[(channel, hi)][key] / low, 2) if low > 0 else None)  # none written: no ratio
    print(f"ratios {hi} engines / {lo}: " + ", ".join(f"{k} {v:.2f}" for k, v in ratios.items() if v is not None))
    goals = {}
    if "broadcast" in args.channels:
        cast = [r for r in results if r["channel"] == "broadcast"]
        goals = {
            "broadcast_own_within_2x": ratios.get(f"broadcast_own_{hi}_over_{lo}", float("inf")) <= 2.0,
            "broadcast_served_within_2x": ratios.get(f"broadcast_served_{hi}_over_{lo}", float("inf")) <= 2.0,
            "broadcast_blocked_within_10pct": all(r["blocked_s"] <= 0.1 * r["served_s"] for r in cast),
        }
        print("goals: " + ", ".join(f"{k} {'met' if v else 'NOT met'}" for k, v in goals.items()))
    return {"benchmark": "weight_sync", "engine": args.engine, "quick": bool(args.quick),
            "params_m": round(params / 1e6, 1),
            "mb_per_version": round(mb, 1), "bucket_mb": args.bucket_mb, "receive_ahead_mb": args.ahead_mb,
            "rounds": args.rounds,
            "results": [{k: round(v, 3) if isinstance(v, float) else v for k, v in r.items()} for r in results],
            "ratios": ratios, "goals": goals}


if __name__ == "__main__":
    main()
