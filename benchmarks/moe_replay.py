"""The reference's MoE table on tiny-moe: off-policiness N x {no replay, R2, R3, GSPO} x seeds.

shared/reference/offpolicy_corrections_five_sources.md (source 4) claims that which routing replay
helps depends on the off-policiness N = global batch / mini-batch: N = 1 neither, N = 2 R2, N >= 4
R3, N = 8 only R3 with clipping stays stable; GSPO (sequence-level ratio) is the alternative that
replays nothing. This script runs the real `Learner` on the tiny MoE policy (`run.model: tiny-moe`,
the experiments' addition model as a Qwen3-MoE) fed by the transformers engine in bfloat16, so the
sampler and the float32 learner disagree on some routes; every batch is sampled with the learner's
current weights (no staleness), so N is the only off-policiness besides the backend's. Per
(N, variant), over seeds: the routing mismatch at the proximal pass, the IS weights' spread and
effective sample size, the clip fraction, and the held-out gain (teacher-forced greedy accuracy and
p_exact, experiment_lib.HeldOut).

    python benchmarks/moe_replay.py                  # 4 N x 4 variants x 3 seeds, 20 steps each
    python benchmarks/moe_replay.py --quick          # N in {1, 8}, none and r3, 1 seed, 4 steps, on a
                                                     # model warmed 20 steps (a smoke test, not a measurement)

Writes docs/results/moe_replay.json and docs/results/moe_replay.png, prints the table.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import experiment_lib as lib  # noqa: E402
import numpy as np  # noqa: E402

from lm.causal_lm import load_tokenizer  # noqa: E402
from rollout_workers.engines.hf_engine import HFEngine  # noqa: E402
from rollout_workers.tiny_model import ensure_tiny_model  # noqa: E402

MOE_MODEL = lib.EXPERIMENT_MODEL.moe()
VARIANTS = {  # label: learner overrides
    "none": {},
    "r2": {"routing_replay": "r2"},
    "r3": {"routing_replay": "r3"},
    "gspo": {"policy_loss": {"loss_mode": "gspo"}},
}
EXTRA_KEYS = ("moe/routing_mismatch", "moe/routing_mismatch_any", "rollout_corr/rollout_is_std")
SUMMARY = {  # column: (where, key, how)
    "mismatch": ("steps", "moe/routing_mismatch", "mean"),
    "is_std": ("steps", "rollout_corr/rollout_is_std", "mean"),
    "ess": ("steps", "rollout_corr/rollout_is_eff_sample_size", "mean"),
    "clipfrac": ("steps", "actor/pg_clipfrac", "mean"),
    "ppo_kl": ("steps", "actor/ppo_kl", "mean"),
    "acc_gain": ("evals", "accuracy", "gain"),
    "p_exact_gain": ("evals", "p_exact", "gain"),
}


def summarise(run: dict, where: str, key: str, how: str) -> float:
    if how == "gain":
        return run["evals"][-1][key] - run["evals"][0][key]
    values = [r[key] for r in run[where] if key in r and np.isfinite(r[key])]
    return float(np.mean(values)) if values else float("nan")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ns", default="1,2,4,8", help="off-policiness values N (mini-batches per batch)")
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--groups", type=int, default=8, help="prompts per step (B); N must divide it")
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--difficulty", type=int, default=2, help="digits of the addition task (train and held-out)")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--out", default=str(lib.RESULTS_DIR / "moe_replay.json"))
    args = parser.parse_args(argv)
    spec = MOE_MODEL
    if args.quick:
        args.ns, args.variants, args.seeds, args.steps = "1,8", "none,r3", 1, 4
        spec = MOE_MODEL.model_copy(update={"warm_start_steps": 20})  # built in seconds, cached apart
    ns = [int(n) for n in args.ns.split(",")]
    variants = args.variants.split(",")
    started = time.perf_counter()
    lib.setup_torch()
    lib.STEP_KEYS = (*lib.STEP_KEYS, *EXTRA_KEYS)  # the harness keeps these per step too
    model_dir = ensure_tiny_model(lib.MODEL_CACHE, spec, log=lambda *_: None)
    tokenizer = load_tokenizer(model_dir)
    settings = lib.ToySettings(steps=args.steps, groups_per_step=args.groups, group_size=8, lr=args.lr,
                               difficulties=[args.difficulty],
                               ppo_epochs=1, ppo_mini_batch_size=args.groups, eval_every=max(1, args.steps // 4))
    heldout = lib.HeldOut(tokenizer, settings.difficulties, settings.heldout_prompts)
    engine = HFEngine(model_dir, dtype="bfloat16", device="cpu")  # the sampler disagrees with the float32 learner
    runs: dict[str, dict[str, list[dict]]] = {}
    for n in ns:
        if args.groups % n:
            raise SystemExit(f"N={n} does not divide --groups {args.groups}")
        mini = settings.model_copy(update={"ppo_mini_batch_size": args.groups // n})
        for variant in variants:
            for seed in range(args.seeds):
                rollouts = lib.Rollouts(engine, tokenizer, mini, seed)
                config = lib.learner_config(model_dir, mini, "decoupled_token_is", seed, **VARIANTS[variant])
                run = lib.train_run(config, rollouts, heldout, lambda step: step, mini,
                                    label=f"N={n} {variant} seed {seed}")
                runs.setdefault(f"N={n}", {}).setdefault(variant, []).append(run)
    table = {nk: {v: {col: lib.mean_spread([summarise(r, *spec) for r in rs]) for col, spec in SUMMARY.items()}
                  for v, rs in by_variant.items()} for nk, by_variant in runs.items()}
    header = ["N", "variant", *SUMMARY]
    rows = [[nk, v, *(lib.fmt(cols[c]) for c in SUMMARY)] for nk, by_v in table.items() for v, cols in by_v.items()]
    print(lib.markdown_table(header, rows))
    record = lib.result_record("moe_replay", argv, settings, model_dir, started, table=table,
                               sampler_dtype="bfloat16", learner_dtype="float32", ns=ns, variants=variants,
                               seeds=args.seeds, runs=runs)
    out = lib.write_json(Path(args.out), record)
    _plot(out.with_suffix(".png"), table, ns, variants)
    print(f"wrote {out} and {out.with_suffix('.png')} in {time.perf_counter() - started:.0f} s")


def _plot(path: Path, table: dict, ns: list[int], variants: list[str]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    columns = ["mismatch", "is_std", "clipfrac", "acc_gain", "p_exact_gain"]
    fig, axes = plt.subplots(1, len(columns), figsize=(4.2 * len(columns), 3.6))
    for ax, col in zip(axes, columns):
        for variant in variants:
            mean = [table[f"N={n}"][variant][col]["mean"] for n in ns]
            low = [table[f"N={n}"][variant][col]["min"] for n in ns]
            high = [table[f"N={n}"][variant][col]["max"] for n in ns]
            (line,) = ax.plot(ns, mean, marker="o", label=variant)
            ax.fill_between(ns, low, high, color=line.get_color(), alpha=0.12)
        ax.set_xscale("log", base=2)
        ax.set_xticks(ns, [str(n) for n in ns])
        ax.set_xlabel("N (mini-batches per batch)")
        ax.set_title(col, fontsize=10)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.suptitle("tiny-moe: routing replay by off-policiness (bf16 sampler, fp32 learner; seed mean, min-max band)")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)


if __name__ == "__main__":
    main()
