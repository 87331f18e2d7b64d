"""The rollout worker against a real buffer service (ZMQ server in this process, or the Ray actor):
tagged groups, weight updates between and within generations, failures that release permits,
a hanging reward, graceful stop, and a killed worker whose permit comes back."""
from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from rollout_helpers import PublishWhenArmed, length_reward, perturbed, pull_all

from buffer.config import BufferConfig, GateConfig
from lm.causal_lm import load_causal_lm, response_log_probs
from lm.weight_sync import WeightStore, save_weights_folder
from rollout_workers.config import EngineConfig, RolloutConfig, SamplingConfig, TaskConfig
from rollout_workers.rewards import REWARD_ERROR, math_reward, reward_metrics
from rollout_workers.tasks import train_prompts
from rollout_workers.tiny_model import tiny_model_info
from rollout_workers.worker import RolloutWorker, WorkerNeedsRestart

pytestmark = pytest.mark.timeout(180)  # a stuck worker loop fails its test instead of the suite


def config(model_dir, **changes) -> RolloutConfig:
    base = dict(model_path=str(model_dir), sampling=SamplingConfig(n=4, max_new_tokens=8, seed=0),
                weight_poll_s=0.0, acquire_timeout_s=0.2, error_backoff_s=0.0, groups_per_batch=2)
    return RolloutConfig(**{**base, **changes})


def assert_log_probs_match(model, group, tol=1e-4):
    prompts = [s.prompt_ids.tolist() for s in group.samples]
    responses = [s.response_ids.tolist() for s in group.samples]
    with torch.no_grad():
        lp, _ = response_log_probs(model, prompts, responses)
    for row, s in enumerate(group.samples):
        np.testing.assert_allclose(s.rollout_log_probs, lp[row, : len(s.response_ids)].numpy(), atol=tol)


def test_worker_pushes_scored_tagged_groups(tiny_model_dir, vllm_engine, hf_model, tokenizer, buffer):
    cfg = config(tiny_model_dir)
    worker = RolloutWorker(cfg, "worker-a", buffer, WeightStore(), engine=vllm_engine)
    stats = worker.run(max_groups=4)
    groups = sorted(pull_all(buffer, 4), key=lambda g: g.prompt_index)
    prompts = train_prompts(cfg.task)
    assert [g.prompt_index for g in groups] == [0, 1, 2, 3]  # tickets are the data cursor
    for group in groups:
        problem = prompts.problem(group.prompt_index)
        assert len(group.samples) == 4
        assert tokenizer.decode(group.samples[0].prompt_ids.tolist()) == problem.prompt
        for s in group.samples:
            assert s.worker_id == "worker-a" and s.weight_version == 0 and s.group_id == group.group_id
            assert s.token_versions.tolist() == [0] * len(s.response_ids)
            assert s.loss_mask.tolist() == [1] * len(s.response_ids)
            text = tokenizer.decode(s.response_ids.tolist(), skip_special_tokens=True)
            assert s.reward == math_reward(text, problem.answer)
            assert s.metadata["ticket"] == group.prompt_index and s.metadata["family"] == "add"
        assert_log_probs_match(hf_model, group)
    assert stats["groups_total"] == 4 and stats["samples_total"] == 16 and stats["loaded_version"] == 0
    assert stats["tokens_per_s"] > 0 and 0.0 <= stats["reward_mean"] <= 1.0
    assert buffer.stats()["running"] == 0
    worker.close()


@pytest.mark.parametrize("engine_kind,streaming", [("vllm", True), ("vllm", False), ("hf", False)])
def test_a_greedy_baseline_goes_with_every_sample_of_its_group(tiny_model_dir, vllm_engine, tokenizer, buffer,
                                                              engine_kind, streaming):
    """rollout.greedy_baseline (remax): beside each group's n samples the worker generates one
    greedy response to the prompt, in the same engine batch (streamed: the same request), scores it
    and hands its reward to every sample as reward_baseline; the greedy response is not a sample."""
    from buffer.sample import REWARD_BASELINE

    # the task the model was warm-started on, as its build recorded it (its greedy answers end, at
    # lengths that differ between prompts), and a reward that tells responses apart
    spec = tiny_model_info(tiny_model_dir)["spec"]
    task = TaskConfig(families=spec["families"], difficulties=spec["difficulties"])
    cfg = config(tiny_model_dir, greedy_baseline=True, streaming=streaming, engine=EngineConfig(kind=engine_kind),
                 task=task, reward="rollout_helpers:length_reward")
    engine = vllm_engine if engine_kind == "vllm" else None
    worker = RolloutWorker(cfg, "worker-g", buffer, WeightStore(), engine=engine)
    stats = worker.run(max_groups=4)
    prompts = train_prompts(cfg.task)
    baselines = []
    for group in sorted(pull_all(buffer, 4), key=lambda g: g.prompt_index):
        problem = prompts.problem(group.prompt_index)
        (greedy,) = worker.engine.generate(group.samples[0].prompt_ids.tolist(),
                                           worker._baseline_params(group.prompt_index)[0])
        expected = length_reward(tokenizer.decode(greedy.token_ids, skip_special_tokens=True), problem.answer)
        assert len(group.samples) == 4
        assert [s.metadata[REWARD_BASELINE] for s in group.samples] == [expected] * 4
        baselines.append(expected)
    assert stats["samples_total"] == 16  # the greedy responses are not counted as samples
    assert len(set(baselines)) > 1, baselines  # greedy responses of several lengths: each group has its own
    worker.close()


