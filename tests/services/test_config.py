"""The config tree: YAML + dotted overrides, presets and modes, and errors that name the key."""
import os

import pytest

from learner.correction import RolloutCorrectionConfig
from services.config import (
    DEFAULT_CONFIG, ConfigError, EtarlConfig, build_config, load_config, parse_override, with_absolute_paths,
)


def test_default_config_is_the_embedded_async_run():
    cfg = load_config()
    assert cfg.mode == "async" and cfg.eta == 2
    assert cfg.run.model == "tiny" and cfg.learner.model_path == "tiny"
    assert cfg.buffer.transport == "ray"
    assert cfg.ray.address == "local"
    # decoupled token-TIS: token-level IS, not bypass
    assert cfg.learner.rollout_correction.rollout_is == "token"
    assert cfg.learner.rollout_correction.bypass_mode is False


def test_overrides_are_typed_by_yaml_then_by_the_field():
    assert parse_override("run.steps=7") == ("run.steps", 7)
    assert parse_override("learner.betas=[0.9, 0.95]") == ("learner.betas", [0.9, 0.95])
    assert parse_override("buffer.gate.eta=null") == ("buffer.gate.eta", None)
    assert parse_override("run.progress=false") == ("run.progress", False)
    cfg = load_config(None, ["learner.lr=3e-5", "buffer.gate.eta=3", "run.steps=7", "run.progress=false",
                             "learner.rollout_correction=decoupled_seq_is"])
    assert cfg.learner.lr == pytest.approx(3e-5) and cfg.eta == 3 and cfg.run.steps == 7
    assert cfg.run.progress is False
    assert cfg.learner.rollout_correction.rollout_is == "sequence"


def test_modes_set_eta_and_contradictions_are_errors():
    assert load_config(None, ["mode=synchronous"]).eta == 0
    assert load_config(None, ["mode=one_step_off"]).eta == 1
    assert EtarlConfig.synchronous().eta == 0
    assert EtarlConfig.one_step_off().eta == 1
    assert EtarlConfig.fully_async(eta=None).eta is None
    with pytest.raises(ConfigError, match=r"mode=synchronous means buffer.gate.eta=0"):
        load_config(None, ["mode=synchronous", "buffer.gate.eta=3"])
    with pytest.raises(ConfigError, match="use mode=synchronous"):
        load_config(None, ["buffer.gate.eta=0"])


def test_unknown_keys_name_the_full_dotted_key_and_suggest():
    with pytest.raises(ConfigError) as err:
        load_config(None, ["learner.learning_rate=1e-5"])
    assert "learner.learning_rate: unknown key" in str(err.value)
    with pytest.raises(ConfigError) as err:
        load_config(None, ["buffer.gate.etaa=3"])
    assert "buffer.gate.etaa: unknown key (did you mean buffer.gate.eta?)" in str(err.value)
    with pytest.raises(ConfigError, match=r"nosuchsection: unknown key"):
        load_config(None, ["nosuchsection.x=1"])


@pytest.mark.parametrize("override, line", [
    # a key given one level too high (or at the top) names where it lives
    ("buffer.eta=2", "buffer.eta: unknown key (did you mean buffer.gate.eta?)"),
    ("eta=2", "eta: unknown key (did you mean buffer.gate.eta?)"),
    ("lr=1e-5", "lr: unknown key (did you mean learner.lr or learner.critic.lr?)"),
    # a key of another form of a tagged union names the key that selects that form
    ("learner.weight_sync.backend=nccl", "learner.weight_sync.backend: unknown key with "
     "learner.weight_sync.channel=object_store (a key of learner.weight_sync.channel=broadcast)"),
    # a union's members' complaints on one line, under the key the user wrote (no `.int`, `.literal[...]`)
    ("buffer.gate.eta=abc", "buffer.gate.eta: Input should be a valid integer, unable to parse string as an "
     "integer; or Input should be 'auto' (got 'abc')"),
    ("rollout.sampling.stop_token_ids=[1, x]", "rollout.sampling.stop_token_ids[1]: Input should be a valid "
     "integer, unable to parse string as an integer (got 'x')"),
])
def test_errors_name_the_key_as_the_user_writes_it(override, line):
    with pytest.raises(ConfigError) as err:
        load_config(None, [override])
    assert str(err.value).splitlines()[1:] == [f"  {line}"]


def test_a_tag_that_is_also_a_key_of_its_form_is_not_taken_for_the_key():
    with pytest.raises(ConfigError) as err:
        load_config(None, ["learner.weight_sync.channel=folder", "learner.weight_sync.backend=nccl"])
    assert str(err.value).splitlines()[1:] == [
        "  learner.weight_sync.folder: Field required",
        "  learner.weight_sync.backend: unknown key with learner.weight_sync.channel=folder (a key of "
        "learner.weight_sync.channel=broadcast)"]


