"""verl's command-line keys answered with etarl's.

A verl user's overrides (`actor_rollout_ref.rollout.n=8 data.train_batch_size=128 ...`) are not
read: etarl has its own names, and a key that looked read but meant something else would be worse
than an error. A command line naming verl's sections is refused with each key's etarl name (or
why there is none) and the whole command line in etarl's keys, to check and paste.

The table follows verl's `ppo_trainer.yaml` (verl/trainer/config, 2026-08) and its recipes' keys
(DAPO's `algorithm.filter_groups` and overlong buffer, in `reward_model.overlong_buffer` or
`reward.reward_kwargs.overlong_buffer_cfg`); `etarl config` lists etarl's own. Keys read together
(the two lengths, a switch and its coefficient, the estimator and its std flag, a reward's path and
name) are joined over the whole command line, whatever their order.
"""
from __future__ import annotations

import json
import shlex
from dataclasses import dataclass
from typing import Any, Callable, Optional

import yaml

from rollout_workers.environments.tool_calls import FORMATS as TOOL_CALL_FORMATS
from services.config import TRACKERS
from services.yaml_values import yaml_value

# verl's top-level sections; none of them is one of etarl's (mode, run, ray, buffer, rollout, learner, eval, metrics)
VERL_SECTIONS = ("actor_rollout_ref", "algorithm", "async_training", "critic", "custom_reward_function", "data",
                 "distillation", "global_profiler", "ray_kwargs", "reward", "reward_manager", "reward_model",
                 "sandbox_fusion", "skip", "trainer", "transfer_queue")
# verl's fully-async trainer has a top-level `rollout` section too: these keys of it are not etarl's
VERL_ROLLOUT_KEYS = ("rollout.nnodes", "rollout.n_gpus_per_node", "rollout.total_rollout_steps")


@dataclass(frozen=True)
class Rule:
    """A verl key's etarl key (None: there is none), how a value changes on the way, and a note."""

    etarl: Optional[str]
    note: str = ""
    value: Optional[Callable[[Any], Any]] = None


def _off_if_negative(value):  # verl's -1: never / none
    return 0 if isinstance(value, (int, float)) and value < 0 else value


def _unset_if_zero(value):  # verl's 0: no limit (etarl's default stands)
    return None if value == 0 else value


ACTOR, ROLLOUT, MODEL = "actor_rollout_ref.actor.", "actor_rollout_ref.rollout.", "actor_rollout_ref.model."
# Notes several keys share.
CLUSTER = "etarl uses the Ray cluster's nodes and GPUs (ray.address; `etarl plan` shows the layout)"
ONE_REWARD = "etarl tells the manager by the reward's signature: compute_score(data_source, solution_str, ...) " \
             "scores each response (verl's naive), compute_score(data_sources, solution_strs, ...) a group in one " \
             "call (verl's batch); DAPO's overlong shaping is rollout.overlong_buffer"
NO_REWARD_MODEL = "etarl starts no reward model: serve the judge apart and call it from the reward " \
                  "(examples/judge_reward.py; its URL and key named in rollout.reward_env)"
DEFAULT_REWARD = ("verl's default reward by data_source, without verl: GSM8K, MATH, DAPO/AIME, Search-R1 and "
                  "PRIME's numina_* rows; "
                  "a row of another data_source is a bad row")