class CountingClient:
    """The real buffer client, recording which requests the worker makes (and, optionally, asking
    the worker to stop right after a push)."""

    def __init__(self, client, stop_after_push=None):
        self.client, self.requests, self.stop_after_push = client, [], stop_after_push

    def __getattr__(self, name):
        method = getattr(self.client, name)

        def counted(*args, **kwargs):
            self.requests.append(name)
            result = method(*args, **kwargs)
            if name == "push_and_acquire" and self.stop_after_push is not None:
                self.stop_after_push.set()
            return result
        return counted


def test_worker_takes_the_next_permits_with_its_push(tiny_model_dir, vllm_engine, buffer):
    """While the gate is open, one request per engine batch: the push brings the next permits."""
    client = CountingClient(buffer)
    worker = RolloutWorker(config(tiny_model_dir, groups_per_batch=2, streaming=False), "worker-p", client,
                           WeightStore(), engine=vllm_engine)
    stats = worker.run(max_groups=6)
    assert client.requests == ["acquire_permits"] + ["push_and_acquire"] * 3
    assert stats["groups_total"] == 6 and stats["permits_released_total"] == 0
    buffer_stats = buffer.stats()
    assert (buffer_stats["accepted"], buffer_stats["running"]) == (6, 0), "no permit taken beyond max_groups"
    assert sorted(g.prompt_index for g in pull_all(buffer, 6)) == list(range(6))
    worker.close()


def test_permits_taken_with_the_last_push_are_released_on_stop(tiny_model_dir, vllm_engine, buffer):
    worker = RolloutWorker(config(tiny_model_dir, groups_per_batch=2, streaming=False), "worker-q", None,
                           WeightStore(), engine=vllm_engine)
    worker.client = CountingClient(buffer, stop_after_push=worker._stop)
    stats = worker.run()
    assert stats["groups_total"] == 2 and stats["permits_released_total"] == 2
    buffer_stats = buffer.stats()
    assert (buffer_stats["running"], buffer_stats["permits_released"], buffer_stats["free_tickets"]) == (0, 2, 2)
    worker.close()


def test_permits_held_when_the_buffer_is_gone_are_left_to_their_leases_after_one_call(tiny_model_dir, vllm_engine):
    """A loop that ends holding permits hands them back; when the buffer does not answer, one call
    says so and the rest are left to their leases (each call would wait out its timeout and
    retries: a run that lost its buffer waited that long per permit to stop)."""
    from buffer.client import BufferClient
    from buffer.config import ClientConfig
    from buffer.server import BufferServer

    server = BufferServer(BufferConfig(port=0, gate=GateConfig(batch_size=4, eta=None, permit_lease_s=60))).start()
    with BufferClient(server.endpoint) as taker:
        permits = taker.acquire_permits("worker-g", 3)
    server.stop()
    worker = RolloutWorker(config(tiny_model_dir), "worker-g", None, WeightStore(), engine=vllm_engine)
    worker.client = BufferClient(server.endpoint, ClientConfig(request_timeout_s=0.2, retries=1, retry_backoff_s=0))
    try:
        worker._release_all(permits)
        assert len(permits) == 3 and worker.client.reconnects == 1, "one call (and its one resend), not one per permit"
        assert worker.counters["permits_released_total"] == 0
    finally:
        worker.client.close()
        worker.close()


