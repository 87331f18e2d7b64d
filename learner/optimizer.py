"""The learner's optimizers: AdamW with a learning-rate schedule, and the clipped step, the same
for the policy (learner/trainer.py) and the critic (learner/critic.py)."""
from __future__ import annotations

import contextlib
import math

import torch


def lr_factor(step: int, warmup_steps: int, schedule: str, total_steps: int | None, min_ratio: float) -> float:
    """Learning-rate multiplier at learner step `step` (0-based): linear warm-up to 1 over
    `warmup_steps`, then constant, or linear / cosine decay to `min_ratio` at `total_steps`."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    if schedule == "constant":
        return 1.0
    span = max(1, total_steps - warmup_steps)
    progress = min(1.0, (step - warmup_steps) / span)
    if schedule == "linear":
        shape = 1.0 - progress
    else:  # cosine
        shape = 0.5 * (1.0 + math.cos(math.pi * progress))
    return min_ratio + (1.0 - min_ratio) * shape


def adamw_with_schedule(params, lr: float, betas, eps: float, weight_decay: float, warmup_steps: int,
                        schedule: str = "constant", total_steps: int | None = None, min_ratio: float = 0.0):
    """(AdamW over `params`, its LambdaLR scheduler following `lr_factor`)."""
    if schedule != "constant" and total_steps is None:  # a run fills it in from its steps; a learner alone cannot
        raise ValueError(f"lr_schedule {schedule!r} needs total_steps (the steps the decay spans)")
    optimizer = torch.optim.AdamW(params, lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: lr_factor(step, warmup_steps, schedule, total_steps, min_ratio))
    return optimizer, scheduler


def load_schedule(scheduler, state: dict) -> None:
    """A saved scheduler's position, its learning rates worked out again from this run's schedule: the saved
    ones are the saving run's (a run resumed with more steps stretches a decay over the run: its first
    step would otherwise take the old schedule's last rate)."""
    scheduler.load_state_dict(state)
    for group, base_lr, factor in zip(scheduler.optimizer.param_groups, scheduler.base_lrs, scheduler.lr_lambdas):
        group["lr"] = base_lr * factor(scheduler.last_epoch)
    scheduler._last_lr = [group["lr"] for group in scheduler.optimizer.param_groups]  # get_last_lr() agrees


def clip_and_step(params, optimizer, max_norm: float | None, writing=contextlib.nullcontext) -> float:
    """Clip to the global norm (None: no clipping) and step inside `writing()`; a non-finite
    gradient skips the step (no update beats a corrupted one) and is reported as inf."""
    norm = float(torch.nn.utils.clip_grad_norm_(params, max_norm if max_norm is not None else float("inf")))
    if not math.isfinite(norm):
        optimizer.zero_grad(set_to_none=True)
        return float("inf")
    with writing():
        optimizer.step()
    return norm