REWARD_KWARGS = Rule("rollout.reward_kwargs.", "the reward's keyword arguments")
# verl's defaults that etarl's embedded default (a tiny model's run) does not share: a verl command line gets
# verl's where it names none of the keys that set them. {etarl key: (verl keys, verl's value, note)}
VERL_DEFAULTS = {
    "learner.lr": ((ACTOR + "optim.lr",), 1e-6, "verl's actor learning rate"),
    "learner.warmup_steps": ((ACTOR + "optim.lr_warmup_steps", ACTOR + "optim.lr_warmup_steps_ratio"), 0,
                             "verl warms up for no step"),
    "rollout.task.shuffle": (("data.shuffle",), True, "verl shuffles its train prompts"),
    "rollout.sampling.max_new_tokens": (("data.max_response_length", ROLLOUT + "response_length"), 512,
                                        "verl's response length"),
}
RULES: dict[str, Rule] = {
    # data
    "data.train_files": Rule("rollout.task.path", "with rollout.task.kind=file; a list: the files one after "
                                                  "another"),
    "data.val_files": Rule("rollout.task.heldout_path", "with rollout.task.kind=file and rollout.task.path"),
    "data.prompt_key": Rule("rollout.task.prompt_key"),
    "data.reward_fn_key": Rule("rollout.task.data_source_key"),
    "data.train_batch_size": Rule("buffer.gate.batch_size", "prompts per step, each a group of rollout.sampling.n",
                                  lambda v: None if v == 0 else v),  # 0: verl's fully-async trainer's
    "data.max_response_length": Rule("rollout.sampling.max_new_tokens"),
    "data.shuffle": Rule("rollout.task.shuffle", "etarl's default is file order"),
    "data.seed": Rule("rollout.task.seed"),
    "data.filter_overlong_prompts": Rule("rollout.task.skip_invalid", "skips every unusable row, too long or not"),
    "data.truncation": Rule("rollout.task.truncation", "to leave max_new_tokens within the context; a cut "
                            "prompt is usable, so skip_invalid does not skip it (verl filters overlong prompts "
                            "first; verl's agent loop cuts from the left whatever this says, etarl's default "
                            "refuses)"),
    "data.apply_chat_template_kwargs": Rule("rollout.task.chat_template_kwargs"),
    # the model
    MODEL + "path": Rule("run.model"),
    MODEL + "enable_gradient_checkpointing": Rule("learner.gradient_checkpointing"),
    MODEL + "use_remove_padding": Rule("learner.packing", "auto packs where it pays: on GPUs",
                                       lambda v: "auto" if v else False),
    MODEL + "lora_adapter_path": Rule(None, "etarl's adapters start new (B = 0: the base model); it writes "
                                            "its own as a PEFT folder, lora_adapter/ in each checkpoint"),
    MODEL + "use_shm": Rule(None, "etarl's engines and learner read the model folder where it is"),
    ROLLOUT + "layered_summon": Rule(None, "etarl gathers what it sends engines a bucket at a time (learner.lora)"),
    **{MODEL + "lora." + key: Rule(None, "etarl's adapters are PEFT's LoRA: A Kaiming-uniform, B zeros, float32")
       for key in ("type", "lora_A_init_method", "lora_B_init_method", "dtype")},
    ROLLOUT + "load_format": Rule(None, "etarl's engines load the model folder, then each version the learner "
                                        "publishes"),
    "critic.model.lora_rank": Rule(None, "etarl's critic trains every weight; learner.lora adapts the policy"),
    # the actor
    ACTOR + "optim.lr": Rule("learner.lr"),
    ACTOR + "optim.weight_decay": Rule("learner.weight_decay"),
    ACTOR + "optim.betas": Rule("learner.betas"),
    ACTOR + "optim.clip_grad": Rule("learner.grad_clip"),
    ACTOR + "grad_clip": Rule("learner.grad_clip"),
    ACTOR + "optim.lr_warmup_steps": Rule("learner.warmup_steps", value=_off_if_negative),
    ACTOR + "optim.warmup_style": Rule("learner.lr_schedule", "verl's older name of lr_scheduler_type"),
    ACTOR + "optim.lr_warmup_steps_ratio": Rule(None, "etarl counts warm-up in steps: learner.warmup_steps = the "
                                                      "ratio x the run's steps"),
    ACTOR + "optim.lr_scheduler_type": Rule("learner.lr_schedule", "cosine and linear decay over the run's steps, as verl's do"),
    ACTOR + "optim.min_lr_ratio": Rule("learner.min_lr_ratio"),
    ACTOR + "optim.total_training_steps": Rule("learner.total_steps"),
    ACTOR + "ppo_mini_batch_size": Rule("learner.ppo_mini_batch_size", "groups, that is prompts, as verl's"),
    ACTOR + "ppo_micro_batch_size_per_gpu": Rule("learner.micro_batch_size", "sequences per forward/backward"),
    ACTOR + "ppo_max_token_len_per_gpu": Rule("learner.max_tokens_per_micro_batch"),
    ACTOR + "use_dynamic_bsz": Rule(None, "etarl always plans micro-batches by tokens "
                                          "(learner.max_tokens_per_micro_batch)"),
    ACTOR + "ppo_epochs": Rule("learner.ppo_epochs"),
    ACTOR + "shuffle": Rule("learner.shuffle_minibatches"),
    ACTOR + "clip_ratio_low": Rule("learner.policy_loss.clip_ratio_low"),
    ACTOR + "clip_ratio_high": Rule("learner.policy_loss.clip_ratio_high"),
    ACTOR + "clip_ratio_c": Rule("learner.policy_loss.clip_ratio_c"),
    ACTOR + "tau_pos": Rule("learner.policy_loss.tau_pos"),
    ACTOR + "tau_neg": Rule("learner.policy_loss.tau_neg"),
    ACTOR + "loss_agg_mode": Rule("learner.policy_loss.loss_agg_mode"),
    ACTOR + "loss_scale_factor": Rule("learner.policy_loss.loss_scale_factor"),
    ACTOR + "entropy_coeff": Rule("learner.policy_loss.entropy_coeff"),
    ACTOR + "calculate_entropy": Rule("learner.compute_entropy"),
    ACTOR + "kl_loss_type": Rule("learner.policy_loss.kl_estimator", "verl's names are taken"),
    ACTOR + "strategy": Rule(None, "etarl's learner shards with FSDP2 where it has several ranks "
                                   "(learner.distributed.strategy; `etarl plan` chooses)"),
    **{ACTOR + "policy_loss." + key: Rule("learner.policy_loss." + key)
       for key in ("loss_mode", "clip_cov_ratio", "clip_cov_lb", "clip_cov_ub", "kl_cov_ratio", "ppo_kl_coef")},
    # rollout
    ROLLOUT + "n": Rule("rollout.sampling.n"),
    ROLLOUT + "temperature": Rule("rollout.sampling.temperature"),
    ROLLOUT + "top_p": Rule("rollout.sampling.top_p"),
    ROLLOUT + "top_k": Rule("rollout.sampling.top_k", "etarl's 0 is verl's -1: no top-k", _off_if_negative),
    ROLLOUT + "name": Rule("rollout.engine.kind", "vllm or hf, transformers; no SGLang",
                           lambda v: v if v in ("vllm", "hf") else None),
    ROLLOUT + "dtype": Rule("rollout.engine.dtype"),
    ROLLOUT + "gpu_memory_utilization": Rule("rollout.engine.gpu_memory_utilization"),
    ROLLOUT + "tensor_model_parallel_size": Rule("rollout.engine.tensor_parallel_size"),
    ROLLOUT + "max_model_len": Rule("rollout.engine.max_model_len"),
    ROLLOUT + "enforce_eager": Rule("rollout.engine.enforce_eager"),
    ROLLOUT + "mode": Rule(None, "etarl's engines always serve asynchronously"),
    ROLLOUT + "calculate_log_probs": Rule(None, "etarl's engines always return the behaviour log-probs"),
    ROLLOUT + "multi_turn.enable": Rule(None, "multi-turn rollouts are on when rollout.multi_turn.environment "
                                              "names an environment"),
    ROLLOUT + "multi_turn.max_assistant_turns": Rule("rollout.multi_turn.max_turns"),
    **{ROLLOUT + "multi_turn." + k: Rule("rollout.multi_turn.environment_kwargs." + k, "of the tools environment")
       for k in ("max_parallel_calls", "max_tool_response_length", "tool_response_truncate_side")},
    ROLLOUT + "agent.default_agent_loop": Rule(None, "verl's tool_agent is rollout.multi_turn.environment=tools (and "
                                                     "multi_turn.tool_config_path or function_tool_path its tools); "
                                                     "without an environment etarl's rollouts are single-turn"),
    "data.return_raw_chat": Rule(None, "etarl keeps chat prompts as messages and renders them itself"),
    ROLLOUT + "multi_turn.max_user_turns": Rule("rollout.multi_turn.environment_kwargs.max_tool_turns",
                                                "turns that called tools before the answer turn, as verl counts "
                                                "tool responses; unset: one fewer than max_turns", _unset_if_zero),
    ROLLOUT + "multi_turn.use_inference_chat_template": Rule(None, "etarl keeps each turn's tokens as generated "
                                                                   "and renders only what follows them"),
    ROLLOUT + "multi_turn.tokenization_sanity_check_mode": Rule(None, "etarl never re-tokenizes a trajectory"),
    ROLLOUT + "multi_turn.num_repeat_rollouts": Rule(None, "a prompt's trajectories are rollout.sampling.n"),
    ROLLOUT + "multi_turn.format": Rule("rollout.multi_turn.environment_kwargs.format",
                                        f"the tools environment reads {' and '.join(TOOL_CALL_FORMATS)} calls",
                                        lambda v: v if v in TOOL_CALL_FORMATS else None),
    # the algorithm
    "algorithm.gamma": Rule("learner.advantage.gamma"),
    "algorithm.lam": Rule("learner.advantage.lam"),
    "algorithm.kl_penalty": Rule("learner.kl_in_reward.estimator"),
    "algorithm.kl_ctrl.type": Rule("learner.kl_in_reward.controller"),
    "algorithm.kl_ctrl.target_kl": Rule("learner.kl_in_reward.target_kl"),
    "algorithm.kl_ctrl.horizon": Rule("learner.kl_in_reward.horizon"),
    "algorithm.filter_groups.enable": Rule("rollout.filter_groups.enabled"),
    "algorithm.filter_groups.metric": Rule("rollout.filter_groups.metric", "verl's score, seq_reward and "
                                           "seq_final_reward are the reward", lambda v: "reward" if v in (
                                               "score", "seq_reward", "seq_final_reward") else v),
    "algorithm.filter_groups.max_num_gen_batches": Rule(None, "etarl pushes a group anyway after "
                                                              "rollout.filter_groups.max_in_a_row filtered in a row"),
    **{f"{where}{key}": Rule(f"rollout.overlong_buffer.{etarl_key}")  # DAPO's, in verl's older and newer places
       for where in ("reward_model.overlong_buffer.", "reward_model.reward_kwargs.overlong_buffer_cfg.",
                     "reward.reward_kwargs.overlong_buffer_cfg.")
       for key, etarl_key in (("enable", "enabled"), ("len", "len"), ("penalty_factor", "penalty_factor"))},
    "reward.reward_kwargs.max_resp_len": Rule(None, "etarl's overlong buffer ends at rollout.sampling.max_new_tokens"),
    "reward.reward_manager.name": Rule(None, ONE_REWARD),
    "reward.reward_model.enable": Rule(None, NO_REWARD_MODEL),
    ACTOR + "router_replay.mode": Rule("learner.routing_replay", "verl's disabled, R2, R3",
                                       lambda v: {"disabled": "none"}.get(str(v), str(v).lower())),
    "reward_model.enable": Rule(None, NO_REWARD_MODEL),
    "reward_model.reward_manager": Rule(None, ONE_REWARD),
    "custom_reward_function.reward_kwargs": Rule("rollout.reward_kwargs"),
    "reward.custom_reward_function.reward_kwargs": Rule("rollout.reward_kwargs"),
    # the critic
    "critic.optim.lr": Rule("learner.critic.lr"),
    "critic.optim.weight_decay": Rule("learner.critic.weight_decay"),
    "critic.optim.lr_warmup_steps": Rule("learner.critic.warmup_steps", value=_off_if_negative),
    "critic.grad_clip": Rule("learner.critic.grad_clip"),
    "critic.cliprange_value": Rule("learner.critic.cliprange_value"),
    "critic.loss_agg_mode": Rule("learner.critic.loss_agg_mode"),
    "critic.model.path": Rule("learner.critic.model_path"),
    # the trainer
    "trainer.test_freq": Rule("run.eval_every", "verl's -1: no evaluation during training; etarl's 0: at the start "
                                                "and the end", _off_if_negative),
    "trainer.save_freq": Rule("run.checkpoint_every", "verl's -1: no checkpoint; etarl's 0: one at the end",
                              _off_if_negative),
    "trainer.val_before_train": Rule(None, "etarl evaluates at the start whenever eval.enabled"),
    "trainer.critic_warmup": Rule("learner.critic.train_alone_steps"),
    "trainer.default_local_dir": Rule("run.run_dir"),
    "trainer.max_actor_ckpt_to_keep": Rule("run.keep_checkpoints"),
    "trainer.resume_mode": Rule(None, "etarl train --resume RUN_DIR continues a run"),
    "trainer.balance_batch": Rule(None, "etarl always balances the learner's ranks by tokens"),
    **{key: Rule(None, CLUSTER) for key in ("trainer.nnodes", "trainer.n_gpus_per_node", "rollout.nnodes",
                                            "rollout.n_gpus_per_node")},
    "rollout.total_rollout_steps": Rule(None, "etarl counts learner steps: run.steps"),
    "trainer.project_name": Rule("metrics.project", "the W&B project"),
    "trainer.experiment_name": Rule("metrics.experiment", "the run's name in W&B"),
}
# Whole sections: under another name, or without an etarl counterpart.
PREFIXES = {
    "algorithm.rollout_correction.": Rule("learner.rollout_correction.", "the same keys"),
    "custom_reward_function.reward_kwargs.": REWARD_KWARGS,
    "reward.custom_reward_function.reward_kwargs.": REWARD_KWARGS,
    ACTOR + "fsdp_config.": Rule(None, "etarl's FSDP2 learner: learner.distributed, learner.mixed_precision; no "
                                       "offloading"),
    "actor_rollout_ref.ref.": Rule(None, "etarl's reference model (for a KL term) is the policy's start, sharded "
                                         "as the learner is; its passes share learner.max_tokens_per_micro_batch"),
    ROLLOUT + "log_prob_": Rule(None, "the learner's log-prob passes share learner.max_tokens_per_micro_batch"),
    "critic.model.fsdp_config.": Rule(None, "etarl's critic is sharded as the learner is"),
    "global_profiler.": Rule(None, "no profiler settings"),
    "async_training.": Rule(None, "etarl is asynchronous by design: its staleness bound is buffer.gate.eta (versions "
                                  "a sample may lag the learner; 'auto' adapts it), its weight sync each step"),
}
# Keys read together: each join reads the whole command line (the order of its keys is not theirs).
PROMPT_LENGTH, VERL_LENGTH = "data.max_prompt_length", 512
RESPONSE_LENGTHS = ("data.max_response_length", ROLLOUT + "response_length")
ESTIMATOR, NORM_BY_STD = "algorithm.adv_estimator", "algorithm.norm_adv_by_std_in_grpo"
REWARD_FUNCTIONS = ("custom_reward_function.", "reward.custom_reward_function.")  # verl's older and newer place
KL_SWITCHES = {  # switch, its coefficient, verl's default coefficient, etarl's key
    ACTOR + "use_kl_loss": (ACTOR + "kl_loss_coef", 0.001, "learner.policy_loss.kl_coef"),
    "algorithm.use_kl_in_reward": ("algorithm.kl_ctrl.kl_coef", 0.001, "learner.kl_in_reward.coef"),
}
Said = list[tuple[Optional[str], Any, str]]  # (etarl key or None, value, note)