@pytest.mark.parametrize("max_permits", [64, 3])
def test_a_slow_reward_bounds_the_permits_a_streaming_worker_holds(tiny_model_dir, vllm_engine, max_permits):
    """Groups generated faster than the reward scores them wait for a scorer: at most an engine's
    worth (here 2 groups generating and 2 waiting), not a permit for every group the engine could
    start meanwhile. Under a buffer whose per-client cap is below that, the refused requests are
    counted and the worker goes on with the permits it holds."""
    from buffer.client import BufferClient
    from buffer.config import PerClientLimits
    from buffer.server import BufferServer

    server = BufferServer(BufferConfig(port=0, gate=GateConfig(batch_size=4, eta=None, permit_lease_s=60),
                                       per_client=PerClientLimits(max_permits=max_permits))).start()
    client, observer = BufferClient(server.endpoint), BufferClient(server.endpoint)
    cfg = config(tiny_model_dir, reward="rollout_helpers:slow_reward", max_requests_in_flight=8)  # room: 2 groups
    worker = RolloutWorker(cfg, "worker-s", client, WeightStore(), engine=vllm_engine)
    held = []
    try:
        def observed(w):
            held.append(observer.stats()["running"])
            return w.counters["groups_total"] >= 6
        stats = run_until(worker, observed)
        assert 0 < max(held) <= min(4, max_permits), held
        assert (stats["permits_refused_total"] > 0) == (max_permits < 4), stats
        assert observer.stats()["running"] == 0  # every permit held at the stop came back
    finally:
        worker.close()
        client.close()
        observer.close()
        server.stop()


@pytest.mark.parametrize("streaming", [True, False])
def test_groups_that_score_alike_are_filtered_and_their_tickets_end(tiny_model_dir, vllm_engine, buffer, streaming):
    """Dynamic sampling (rollout.filter_groups): a group whose samples all score alike is not
    pushed; its ticket ends in the buffer (not reissued), so every ticket the gate issued is pushed,
    filtered or back for reissue, and only informative groups reach the learner."""
    from rollout_workers.config import FilterGroupsConfig

    cfg = config(tiny_model_dir, reward="rollout_helpers:even_answers_alike", streaming=streaming,
                 filter_groups=FilterGroupsConfig(enabled=True))
    worker = RolloutWorker(cfg, "worker-f", buffer, WeightStore(), engine=vllm_engine)
    stats = run_until(worker, lambda w: w.counters["groups_total"] >= 3 and w.counters["groups_filtered_total"] >= 2)
    buffered = buffer.stats()
    groups = pull_all(buffer, stats["groups_total"])
    prompts = train_prompts(cfg.task)
    for group in groups:
        assert len({s.reward for s in group.samples}) > 1, "an uninformative group reached the buffer"
        assert int(prompts.problem(group.prompt_index).answer) % 2 == 1
    assert buffered["groups_filtered"] == stats["groups_filtered_total"] and stats["uninformative_pushed_total"] == 0
    assert buffered["next_ticket"] == stats["groups_total"] + stats["groups_filtered_total"] + buffered["free_tickets"]
    worker.close()


def test_a_filter_metric_is_a_reward_metric_by_verls_name_or_etarls():
    """DAPO's `algorithm.filter_groups.metric=acc` names what the reward's dict returns; the sample
    carries it as reward/acc (it is never found under the bare name, so nothing was filtered)."""
    from types import SimpleNamespace

    sample = SimpleNamespace(reward=0.5, metadata={"reward/acc": 1.0, "turns": "two"})
    assert RolloutWorker._filter_value(sample, "acc") == RolloutWorker._filter_value(sample, "reward/acc") == 1.0
    assert RolloutWorker._filter_value(sample, "reward") == 0.5
    assert RolloutWorker._filter_value(sample, "turns") is None and RolloutWorker._filter_value(sample, "x") is None


def test_after_max_in_a_row_filtered_groups_the_next_is_pushed(tiny_model_dir, vllm_engine, buffer):
    """A task every sample scores alike on (solved, or hopeless) slows the run, never stops it."""
    from rollout_workers.config import FilterGroupsConfig

    cfg = config(tiny_model_dir, reward="rollout_helpers:zero_reward",
                 filter_groups=FilterGroupsConfig(enabled=True, max_in_a_row=2))
    worker = RolloutWorker(cfg, "worker-m", buffer, WeightStore(), engine=vllm_engine)
    stats = run_until(worker, lambda w: w.counters["groups_total"] >= 2)
    pushed, filtered = stats["groups_total"], stats["groups_filtered_total"]
    assert stats["uninformative_pushed_total"] == pushed and 2 * pushed <= filtered <= 2 * pushed + 2, stats
    assert buffer.stats()["groups_filtered"] == filtered
    worker.close()