def test_a_key_below_a_preset_name_changes_that_key_of_the_preset():
    default = load_config(None).learner.rollout_correction
    assert default.rollout_is == "token" and default.rollout_is_threshold == 2.0  # the default.yaml names a preset
    tuned = load_config(None, ["learner.rollout_correction.rollout_is_threshold=3"]).learner.rollout_correction
    assert tuned.model_dump() == {**default.model_dump(), "rollout_is_threshold": 3.0}
    seq = load_config(None, ["learner.rollout_correction=decoupled_seq_is_rs",
                             "learner.rollout_correction.rollout_is_threshold=5"]).learner.rollout_correction
    preset = RolloutCorrectionConfig.preset("decoupled_seq_is_rs")
    assert seq.rollout_is == "sequence" and seq.rollout_rs == preset.rollout_rs and seq.rollout_is_threshold == 5.0
    # a config that leaves the section to its default: the default preset is what the key changes
    unset = build_config({}, ["learner.rollout_correction.rollout_is_threshold=3"]).learner.rollout_correction
    assert unset == tuned
    with pytest.raises(ConfigError, match="learner.rollout_correction: unknown rollout-correction preset 'nope'"):
        load_config(None, ["learner.rollout_correction=nope", "learner.rollout_correction.rollout_is_threshold=3"])


def test_bad_values_name_the_key_and_the_value():
    with pytest.raises(ConfigError) as err:
        load_config(None, ["learner.lr=fast"])
    assert "learner.lr" in str(err.value) and "'fast'" in str(err.value)
    with pytest.raises(ConfigError, match=r"run.steps: Input should be greater than or equal to 1"):
        load_config(None, ["run.steps=0"])
    with pytest.raises(ConfigError, match=r"learner.rollout_correction"):
        load_config(None, ["learner.rollout_correction=no_such_preset"])
    with pytest.raises(ConfigError, match="not of the form dotted.key=value$"):
        load_config(None, ["learner.lr"])
    with pytest.raises(ConfigError, match="it is a path; a config file goes after --config"):
        load_config(None, [str(DEFAULT_CONFIG.parent)])  # `etarl eval runs/X` instead of `--run runs/X`
    with pytest.raises(ConfigError, match="is a value, not a section"):
        load_config(None, ["run.steps.x=1"])


def test_sampler_truncation_is_refused_because_the_learner_scores_the_full_vocabulary():
    for override in ("rollout.sampling.top_p=0.9", "rollout.sampling.top_k=50"):
        with pytest.raises(ConfigError, match="learner scores the full vocabulary"):
            load_config(None, [override])
    assert load_config(None, ["rollout.sampling.top_p=1.0", "rollout.sampling.top_k=0"]).rollout.sampling.top_k == 0


def test_pass_at_k_advantages_need_two_responses_per_prompt():
    with pytest.raises(ConfigError, match="rollout.sampling.n must be >= 2"):
        load_config(None, ["learner.advantage.estimator=grpo_passk", "rollout.sampling.n=1"])
    assert load_config(None, ["learner.advantage.estimator=grpo_passk"]).learner.advantage.estimator == "grpo_passk"


def test_remax_turns_on_the_workers_greedy_baseline_and_is_single_turn():
    assert load_config(None, []).rollout.greedy_baseline is False
    assert load_config(None, ["learner.advantage.estimator=remax"]).rollout.greedy_baseline is True
    with pytest.raises(ConfigError, match="rollout.greedy_baseline .* is single-turn"):
        load_config(None, ["learner.advantage.estimator=remax", "rollout.multi_turn.environment=calculator"])


def test_ppo_with_a_critic_takes_groups_of_one_and_names_a_misspelled_critic_key():
    cfg = load_config(None, ["learner.advantage.estimator=gae", "rollout.sampling.n=1", "learner.critic.lr=3e-4"])
    assert (cfg.learner.advantage.estimator, cfg.rollout.sampling.n, cfg.learner.critic.lr) == ("gae", 1, 3e-4)
    with pytest.raises(ConfigError, match="cliprange_value"):
        load_config(None, ["learner.advantage.estimator=gae", "learner.critic.cliprange=0.2"])


def test_gdpo_needs_a_reward_with_parts():
    gdpo = ["learner.advantage.estimator=gdpo", "learner.advantage.gdpo_reward_keys=[format,accuracy]"]
    with pytest.raises(ConfigError, match="rollout.reward=exact is one score, with no parts"):
        load_config(None, gdpo)  # the default's reward is the built-in exact match
    with pytest.raises(ConfigError, match="multi-turn rollouts take their rewards from the environment"):
        load_config(None, gdpo + ["rollout.reward=my_rewards:score", "rollout.multi_turn.environment=calculator"])
    with pytest.raises(ConfigError, match="gdpo needs gdpo_reward_keys"):
        load_config(None, ["learner.advantage.estimator=gdpo", "rollout.reward=my_rewards:score"])
    cfg = load_config(None, gdpo + ["rollout.reward=my_rewards:score"])
    assert cfg.learner.advantage.gdpo_reward_keys == ["format", "accuracy"]


