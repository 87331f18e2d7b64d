"""What a run takes from its user, checked before anything starts, and carried where it is needed.

`check_run_inputs` (called by the controller once the model folder is known) fails with a
ConfigError naming the key when the model folder has no tokenizer, the reward cannot be imported
or has a signature that fits no accepted form, the chat template file is missing, a prompt file
has unusable rows (`rollout.task.skip_invalid` skips them instead), or max_new_tokens leaves a
built-in task's prompts no room in the context; it logs what it checked. `etarl data check`
prints the same checks for the files named, or the config's (`data_check`).
`ray_runtime_env` adds a reward module that is not installed to the Ray job's `py_modules`, so
the workers of any cluster can import it.
"""
from __future__ import annotations

import difflib
import inspect
import json
import logging
import math
import os
import re
from pathlib import Path

from rollout_workers.data import (InvalidPrompts, Problem, PromptFormat, PromptReport, check_prompts,
                                  context_can_stretch, mixed_problems, model_context_len)
from services.config import ConfigError, EtarlConfig

log = logging.getLogger("etarl")
# The estimators whose baseline is the other responses of a prompt's group (a group of one has none).
GROUP_BASELINE_ESTIMATORS = ("grpo", "dr_grpo", "rloo", "reinforce_plus_plus_baseline", "opo", "gpg", "gdpo")


def prompt_format(cfg: EtarlConfig, model_dir) -> PromptFormat:
    """How the run writes prompts for its model (tokenizer, chat template, context, EOS ids)."""
    from lm.causal_lm import load_tokenizer

    try:
        tokenizer = load_tokenizer(model_dir)
    except FileNotFoundError as err:
        raise ConfigError(f"run.model: {err}") from None
    asked, own = cfg.rollout.engine.max_model_len, model_context_len(model_dir)
    if asked and own and asked > own and not context_can_stretch(model_dir):
        raise ConfigError(f"rollout.engine.max_model_len={asked} is longer than the model's context ({own} tokens, "
                          f"its config.json): vLLM refuses it; set at most {own}")
    try:
        return PromptFormat.for_rollout(model_dir, cfg.rollout, tokenizer)
    except FileNotFoundError as err:
        raise ConfigError(str(err)) from None
    except ValueError as err:  # the tools environment's file or schemas
        raise ConfigError(f"rollout.multi_turn: {err}") from None


def check_reward(cfg: EtarlConfig):
    """The run's reward, loaded here: an import error or a wrong signature stops the run now."""
    from rollout_workers.rewards import Reward

    try:
        return Reward(cfg.rollout.reward, cfg.rollout.reward_kwargs)
    except ValueError as err:
        raise ConfigError(f"rollout.reward: {err}") from None


def check_environment(cfg: EtarlConfig, fmt: PromptFormat) -> None:
    """A multi-turn run's environment and stop texts, checked here: a bad one stops the run now."""
    multi_turn = cfg.rollout.multi_turn
    if not multi_turn.enabled:
        return
    from rollout_workers.agent_loop import stop_token_ids
    from rollout_workers.environments import resolve_environment

    arguments = cfg.rollout.environment_arguments()
    make = None
    try:
        make = resolve_environment(multi_turn.environment)
        if multi_turn.environment == "tools":  # built-in: its tools and reward load here as in each process
            make(**arguments)
        stop_token_ids(fmt.tokenizer, multi_turn.stop)
    except ValueError as err:
        raise ConfigError(f"rollout.multi_turn: {err}") from None
    except TypeError as err:  # an environment_kwargs key it does not take
        raise ConfigError(f"rollout.multi_turn: {_unknown_argument(make, err)}") from None
    if multi_turn.environment == "tools":
        _check_tools_template(fmt, arguments.get("format", "hermes"))


def _unknown_argument(make, err: TypeError) -> str:
    """A TypeError of building the environment, with the argument meant where a key is misspelt."""
    wrong = re.search(r"unexpected keyword argument '(\w+)'", str(err))
    try:
        taken = [name for name in inspect.signature(make).parameters if name != "self"]
    except (TypeError, ValueError):  # no signature to read (make is None: it failed before)
        return str(err)
    if not wrong:
        return str(err)
    close = difflib.get_close_matches(wrong.group(1), taken, n=1)
    return (f"environment_kwargs.{wrong.group(1)}: not an argument of the environment"
            + (f" (did you mean {close[0]}?)" if close else "") + f"; it takes {', '.join(taken)}")