def test_overlong_shaping_adds_dapos_penalty_to_each_samples_reward(tiny_model_dir, vllm_engine, buffer):
    """rollout.overlong_buffer: a response in the last `len` tokens before max_new_tokens loses
    reward linearly, up to penalty_factor at the limit (verl's DAPO reward manager's formula)."""
    from rollout_workers.config import OverlongBufferConfig

    shaping = OverlongBufferConfig(enabled=True, len=4, penalty_factor=0.5)
    assert [shaping.penalty(n, 8) for n in (0, 4, 5, 6, 8)] == [0.0, 0.0, -0.125, -0.25, -0.5]
    shaping = OverlongBufferConfig(enabled=True, len=6, penalty_factor=0.5)  # the tiny model answers in ~3 tokens
    cfg = config(tiny_model_dir, reward="rollout_helpers:zero_reward", overlong_buffer=shaping)
    worker = RolloutWorker(cfg, "worker-o", buffer, WeightStore(), engine=vllm_engine)
    worker.run(max_groups=4)
    samples = [s for g in pull_all(buffer, 4) for s in g.samples]
    for s in samples:
        assert s.reward == pytest.approx(min(0.0, -(len(s.response_ids) - 2) / 6 * 0.5))
        assert s.metadata["reward/overlong_reward"] == s.reward and s.metadata["reward/overlong"] == float(s.reward < 0)
    assert any(s.reward < 0 for s in samples), [len(s.response_ids) for s in samples]
    worker.close()
    with pytest.raises(ValueError, match="at most rollout.sampling.max_new_tokens"):
        config(tiny_model_dir, overlong_buffer=OverlongBufferConfig(enabled=True, len=9))


def test_worker_loads_published_weights_before_generating(tiny_model_dir, vllm_engine, buffer, tmp_path,
                                                           restore_vllm_weights):
    """A (re)started worker resumes with the store's current weights, from a folder payload."""
    new_weights = perturbed(restore_vllm_weights, scale=0.05, seed=1)
    store = WeightStore()
    store.publish({"version": 3, "kind": "folder", "path": str(save_weights_folder(new_weights, tmp_path / "v3", 3))})
    buffer.set_version(3)  # the learner is at version 3 (the buffer refuses versions from the future)
    worker = RolloutWorker(config(tiny_model_dir), "worker-b", buffer, store, engine=vllm_engine)
    stats = worker.run(max_groups=2)
    assert stats["loaded_version"] == 3 and stats["weight_loads_total"] == 1 and stats["weight_load_s"] > 0
    vllm_engine.version = -1  # what the engine says while a load is in flight (its weights a mix)
    try:
        assert worker.stats()["loaded_version"] == 3, "the gauge shows the last version fully loaded"
    finally:
        vllm_engine.version = 3
    model = load_causal_lm(tiny_model_dir).eval()
    model.load_state_dict(new_weights)
    for group in pull_all(buffer, 2):
        assert all(s.weight_version == 3 and set(s.token_versions.tolist()) == {3} for s in group.samples)
        assert_log_probs_match(model, group)
    worker.close()


def test_interrupt_on_update_continues_with_new_weights_and_tags_tokens(tiny_model_dir, buffer, tmp_path):
    """The transformers engine stops after the first token when weights arrive; the rest of
    each response comes from version 1 and is tagged so, the first token keeps version 0."""
    base = load_causal_lm(tiny_model_dir).state_dict()
    new_weights = perturbed(base, scale=0.05, seed=2)
    payload = {"version": 1, "kind": "folder", "path": str(save_weights_folder(new_weights, tmp_path / "v1", 1))}
    store = PublishWhenArmed(payload, buffer)  # armed by the worker's first interrupt check (after a token)
    cfg = config(tiny_model_dir, engine=EngineConfig(kind="hf"), interrupt_on_update=True, groups_per_batch=1)
    worker = RolloutWorker(cfg, "worker-c", buffer, store)
    real_interrupt = worker._interrupt

    def interrupt():
        store.armed = True
        return real_interrupt()

    worker._interrupt = interrupt
    stats = worker.run(max_groups=1)
    (group,) = pull_all(buffer, 1)
    assert stats["interrupted_generations_total"] == 1 and stats["loaded_version"] == 1
    for s in group.samples:
        versions = s.token_versions.tolist()
        assert s.weight_version == 0 and versions[0] == 0 and set(versions[1:]) == {1}, versions
        assert len(versions) >= 2
    assert_log_probs_follow_versions(tiny_model_dir, new_weights, group)
    worker.close()


def assert_log_probs_follow_versions(model_dir, new_weights, group, tol=1e-4):
    """Each token's log-prob is that of the weights that produced it: the model folder's for
    version 0, `new_weights` for version 1."""
    old_model, new_model = load_causal_lm(model_dir).eval(), load_causal_lm(model_dir).eval()
    new_model.load_state_dict(new_weights)
    prompts = [s.prompt_ids.tolist() for s in group.samples]
    responses = [s.response_ids.tolist() for s in group.samples]
    with torch.no_grad():
        old_lp, _ = response_log_probs(old_model, prompts, responses)
        new_lp, _ = response_log_probs(new_model, prompts, responses)
    for row, s in enumerate(group.samples):
        expected = torch.where(torch.tensor(s.token_versions) == 0, old_lp[row, : len(s.response_ids)],
                               new_lp[row, : len(s.response_ids)])
        np.testing.assert_allclose(s.rollout_log_probs, expected.numpy(), atol=tol)