def test_config_files_errors(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("run: [1, 2\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(bad)
    bad.write_text("- 1\n- 2\n")
    with pytest.raises(ConfigError, match="mapping at the top"):
        load_config(bad)
    typo = tmp_path / "typo.yaml"
    typo.write_text("run:\n  stepz: 3\n")
    with pytest.raises(ConfigError, match=rf"{typo}.*\n  run.stepz: unknown key \(did you mean run.steps\?\)"):
        load_config(typo)


def test_model_path_has_one_home():
    cfg = load_config(None, ["run.model=/some/model"])
    assert cfg.learner.model_path == "/some/model"
    with pytest.raises(ConfigError, match="set the model once, in run.model"):
        load_config(None, ["learner.model_path=/other"])


def test_run_seed_seeds_the_train_prompts_and_the_sampler_unless_they_are_set():
    """One seed varies the whole run: before, run.seed changed the learner and the held-out set
    while every run trained on the same prompts with the same samples."""
    from rollout_workers.data import train_prompts
    from rollout_workers.worker import group_seed

    cfg = load_config(None, ["run.seed=5"])
    assert (cfg.learner.seed, cfg.rollout.sampling.seed, cfg.rollout.task.seed) == (5, 5, 5)
    cfg = load_config(None, ["run.seed=5", "rollout.sampling.seed=null", "rollout.task.seed=9"])
    assert (cfg.rollout.sampling.seed, cfg.rollout.task.seed) == (None, 9)
    first = [[p.prompt for p in train_prompts(load_config(None, [f"run.seed={seed}"]).rollout.task).problems[:20]]
             for seed in (0, 5)]
    assert first[0] != first[1]
    # a group's seeds (its seed + sample index, as vLLM seeds each sample) never repeat another
    # run seed's: the old rule, seed + ticket x n, gave run.seed=8 the samples of run.seed=0
    n, tickets = 8, range(2000)
    drawn = {base: {group_seed(base, t) + i for t in tickets for i in range(n)} for base in (0, 1, 8)}
    assert not drawn[0] & drawn[1] and not drawn[0] & drawn[8]
    assert len(drawn[0]) == n * len(tickets), "one ticket's samples never draw another ticket's"
    assert group_seed(3, 17) == group_seed(3, 17) < 2**31, "reproducible, and room for the engines' offsets"


def test_resolved_config_round_trips_through_yaml(tmp_path):
    cfg = load_config(None, ["run.steps=5", "mode=one_step_off"])
    path = tmp_path / "resolved.yaml"
    path.write_text(cfg.to_yaml())
    again = load_config(path)
    assert again == cfg


@pytest.mark.parametrize("path", sorted(DEFAULT_CONFIG.parent.glob("*.yaml")), ids=lambda p: p.name)
def test_every_shipped_config_is_valid(path):
    load_config(path)


def test_the_buffer_service_reads_a_saved_run_config(tmp_path):
    """`etarl buffer serve --config RUN_DIR/config.yaml` takes the run's buffer section; the keys
    only the run uses (max_restarts) are left out, and the rest is the run's buffer exactly."""
    from buffer.config import BufferConfig
    from services.config import build_config

    cfg = build_config({"buffer": {"transport": "zmq", "max_restarts": 5, "gate": {"eta": 2}}}, [])
    saved = tmp_path / "config.yaml"
    saved.write_text(cfg.to_yaml())
    assert BufferConfig.from_yaml(saved) == cfg.buffer.service_config()
    own = tmp_path / "buffer.yaml"
    own.write_text("max_restarts: 5\n")  # in a buffer's own file it means nothing: an error, as any unknown key
    with pytest.raises(ValueError, match="max_restarts"):
        BufferConfig.from_yaml(own)


def test_the_two_ends_of_vllms_weight_transfer_and_routing_replay_are_checked_together():
    cfg = load_config(None, ["learner.weight_sync.channel=broadcast", "learner.weight_sync.backend=nccl"])
    assert cfg.rollout.engine.weight_transfer == "nccl", "the engine starts with the learner's backend"
    assert load_config(None, ["learner.weight_sync.channel=broadcast"]).rollout.engine.weight_transfer == "auto"
    with pytest.raises(ConfigError, match="both ends of vLLM's weight transfer use one backend"):
        load_config(None, ["learner.weight_sync.channel=broadcast", "learner.weight_sync.backend=gloo",
                           "rollout.engine.weight_transfer=nccl"])
    assert not load_config(None, []).rollout.engine.return_routing
    assert load_config(None, ["learner.routing_replay=r3"]).rollout.engine.return_routing, "r3 asks vLLM for experts"
    with pytest.raises(ConfigError, match="comes back without its experts"):
        load_config(None, ["learner.routing_replay=r3", "rollout.interrupt_on_update=true", "rollout.streaming=false"])
    assert load_config(None, ["learner.routing_replay=r3", "rollout.interrupt_on_update=true",
                              "rollout.streaming=false", "rollout.engine.kind=hf"]).learner.routing_replay == "r3"


def test_a_configmap_is_read_as_the_config_it_carries_and_other_manifests_are_named(tmp_path):
    """`--config` accepts the ConfigMap a cluster mounts (its one .yaml entry); any other
    Kubernetes manifest, or a ConfigMap without exactly one YAML entry, is refused naming what it is."""
    import yaml

    config_map = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "c"},
                  "data": {"etarl.yaml": "run:\n  steps: 7\n", "README": "not a config"}}
    path = tmp_path / "cm.yaml"
    path.write_text(yaml.safe_dump(config_map))
    assert load_config(path).run.steps == 7
    path.write_text(yaml.safe_dump({**config_map, "data": {"a.yaml": "{}", "b.yml": "{}"}}))
    with pytest.raises(ConfigError, match="a Kubernetes ConfigMap manifest, not an etarl config"):
        load_config(path)
    path.write_text(yaml.safe_dump({**config_map, "data": {"etarl.yaml": "- a list"}}))
    with pytest.raises(ConfigError, match="config must hold a mapping"):
        load_config(path)
    path.write_text(yaml.safe_dump({"apiVersion": "ray.io/v1", "kind": "RayJob", "spec": {}}))
    with pytest.raises(ConfigError, match="a Kubernetes RayJob manifest, not an etarl config"):
        load_config(path)