def _reward_function(key: str, value: Any, given: dict) -> Said:
    section = next(s for s in REWARD_FUNCTIONS if key.startswith(s))
    path, name = given.get(section + "path"), given.get(section + "name") or "compute_score"
    if key.endswith(".name") and path:
        return []  # said with the path
    if not path:
        return [(None, None, f"the function named goes with a file: rollout.reward=path/to/file.py:{name}")]
    return [("rollout.reward", f"{path}:{name}", f"{section}name joined")]


def _kl(key: str, value: Any, given: dict) -> Said:
    switch = next(s for s, (coef, _, _) in KL_SWITCHES.items() if key in (s, coef))
    coef_key, verl_default, target = KL_SWITCHES[switch]
    if key == coef_key:
        return [] if switch in given else [(None, None, f"verl applies it only with {switch}=true (default false); "
                                                        f"etarl's is {target}")]
    if not value:
        return [(target, 0.0, "off")]
    if coef_key in given:
        return [(target, given[coef_key], f"with {coef_key}")]
    return [(target, verl_default, f"{coef_key} at verl's default")]


def _estimator(key: str, value: Any, given: dict) -> Said:
    estimator, by_std = given.get(ESTIMATOR, "gae"), given.get(NORM_BY_STD, True)
    if key == ESTIMATOR:
        if estimator in ("grpo", "grpo_vectorized") and by_std is False:
            return [("learner.advantage.estimator", "dr_grpo", f"GRPO with {NORM_BY_STD}=false: no std division")]
        same = {"grpo_vectorized": "grpo", "rloo_vectorized": "rloo"}  # verl's two forms of one estimator
        return [("learner.advantage.estimator", same.get(value, value), "")]
    if estimator == "gdpo":
        return [("learner.advantage.gdpo_norm_by_std", value, "")]
    if estimator in ("grpo", "grpo_vectorized"):
        return []  # said with the estimator
    if estimator == "grpo_passk":
        return [(None, None, "etarl's grpo_passk divides by the group's std")] if value is False else []
    return [(None, None, f"verl applies it to grpo only (here {estimator}); GRPO without the std division is "
                         f"learner.advantage.estimator=dr_grpo")]