def test_hanging_and_crashing_rewards_are_scored_as_failed(tiny_model_dir, vllm_engine, buffer):
    cfg = config(tiny_model_dir, reward="rollout_helpers:hang", reward_timeout_s=0.5, groups_per_batch=1,
                 sampling=SamplingConfig(n=2, max_new_tokens=8, seed=0))
    worker = RolloutWorker(cfg, "worker-d", buffer, WeightStore(), engine=vllm_engine)
    stats = worker.run(max_groups=1)
    (group,) = pull_all(buffer, 1)
    assert [s.reward for s in group.samples] == [0.0, 0.0]
    assert stats["reward_timeouts_total"] == 2 and stats["reward_failures_total"] == 2
    # each sample says why (the learner's process warns with it), and the step's record counts them
    assert all("took longer than 0.5s" in s.metadata[REWARD_ERROR] for s in group.samples)
    assert reward_metrics([group])["reward/failure_fraction"] == 1.0
    worker.close()


def run_until(worker, condition, timeout=90.0) -> dict:
    """Run the worker in a thread until `condition(worker)` holds (bounded), then stop it."""
    runner = threading.Thread(target=worker.run)
    runner.start()
    deadline = time.monotonic() + timeout
    while not condition(worker) and runner.is_alive() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert worker.stop(timeout=60)
    runner.join(timeout=10)
    assert condition(worker), worker.stats()
    return worker.stats()


def test_a_prompt_the_engine_refuses_is_quarantined_and_the_run_goes_on(tiny_model_dir, vllm_engine, buffer,
                                                                        tmp_path):
    """A prompt longer than the engine's context fails its whole engine batch: the batch is
    generated again prompt by prompt (its batch-mates are pushed), the bad prompt is retried alone
    and, after max_prompt_failures, quarantined: never reissued, counted on both sides, named
    with its ticket and the engine's error. When the prompt set wraps around, the same prompt
    under a new ticket is set aside at once. (The prompt checks refuse such a prompt before a run
    starts; here the config claims a context of 128 tokens while the engine has 64, so the prompt
    passes the checks and fails in the engine, as one would that the checks cannot foresee.)"""
    prompts = tmp_path / "prompts.jsonl"
    rows = ['{"prompt": "1+1=", "answer": "2"}', '{"prompt": "%s=", "answer": "1"}' % ("1+" * 40),
            '{"prompt": "2+3=", "answer": "5"}']
    prompts.write_text("\n".join(rows) + "\n")
    cfg = config(tiny_model_dir, task=TaskConfig(kind="file", path=str(prompts)), groups_per_batch=3,
                 engine=EngineConfig(max_model_len=128))
    worker = RolloutWorker(cfg, "worker-e", buffer, WeightStore(), engine=vllm_engine)
    stats = run_until(worker, lambda w: w.counters["prompts_quarantined_total"] >= 2 and w.counters["groups_total"] >= 4)
    buffer_stats = buffer.stats()
    assert stats["prompt_failures_total"] == cfg.max_prompt_failures, "retried alone, then set aside"
    assert "ticket 1" in stats["last_error"] or "max_model_len" in stats["last_error"]
    assert stats["last_quarantine"].startswith("ticket ")  # which prompt and why, for the run's console
    assert buffer_stats["prompts_quarantined"] == stats["prompts_quarantined_total"] >= 2  # tickets 1, 4, ...
    assert buffer_stats["running"] == 0 and stats["failed_generations_total"] == 0
    groups = pull_all(buffer, stats["groups_total"])
    assert {g.prompt_index % 3 for g in groups} == {0, 2}, "only the good prompts were generated"
    issued = buffer_stats["next_ticket"]
    assert stats["groups_total"] + buffer_stats["prompts_quarantined"] + buffer_stats["free_tickets"] == issued
    worker.close()