# ---- verl's command-line keys (services/verl_keys.py) ----------------------------------------------
# A verl GRPO command line, as verl's examples/grpo_trainer/run_qwen2-7b.sh writes it (a Hydra '+' too).
VERL_GRPO = ["algorithm.adv_estimator=grpo", "data.train_files=/data/gsm8k/train.parquet",
             "data.val_files=/data/gsm8k/test.parquet", "data.train_batch_size=1024", "data.max_prompt_length=512",
             "data.max_response_length=1024", "data.filter_overlong_prompts=True", "data.truncation=left",
             "actor_rollout_ref.model.path=tiny", "actor_rollout_ref.actor.optim.lr=1e-6",
             "actor_rollout_ref.model.use_remove_padding=True", "actor_rollout_ref.actor.ppo_mini_batch_size=256",
             "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=40", "actor_rollout_ref.actor.use_kl_loss=True",
             "actor_rollout_ref.actor.kl_loss_coef=0.002", "actor_rollout_ref.actor.kl_loss_type=low_var_kl",
             "actor_rollout_ref.actor.entropy_coeff=0", "actor_rollout_ref.model.enable_gradient_checkpointing=True",
             "actor_rollout_ref.actor.fsdp_config.param_offload=False", "actor_rollout_ref.rollout.name=vllm",
             "actor_rollout_ref.rollout.tensor_model_parallel_size=2", "actor_rollout_ref.rollout.n=5",
             "actor_rollout_ref.rollout.gpu_memory_utilization=0.6", "actor_rollout_ref.rollout.top_k=-1",
             "algorithm.use_kl_in_reward=False", "algorithm.rollout_correction.rollout_is=token",
             "custom_reward_function.path=my_reward.py", "trainer.logger=['console','wandb']", "trainer.nnodes=1",
             "trainer.save_freq=20", "trainer.test_freq=-1", "trainer.total_epochs=15", "+data.seed=7"]


def test_verl_keys_are_refused_with_etarls_names_and_a_command_line_that_loads():
    import shlex

    with pytest.raises(ConfigError) as refused:
        load_config(None, ["run.steps=40", *VERL_GRPO])
    message = str(refused.value)
    assert "these are verl's keys, which etarl does not read" in message
    assert "actor_rollout_ref.rollout.n=5 -> rollout.sampling.n=5" in message
    assert "data.max_prompt_length=512 -> rollout.engine.max_model_len=1536" in message
    assert "trainer.logger=[console, wandb] -> metrics.trackers=[wandb] (the console, metrics.jsonl" in message
    assert "trainer.total_epochs=15 -> run.epochs=15 (the steps are worked out when the run starts" in message
    assert "actor_rollout_ref.actor.fsdp_config.param_offload: no etarl key" in message
    cfg = load_config(None, shlex.split(message.splitlines()[-1]))  # the etarl line, as a shell reads it
    assert cfg.run.steps == 40 and cfg.run.model == "tiny"  # the user's own etarl keys kept
    assert (cfg.rollout.task.kind, cfg.rollout.task.path, cfg.rollout.task.heldout_path, cfg.rollout.task.seed) == \
        ("file", "/data/gsm8k/train.parquet", "/data/gsm8k/test.parquet", 7)
    assert cfg.rollout.task.skip_invalid and cfg.rollout.reward == "my_reward.py:compute_score"
    assert cfg.rollout.task.truncation == "left"
    assert (cfg.buffer.gate.batch_size, cfg.rollout.sampling.n, cfg.rollout.sampling.max_new_tokens,
            cfg.rollout.sampling.top_k) == (1024, 5, 1024, 0)
    assert (cfg.rollout.engine.max_model_len, cfg.rollout.engine.tensor_parallel_size,
            cfg.rollout.engine.gpu_memory_utilization) == (1536, 2, 0.6)
    learner = cfg.learner
    assert (learner.lr, learner.ppo_mini_batch_size, learner.micro_batch_size, learner.packing,
            learner.gradient_checkpointing) == (1e-6, 256, 40, "auto", True)
    assert (learner.policy_loss.kl_coef, learner.policy_loss.kl_estimator, learner.kl_in_reward.coef) == \
        (0.002, "low_var_kl", 0.0)
    assert learner.advantage.estimator == "grpo" and learner.rollout_correction.rollout_is == "token"
    assert (cfg.run.checkpoint_every, cfg.run.eval_every) == (20, 0)


def test_a_verl_command_line_without_a_reward_function_is_told_which_reward_etarl_uses():
    with pytest.raises(ConfigError) as refused:
        load_config(None, [k for k in VERL_GRPO if not k.startswith("custom_reward_function.")])
    said = str(refused.value)
    assert "(no custom_reward_function -> rollout.reward=verl: verl's default reward by data_source, without verl" \
        in said
    assert "rollout.reward=verl" in said.splitlines()[-1]  # in the line to paste
    with pytest.raises(ConfigError) as refused:
        load_config(None, VERL_GRPO)
    assert "no custom_reward_function" not in str(refused.value)


