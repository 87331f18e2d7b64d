"""The harness the correction experiments share (`staleness_ablation.py`, `backend_mismatch.py`).

One toy RL run = the real `learner.trainer.Learner` (same step, same correction and loss code)
fed by a real generation engine (`rollout_workers.engines`: transformers or vLLM-CPU) that samples
each batch with a weight version the experiment chooses. That choice is the only thing the
harness adds: instead of racing workers against the learner and letting the η gate bound the
lag, the lag is set exactly, step by step, by a `behaviour_version(step) -> version` schedule.
Everything else is what a worker does: prompts in ticket order from the train split, groups of n
sampled with the engine's processed log-probs as μ, the built-in reward, samples tagged with the
version that generated them.

Held-out accuracy is measured on the learner's own float32 weights in one batched forward pass,
teacher-forced on the reference answer (+ EOS):
  * `accuracy`: the greedy answer is exactly the reference, i.e. the argmax at every answer
    position is the reference token (identical to greedy decoding + exact match, by induction);
  * `p_exact`: the probability that one temperature-1 sample is exactly the reference
    (exp of the summed log-probs): the expected exact-match pass@1, with no sampling noise.
"""
from __future__ import annotations

import json
import math
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Callable

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import numpy as np  # noqa: E402
import torch  # noqa: E402
from pydantic import BaseModel, ConfigDict, Field  # noqa: E402

from buffer.sample import Group, Sample  # noqa: E402
from learner.config import LearnerConfig  # noqa: E402
from learner.trainer import Learner  # noqa: E402
from lm.causal_lm import pad_sequences, response_log_probs  # noqa: E402
from rollout_workers.engines.base import GenerationEngine, SamplingParams  # noqa: E402
from rollout_workers.rewards import resolve_reward  # noqa: E402
from rollout_workers.tasks import PromptSet, mixed_problems  # noqa: E402
from rollout_workers.tiny_model import (  # noqa: E402
    SPEC_FILE, TinyModelSpec, encode_problem, ensure_tiny_model, tiny_model_info,
)

MODEL_CACHE = REPO / ".cache" / "tiny-model"
# The model the committed results were measured on, pinned (the kit's default may move): 2 layers,
# hidden 128, 800 supervised warm-start steps on 1-3 digit addition; held-out greedy accuracy
# 0.92 / 0.95 / 0.13 on 1 / 2 / 3 digits.
EXPERIMENT_MODEL = TinyModelSpec(
    hidden_size=128, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=512, max_positions=64,
    families=["add"], difficulties=[1, 2, 3], warm_start_steps=800, batch_size=64, learning_rate=3e-3, seed=0,
)
RESULTS_DIR = REPO / "docs" / "results"
# Per-step training metrics kept in the JSON (verl names, as the learner reports them).
STEP_KEYS = (
    "reward/mean", "response_length/mean", "actor/entropy", "actor/pg_clipfrac", "actor/ppo_kl",
    "actor/grad_norm", "rollout_corr/kl", "rollout_corr/k3_kl", "rollout_corr/rollout_is_mean",
    "rollout_corr/rollout_is_ratio_fraction_high", "rollout_corr/rollout_rs_masked_fraction",
    "rollout_corr/rollout_is_eff_sample_size", "staleness/mean", "staleness/max",
    "gap/k1", "gap/mean_abs_dlogp",  # measured by the harness before each step, see train_run
)


class ToySettings(BaseModel):
    """One toy run's knobs. Defaults make the policy move fast per step (high lr, several PPO
    minibatch updates per batch), so that data a few versions old is measurably off-policy."""

    model_config = ConfigDict(extra="forbid")

    steps: int = Field(30, ge=1, description="learner steps (the sample budget is steps x groups x n)")
    groups_per_step: int = Field(16, ge=1, description="prompts per learner step (B)")
    group_size: int = Field(8, ge=2, description="responses per prompt (n)")
    difficulties: list[int] = [2]
    lr: float = Field(1e-4, gt=0)
    warmup_steps: int = Field(
        5, ge=0, description="linear lr warm-up (learner steps): Adam's first updates are lr-sized per weight")
    ppo_epochs: int = Field(4, ge=1)
    ppo_mini_batch_size: int = Field(8, ge=1, description="groups per optimizer step")
    temperature: float = Field(1.0, gt=0)
    max_new_tokens: int = Field(6, ge=1)
    heldout_prompts: int = Field(256, ge=1)
    eval_every: int = Field(5, ge=1)

    @property
    def samples(self) -> int:
        return self.steps * self.groups_per_step * self.group_size