def test_a_broadcast_reaches_vllm_mid_generation_and_tokens_keep_their_versions(tiny_model_dir, vllm_engine, buffer,
                                                                              restore_vllm_weights, monkeypatch):
    """The broadcast channel into the streaming vLLM engine: the learner publishes version 1 while
    the worker's requests are in flight (the engine paused as the first token came out, so the send
    surely lands mid-generation); the worker takes part in the send (a gloo group of the learner
    and this engine), the engine loads with mode=keep and resumes the same requests (no abort, no
    re-prefill). Each response's tokens are version 0, then version 1, as vLLM reports them: the
    version-0 tokens have the old weights' log-probs exactly, the version-1 tokens the new
    weights' (their K/V prefix, kept, was computed by the old: close, not equal)."""
    from lm.weight_sync import BroadcastSender, ParameterGuard, Publication

    board = WeightStore()
    learner = load_causal_lm(tiny_model_dir).eval()
    new_weights = perturbed(restore_vllm_weights, scale=0.05, seed=3)
    guard = ParameterGuard()
    sender = BroadcastSender(board, "gloo", "chain", chunk_bytes=64 * 1024, ready_timeout_s=60, timeout_s=60,
                             address="127.0.0.1")
    publication = Publication(sender, guard, learner.state_dict)
    cfg = config(tiny_model_dir, interrupt_on_update=True, groups_per_batch=1, reward="rollout_helpers:length_reward",
                 sampling=SamplingConfig(n=2, max_new_tokens=8, seed=0))
    worker = RolloutWorker(cfg, "worker-bc", buffer, board, engine=vllm_engine)
    llm, paused = vllm_engine._llm, threading.Event()
    real_generate = llm.generate
    started = set()  # requests that have a token out

    async def generate(*args, **kwargs):  # pauses the engine once every request has its first token
        # (its two requests may reach the engine core in different steps on a busy machine: pausing at
        # the first request's first token let the other sample every token under the new weights)
        async for out in real_generate(*args, **kwargs):
            yield out
            started.add(kwargs["request_id"])
            if len(started) == cfg.sampling.n and not paused.is_set():
                paused.set()
                await llm.pause_generation(mode="keep", clear_cache=False)

    monkeypatch.setattr(llm, "generate", generate)
    folder_loads = []  # the pull channels' way in: not this one's
    monkeypatch.setattr(vllm_engine, "load_weights_folder", lambda *args: folder_loads.append(args))
    result = {}
    runner = threading.Thread(target=lambda: result.update(stats=worker.run(max_groups=1)))
    runner.start()
    try:
        assert paused.wait(60)
        with guard.writing(), torch.no_grad():
            learner.load_state_dict(new_weights)
        buffer.set_version(1)
        publication.publish(1)  # the worker's load resumes the engine
        runner.join(timeout=120)
        stats = result["stats"]
        (group,) = pull_all(buffer, 1)
        assert stats["loaded_version"] == 1 and vllm_engine.engine_weight_version() == "1"
        assert publication.wait_sent(1)["engines"] == 1
        # Through vLLM's weight transfer (the gloo plugin in its worker process), not a folder.
        assert vllm_engine._transfer_joined and folder_loads == []
        assert_versions_then_log_probs(tiny_model_dir, new_weights, group)
    finally:
        worker.stop(timeout=30)
        runner.join(timeout=30)
        publication.close()
        # A failure above may leave the shared engine paused: the package's next tests would hang on it.
        if vllm_engine._loop.run(llm.is_paused(), timeout=30):
            vllm_engine._loop.run(llm.resume_generation(), timeout=30)


def test_a_version_vllm_refuses_leaves_its_weights_and_the_next_one_loads(tiny_model_dir, vllm_engine,
                                                                        restore_vllm_weights):
    """A version holding a NaN reaches vLLM's worker through the gloo weight transfer: the worker
    process refuses it before the model takes any of it (the refusal, raised there, reaches the
    subscription as WeightsRejected), the engine keeps its weights, version and outputs; the next
    version loads and the engine reports it."""
    from lm.weight_sync import BroadcastSender, ParameterGuard, Publication, WeightsRejected, WeightSubscription
    from rollout_workers.engines.base import SamplingParams

    board, learner, guard = WeightStore(), load_causal_lm(tiny_model_dir).eval(), ParameterGuard()
    publication = Publication(BroadcastSender(board, "gloo", "chain", chunk_bytes=64 * 1024, ready_timeout_s=60,
                                              timeout_s=60, address="127.0.0.1"), guard, learner.state_dict)
    greedy = SamplingParams(n=1, temperature=0.0, max_new_tokens=6, seed=0)
    before, have = vllm_engine.generate([5, 6, 7], greedy), vllm_engine.version
    subscription = WeightSubscription(board, "worker-nan", have)
    try:
        with guard.writing(), torch.no_grad():
            learner.model.layers[0].mlp.up_proj.weight[0, 0] = float("nan")
        publication.publish(have + 1)
        with pytest.raises(WeightsRejected, match="'model.layers.0.mlp.up_proj.weight' holds a NaN") as err:
            subscription.receive(vllm_engine, wait_s=60)
        assert not err.value.retry and subscription.refused_newest().version == have + 1
        assert vllm_engine.version == have and vllm_engine.engine_weight_version() == str(have)
        assert vllm_engine.generate([5, 6, 7], greedy)[0].token_ids == before[0].token_ids
        new_weights = perturbed(restore_vllm_weights, scale=0.05, seed=4)
        with guard.writing(), torch.no_grad():
            learner.load_state_dict(new_weights)
        publication.publish(have + 2)
        deadline = time.monotonic() + 60
        while board.latest_version() < have + 2 and time.monotonic() < deadline:  # announced by its thread
            time.sleep(0.01)
        assert subscription.receive(vllm_engine, wait_s=60) == have + 2
        assert vllm_engine.engine_weight_version() == str(have + 2)
    finally:
        publication.close()