def _lengths(key: str, value: Any, given: dict) -> Said:
    if key != PROMPT_LENGTH:  # the rollout's response length, where given, is the one verl generates with
        return [] if key == RESPONSE_LENGTHS[0] and RESPONSE_LENGTHS[1] in given else \
            [("rollout.sampling.max_new_tokens", value, "")]
    if ROLLOUT + "max_model_len" in given:
        return [(None, None, f"{ROLLOUT}max_model_len gives the context")]
    response_key = next((k for k in reversed(RESPONSE_LENGTHS) if k in given), None)
    response = given[response_key] if response_key else VERL_LENGTH
    note = f"the prompt and the response: {value} + {response}" + ("" if response_key else
                                                                   " (verl's default response length)")
    return [("rollout.engine.max_model_len", _plus(value, response), note)]


def _clip_ratio(key: str, value: Any, given: dict) -> Said:
    return [(None, None, "verl's PPO clip takes clip_ratio_low and clip_ratio_high (0.2 each unless set; clip_ratio "
                         "only where one is null): etarl's are learner.policy_loss.clip_ratio_low / _high")]


def _validation(key: str, value: Any, given: dict) -> Said:
    """verl validates with val_kwargs: n answers per prompt, sampled only with do_sample (default
    false: greedy). etarl answers each held-out prompt greedily and samples eval.n_samples more."""
    n_key, temperature_key, sample_key = (ROLLOUT + "val_kwargs." + k for k in ("n", "temperature", "do_sample"))
    sampled = bool(given.get(sample_key, False))
    if key == temperature_key:
        if sampled and value:
            return [("eval.temperature", value, "of the sampled answers")]
        return [(None, None, "verl's validation is greedy here; etarl answers each held-out prompt greedily anyway")]
    if key == sample_key and n_key in given:
        return []  # said with n
    n = given.get(n_key, 1)
    if not sampled or not isinstance(n, int):
        return [("eval.n_samples", 0, "greedy validation: etarl's greedy answer, no samples")]
    return [("eval.n_samples", n, "sampled answers per prompt; etarl also answers greedily"),
            ("eval.k", min(n, 4), "pass@k within the samples")]