def setup_torch() -> None:
    torch.set_num_threads(1)


def add_model_argument(parser) -> None:
    parser.add_argument("--model", type=Path, help="a tiny-model folder to run on instead of the pinned one "
                        "(the committed results are the pinned model's; the JSON records which one ran)")


def tiny_model_dir(folder: Path | None = None) -> Path:
    """`folder` when given (a tiny-model kit folder: the task's tokenizer and format); else the
    pinned warm-started tiny model (built once into .cache/, reused after)."""
    if folder is not None:
        if not (Path(folder) / SPEC_FILE).is_file():
            raise SystemExit(f"--model {folder}: not a tiny-model folder (no {SPEC_FILE}): the experiments "
                             "need the kit's tokenizer and task format")
        return Path(folder)
    return ensure_tiny_model(MODEL_CACHE, EXPERIMENT_MODEL, log=lambda *_: None)


def model_record(model_dir: Path) -> dict:
    info = tiny_model_info(model_dir)
    return {"cache_key": info["cache_key"], "spec": info["spec"],
            "heldout_greedy_accuracy": info["heldout_greedy_accuracy"]}


def clone_state(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in state.items()}


# ----------------------------------------------------------------------------- held-out evaluation

class HeldOut:
    """Held-out problems, scored on a model's own weights in one teacher-forced pass."""

    def __init__(self, tokenizer, difficulties: list[int], count: int, seed: int = 0) -> None:
        problems = mixed_problems(["add"], difficulties, "heldout", count, seed=seed)
        pairs = [encode_problem(tokenizer, p) for p in problems]
        self.prompts = [p for p, _ in pairs]
        self.answers = [a for _, a in pairs]
        self.pad_id = tokenizer.pad_token_id or 0

    @torch.no_grad()
    def evaluate(self, model) -> dict[str, float]:
        ids, attention, mask, _ = pad_sequences(self.prompts, self.answers, self.pad_id)
        logits = model(input_ids=ids, attention_mask=attention).logits.float()
        greedy_ok, log_p = [], []
        for row, (prompt, answer) in enumerate(zip(self.prompts, self.answers)):
            step_logits = logits[row, len(prompt) - 1 : len(prompt) - 1 + len(answer)]
            target = torch.tensor(answer)
            greedy_ok.append(bool((step_logits.argmax(-1) == target).all()))
            log_p.append(float(torch.log_softmax(step_logits, -1).gather(-1, target[:, None]).sum()))
        return {"accuracy": float(np.mean(greedy_ok)), "p_exact": float(np.mean(np.exp(log_p)))}


# ----------------------------------------------------------------------------- rollouts

class Rollouts:
    """What a rollout worker does for one permit, with the weight version chosen by the caller:
    load that version into the engine, sample a group per ticket, score, tag."""

    def __init__(self, engine: GenerationEngine, tokenizer, settings: ToySettings, seed: int) -> None:
        self.engine = engine
        self.tokenizer = tokenizer
        self.settings = settings
        self.seed = seed
        self.prompts = PromptSet(mixed_problems(["add"], settings.difficulties, "train", 20000, seed=seed))
        self.reward = resolve_reward("math")
        self._loaded: tuple[int, int] | None = None  # (run token, version) in the engine now

    def load(self, run_token: int, version: int, state: dict[str, torch.Tensor]) -> None:
        if self._loaded != (run_token, version):
            self.engine.load_weights(version, state)
            self._loaded = (run_token, version)

    def sample(self, step: int) -> list[Group]:
        s = self.settings
        tickets = range(step * s.groups_per_step, (step + 1) * s.groups_per_step)
        problems = [self.prompts.problem(t) for t in tickets]
        prompts = [self.tokenizer(p.prompt, add_special_tokens=False)["input_ids"] for p in problems]
        requests = [
            (prompt, SamplingParams(n=s.group_size, temperature=s.temperature, max_new_tokens=s.max_new_tokens,
                                    stop_token_ids=(self.tokenizer.eos_token_id,),
                                    seed=self.seed * 7_919 + ticket * s.group_size))
            for prompt, ticket in zip(prompts, tickets)
        ]
        outputs = self.engine.generate_batch(requests)
        version = int(self.engine.version)
        groups = []
        for ticket, problem, prompt, completions in zip(tickets, problems, prompts, outputs):
            gid = f"s{self.seed}-t{ticket}"
            samples = [
                Sample(sample_id=f"{gid}-{i}", group_id=gid, prompt_ids=np.asarray(prompt, np.int32),
                       response_ids=np.asarray(c.token_ids, np.int32),
                       rollout_log_probs=np.asarray(c.log_probs, np.float32),
                       loss_mask=np.ones(len(c.token_ids), np.uint8),
                       reward=float(self.reward(self.tokenizer.decode(c.token_ids, skip_special_tokens=True),
                                                problem.answer)),
                       weight_version=version, finish_reason=c.finish_reason,
                       routed_experts=c.routed_experts)  # an MoE engine's routing, as a worker carries it
                for i, c in enumerate(completions)
            ]
            groups.append(Group(group_id=gid, samples=samples, prompt_index=ticket))
        return groups