def assert_versions_then_log_probs(model_dir, new_weights, group, tol=1e-4):
    """Tokens are version 0 then version 1 (at least one of each). Each log-prob is exactly that of
    what sampled it under mode=keep: the old weights up to the switch; after it the new weights
    over the K/V cache the old ones computed (the prompt and the tokens before the switch but the
    last, whose K/V the first new step computes)."""
    old_model, new_model = load_causal_lm(model_dir).eval(), load_causal_lm(model_dir).eval()
    new_model.load_state_dict(new_weights)
    for s in group.samples:
        versions, prompt, tokens = s.token_versions.tolist(), s.prompt_ids.tolist(), s.response_ids.tolist()
        switch = versions.index(1) if 1 in versions else len(versions)
        assert s.weight_version == 0 and 0 < switch < len(versions), versions
        assert versions == [0] * switch + [1] * (len(versions) - switch), versions
        with torch.no_grad():
            old_lp, _ = response_log_probs(old_model, [prompt], [tokens])
            cached = old_model(torch.tensor([prompt + tokens[:switch - 1]]), use_cache=True)
            logits = new_model(torch.tensor([tokens[switch - 1:-1]]), past_key_values=cached.past_key_values).logits
            new_lp = torch.log_softmax(logits[0].float(), -1).gather(-1, torch.tensor(tokens[switch:])[:, None])[:, 0]
        np.testing.assert_allclose(s.rollout_log_probs[:switch], old_lp[0, :switch].numpy(), atol=tol)
        np.testing.assert_allclose(s.rollout_log_probs[switch:], new_lp.numpy(), atol=tol)


class FailingEngine:
    """Fault injection around the real engine: every generation raises (a broken engine)."""

    def __init__(self, engine):
        self.engine = engine
        self.version = engine.version

    def generate_batch(self, requests, interrupt=None):
        raise RuntimeError("engine is broken")

    def submit(self, prompt_ids, params):  # the streaming loop's way in
        raise RuntimeError("engine is broken")

    def __getattr__(self, name):
        return getattr(self.engine, name)


def test_an_engine_that_serves_nothing_asks_for_a_restart_and_quarantines_nothing(tiny_model_dir, vllm_engine,
                                                                                 buffer):
    cfg = config(tiny_model_dir, groups_per_batch=2, max_requests_in_flight=8)  # two groups of 4 at once
    worker = RolloutWorker(cfg, "worker-g", buffer, WeightStore(), engine=FailingEngine(vllm_engine))
    with pytest.raises(WorkerNeedsRestart, match="the engine fails every prompt"):
        worker.run()
    buffer_stats = buffer.stats()
    assert buffer_stats["prompts_quarantined"] == 0 and buffer_stats["running"] == 0
    assert buffer_stats["permits_released"] == 2, "both permits of the batch are back"


class FlakyStore(WeightStore):
    """Serves version 1 as a folder that is not there for the first `bad` reads, then the real one."""

    def __init__(self, good: dict, bad: int):
        super().__init__()
        self.publish(good)
        self.good, self.bad = good, bad

    def latest(self, reader=None):
        if self.bad > 0:
            self.bad -= 1
            return {"version": self.good["version"], "kind": "folder", "path": "/nonexistent/v000001"}
        return super().latest(reader)


def test_a_failed_weight_load_is_retried_then_the_worker_asks_for_a_restart(tiny_model_dir, buffer, tmp_path):
    weights = {k: v.clone() for k, v in load_causal_lm(tiny_model_dir).state_dict().items()}  # untied copies
    good = {"version": 1, "kind": "folder", "path": str(save_weights_folder(weights, tmp_path / "v1", 1))}
    cfg = config(tiny_model_dir, engine=EngineConfig(kind="hf"), weight_load_retries=2, groups_per_batch=1)
    buffer.set_version(1)  # the learner published version 1
    recovering = RolloutWorker(cfg, "worker-h", buffer, FlakyStore(good, bad=2))
    assert recovering.run(max_groups=1)["loaded_version"] == 1, "the third attempt loads"
    assert recovering.counters["weight_load_failures_total"] == 2
    broken = RolloutWorker(cfg, "worker-i", buffer, FlakyStore(good, bad=10))
    with pytest.raises(WorkerNeedsRestart, match="did not load in 3 attempt"):
        broken.run(max_groups=1)
    assert broken.counters["weight_load_failures_total"] == 3 and "nonexistent" in broken.last_error
    assert buffer.stats()["running"] == 0
    recovering.close()
    broken.close()