def _steps(key: str, value: Any, given: dict) -> Said:
    said: Said = [("run.steps", value, "")]
    schedule = given.get(ACTOR + "optim.lr_scheduler_type", "constant")
    if schedule != "constant" and ACTOR + "optim.total_training_steps" not in given:
        said.append(("learner.total_steps", value, f"the span of the {schedule} decay, as verl takes it"))
    return said


def _tools(key: str, value: Any, given: dict) -> Said:
    which = "path" if key.endswith("function_tool_path") else "config"
    return [("rollout.multi_turn.environment", "tools", "the built-in tools environment: verl's function tools "
             "and BaseTool classes (hermes <tool_call> blocks, their results through the chat template)"),
            ("rollout.multi_turn.environment_kwargs." + which, value, "")]


def _epochs(key: str, value: Any, given: dict) -> Said:
    if given.get("trainer.total_training_steps") is not None:
        return [(None, None, "trainer.total_training_steps decides the steps, as in verl")]
    return [("run.epochs", value, "the steps are worked out when the run starts: usable prompts // "
             "buffer.gate.batch_size an epoch")]


def _trackers(key: str, value: Any, given: dict) -> Said:
    """verl's trainer.logger: console (etarl always prints), wandb and tensorboard are etarl's too."""
    names = [value] if isinstance(value, str) else list(value) if isinstance(value, (list, tuple)) else [value]
    kept = list(dict.fromkeys(name for name in names if name in TRACKERS))
    others = [str(name) for name in names if name not in TRACKERS and name != "console"]
    note = (f"etarl has no {', '.join(others)} tracker (it has {', '.join(TRACKERS)}); " if others else "") + \
        "the console, metrics.jsonl and plots in the run folder, Prometheus on metrics.port, always"
    return [("metrics.trackers", kept, note)] if kept else [(None, None, note)]