@torch.no_grad()
def sampler_and_learner_log_probs(model, groups: list[Group], temperature: float = 1.0):
    """([B, T] learner log-probs π, [B, T] sampler log-probs μ, [B, T] response mask) for every
    sample of the groups; μ is what the engine recorded, π the given (float32) model's."""
    samples = [s for g in groups for s in g.samples]
    log_prob, mask = response_log_probs(model, [list(s.prompt_ids) for s in samples],
                                        [list(s.response_ids) for s in samples], temperature)
    mu = torch.zeros_like(log_prob)
    for row, s in enumerate(samples):
        mu[row, : len(s.rollout_log_probs)] = torch.from_numpy(s.rollout_log_probs)
    return log_prob, mu, mask


def logp_deltas(model, groups: list[Group], temperature: float = 1.0) -> torch.Tensor:
    """log μ − log π over every response token of the groups. Its mean is the k1 estimate of
    KL(μ‖π) (the tokens were drawn from μ)."""
    log_prob, mu, mask = sampler_and_learner_log_probs(model, groups, temperature)
    return (mu - log_prob)[mask.bool()].double()


# ----------------------------------------------------------------------------- one run

_run_tokens = iter(range(1, 1 << 30))


def learner_config(model_dir: Path, settings: ToySettings, correction: str, seed: int, **changes) -> LearnerConfig:
    return LearnerConfig(
        model_path=str(model_dir), seed=seed, lr=settings.lr, weight_decay=0.0, grad_clip=1.0,
        warmup_steps=settings.warmup_steps, ppo_epochs=settings.ppo_epochs,
        ppo_mini_batch_size=settings.ppo_mini_batch_size,
        temperature=settings.temperature, rollout_correction=correction, compute_entropy=True, **changes,
    )


def train_run(
    config: LearnerConfig,
    rollouts: Rollouts,
    heldout: HeldOut,
    behaviour_version: Callable[[int], int],
    settings: ToySettings,
    label: str = "",
    log: Callable[[str], None] = print,
) -> dict:
    """`settings.steps` learner steps; the batch for step i is sampled with the weights of version
    `behaviour_version(i)` (clamped to [0, i]). Returns the per-step metrics and the eval curve."""
    token = next(_run_tokens)
    learner = Learner(config)
    history = {0: clone_state(learner.full_state_dict())}
    evals = [{"step": 0, **heldout.evaluate(learner.model)}]
    steps, started = [], time.perf_counter()
    for step in range(settings.steps):
        version = min(max(0, int(behaviour_version(step))), learner.version)
        rollouts.load(token, version, history[version])
        groups = rollouts.sample(step)
        # The gap the step starts from (μ against the learner's current weights), the same
        # measurement for every method (rollout_corr/kl is against π_θ in bypass mode).
        delta = logp_deltas(learner.model, groups, settings.temperature)
        metrics = learner.train_step(groups)
        metrics.update({"gap/k1": float(delta.mean()), "gap/mean_abs_dlogp": float(delta.abs().mean())})
        history[learner.version] = clone_state(learner.full_state_dict())
        for old in [v for v in history if v < learner.version - 64]:
            del history[old]  # no schedule here lags more than 64 versions behind a bounded run
        steps.append({"step": step + 1, "behaviour_version": version,
                      **{k: float(metrics[k]) for k in STEP_KEYS if k in metrics}})
        if (step + 1) % settings.eval_every == 0 or step + 1 == settings.steps:
            evals.append({"step": step + 1, **heldout.evaluate(learner.model)})
    final = evals[-1]
    log(f"  {label}: acc {evals[0]['accuracy']:.3f} -> {final['accuracy']:.3f}, "
        f"p_exact {evals[0]['p_exact']:.3f} -> {final['p_exact']:.3f}, "
        f"reward(last 5) {statistics.mean(r['reward/mean'] for r in steps[-5:]):.3f}, "
        f"{time.perf_counter() - started:.0f}s")
    return {"steps": steps, "evals": evals, "final": final, "seconds": time.perf_counter() - started}


