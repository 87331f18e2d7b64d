"""Staleness ablation (AReaL's experiment at toy scale): η × {naive PPO, decoupled PPO + token-TIS}.

    .venv/bin/python benchmarks/staleness_ablation.py --quick     # a few minutes
    .venv/bin/python benchmarks/staleness_ablation.py             # η in {0,1,2,4,8,unbounded}, 3 seeds

Every run trains the warm-started tiny model on 3-digit addition with the real Learner for a
fixed budget of samples (steps × B groups × n), sampling with the transformers engine. Staleness
is produced exactly (see benchmarks/experiment_lib.py): the batch of learner step i is sampled
with the weights of version max(0, i − η), the most a run under the η gate can lag when workers
are faster than the learner; "unbounded" lags without limit, version i // 4 (workers 4x faster
than the learner and no gate, so the lag grows as 3i/4).

Methods: naive PPO = bypass_ppo_clip (the PPO ratio is π_θ/μ against the stale behaviour
log-probs; no proximal policy, no IS weights); decoupled = decoupled_token_is (π_old recomputed
with the current weights, PPO clipped on π_θ/π_old, token weights π_old/μ truncated at 2).
Writes <out>/staleness_ablation[_quick].json and .png; prints the final held-out accuracy table.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import experiment_lib as lib  # noqa: E402

from lm.causal_lm import load_tokenizer  # noqa: E402
from rollout_workers.engines.hf_engine import HFEngine  # noqa: E402

METHODS = {"naive_ppo": "bypass_ppo_clip", "decoupled_tis": "decoupled_token_is"}
UNBOUNDED = "unbounded"
UNBOUNDED_SPEEDUP = 4  # workers this many times faster than the learner, no gate
ALL_ETAS = ["0", "1", "2", "4", "8", UNBOUNDED]


def behaviour_schedule(eta: str):
    """Learner step i -> the weight version its batch is sampled with."""
    if eta == UNBOUNDED:
        return lambda step: step // UNBOUNDED_SPEEDUP
    lag = int(eta)
    return lambda step: step - lag


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="η in {0, 4, unbounded}, 2 seeds, 12 steps")
    p.add_argument("--etas", help=f"comma-separated, from {','.join(ALL_ETAS)}")
    p.add_argument("--seeds", type=int)
    p.add_argument("--first-seed", type=int, default=0, help="seeds are first-seed, first-seed + 1, ...")
    p.add_argument("--steps", type=int)
    p.add_argument("--lr", type=float)
    p.add_argument("--ppo-epochs", type=int)
    p.add_argument("--eval-every", type=int)
    p.add_argument("--difficulties", help="comma-separated addition difficulties (digits), default 2")
    p.add_argument("--groups", type=int, help="prompts per learner step (default 16)")
    lib.add_model_argument(p)
    p.add_argument("--out", type=Path, default=lib.RESULTS_DIR)
    p.add_argument("--name", help="file stem (default staleness_ablation[_quick])")
    p.add_argument("--merge", type=Path, nargs="+",
                   help="no training: pool the runs of several saved JSONs (same settings, other seeds) into <out>/<name>.json")
    p.add_argument("--from-json", type=Path,
                   help="no training: recompute the summary of a saved JSON, redraw its PNGs and print the table")
    args = p.parse_args(argv)
    etas = (args.etas or ("0,4," + UNBOUNDED if args.quick else ",".join(ALL_ETAS))).split(",")
    bad = [e for e in etas if e != UNBOUNDED and not e.isdigit()]
    if bad:
        p.error(f"--etas: {bad} are not non-negative integers or {UNBOUNDED!r}")
    args.etas = etas
    args.seeds = args.seeds or (2 if args.quick else 3)
    args.name = args.name or ("staleness_ablation_quick" if args.quick else "staleness_ablation")
    return args


def settings_from(args) -> lib.ToySettings:
    changes = {"steps": args.steps or (12 if args.quick else 40)}
    if args.groups:
        changes["groups_per_step"] = args.groups
        changes["ppo_mini_batch_size"] = min(args.groups, lib.ToySettings().ppo_mini_batch_size)
    for key in ("lr", "ppo_epochs", "eval_every"):
        if getattr(args, key) is not None:
            changes[key] = getattr(args, key)
    if args.difficulties:
        changes["difficulties"] = [int(d) for d in args.difficulties.split(",")]
    if args.quick and args.eval_every is None:
        changes["eval_every"] = 4
    return lib.ToySettings(**changes)


def summarise(results: dict, etas: list[str]) -> dict:
    summary = {}
    for method, by_eta in results.items():
        summary[method] = {}
        for eta in etas:
            runs = by_eta[eta]
            summary[method][eta] = {
                "final_accuracy": lib.mean_spread([r["final"]["accuracy"] for r in runs]),
                "final_p_exact": lib.mean_spread([r["final"]["p_exact"] for r in runs]),
                "curve_accuracy": lib.mean_spread([lib.curve_mean(r, "accuracy") for r in runs]),
                "curve_p_exact": lib.mean_spread([lib.curve_mean(r, "p_exact") for r in runs]),
                "train_reward_last5": lib.mean_spread([lib.tail_mean(r, "reward/mean") for r in runs]),
                "mean_staleness": lib.mean_spread([lib.tail_mean(r, "staleness/mean", 10**6) for r in runs]),
                "rollout_corr_kl": lib.mean_spread([lib.tail_mean(r, "rollout_corr/kl", 10**6) for r in runs]),
                "gap_k1": lib.mean_spread([lib.tail_mean(r, "gap/k1", 10**6) for r in runs]),
                "pg_clipfrac": lib.mean_spread([lib.tail_mean(r, "actor/pg_clipfrac", 10**6) for r in runs]),
            }
    return summary


def plot(path: Path, results: dict, etas: list[str], samples: int) -> Path:
    panels = []
    for key, label in (("accuracy", "held-out greedy accuracy"), ("p_exact", "held-out P(exact answer)")):
        for method in results:
            panels.append((f"{method}: {label}", "learner step",
                           {f"η={eta}": lib.series(results[method][eta], "evals", key) for eta in etas}))
    return lib.plot_curves(path, f"Staleness ablation: {samples} samples per run, mean and min-max over seeds",
                           panels, columns=2)


def plot_final(path: Path, summary: dict, etas: list[str]) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    xs = list(range(len(etas)))
    for ax, key, label in ((axes[0], "final_accuracy", "final held-out greedy accuracy"),
                           (axes[1], "final_p_exact", "final held-out P(exact answer)"),
                           (axes[2], "curve_p_exact", "held-out P(exact), mean over the curve")):
        for shift, method in zip((-0.08, 0.08), summary):
            stats = [summary[method][eta][key] for eta in etas]
            ax.errorbar([x + shift for x in xs], [s["mean"] for s in stats], yerr=[s["std"] for s in stats],
                        marker="o", capsize=3, label=method)
        ax.set_xticks(xs, [f"η={e}" if e != UNBOUNDED else "unb." for e in etas])
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    axes[-1].legend()
    fig.suptitle("Held-out accuracy by staleness bound (mean ± std over seeds)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def train(args, argv) -> dict:
    lib.setup_torch()
    settings = settings_from(args)
    model_dir = lib.tiny_model_dir(args.model)
    tokenizer = load_tokenizer(model_dir)
    heldout = lib.HeldOut(tokenizer, settings.difficulties, settings.heldout_prompts)
    engine = HFEngine(model_dir, dtype="float32")  # one engine; each run loads its own versions
    print(f"staleness ablation: η {args.etas}, {args.seeds} seeds, {settings.steps} steps x "
          f"{settings.groups_per_step} groups x {settings.group_size} = {settings.samples} samples per run", flush=True)
    started = time.perf_counter()
    results: dict = {m: {e: [] for e in args.etas} for m in METHODS}
    for seed in range(args.first_seed, args.first_seed + args.seeds):
        rollouts = lib.Rollouts(engine, tokenizer, settings, seed)
        for eta in args.etas:
            for method, preset in METHODS.items():
                config = lib.learner_config(model_dir, settings, preset, seed)
                run = lib.train_run(config, rollouts, heldout, behaviour_schedule(eta), settings,
                                    label=f"seed {seed} η={eta:>9s} {method:13s}")
                results[method][eta].append(run)
    return lib.result_record(
        "staleness_ablation", argv, settings, model_dir, started,
        etas=args.etas,
        seeds=list(range(args.first_seed, args.first_seed + args.seeds)),
        methods=METHODS,
        staleness={"eta=k": "batch i sampled with version max(0, i-k)",
                   UNBOUNDED: f"batch i sampled with version i // {UNBOUNDED_SPEEDUP}"},
        engine="transformers (HFEngine), float32; learner float32",
        summary=summarise(results, args.etas),
        runs=results,
    )


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    if args.merge:
        out = merge([lib.read_json(path) for path in args.merge])
        out["summary"] = summarise(out["runs"], out["etas"])
        lib.write_json(args.out / f"{args.name}.json", out)
    elif args.from_json:
        out = lib.read_json(args.from_json)
        out["summary"] = summarise(out["runs"], out["etas"])
        lib.write_json(args.from_json, out)  # the summary is derived from the runs: keep it current
    else:
        out = train(args, argv)
        lib.write_json(args.out / f"{args.name}.json", out)
    samples = out.get("samples_per_run") or lib.ToySettings(**out["settings"]).samples
    plot(args.out / f"{args.name}_curves.png", out["runs"], out["etas"], samples)
    plot_final(args.out / f"{args.name}_final.png", out["summary"], out["etas"])
    print(table(out["summary"], out["etas"]))
    print(f"wrote {args.out / args.name}.json and PNGs")
    return out


def merge(parts: list[dict]) -> dict:
    """One result from several runs of the script with the same settings and different seeds: each
    (method, η) cell pools the runs of every part that has it."""
    first = parts[0]
    for part in parts[1:]:
        if part["settings"] != first["settings"]:
            raise ValueError(f"cannot pool runs with different settings: {part['settings']} vs {first['settings']}")
    etas = [e for e in ALL_ETAS if any(e in part["etas"] for part in parts)]
    runs = {m: {e: [r for part in parts for r in part["runs"][m].get(e, [])] for e in etas} for m in METHODS}
    return {**first, "command": [part["command"] for part in parts], "etas": etas,
            "seeds": [part["seeds"] for part in parts], "runs": runs,
            "wall_seconds": sum(part["wall_seconds"] for part in parts)}


def table(summary: dict, etas: list[str]) -> str:
    """Markdown: per η and method, final and curve-mean held-out accuracy and P(exact), and the
    measured rollout_corr/kl and clip fraction (means over steps)."""
    keys = [("final_accuracy", "final acc", 3), ("final_p_exact", "final P(exact)", 3),
            ("curve_accuracy", "curve-mean acc", 3), ("curve_p_exact", "curve-mean P(exact)", 3),
            ("rollout_corr_kl", "rollout_corr/kl", 4), ("pg_clipfrac", "clipfrac", 4)]
    rows = [[eta, method] + [lib.fmt(summary[method][eta][k], d) for k, _, d in keys]
            for eta in etas for method in summary]
    return lib.markdown_table(["η", "method"] + [label for _, label, _ in keys], rows)


if __name__ == "__main__":
    main()