def _rank_given(given: dict, key: str) -> bool:
    """Whether verl's command line sets the policy's LoRA rank `key` (lora_rank or lora.rank) above 0."""
    value = given.get(MODEL + key)
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def _lora(key: str, value: Any, given: dict) -> Said:
    """verl's LoRA: lora_rank > 0 turns it on (or the nested lora.rank, which verl reads first); the
    other keys go with it."""
    nested_on = _rank_given(given, "lora.rank")
    if not nested_on and not _rank_given(given, "lora_rank"):
        return [(None, None, "LoRA is off: verl's lora_rank is 0 (etarl trains every weight without learner.lora)")]
    part = key[len(MODEL):].removeprefix("lora.")
    if part == "merge":  # said with the rank, merge=False (verl's default) included
        return []
    target = {"lora_rank": "rank", "lora_alpha": "alpha"}.get(part, part)
    if key.startswith(MODEL + "lora.") != nested_on:
        return [(None, None, f"verl reads the {'nested lora.*' if nested_on else 'lora_*'} keys here (those whose "
                             f"rank is above 0)")]
    if target == "rank":  # verl's lora.merge (False by default, for lora_rank too): adapters into vLLM
        merge = bool(given.get(MODEL + "lora.merge", False))
        return [("learner.lora.rank", value, ""),
                ("learner.lora.publish", "merged" if merge else "adapter",
                 f"verl's lora.merge={merge}: the engines get {'merged weights' if merge else 'the adapters'}")]
    names = value.split(",") if isinstance(value, str) else []
    if part in ("target_modules", "exclude_modules") and len(names) > 1 and \
            all(name.strip().isidentifier() for name in names):
        value = [name.strip() for name in names]  # "q_proj,v_proj"; any other string is a regular expression
    return [("learner.lora." + target, value, "")]