def test_a_verl_string_etarl_would_read_as_a_number_stays_a_string_in_the_line():
    import shlex

    with pytest.raises(ConfigError) as refused:
        load_config(None, ["custom_reward_function.path=r.py", 'custom_reward_function.reward_kwargs.v="1e-6"'])
    cfg = load_config(None, shlex.split(str(refused.value).splitlines()[-1]))
    assert cfg.rollout.reward_kwargs == {"v": "1e-6"}


def test_a_verl_value_yaml_cannot_read_is_a_string_in_the_line():
    with pytest.raises(ConfigError) as refused:
        load_config(None, ["actor_rollout_ref.model.path=[oops"])
    assert """'run.model="[oops"'""" in str(refused.value)


@pytest.mark.parametrize("verl, said", [
    (["actor_rollout_ref.actor.kl_loss_coef=0.01"],
     "verl applies it only with actor_rollout_ref.actor.use_kl_loss=true"),
    (["actor_rollout_ref.actor.clip_ratio=0.28"], "verl's PPO clip takes clip_ratio_low and clip_ratio_high"),
    (["algorithm.adv_estimator=rloo", "algorithm.norm_adv_by_std_in_grpo=False"], "verl applies it to grpo only"),
    (["trainer.max_actor_ckpt_to_keep=null"], "null: etarl's default stands"),
    (["data.train_batch_size=0"], "0 has no etarl form of buffer.gate.batch_size"),  # verl's fully-async trainer
    (["async_training.staleness_threshold=0.5"], "etarl is asynchronous by design: its staleness bound is"),
    (["rollout.total_rollout_steps=100"], "etarl counts learner steps: run.steps"),  # in etarl's own section's name
    (["algorithm.adv_estimator=grpo_passk", "algorithm.norm_adv_by_std_in_grpo=False"],
     "etarl's grpo_passk divides by the group's std"),
    (["actor_rollout_ref.model.lora_rank=0", "actor_rollout_ref.model.lora_alpha=32"], "LoRA is off"),
])
def test_verl_keys_that_change_nothing_in_verl_or_etarl_become_no_key(verl, said):
    with pytest.raises(ConfigError) as refused:
        load_config(None, verl)
    assert f": no etarl key: {said}" in str(refused.value)