def _check_tools_template(fmt: PromptFormat, call_format: str) -> None:
    """Warnings where the chat template does not show the tools, or teaches another call form than the
    one the tools environment reads."""
    rendered = fmt.render(Problem([{"role": "user", "content": "?"}], ""))
    names = [schema["function"]["name"] for schema in fmt.template_kwargs.get("tools", [])]
    if names and not any(name in rendered for name in names):
        log.warning("the chat template does not show the tools to the model (no tool's name is in a rendered "
                    "prompt), so the policy cannot know them: use a template that renders `tools` "
                    "(rollout.task.chat_template)")
    elif "<tool_call>" not in rendered:
        log.warning("the chat template writes no <tool_call> where it lists the tools: the tools environment reads "
                    "%s calls in <tool_call> blocks, so a model taught another form never calls them", call_format)
    elif ("<function=" in rendered) != (call_format == "qwen3_coder"):
        taught = "qwen3_coder" if "<function=" in rendered else "hermes"
        log.warning("the chat template teaches %s tool calls but the tools environment reads %s ones: set "
                    "rollout.multi_turn.environment_kwargs.format=%s", taught, call_format, taught)


def prompt_reports(cfg: EtarlConfig, fmt: PromptFormat) -> dict[str, PromptReport]:
    """The checked prompt files of a `rollout.task.kind: file` run, by config key."""
    task = cfg.rollout.task
    if task.kind != "file":
        return {}
    files = {key: (path, cfg.rollout.sampling.max_new_tokens) for key, path in task.files("path").items()}
    if cfg.eval.enabled:
        if not task.heldout_path:
            raise ConfigError("rollout.task.heldout_path is unset, so there are no held-out prompts to evaluate on: "
                              "set it, or eval.enabled=false")
        files |= {key: (path, cfg.eval.max_new_tokens) for key, path in task.files("heldout_path").items()}
    return _checked_files(files, task, fmt, cfg.rollout.rows_reward())


def _checked_files(files: dict[str, tuple[str, int | None]], task, fmt: PromptFormat,
                   reward: str | None) -> dict[str, PromptReport]:
    """{name: (path, max_new_tokens)} checked, by name (`reward`: the spec that scores the rows, as
    check_prompts takes it); a file that cannot be read is a ConfigError naming it (by its config key,
    where that is its name)."""
    reports = {}
    for name, (path, max_new_tokens) in files.items():
        try:
            reports[name] = check_prompts(path, task, fmt, max_new_tokens, reward)
        except (OSError, ValueError) as err:
            raise ConfigError(str(err) if name == path else f"{name}: {err}") from None
    return reports


def _check_verl_reward_task(cfg: EtarlConfig) -> None:
    """rollout.reward=verl goes by each row's data_source, which the built-in tasks' problems do not have
    (checked by a run and eval, not by the config: `etarl data check FILE` takes files of any config)."""
    if cfg.rollout.rows_reward() == "verl" and cfg.rollout.task.kind != "file":
        raise ConfigError(f"rollout.reward=verl scores verl rows by their data_source, and the built-in "
                          f"rollout.task.kind={cfg.rollout.task.kind} task has none: use rollout.reward=math or exact, "
                          "or a file of verl rows (rollout.task.kind=file)")


def check_run_inputs(cfg: EtarlConfig, model_dir) -> int | None:
    """Check the model folder, the reward and the prompt files before a run starts (see above); the
    number of usable train prompts of a file task (None: a built-in task)."""
    if cfg.rollout.task.kind == "file" and not cfg.rollout.task.path:
        raise ConfigError("rollout.task.path is unset: a run trains on the prompts of a file (the held-out ones "
                          "alone serve etarl eval)")
    fmt = prompt_format(cfg, model_dir)
    reward = check_reward(cfg)
    _check_verl_reward_task(cfg)
    check_environment(cfg, fmt)
    check_lora(cfg, model_dir)
    check_prompt_room(cfg, fmt)
    warn_of_groups_of_one(cfg)
    if cfg.run.epochs is None:  # with epochs, once the steps are worked out (with_epochs)
        warn_if_the_policy_never_trains(cfg, cfg.run.steps)
    log.info("model %s: %s; reward %s (%s form)", model_dir, fmt.describe(), reward.spec, reward.form)
    if cfg.rollout.task.truncation != "error" and not fmt.context_len:
        log.warning("rollout.task.truncation=%s cuts nothing: the context is unknown (the model's config does not "
                    "say it): set rollout.engine.max_model_len", cfg.rollout.task.truncation)
    train_keys, train_prompts = set(cfg.rollout.task.files("path")), 0
    for key, report in prompt_reports(cfg, fmt).items():
        try:
            report.usable(cfg.rollout.task.skip_invalid)
        except InvalidPrompts as err:
            raise ConfigError(f"{key}: {err}") from None
        log.info("prompts %s", report.summary(list_bad=False))  # usable() logged the rows it skips
        if key in train_keys:
            train_prompts += len(report.problems)
    return train_prompts if cfg.rollout.task.kind == "file" else None