def test_stop_interrupts_generation_and_returns_the_permit(tiny_model_dir, buffer):
    """Graceful stop mid-generation: the in-flight permit is released, run() returns."""
    cfg = config(tiny_model_dir, engine=EngineConfig(kind="hf"), groups_per_batch=1,
                 reward="rollout_helpers:length_reward",
                 sampling=SamplingConfig(n=2, max_new_tokens=8, stop_token_ids=[], seed=0))
    worker = RolloutWorker(cfg, "worker-f", buffer, WeightStore())
    worker._ensure_started()
    in_generation = threading.Event()
    real_interrupt = worker._interrupt

    def interrupt():  # the engine asks between tokens; hold it there until stop() is called
        in_generation.set()
        worker._stop.wait(30)
        return real_interrupt()

    worker._interrupt = interrupt
    runner = threading.Thread(target=worker.run)
    runner.start()
    assert in_generation.wait(60)
    assert worker.stop(timeout=60)
    runner.join(timeout=10)
    buffer_stats, stats = buffer.stats(), worker.stats()
    assert buffer_stats["running"] == 0 and buffer_stats["permits_released"] == 1
    assert stats["permits_released_total"] == 1 and stats["groups_total"] == 0
    assert stats["failed_generations_total"] == 0  # a stop is not a failure
    worker.close()


def test_prepare_builds_the_engine_without_the_buffer_and_run_raises_what_it_met(tiny_model_dir, buffer, tmp_path):
    """`prepare` (a run calls it while its learner loads) sets the worker up without a buffer or a
    weight store; `run` then uses the same engine. A set-up that fails is not raised by `prepare`
    (nobody reads its result) but by `run`, once, where the pool watches."""
    worker = RolloutWorker(config(tiny_model_dir, engine=EngineConfig(kind="hf"), groups_per_batch=1), "worker-p")
    worker.prepare()
    engine = worker.engine
    assert engine is not None and engine.version == 0 and worker.prompts is not None and worker.rewards is not None
    worker.client, worker.store = buffer, WeightStore()
    assert worker.run(max_groups=1)["groups_total"] == 1
    assert worker.engine is engine, "run built no second engine"
    worker.close()

    (tmp_path / "empty").mkdir()
    broken = RolloutWorker(config(tmp_path / "empty", engine=EngineConfig(kind="hf")), "worker-q", buffer, WeightStore())
    broken.prepare()  # does not raise
    assert broken.engine is None and broken._setup_error is not None
    with pytest.raises(type(broken._setup_error)):
        broken.run(max_groups=1)
    assert broken._setup_error is None, "raised once; a later run tries again"
    assert buffer.stats()["running"] == 0, "no permit was taken"
    broken.close()


def test_bad_config_is_refused(tiny_model_dir):
    with pytest.raises(ValueError, match="extra"):
        RolloutConfig(model_path=str(tiny_model_dir), engine={"kind": "hf", "bogus": 1})
    with pytest.raises(ValueError, match="task.path"):
        TaskConfig(kind="file")
    with pytest.raises(ValueError, match="model_path"):
        RolloutWorker(RolloutConfig(), "w", None, WeightStore())


@pytest.mark.slow
def test_killed_ray_worker_returns_its_permit(ray_cluster, tiny_model_dir):
    """A worker actor killed while it holds a permit (stuck in a hanging reward) loses it to
    the buffer's lease: the ticket is reclaimed and handed to the next worker."""
    import ray

    from services.buffer_actor import RayBufferClient, create_buffer_actor

    buffer_cfg = BufferConfig(transport="ray", gate=GateConfig(batch_size=4, eta=None, permit_lease_s=2.0))
    client = RayBufferClient(create_buffer_actor(buffer_cfg), buffer_cfg)
    cfg = config(tiny_model_dir, engine=EngineConfig(kind="hf"), reward="rollout_helpers:hang",
                 reward_timeout_s=600, groups_per_batch=1, sampling=SamplingConfig(n=1, max_new_tokens=4, seed=0))
    helpers = str(Path(__file__).parent)
    store = ray.remote(WeightStore).options(num_cpus=0).remote()
    actor = ray.remote(RolloutWorker).options(
        num_cpus=0, max_concurrency=2, max_restarts=0,
        runtime_env={"env_vars": {"PYTHONPATH": os.pathsep.join([helpers, str(Path(helpers).parents[1])])}},
    ).remote(cfg, "worker-k", client, store)
    actor.run.remote()
    deadline = time.monotonic() + 120
    while client.stats()["running"] == 0 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert client.stats()["running"] == 1  # the worker holds ticket 0, mid-group
    ray.kill(actor, no_restart=True)
    deadline = time.monotonic() + 60
    permit = None
    while permit is None and time.monotonic() < deadline:
        permit = client.acquire_permit("worker-next", timeout=0.5)
        if permit is not None and permit.ticket != 0:
            client.release_permit(permit.permit_id)
            permit = None
    assert permit is not None and permit.ticket == 0
    assert client.stats()["permits_reclaimed"] == 1
