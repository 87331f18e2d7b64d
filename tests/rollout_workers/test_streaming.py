"""The streaming worker on vLLM's AsyncLLM: the engine kept full within its bound, groups pushed as
they end (several to a push), a weight load that waits for the requests in flight (mode=wait),
the interface check at start, and the platform defaults."""
from __future__ import annotations

import threading

import pytest
from rollout_helpers import load_with_mode_wait, perturbed, pull_all

from lm.weight_sync import WeightStore
from rollout_workers.config import RolloutConfig, SamplingConfig
from rollout_workers.engines.base import SamplingParams
from rollout_workers.engines.vllm_check import TESTED_VLLM, VLLMInterfaceMissing, check_vllm_interface
from rollout_workers.worker import RolloutWorker

pytestmark = pytest.mark.timeout(180)


class WatchedEngine:
    """The real engine, counting the groups and responses in flight at once and the pushes' sizes' source."""

    def __init__(self, engine):
        self.engine, self.lock = engine, threading.Lock()
        self.in_flight = self.most_in_flight = self.submitted = self.responses = self.most_responses = 0

    def submit(self, prompt_ids, params, *more):
        request = self.engine.submit(prompt_ids, params, *more)
        responses = params.n + sum(m.n for m in more)
        with self.lock:
            self.in_flight += 1
            self.responses += responses
            self.submitted += 1
            self.most_in_flight = max(self.most_in_flight, self.in_flight)
            self.most_responses = max(self.most_responses, self.responses)

        def ended(_):
            with self.lock:
                self.in_flight -= 1
                self.responses -= responses

        request.future.add_done_callback(ended)
        return request

    def __getattr__(self, name):
        return getattr(self.engine, name)


class PushSizes:
    def __init__(self, client):
        self.client, self.sizes = client, []

    def push_and_acquire(self, groups, permit_ids, worker_id, count):
        self.sizes.append(len(groups))
        return self.client.push_and_acquire(groups, permit_ids, worker_id, count)

    def __getattr__(self, name):
        return getattr(self.client, name)


@pytest.mark.parametrize("greedy_baseline", [False, True])
def test_the_streaming_worker_keeps_its_bound_and_pushes_groups_as_they_end(tiny_model_dir, vllm_engine, buffer,
                                                                           greedy_baseline):
    """Groups of 4 with room for 12 responses: 3 groups in flight at once, never more (with a
    greedy baseline each group is 5 responses: 2 groups); every group is tagged version 0 per
    token, the tickets are the data cursor, the pushes carry what has ended (one request may carry
    several groups), two reward processes score them."""
    cfg = RolloutConfig(model_path=str(tiny_model_dir), sampling=SamplingConfig(n=4, max_new_tokens=8, seed=0),
                        weight_poll_s=0.0, acquire_timeout_s=0.2, error_backoff_s=0.0, max_requests_in_flight=12,
                        reward_processes=2, greedy_baseline=greedy_baseline)
    engine, client = WatchedEngine(vllm_engine), PushSizes(buffer)
    worker = RolloutWorker(cfg, "worker-s", client, WeightStore(), engine=engine)
    stats = worker.run(max_groups=9)
    groups = pull_all(buffer, 9)
    assert sorted(g.prompt_index for g in groups) == list(range(9))
    assert all(set(s.token_versions.tolist()) == {0} and s.weight_version == 0 for g in groups for s in g.samples)
    per_group = 5 if greedy_baseline else 4
    assert engine.most_in_flight == 12 // per_group and engine.submitted == 9
    assert engine.most_responses == 12 // per_group * per_group
    assert sum(client.sizes) == 9 and stats["groups_total"] == 9
    assert stats["tokens_per_s"] > 0 and buffer.stats()["running"] == 0
    assert stats["reward_calls_total"] == 9 * per_group  # both reward processes' calls
    assert stats["engine_pause_s"] == vllm_engine.pause_s_total
    worker.close()


def test_a_load_with_mode_wait_lets_the_requests_in_flight_end_first(vllm_engine, tokenizer, restore_vllm_weights):
    """interrupt_on_update=false on the streaming engine: the load waits for the requests in
    flight, which end under the old version, and requests after it run under the new."""
    prompt = tokenizer("12+34=", add_special_tokens=False)["input_ids"]
    params = SamplingParams(n=2, max_new_tokens=8, stop_token_ids=(tokenizer.eos_token_id,), seed=1)
    first, after = load_with_mode_wait(vllm_engine, prompt, params, 5, perturbed(restore_vllm_weights, seed=6))
    assert all(set(versions) == {0} for _, versions in first), first
    assert all(set(versions) == {5} for _, versions in after)
    assert vllm_engine.version == 5 and vllm_engine.engine_weight_version() == "5"


def test_the_cpu_defaults_are_eager_and_seeded(vllm_engine):
    assert vllm_engine.enforce_eager is True and vllm_engine.seed_requests is True


def test_a_vllm_without_the_interface_is_refused_in_one_line_naming_the_version():
    from vllm.v1.engine.async_llm import AsyncLLM

    check_vllm_interface()  # the installed one has it all
    lacking = type("OldAsyncLLM", (AsyncLLM,), {"pause_generation": None})

    async def pause_without_mode(self, clear_cache=True): ...

    old_signature = type("OlderAsyncLLM", (AsyncLLM,), {"pause_generation": pause_without_mode})
    with pytest.raises(VLLMInterfaceMissing) as refused:
        check_vllm_interface(lacking)
    message = str(refused.value)
    assert "\n" not in message and "AsyncLLM.pause_generation" in message and f"needs vllm {TESTED_VLLM}" in message
    with pytest.raises(VLLMInterfaceMissing, match=r"pause_generation\(mode=\.\.\.\)"):
        check_vllm_interface(old_signature)
