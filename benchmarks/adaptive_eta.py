"""Fixed η against `buffer.gate.eta: auto`, in real runs (Ray, vLLM, the buffer actor).

    .venv/bin/python benchmarks/adaptive_eta.py                # the fast and the slow setting, 3 seeds
    .venv/bin/python benchmarks/adaptive_eta.py --quick        # fewer steps, one seed: a smoke run
    .venv/bin/python benchmarks/adaptive_eta.py --backend      # the drift split with a float32 vs bfloat16 sampler

Every run is `etarl train` on the embedded task with two rollout workers, so generation outpaces
the learner and the η window stays full (as on any GPU: docs/results.md). Settings:
  * fast: the embedded default (lr 2e-4): the tiny model moves far per step;
  * slow: a smaller learning rate, so the drift per version is small and a larger η costs little.
For each (setting, η) and seed: held-out greedy accuracy and pass@1 at the start and the end (the
gain), mean staleness, the η in force over time, samples/s and the learner's wait for data (over
the last three quarters of the steps: the first step waits for the engines to start).
`--backend` runs `auto` with a float32 and a bfloat16 sampler and the exact drift probe
(`diagnostics.exact_drift_every`): the backend part of the drift split, estimated and exact.

Writes <out>/adaptive_eta[_quick].json and PNGs, prints the tables; the last line is a JSON
summary.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))

import experiment_lib as lib  # noqa: E402

SETTINGS = {"fast": [], "slow": ["learner.lr=5e-5"]}
ETAS = {"fast": ["1", "2", "4", "auto"], "slow": ["2", "auto"]}
COMMON = ["rollout.num_workers=2", "run.checkpoint_every=0", "run.progress=false", "eval.n_samples=4",
          "eval.num_prompts=200"]


def run_once(out: Path, name: str, steps: int, eval_every: int, seed: int, overrides: list[str]) -> dict:
    """One `etarl train` in its own process; its metrics.jsonl as {"steps": [...], "evals": [...]}."""
    run_dir = out / "runs" / name
    done_before = read_run(run_dir, steps)
    if done_before is not None:  # a finished run of an interrupted experiment: not run again
        return {"name": name, "seed": seed, "overrides": overrides, "wall_s": math.nan, **done_before}
    shutil.rmtree(run_dir, ignore_errors=True)  # a run cut short starts again
    args = [sys.executable, "-m", "services.cli", "train", f"run.run_dir={run_dir}", f"run.steps={steps}",
            f"run.eval_every={eval_every}", f"run.seed={seed}", *COMMON, *overrides]
    started = time.perf_counter()
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    done = subprocess.run(args, cwd=REPO, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"{name} failed ({done.returncode}):\n{done.stderr[-3000:]}")
    return {"name": name, "seed": seed, "overrides": overrides, "wall_s": round(time.perf_counter() - started, 1),
            **read_run(run_dir, steps)}


def read_run(run_dir: Path, steps: int) -> dict | None:
    """{"steps": [...], "evals": [...]} of a run that logged all its steps, else None. A NaN
    metric is logged as null: read back as NaN."""
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        return None
    rows = [{k: (math.nan if v is None else v) for k, v in json.loads(line).items()}
            for line in path.read_text().splitlines() if line.strip()]
    step_rows = [r for r in rows if "audit/groups" in r]
    if len(step_rows) < steps:
        return None
    return {"steps": step_rows, "evals": [r for r in rows if "eval/accuracy" in r]}


def summarise(run: dict) -> dict:
    steps, evals = run["steps"], run["evals"]
    later = steps[len(steps) // 4:]  # after the window filled
    mean = lambda key, rows=later: float(np.nanmean([r.get(key, math.nan) for r in rows]))  # noqa: E731
    wall = sum(r["timing_s/step_total"] for r in later)  # the first step waits for the engines to start
    return {
        "greedy_start": evals[0]["eval/accuracy"], "greedy_end": evals[-1]["eval/accuracy"],
        "greedy_gain": evals[-1]["eval/accuracy"] - evals[0]["eval/accuracy"],
        "pass1_start": evals[0]["eval/pass@1"], "pass1_end": evals[-1]["eval/pass@1"],
        "pass1_gain": evals[-1]["eval/pass@1"] - evals[0]["eval/pass@1"],
        "staleness_mean": mean("staleness/mean"), "eta_mean": mean("gate/eta"),
        "eta_last": steps[-1].get("gate/eta", math.nan), "drift_per_version_k3": mean("drift/per_version_k3"),
        "backend_k3": mean("drift/backend_k3"), "samples_per_s": sum(len(r["audit/sample_versions"]) for r in later) / wall,
        "wait_data_s": mean("timing_s/wait_data"),
    }


def table(results: dict) -> str:
    header = ["setting", "eta", "seeds", "greedy gain", "pass@1 gain", "mean staleness", "eta (mean, last)",
              "drift/version k3", "samples/s", "wait for data s"]
    rows = []
    for key, runs in results.items():
        setting, eta = key.split("/")
        stats = {k: lib.mean_spread([summarise(r)[k] for r in runs]) for k in summarise(runs[0])}
        rows.append([setting, eta, str(len(runs)), lib.fmt(stats["greedy_gain"]), lib.fmt(stats["pass1_gain"]),
                     lib.fmt(stats["staleness_mean"], 2), f"{stats['eta_mean']['mean']:.1f}, "
                     f"{stats['eta_last']['mean']:.1f}", lib.fmt(stats["drift_per_version_k3"], 4),
                     lib.fmt(stats["samples_per_s"], 1), lib.fmt(stats["wait_data_s"], 3)])
    return lib.markdown_table(header, rows)


def plots(out: Path, stem: str, results: dict) -> list[Path]:
    paths = []
    for setting in sorted({k.split("/")[0] for k in results}):
        runs = {k.split("/")[1]: v for k, v in results.items() if k.startswith(setting + "/")}
        panels = [
            ("held-out pass@1", "step", {f"eta={e}": lib.series(r, "evals", "eval/pass@1") for e, r in runs.items()}),
            ("eta in force", "step", {f"eta={e}": lib.series(r, "steps", "gate/eta") for e, r in runs.items()}),
            ("staleness (mean)", "step", {f"eta={e}": lib.series(r, "steps", "staleness/mean") for e, r in runs.items()}),
            ("drift per version (k3)", "step",
             {f"eta={e}": lib.series(r, "steps", "drift/per_version_k3") for e, r in runs.items()}),
        ]
        paths.append(lib.plot_curves(out / f"{stem}_{setting}.png", f"adaptive eta, {setting} setting", panels,
                                     columns=2))
    return paths


def backend_runs(out: Path, args) -> dict:
    """`auto` with a float32 and a bfloat16 sampler, the exact probe every few steps."""
    probe = ["buffer.gate.eta=auto", "diagnostics.exact_drift_every=5"]
    found = {}
    for dtype in ("float32", "bfloat16"):
        run = run_once(out, f"backend-{dtype}", args.backend_steps, args.backend_steps, 0,
                       [*probe, f"rollout.engine.dtype={dtype}"])
        rows = [r for r in run["steps"] if "drift/exact_backend_k3" in r]
        found[dtype] = {
            "estimated_backend_k3": float(np.nanmean([r.get("drift/backend_k3", math.nan) for r in run["steps"]])),
            "steps_with_fresh_tokens": int(sum(math.isfinite(r.get("drift/backend_k3", math.nan)) for r in run["steps"])),
            "intercept_backend_k3": float(np.nanmean([r.get("drift/backend_intercept_k3", math.nan)
                                                      for r in run["steps"]])),
            "exact_backend_k3": float(np.nanmean([r["drift/exact_backend_k3"] for r in rows])) if rows else math.nan,
            "exact_staleness_per_version_k3": float(np.nanmean([r.get("drift/exact_per_version_k3", math.nan)
                                                                for r in rows])) if rows else math.nan,
            "probes": len(rows)}
        print(f"sampler {dtype}: backend k3 from fresh tokens {found[dtype]['estimated_backend_k3']:.2e} "
              f"({found[dtype]['steps_with_fresh_tokens']} steps had them), intercept "
              f"{found[dtype]['intercept_backend_k3']:.2e}, exact {found[dtype]['exact_backend_k3']:.2e} "
              f"({len(rows)} probes)", flush=True)
    return found


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="30 steps, one seed, the fast setting's eta=2 and auto")
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--settings", default="fast,slow")
    p.add_argument("--backend", action="store_true", help="only the float32 / bfloat16 sampler runs")
    p.add_argument("--backend-steps", type=int, default=60)
    p.add_argument("--out", type=Path, default=lib.RESULTS_DIR)
    args = p.parse_args(argv)
    started = time.perf_counter()
    stem = "adaptive_eta_quick" if args.quick else "adaptive_eta"
    if args.backend:
        found = backend_runs(args.out, args)
        print(json.dumps({"experiment": "adaptive_eta_backend", **found}))
        return
    seeds = 1 if args.quick else args.seeds
    steps = 30 if args.quick else args.steps
    results = {}
    for setting in args.settings.split(","):
        for eta in (["2", "auto"] if args.quick else ETAS[setting]):
            key = f"{setting}/{eta}"
            for seed in range(seeds):
                run = run_once(args.out, f"{setting}-eta{eta}-seed{seed}", steps, steps // 2, seed,
                               [*SETTINGS[setting], f"buffer.gate.eta={eta}"])
                results.setdefault(key, []).append(run)
                s = summarise(run)
                print(f"{key} seed {seed}: pass@1 {s['pass1_start']:.3f} -> {s['pass1_end']:.3f}, greedy "
                      f"{s['greedy_start']:.3f} -> {s['greedy_end']:.3f}, staleness {s['staleness_mean']:.2f}, eta "
                      f"{s['eta_mean']:.1f}, {s['samples_per_s']:.1f} samples/s ({run['wall_s']:.0f} s)", flush=True)
        if args.quick:
            break
    print(table(results))
    pngs = plots(args.out, stem, results)
    summary = {key: {k: lib.mean_spread([summarise(r)[k] for r in runs]) for k in summarise(runs[0])}
               for key, runs in results.items()}
    lib.write_json(args.out / f"{stem}.json", {
        "experiment": "adaptive_eta", "command": "benchmarks/adaptive_eta.py " + " ".join(argv or sys.argv[1:]),
        "steps": steps, "seeds": seeds, "summary": summary,
        "runs": {k: [{**summarise(r), "seed": r["seed"], "wall_s": r["wall_s"],
                      "eta_curve": [r2.get("gate/eta") for r2 in r["steps"]]} for r in v] for k, v in results.items()},
        "machine": lib.machine_info(), "wall_seconds": round(time.perf_counter() - started, 1)})
    print(json.dumps({"experiment": "adaptive_eta", "pngs": [str(p) for p in pngs],
                      **{k: {m: round(v[m]["mean"], 4) for m in ("pass1_gain", "greedy_gain", "staleness_mean",
                                                                 "eta_mean", "samples_per_s")}
                         for k, v in summary.items()}}))


if __name__ == "__main__":
    main()