def check_prompt_room(cfg: EtarlConfig, fmt: PromptFormat, train: bool = True) -> None:
    """Each max_new_tokens (the rollout's where `train`, the evaluation's where it runs) leaves room in
    the context for the prompts: the engine refuses a request longer than its context, so a run whose
    every prompt is refused would wait for samples that never come. A file's rows are checked one by
    one (`check_prompts`: too long, or cut by rollout.task.truncation); a built-in task's prompts are
    a few tokens, the same length at one family and difficulty, so a few of each are measured. A
    multi-turn turn asks for what its trajectory has left, so there a prompt needs only to fit."""
    if not fmt.context_len:
        return
    task = cfg.rollout.task
    longest = 1
    if task.kind != "file":
        pairs = len(task.families) * len(task.difficulties)
        problems = mixed_problems(list(task.families), list(task.difficulties), "train", 4 * pairs, task.seed)
        longest = max((len(fmt.encode(problem)) for problem in problems), default=1)
    if cfg.rollout.multi_turn.enabled:  # each turn asks for at most what its trajectory has left (agent_loop)
        if longest >= fmt.context_len:
            raise ConfigError(f"the task's prompts (up to {longest} tokens) fill the trajectory's context of "
                              f"{fmt.context_len} tokens (rollout.multi_turn.max_total_tokens, or the engine's): "
                              "give it more")
        return
    budgets = {"rollout.sampling.max_new_tokens": cfg.rollout.sampling.max_new_tokens} if train else {}
    if cfg.eval.enabled:
        budgets["eval.max_new_tokens"] = cfg.eval.max_new_tokens
    for key, budget in budgets.items():
        room = fmt.prompt_room(budget)
        if room >= longest or fmt.cuts(longest, budget):  # fits, or cut to fit (rollout.task.truncation)
            continue
        what = "any prompt" if task.kind == "file" else f"the task's prompts (up to {longest} tokens)"
        raise ConfigError(f"{key}={budget} leaves {max(room, 0)} of the context's {fmt.context_len} tokens for a "
                          f"prompt, too few for {what}: the engine refuses a prompt that leaves max_new_tokens no "
                          f"room. Set {key} to at most {fmt.context_len - longest}, or give the engine a longer "
                          "context (rollout.engine.max_model_len)")


def warn_of_groups_of_one(cfg: EtarlConfig) -> None:
    """rollout.sampling.n=1 under a group-baseline estimator runs (verl's rule: a group of one has
    baseline 0), but trains on raw rewards, which a user who meant groups does not expect: said once."""
    estimator = cfg.learner.advantage.estimator
    if cfg.rollout.sampling.n == 1 and estimator in GROUP_BASELINE_ESTIMATORS:
        log.warning("rollout.sampling.n=1: learner.advantage.estimator=%s takes its baseline from the other responses "
                    "to a prompt, and a group of one has none, so each response's advantage is its raw reward "
                    "(verl's rule): rewarded responses are pushed up and none down. Sample a group (n >= 2; 8 to 16 "
                    "is usual), or use an estimator with a baseline of its own (gae, remax)", estimator)


def warn_if_the_policy_never_trains(cfg: EtarlConfig, steps: int) -> None:
    """A critic that trains alone for the run's every step leaves the policy as it started: legal
    (a value head warmed for a later resume), but rarely what a run means: said once at start."""
    learner = cfg.learner
    if learner.advantage.estimator == "gae" and learner.critic.train_alone_steps >= steps:
        log.warning("learner.critic.train_alone_steps=%d covers the run's %d steps: the critic trains alone and the "
                    "policy never does (its weights stay as they started). Raise run.steps past it, or "
                    "lower it", learner.critic.train_alone_steps, steps)