@pytest.mark.parametrize("verl, etarl", [
    (["actor_rollout_ref.actor.use_kl_loss=True"], "learner.policy_loss.kl_coef=0.001"),  # verl's default coefficient
    (["actor_rollout_ref.actor.kl_loss_coef=0.01", "+actor_rollout_ref.actor.use_kl_loss=False"],
     "learner.policy_loss.kl_coef=0.0"),  # Hydra's '+' read as the key; the switch wins wherever it stands
    (["algorithm.use_kl_in_reward=True", "algorithm.kl_ctrl.kl_coef=0.05"], "learner.kl_in_reward.coef=0.05"),
    (["algorithm.norm_adv_by_std_in_grpo=False", "algorithm.adv_estimator=grpo"],
     "learner.advantage.estimator=dr_grpo"),
    (["algorithm.adv_estimator=gdpo", "algorithm.norm_adv_by_std_in_grpo=False", "custom_reward_function.path=r.py",
      "learner.advantage.gdpo_reward_keys=[fmt,acc]"],  # an etarl key beside them is kept in the line
     "learner.advantage.estimator=gdpo learner.advantage.gdpo_norm_by_std=false"),
    (["custom_reward_function.name=score", "custom_reward_function.path=r.py"], "rollout.reward=r.py:score"),
    (["reward.custom_reward_function.path=r.py", "+reward.custom_reward_function.reward_kwargs.scale=0.5"],
     "rollout.reward=r.py:compute_score rollout.reward_kwargs.scale=0.5"),  # verl's newer place
    (["data.max_prompt_length=32", "data.max_response_length=64"], "rollout.engine.max_model_len=96"),
    (["data.max_prompt_length=32", "data.max_response_length=64", "actor_rollout_ref.rollout.response_length=40"],
     "rollout.engine.max_model_len=72 rollout.sampling.max_new_tokens=40"),
    (["actor_rollout_ref.rollout.val_kwargs.n=1", "actor_rollout_ref.rollout.val_kwargs.temperature=0"],
     "eval.n_samples=0"),
    (["algorithm.filter_groups.enable=True", "algorithm.filter_groups.metric=seq_reward"],
     "rollout.filter_groups.enabled=true rollout.filter_groups.metric=reward"),
    (["actor_rollout_ref.actor.router_replay.mode=R2", "actor_rollout_ref.rollout.enable_rollout_routing_replay=False"],
     "learner.routing_replay=r2"),
    (["+reward.reward_kwargs.overlong_buffer_cfg.enable=True", "+reward.reward_kwargs.overlong_buffer_cfg.len=4"],
     "rollout.overlong_buffer.enabled=true rollout.overlong_buffer.len=4"),  # DAPO's newer form
    (["actor_rollout_ref.rollout.val_kwargs.do_sample=True", "actor_rollout_ref.rollout.val_kwargs.n=2",
      "actor_rollout_ref.rollout.val_kwargs.temperature=0.6"],
     "eval.n_samples=2 eval.k=2 eval.temperature=0.6"),
    (["actor_rollout_ref.actor.optim.lr_scheduler_type=cosine", "trainer.total_training_steps=100"],
     "learner.lr_schedule=cosine run.steps=100 learner.total_steps=100"),  # verl's decay spans the run
    (["data.max_prompt_length=null", "data.max_response_length=100", "actor_rollout_ref.rollout.max_model_len=null"],
     "rollout.sampling.max_new_tokens=100"),  # nulls are verl's defaults: etarl's stand
    (["algorithm.adv_estimator=grpo_vectorized"], "learner.advantage.estimator=grpo"),
    (["trainer.logger=['console','wandb','swanlab']", "trainer.project_name=gsm8k", "trainer.experiment_name=q05"],
     "'metrics.trackers=[wandb]' metrics.project=gsm8k metrics.experiment=q05"),  # console always; no swanlab
    (["custom_reward_function.path=r.py", 'custom_reward_function.reward_kwargs.mode="yes"'],
     "'rollout.reward_kwargs.mode=\"yes\"'"),  # a string YAML would read as true stays a string
    (["actor_rollout_ref.model.target_modules=q_proj,v_proj", "actor_rollout_ref.model.lora_rank=32",
      "actor_rollout_ref.model.lora_alpha=64", "actor_rollout_ref.model.use_shm=True"],
     # verl's lora.merge is False unless given: the engines load the adapters
     "'learner.lora.target_modules=[q_proj, v_proj]' learner.lora.rank=32 learner.lora.publish=adapter "
     "learner.lora.alpha=64"),
    (["actor_rollout_ref.actor.fsdp_config.model_dtype=bf16", "actor_rollout_ref.model.lora_rank=8"],
     "learner.dtype=bfloat16 learner.lora.rank=8"),  # with LoRA: the frozen weights' dtype
    (["actor_rollout_ref.model.lora.rank=16", "actor_rollout_ref.model.lora_rank=8",
      "actor_rollout_ref.model.lora.alpha=8", "+actor_rollout_ref.model.lora.merge=True"],
     "learner.lora.rank=16 learner.lora.publish=merged learner.lora.alpha=8"),  # verl's nested form, read first
    (["actor_rollout_ref.model.lora_rank=8", r"actor_rollout_ref.model.exclude_modules=.*layers\.[0-9]{1,2}\.mlp.*"],
     r"'learner.lora.exclude_modules=.*layers\.[0-9]{1,2}\.mlp.*'"),  # a regular expression stays whole
    (["reward_model.overlong_buffer.enable=True", "reward_model.overlong_buffer.len=4",
      "algorithm.filter_groups.enable=True"],
     "rollout.overlong_buffer.enabled=true rollout.overlong_buffer.len=4 rollout.filter_groups.enabled=true"),
])
def test_verl_keys_that_join_or_change_on_the_way(verl, etarl):
    import shlex

    with pytest.raises(ConfigError) as refused:
        load_config(None, verl)
    line = str(refused.value).splitlines()[-1]
    assert etarl in line
    cfg = load_config(None, shlex.split(line))  # and it loads
    if "reward_kwargs.mode" in etarl:
        assert cfg.rollout.reward_kwargs == {"mode": "yes"}


def test_every_rule_of_the_verl_table_gives_a_line_that_loads():
    """Each key of the table with verl's default value (from its ppo_trainer.yaml) translates to
    overrides the real loader takes (a value etarl refuses would fail the user's paste)."""
    import shlex

    from services.verl_keys import RULES

    verl_defaults = {"data.max_response_length": 512, "actor_rollout_ref.rollout.n": 1, "data.train_batch_size": 1024,
                     "actor_rollout_ref.actor.optim.lr_scheduler_type": "constant", "algorithm.kl_penalty": "kl",
                     "actor_rollout_ref.actor.optim.warmup_style": "constant",
                     "algorithm.kl_ctrl.type": "fixed", "actor_rollout_ref.rollout.name": "vllm",
                     "actor_rollout_ref.rollout.dtype": "bfloat16",
                     "actor_rollout_ref.actor.kl_loss_type": "low_var_kl",
                     "actor_rollout_ref.actor.loss_agg_mode": "token-mean", "data.prompt_key": "prompt",
                     "actor_rollout_ref.actor.policy_loss.loss_mode": "vanilla", "data.reward_fn_key": "data_source",
                     "actor_rollout_ref.actor.router_replay.mode": "R3", "algorithm.filter_groups.metric": "acc",
                     "actor_rollout_ref.rollout.gpu_memory_utilization": 0.5, "actor_rollout_ref.actor.optim.betas":
                     [0.9, 0.999], "data.apply_chat_template_kwargs": {}, "critic.loss_agg_mode": "token-mean",
                     "custom_reward_function.reward_kwargs": {}, "reward.custom_reward_function.reward_kwargs": {},
                     "actor_rollout_ref.actor.optim.total_training_steps": 1000,
                     "actor_rollout_ref.actor.clip_ratio_c": 3.0,
                     "actor_rollout_ref.actor.policy_loss.clip_cov_ub": 5.0,
                     "actor_rollout_ref.rollout.top_p": 1.0, "actor_rollout_ref.rollout.top_k": -1,
                     "actor_rollout_ref.rollout.max_model_len": 1536, "data.truncation": "error",
                     "actor_rollout_ref.rollout.multi_turn.format": "hermes", "trainer.project_name": "verl_examples",
                     "trainer.experiment_name": "gsm8k"}
    for key, rule in RULES.items():
        if rule.etarl is None or key.startswith(("data.train_files", "data.val_files", "critic.model.path",
                                                  "trainer.default_local_dir", "actor_rollout_ref.model.path")):
            continue  # paths: checked where they are read
        value = verl_defaults.get(key, True if "enable" in key or key.endswith(("use_remove_padding", "shuffle"))
                                  else 0.2 if any(w in key for w in ("clip_ratio", "lr_ratio", "top_p", "cov_ratio"))
                                  else 1)
        with pytest.raises(ConfigError) as refused:
            load_config(None, [f"{key}={value}"])
        line = str(refused.value).splitlines()[-1]
        load_config(None, shlex.split(line) + (["rollout.overlong_buffer.len=4"] if "overlong" in key else []))