def _model_dtype(key: str, value: Any, given: dict) -> Said:
    """verl's FSDP model_dtype: the dtype its actor keeps its weights in (fp32 by default)."""
    names = {"fp32": "float32", "float32": "float32", "bf16": "bfloat16", "bfloat16": "bfloat16",
             "fp16": "float16", "float16": "float16"}
    if value not in names:
        return [(None, None, f"{value!r} is none of {sorted(names)}")]
    lora = _rank_given(given, "lora.rank") or _rank_given(given, "lora_rank")
    note = "with LoRA the frozen weights' dtype (the adapters stay float32)" if lora else \
        "prefer float32 with learner.mixed_precision=bfloat16 for full fine-tuning"
    return [("learner.dtype", names[value], note if names[value] != "float32" else "")]


def _routing(key: str, value: Any, given: dict) -> Said:
    if ACTOR + "router_replay.mode" in given:
        return []  # the mode says it
    return [("learner.routing_replay", "r3", "")] if value else [(None, None, "etarl's default replays nothing")]


JOINS: dict[str, Callable[[str, Any, dict], Said]] = {
    **{section + part: _reward_function for section in REWARD_FUNCTIONS for part in ("path", "name")},
    **{key: _kl for switch, (coef, _, _) in KL_SWITCHES.items() for key in (switch, coef)},
    ESTIMATOR: _estimator, NORM_BY_STD: _estimator,
    PROMPT_LENGTH: _lengths, **{key: _lengths for key in RESPONSE_LENGTHS},
    ACTOR + "clip_ratio": _clip_ratio,
    **{ROLLOUT + "val_kwargs." + k: _validation for k in ("n", "temperature", "do_sample")},
    "trainer.total_training_steps": _steps,
    "trainer.total_epochs": _epochs,
    "trainer.logger": _trackers,
    ROLLOUT + "enable_rollout_routing_replay": _routing,
    ACTOR + "fsdp_config.model_dtype": _model_dtype,
    **{MODEL + key: _lora for key in ("lora_rank", "lora_alpha", "target_modules", "exclude_modules",
                                      "lora.rank", "lora.alpha", "lora.target_modules", "lora.exclude_modules",
                                      "lora.merge")},
    ROLLOUT + "multi_turn.function_tool_path": _tools,
    ROLLOUT + "multi_turn.tool_config_path": _tools,
}