def check_lora(cfg: EtarlConfig, model_dir) -> None:
    """learner.lora's target_modules pick some of the model's linear layers (the model built on the meta
    device: no weights read), checked before Ray starts rather than in the learner's actor."""
    if cfg.learner.lora is None:
        return
    from lm.lora_weights import target_names
    from lm.causal_lm import causal_lm_on_meta

    lora = cfg.learner.lora
    try:
        model = causal_lm_on_meta(model_dir)
    except Exception as exc:  # a model that will not build on meta here: the learner checks as it builds
        log.debug("learner.lora's targets not checked before the start: %s", exc)
        return
    try:
        target_names(model, lora.target_modules, lora.exclude_modules)
    except ValueError as err:
        raise ConfigError(str(err)) from None


def check_resume_settings(cfg: EtarlConfig, checkpoint) -> None:
    """A resumed run trains what its checkpoint holds: the same LoRA settings (or none), checked before
    Ray starts."""
    from learner.checkpoint import check_lora_settings, read_trainer_file

    try:
        check_lora_settings(Path(checkpoint), read_trainer_file(Path(checkpoint)), cfg.learner.lora_settings())
    except (ValueError, FileNotFoundError) as err:  # a checkpoint without trainer.pt: said before Ray starts too
        raise ConfigError(str(err)) from None


def with_epochs(cfg: EtarlConfig, train_prompts: int) -> EtarlConfig:
    """`cfg` with run.epochs worked out as run.steps over `train_prompts` usable prompts, epochs cleared (a
    resumed run keeps the steps, or takes new ones). verl's count: prompts // batch size steps an epoch (its
    loader drops a last partial batch)."""
    run, batch_size = cfg.run, cfg.buffer.gate.batch_size
    per_epoch = train_prompts // batch_size
    if per_epoch == 0:
        raise ConfigError(f"run.epochs: {train_prompts} usable train prompts make no batch of buffer.gate.batch_size="
                          f"{batch_size} prompts: use fewer prompts per step, or set run.steps")
    steps = max(1, math.floor(per_epoch * run.epochs))
    log.info("run.epochs=%g: %d usable prompts // buffer.gate.batch_size %d = %d steps an epoch -> run.steps=%d "
             "(run.epochs decides the steps: a run.steps given with it is not read)", run.epochs, train_prompts,
             batch_size, per_epoch, steps)
    try:
        cfg.learner.check_decay_span(steps, f"the {steps} steps of run.epochs={run.epochs:g}")
    except ValueError as err:
        raise ConfigError(str(err)) from None
    warn_if_the_policy_never_trains(cfg, steps)
    return cfg.model_copy(update={"run": run.model_copy(update={"steps": steps, "epochs": None})})


def check_eval_inputs(cfg: EtarlConfig, model_dir) -> None:
    """`etarl eval`'s checks before an engine starts: a held-out set to evaluate on, the model
    folder's tokenizer and context, and a multi-turn run's environment (the held-out rows are checked
    where the evaluator reads them, before its engine starts)."""
    task = cfg.rollout.task
    if task.kind == "file" and not task.heldout_path:
        raise ConfigError("rollout.task.heldout_path is unset: etarl eval evaluates on the held-out prompts "
                          "(set it)")
    _check_verl_reward_task(cfg)
    fmt = prompt_format(cfg, model_dir)
    check_environment(cfg, fmt)
    check_prompt_room(cfg, fmt, train=False)