def test_every_etarl_key_the_verl_table_names_exists():
    import typing

    from pydantic import BaseModel

    from services.config import EtarlConfig, _holds, _models
    from services.verl_keys import PREFIXES, RULES

    def exists(dotted: str) -> bool:
        models: list[type[BaseModel]] = [EtarlConfig]
        for part in dotted.split("."):
            fields = [m.model_fields[part] for m in models if part in m.model_fields]
            if not fields:
                return False
            if any(typing.get_origin(f.annotation) is dict for f in fields):
                return True  # a free-form mapping (environment_kwargs): its keys are the environment's
            models = [m for f in fields for m in _models(_holds(f.annotation))]
        return True

    targets = [rule.etarl for rule in RULES.values() if rule.etarl]
    targets += [rule.etarl.rstrip(".") for rule in PREFIXES.values() if rule.etarl]  # the sections
    missing = [t for t in targets if not exists(t)]
    assert not missing and len(targets) > 60


def test_etarl_train_with_verl_keys_exits_with_the_translation(tmp_path, capsys):
    from services.cli import EXIT_CONFIG_ERROR, main

    assert main(["train", "actor_rollout_ref.rollout.n=4", f"run.run_dir={tmp_path / 'run'}"]) == EXIT_CONFIG_ERROR
    err = capsys.readouterr().err
    assert "actor_rollout_ref.rollout.n=4 -> rollout.sampling.n=4" in err and not (tmp_path / "run").exists()
    # a verl config file: each of its sections said to be verl's
    with pytest.raises(ConfigError, match=r"data: unknown key \(a section of verl's config"):
        build_config({"data": {"train_batch_size": 8}})


def test_a_decaying_learning_rate_spans_the_run_unless_told_and_epochs_need_a_prompt_file():
    cfg = load_config(None, ["run.steps=30", "learner.lr_schedule=cosine", "learner.warmup_steps=5"])
    assert cfg.learner.total_steps is None and cfg.learner_for_run("/m").total_steps == 30  # as verl's spans its run
    longer = cfg.model_copy(update={"run": cfg.run.model_copy(update={"steps": 50})})  # a resume with more steps
    assert longer.learner_for_run("/m").total_steps == 50 and longer.learner_for_run("/m").model_path == "/m"
    assert load_config(None, ["learner.lr_schedule=linear", "learner.total_steps=12", "learner.warmup_steps=2"]) \
        .learner_for_run("/m").total_steps == 12  # told: kept
    with pytest.raises(ConfigError, match=r"learner.warmup_steps \(50\) exceeds the run's 30 steps"):
        load_config(None, ["run.steps=30", "learner.lr_schedule=cosine", "learner.warmup_steps=50"])
    with pytest.raises(ConfigError, match="run.epochs counts passes over a prompt file"):
        load_config(None, ["run.epochs=2"])
    epochs = load_config(None, ["run.epochs=2", "rollout.task.kind=file", "rollout.task.path=p.jsonl",
                                "learner.lr_schedule=cosine"])
    assert epochs.learner.total_steps is None  # the steps are worked out when the prompts are counted



def test_a_verl_data_line_gets_verls_defaults_where_etarls_embedded_default_differs():
    from services.verl_keys import translate

    lines, etarl = translate([("data.train_files", "a.parquet"), ("actor_rollout_ref.actor.optim.lr", 3e-6),
                              ("data.max_response_length", 1024)])
    assert etarl == ["rollout.task.path=a.parquet", "learner.lr=3.0e-06", "rollout.sampling.max_new_tokens=1024",
                     "rollout.task.kind=file", "rollout.reward=verl", "learner.warmup_steps=0",
                     "rollout.task.shuffle=true"]  # what the line named stays; only what it did not is filled
    assert "(verl's defaults where etarl's embedded default differs: learner.warmup_steps=0 (verl warms up" in \
        "\n".join(lines)
    _, held_out_only = translate([("data.val_files", "t.parquet")])
    assert "rollout.task.kind=file" in held_out_only  # etarl eval reads a held-out file only with kind=file