# ----------------------------------------------------------------------------- summaries and output

def mean_spread(values: list[float]) -> dict[str, float]:
    """Mean, sample standard deviation, min and max over seeds."""
    return {
        "mean": float(np.mean(values)),
        "std": float(np.std(values, ddof=1)) if len(values) > 1 else 0.0,
        "min": float(np.min(values)),
        "max": float(np.max(values)),
        "n": len(values),
    }


def curve_mean(run: dict, key: str) -> float:
    """The mean of a held-out metric over every evaluation after the start: a lower-noise summary
    of a training curve than its last point."""
    return float(np.mean([e[key] for e in run["evals"][1:]]))


def tail_mean(run: dict, key: str, last: int = 5) -> float:
    values = [r[key] for r in run["steps"][-last:] if key in r and math.isfinite(r[key])]
    return float(np.mean(values)) if values else float("nan")


def machine_info() -> dict:
    import platform

    return {
        "cpu_count": os.cpu_count(),
        "load_average_1m": round(os.getloadavg()[0], 2),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "platform": platform.platform(),
    }


def result_record(experiment: str, argv: list[str] | None, settings: "ToySettings", model_dir: Path,
                  started: float, **fields) -> dict:
    """The JSON an experiment writes: what ran (command, settings, model, machine, wall time)
    around the experiment's own fields (docs/results.md reads these keys)."""
    return {
        "experiment": experiment,
        "command": f"benchmarks/{experiment}.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "settings": settings.model_dump(),
        "samples_per_run": settings.samples,
        **fields,
        "model": model_record(model_dir),
        "machine": machine_info(),
        "wall_seconds": round(time.perf_counter() - started, 1),
    }


def write_json(path: Path, data: dict) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=1, allow_nan=True) + "\n")
    return path


def plot_curves(path: Path, title: str, panels: list[tuple[str, str, dict[str, list[tuple[list, list]]]]],
                columns: int = 3) -> Path:
    """One PNG with a panel per (y label, x label, {legend label: [(xs, ys) per seed]}); each
    label is drawn as its seed mean with a band from the min to the max over seeds."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    columns = min(columns, len(panels))
    rows = -(-len(panels) // columns)
    fig, axes = plt.subplots(rows, columns, figsize=(5.2 * columns, 3.8 * rows), squeeze=False)
    for ax in axes.flat[len(panels):]:
        ax.set_visible(False)
    for ax, (ylabel, xlabel, lines) in zip(axes.flat, panels):
        for label, runs in lines.items():
            width = min(len(xs) for xs, _ in runs)
            xs = np.asarray(runs[0][0][:width])
            ys = np.asarray([r[1][:width] for r in runs], dtype=float)
            (line,) = ax.plot(xs, np.nanmean(ys, axis=0), label=label, lw=1.6)
            if len(runs) > 1:
                ax.fill_between(xs, np.nanmin(ys, axis=0), np.nanmax(ys, axis=0), color=line.get_color(), alpha=0.15)
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel, fontsize=9)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, loc="best")
    fig.suptitle(title)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def markdown_table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def fmt(stats: dict, digits: int = 3) -> str:
    """'mean ± std' of a mean_spread dict (std over seeds; the mean alone for one seed, '–' for
    a metric the method does not report)."""
    if not math.isfinite(stats["mean"]):
        return "–"
    if stats["n"] < 2:
        return f"{stats['mean']:.{digits}f}"
    return f"{stats['mean']:.{digits}f} ± {stats['std']:.{digits}f}"


def read_json(path: Path) -> dict:
    return json.loads(Path(path).read_text())


def series(runs: list[dict], where: str, key: str) -> list[tuple[list, list]]:
    """(x, y) per run of `key` from its 'steps' or 'evals' records."""
    return [([r["step"] for r in run[where]], [r.get(key, float("nan")) for r in run[where]]) for run in runs]