def data_check(cfg: EtarlConfig, model_dir, paths: list[str] | None = None) -> tuple[str, bool]:
    """`etarl data check`: a report on prompt files under the run's config (the files named, or
    else the config's: each of rollout.task.path and, with evaluation, of heldout_path), and
    whether a run would accept them all (no unusable row, or skip_invalid with usable rows left)."""
    task = cfg.rollout.task
    fmt = prompt_format(cfg, model_dir)
    check_environment(cfg, fmt)  # as a run's start does: a bad environment is refused here too
    if paths:
        reports = _checked_files({path: (path, cfg.rollout.sampling.max_new_tokens) for path in paths}, task, fmt,
                                 cfg.rollout.rows_reward())
    elif task.kind != "file":
        raise ConfigError("no prompt file named, and the config's prompts are built in (rollout.task.kind="
                          f"{task.kind}): name a file, or set rollout.task.path")
    else:
        reports = prompt_reports(cfg, fmt)
    lines, accepted = [f"model {model_dir}: {fmt.describe()}"], True
    for key, report in reports.items():
        lines.append(report.summary() if paths else f"{key} = {report.summary()}")
        if not report.problems:
            accepted = False
            lines.append("  a run would refuse this file: it holds no usable prompt")
        elif report.bad and task.skip_invalid:
            lines.append(f"  a run would skip the {len(report.bad)} unusable rows (rollout.task.skip_invalid=true)")
        elif report.bad:
            accepted = False
            lines.append("  a run would refuse this file: fix the rows, or set rollout.task.skip_invalid=true to "
                         "skip them")
        else:
            lines.append("  every row is usable")
    return "\n".join(lines), accepted


# ---------------------------------------------------------------- the reward module on every node

_SUBMITTED_JOB_CONFIG = "RAY_JOB_CONFIG_JSON_ENV_VAR"  # set by `ray job submit` for its driver


def _submitted_job_runtime_env() -> dict:
    raw = os.environ.get(_SUBMITTED_JOB_CONFIG)
    return (json.loads(raw).get("runtime_env") or {}) if raw else {}


def _tool_py_modules(environment_kwargs: dict) -> list[str]:
    """What the workers need to import the tools environment's tools file and tool classes."""
    from rollout_workers.environments.tool_classes import class_modules
    from rollout_workers.rewards import module_py_modules
    from rollout_workers.verl_stand_in import verl_stand_in

    names = [environment_kwargs["path"]] if environment_kwargs.get("path") else []
    if environment_kwargs.get("config"):
        names += class_modules(environment_kwargs["config"])
    with verl_stand_in():  # finding a module's package may run it, and it may import verl
        return [module for name in names for module in module_py_modules(name)]


def ray_runtime_env(cfg: EtarlConfig, env_vars: dict[str, str] | None = None) -> dict | None:
    """The runtime environment for `ray.init`: `env_vars`, plus the reward's module in py_modules
    when it is not an installed package (None when there is nothing to add). Inside a submitted
    job whose runtime environment already has a working_dir holding the module, nothing travels
    twice; one that has py_modules of its own keeps them (ours are added to the same list)."""
    from rollout_workers.rewards import reward_py_modules

    runtime_env: dict = {"env_vars": dict(env_vars)} if env_vars else {}
    job = _submitted_job_runtime_env()
    try:
        modules = reward_py_modules(cfg.rollout.reward)
    except ImportError as err:
        raise ConfigError(f"rollout.reward: cannot import {cfg.rollout.reward!r} ({err})") from None
    multi_turn = cfg.rollout.multi_turn
    try:
        if multi_turn.environment == "tools":  # its tools travel like a reward's, and the reward it names
            modules += _tool_py_modules(multi_turn.environment_kwargs)
            modules += reward_py_modules(cfg.rollout.environment_arguments()["reward"])
            modules = list(dict.fromkeys(modules))
        elif multi_turn.enabled:  # a user environment travels the same way
            modules += reward_py_modules(multi_turn.environment)
    except (ImportError, ValueError) as err:  # ValueError: a tool config that does not read
        raise ConfigError(f"rollout.multi_turn: cannot import the environment's code ({err})") from None
    if job.get("working_dir"):  # the driver runs in the job's working_dir: what is under it travels already
        modules = [m for m in modules if not Path(m).is_relative_to(Path.cwd())]
    if modules:
        logging.getLogger("ray._private.runtime_env.packaging").setLevel(logging.WARNING)  # one line per upload
        log.info("code the workers import (reward, environment) travels in the Ray job's py_modules: %s", modules)
        if job.get("py_modules"):
            # ours replaces the job's (Ray does not merge two py_modules): its list plus the reward's, and
            # the job's other fields (env_vars: a judge's key the reward process is given) as they are
            env = {**job.get("env_vars", {}), **runtime_env.get("env_vars", {})}
            runtime_env = {**job, **runtime_env, "py_modules": list(job["py_modules"]) + modules,
                           **({"env_vars": env} if env else {})}
            os.environ["RAY_OVERRIDE_JOB_RUNTIME_ENV"] = "1"
        else:
            runtime_env["py_modules"] = modules
    return runtime_env or None