def test_lora_publish_adapter_tells_the_engines_and_is_refused_where_it_cannot_go():
    """learner.lora.publish=adapter gives rollout.engine.lora the adapters' layers and scale (derived:
    a value given is replaced), needs a pull channel, and vLLM's largest LoRA rank; how versions leave
    is not what a checkpoint trained (a resume may change it)."""
    cfg = load_config(None, ["learner.lora.rank=16", "learner.lora.alpha=32", "learner.lora.publish=adapter",
                             "learner.lora.target_modules=[q_proj, v_proj]", "rollout.engine.lora.rank=3",
                             "rollout.engine.lora.alpha=1"])
    lora = cfg.rollout.engine.lora
    assert (lora.rank, lora.alpha, lora.target_modules, lora.exclude_modules) == (16, 32.0, ["q_proj", "v_proj"], [])
    assert cfg.learner.lora_settings() == load_config(None, ["learner.lora.rank=16", "learner.lora.alpha=32",
                                                             "learner.lora.target_modules=[q_proj, v_proj]"]
                                                      ).learner.lora_settings()
    assert load_config(None, ["learner.lora.rank=16"]).rollout.engine.lora is None  # merged: plain weights
    assert load_config(None, ["rollout.engine.lora.rank=4", "rollout.engine.lora.alpha=8"]).rollout.engine.lora is None
    with pytest.raises(ConfigError, match="weight_sync.channel=broadcast is vLLM's weight transfer, which loads "
                                          "model weights only"):
        load_config(None, ["learner.lora.rank=16", "learner.lora.publish=adapter",
                           "learner.weight_sync.channel=broadcast"])
    with pytest.raises(ConfigError, match="vLLM takes LoRA adapters up to rank 512"):
        load_config(None, ["learner.lora.rank=1024", "learner.lora.publish=adapter"])
    assert load_config(None, ["learner.lora.rank=1024", "learner.lora.publish=adapter",
                              "rollout.engine.kind=hf"]).rollout.engine.lora.rank == 1024  # merged in the engine


def test_relative_paths_become_absolute_so_a_saved_config_reads_the_same_files_from_any_folder(tmp_path, monkeypatch):
    """A run started in one folder with relative paths saves absolute ones (a resume from another folder
    stopped with "prompt file 'data/train.jsonl' does not exist"); URLs, module names and built-ins stay."""
    cfg = load_config(None, [
        "run.run_dir=runs/a", "run.model=../models/qwen", "rollout.task.kind=file",
        "rollout.task.path=[data/a.jsonl, s3://bucket/b.parquet]", "rollout.task.heldout_path=./data/test.jsonl",
        "rollout.reward=rewards/mine.py:score", "rollout.multi_turn.environment=tools",
        "rollout.multi_turn.environment_kwargs={path: tools/calc.py, config: tools.yaml}",
        "learner.weight_sync.channel=folder", "learner.weight_sync.folder=weights"])
    out = with_absolute_paths(cfg, base="/work/exp")
    assert out.run.run_dir == "/work/exp/runs/a" and out.run.cache_dir == "/work/exp/.cache"
    assert out.run.model == "/work/models/qwen"
    assert out.rollout.task.path == ["/work/exp/data/a.jsonl", "s3://bucket/b.parquet"]
    assert out.rollout.task.heldout_path == "/work/exp/data/test.jsonl"
    assert out.rollout.reward == "/work/exp/rewards/mine.py:score"
    assert out.rollout.multi_turn.environment == "tools"
    assert out.rollout.multi_turn.environment_kwargs == {"path": "/work/exp/tools/calc.py",
                                                         "config": "/work/exp/tools.yaml"}
    assert out.learner.weight_sync.folder == "/work/exp/weights"
    assert cfg.rollout.task.heldout_path == "./data/test.jsonl"  # the given config is left as it was
    # What a resume reads back validates (learner.model_path, run.model's copy, moved with it).
    again = build_config(yaml_tree(out))
    assert again.learner.model_path == again.run.model == "/work/models/qwen"
    assert again.rollout.task == out.rollout.task and again.rollout.multi_turn == out.rollout.multi_turn
    # Already absolute, a module, a built-in: unchanged; the default base is the working folder.
    kept = load_config(None, ["run.run_dir=/abs/run", "rollout.reward=my_pkg.rewards:score",
                              "rollout.multi_turn.environment=my_pkg.envs:Shop",
                              "rollout.multi_turn.environment_kwargs={path: my_pkg.tools}"])
    monkeypatch.chdir(tmp_path)
    out = with_absolute_paths(kept)
    assert out.run.run_dir == "/abs/run" and out.run.model == "tiny" and out.run.cache_dir == str(tmp_path / ".cache")
    assert out.rollout.reward == "my_pkg.rewards:score" and out.rollout.multi_turn.environment == "my_pkg.envs:Shop"
    assert out.rollout.multi_turn.environment_kwargs == {"path": "my_pkg.tools"}
    assert build_config(yaml_tree(out)).run == out.run
    # `~` is the home folder, as the reward and tool loaders read it, not a folder named "~".
    home = with_absolute_paths(load_config(None, ["rollout.reward=~/rewards/mine.py:score"]), base="/work/exp")
    assert home.rollout.reward == os.path.expanduser("~/rewards/mine.py") + ":score"


def yaml_tree(cfg):
    import yaml

    return yaml.safe_load(cfg.to_yaml())