def is_verl_key(key: str) -> bool:
    name = _verl_name(key)
    return name.split(".", 1)[0] in VERL_SECTIONS or name in VERL_ROLLOUT_KEYS


def _verl_name(key: str) -> str:
    return key.lstrip("+")  # Hydra's +key=value (add) and ++key=value (add or override)


def _plus(a: Any, b: Any) -> Any:
    return a + b if all(isinstance(x, int) and not isinstance(x, bool) for x in (a, b)) else f"{a}+{b}"


def _text(value: Any) -> str:
    """A value as an override's right-hand side (YAML flow), read back as the same value: a string
    YAML would read as something else ('yes', 'null', '1e-3') is quoted."""
    if isinstance(value, str):
        try:
            same = yaml_value(value or "''") == value  # as etarl reads the line back
        except yaml.YAMLError:  # not YAML at all ('[oops'): quoted, it is a string
            same = False
        return value if same else json.dumps(value)
    return yaml.safe_dump(value, default_flow_style=True, width=10**6).strip().removesuffix("...").strip()


def _said(key: str, value: Any, given: dict) -> Said:
    """What one verl key becomes."""
    if value is None:
        return [(None, None, "null: etarl's default stands")]
    if key in JOINS:
        return JOINS[key](key, value, given)
    prefix = next((p for p in PREFIXES if key.startswith(p)), None)
    if prefix is not None:
        rule = PREFIXES[prefix]
        return [(rule.etarl and rule.etarl + key[len(prefix):], value, "" if rule.etarl else rule.note)]
    rule = RULES.get(key)
    if rule is None:
        return [(None, None, "not one etarl has (`etarl config` lists etarl's keys)")]
    new = rule.value(value) if rule.value else value
    if new is None:
        return [(None, None, f"{value!r} has no etarl form of {rule.etarl} ({rule.note})")]
    return [(rule.etarl, new, rule.note)]


def translate(overrides: list[tuple[str, Any]]) -> tuple[list[str], list[str]]:
    """(a line per verl key: its etarl key and value, or why it has none; the etarl overrides)."""
    overrides = [(_verl_name(key) if is_verl_key(key) else key, value) for key, value in overrides]
    given = {key: value for key, value in overrides if value is not None}  # a null is verl's default
    lines: list[str] = []
    etarl: dict[str, str] = {}
    for key, value in overrides:
        if not is_verl_key(key):
            continue
        for target, new, note in _said(key, value, given):
            if target is None:
                lines.append(f"  {key}: no etarl key: {note}")
                continue
            etarl[target] = _text(new)
            lines.append(f"  {key}={_text(value)} -> {target}={etarl[target]}" + (f" ({note})" if note else ""))
    if "rollout.task.path" in etarl or "rollout.task.heldout_path" in etarl:  # verl's data: a run on files
        etarl.setdefault("rollout.task.kind", "file")
        if not any(key.startswith(REWARD_FUNCTIONS) for key in given):
            etarl.setdefault("rollout.reward", "verl")
            lines.append(f"  (no custom_reward_function -> rollout.reward=verl: {DEFAULT_REWARD})")
        unsaid = {target: (value, why) for target, (verl_keys, value, why) in VERL_DEFAULTS.items()
                  if target not in etarl and not any(key in given for key in verl_keys)}
        for target, (value, why) in unsaid.items():
            etarl[target] = _text(value)
        if unsaid:
            lines.append("  (verl's defaults where etarl's embedded default differs: " + "; ".join(
                f"{target}={_text(value)} ({why})" for target, (value, why) in unsaid.items()) + ")")
    return lines, [f"{key}={text}" for key, text in etarl.items()]


def verl_keys_message(overrides: list[tuple[str, Any]]) -> Optional[str]:
    """Why a command line with verl's keys is refused, and the same in etarl's keys; None without any."""
    if not any(is_verl_key(key) for key, _ in overrides):
        return None
    lines, etarl = translate(overrides)
    mine = [f"{key}={_text(value)}" for key, value in overrides if not is_verl_key(key)]
    message = ["these are verl's keys, which etarl does not read (it has its own names):", *lines]
    if etarl:
        message += ["in etarl's keys (check the notes):", "  " + " ".join(shlex.quote(o) for o in mine + etarl)]
    return "\n".join(message)
