"""A poisoned sample never stops a run (issue 30): token ids beyond the model's vocabulary and
samples longer than the engine's context are refused at push, naming the sample (the real ZMQ
service answers with an error and counts it), the worker quarantines the prompt of a group the
buffer refuses and pushes its batch-mates; a batch that fails the learner `max_deliveries` times
is dropped as poisoned (logged, counted, its tickets reissued, the audit agrees), also across
restarts of the buffer; the learner refuses an out-of-vocabulary token by name; the run fills
the limits from its model."""
from __future__ import annotations

import json
import types

import numpy as np
import pytest
from buffer_helpers import make_group

from buffer.client import BufferClient
from buffer.codec import check_group, encode_group
from buffer.config import BufferConfig, GateConfig, LogConfig, SampleLimits, StoreConfig
from buffer.core import BufferCore
from buffer.errors import RemoteError, SampleError
from buffer.sample import Group, Sample, new_id
from buffer.server import BufferServer
from services.audit import audit, read_buffer_log

VOCAB, CONTEXT = 1000, 32


class FakeClock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def poisoned_group(ticket: int, response_ids, prompt_len: int = 3) -> Group:
    """make_group's group whose second sample answers with `response_ids`."""
    group = make_group(ticket)
    good = group.samples[0]
    n = len(response_ids)
    group.samples[1] = Sample(sample_id=new_id(), group_id=group.group_id, prompt_ids=np.arange(prompt_len),
                              response_ids=np.asarray(response_ids, np.int32),
                              rollout_log_probs=np.full(n, -1.0, np.float32), loss_mask=np.ones(n, np.uint8),
                              reward=0.0, weight_version=good.weight_version)
    return group


def test_the_issues_group_is_refused_by_the_codec_naming_the_sample():
    """2**31-1 as response ids, 131,072 tokens: passed the codec before; now each limit names it."""
    group = poisoned_group(0, np.full(131072, 2**31 - 1, np.int32))
    bad = group.samples[1].sample_id
    check_group(encode_group(group))  # without the model's limits: as before
    with pytest.raises(SampleError, match=f"sample '{bad}', field 'response_ids': token id 2147483647 at position 0 "
                                          f"is not below the vocabulary size {VOCAB}"):
        check_group(encode_group(group), SampleLimits(vocab_size=VOCAB))
    with pytest.raises(SampleError, match=f"sample '{bad}'.*131075 tokens? exceed|sample '{bad}'.*exceed "
                                          "max_sequence_tokens=32"):
        check_group(encode_group(group), SampleLimits(max_sequence_tokens=CONTEXT))
    prompt = make_group(1)
    prompt.samples[0].prompt_ids = np.array([5, VOCAB, 7], np.int32)  # the prompt side too
    with pytest.raises(SampleError, match="'prompt_ids': token id 1000 at position 1"):
        check_group(encode_group(prompt), SampleLimits(vocab_size=VOCAB))
    edge = poisoned_group(2, [VOCAB - 1] * (CONTEXT - 3))  # the largest id, the full context: fine
    check_group(encode_group(edge), SampleLimits(vocab_size=VOCAB, max_sequence_tokens=CONTEXT))


@pytest.fixture
def server():
    config = BufferConfig(port=0, gate=GateConfig(batch_size=1, eta=None),
                          limits=SampleLimits(vocab_size=VOCAB, max_sequence_tokens=CONTEXT))
    server = BufferServer(config).start()
    yield server
    server.stop()


def test_the_service_refuses_a_poisoned_group_and_its_ticket_is_quarantined(server):
    with BufferClient(server.endpoint) as client:
        permit = client.acquire_permit("w", timeout=5)
        group = poisoned_group(permit.ticket, [1, 2, 5000])
        with pytest.raises(RemoteError, match=f"sample '{group.samples[1].sample_id}'.*vocabulary") as info:
            client.push_group(group, permit.permit_id)
        assert info.value.reason == "bad_sample"
        long = poisoned_group(permit.ticket, [1] * CONTEXT)
        with pytest.raises(RemoteError, match="max_sequence_tokens=32 \\(the engine's context\\)"):
            client.push_group(long, permit.permit_id)
        stats = client.stats()
        assert stats["bad_messages"] == {"bad_sample": 2} and stats["pushed_groups"] == 0
        assert stats["running"] == 1, "a refused push consumes no permit"
        assert client.release_permit(permit.permit_id, quarantine="group refused: vocabulary")
        stats = client.stats()
        assert stats["prompts_quarantined"] == 1 and stats["running"] == 0 and stats["free_tickets"] == 0
        nxt = client.acquire_permit("w", timeout=5)
        assert nxt.ticket == permit.ticket + 1, "the quarantined ticket is never reissued"
        client.push_group(make_group(nxt.ticket), nxt.permit_id)


class PoisonFirstPrompt:
    """The real engine, except that every response to the first prompt it sees ends in a token
    beyond the vocabulary (an engine bug, or a corrupted transfer)."""

    def __init__(self, engine):
        self.engine, self.bad = engine, None

    def generate_batch(self, requests, interrupt=None):
        out = self.engine.generate_batch(requests, interrupt=interrupt)
        for (prompt, _), completions in zip(requests, out):
            self.bad = self.bad or tuple(prompt)
            if tuple(prompt) == self.bad:
                for c in completions:
                    c.token_ids[-1] = 10**6
        return out

    def __getattr__(self, name):
        return getattr(self.engine, name)


def test_a_worker_quarantines_the_prompt_of_a_refused_group_and_pushes_its_batch_mates(tiny_model_dir):
    from lm.weight_sync import WeightStore
    from rollout_workers.config import EngineConfig, RolloutConfig, SamplingConfig
    from rollout_workers.engines import make_engine
    from rollout_workers.worker import RolloutWorker

    vocab = json.loads((tiny_model_dir / "config.json").read_text())["vocab_size"]
    server = BufferServer(BufferConfig(port=0, gate=GateConfig(batch_size=4, eta=None),
                                       limits=SampleLimits(vocab_size=vocab))).start()
    cfg = RolloutConfig(model_path=str(tiny_model_dir), engine=EngineConfig(kind="hf"),
                        sampling=SamplingConfig(n=2, max_new_tokens=4, seed=0), weight_poll_s=0.0,
                        acquire_timeout_s=0.2, error_backoff_s=0.0, groups_per_batch=2)
    engine = PoisonFirstPrompt(make_engine(cfg.engine, tiny_model_dir))
    client = BufferClient(server.endpoint)
    worker = RolloutWorker(cfg, "worker-p", client, WeightStore(), engine=engine)
    try:
        stats = worker.run(max_groups=3)
        buffer_stats = client.stats()
        assert stats["groups_refused_total"] == 1 and stats["prompts_quarantined_total"] == 1
        assert buffer_stats["prompts_quarantined"] == 1 and buffer_stats["running"] == 0
        # the batch's push and the bad group's push alone, each refused naming the sample
        assert buffer_stats["bad_messages"] == {"bad_sample": 2}
        assert buffer_stats["pushed_groups"] == 3 and "vocabulary" in stats["last_error"]
        tickets = sorted(g.prompt_index for g in client.pull_batch(3).groups)
        assert 0 not in tickets and len(tickets) == 3, "ticket 0 (the first prompt) is quarantined, the rest pushed"
    finally:
        worker.close()
        client.close()
        server.stop()


def durable_core(path, clock, max_deliveries=2) -> BufferCore:
    config = BufferConfig(gate=GateConfig(batch_size=2, eta=None), store=StoreConfig(lease_s=30),
                          log=LogConfig(path=path), max_deliveries=max_deliveries)
    return BufferCore(config, clock=clock)


def push_two(core):
    for _ in range(2):
        permit = core.acquire_permit("w")
        core.push_group(encode_group(make_group(permit.ticket, version=core.gate.version)), permit.permit_id)


def test_a_batch_that_fails_the_learner_twice_is_dropped_as_poisoned_across_restarts(tmp_path):
    path, clock = tmp_path / "buffer.log", FakeClock()
    core = durable_core(path, clock)
    push_two(core)
    for _ in range(3):  # plain hand-backs (a stop, a reply that could not be sent) count nothing
        core.nack(core.pull_batch(2).lease_id)
    first = core.pull_batch(2)
    ids = sorted(g.group_id for g in core.store.leases[first.lease_id].groups)
    core.nack(first.lease_id, failed=True)  # the learner refused or crashed on it: failure 1
    core.close()
    core = durable_core(path, clock)  # the count comes back from the log
    assert sorted(g.group_id for g in core.store.live_groups()) == ids
    assert {g.failures for g in core.store.live_groups()} == {1}
    core.pull_batch(2)
    clock.now += 31  # the learner died with the lease: it expires (failure 2)
    core.tick()
    core.close()
    core = durable_core(path, clock)
    assert core.pull_batch(2) is None, "not handed out a third time"
    stats = core.stats()
    assert stats["dropped_groups"] == {"poisoned": 2} and stats["dropped_samples"] == {"poisoned": 4}
    assert stats["groups_ready"] == 0 and stats["free_tickets"] == 2, "their tickets are reissued"
    push_two(core)  # the reissued tickets' fresh groups go through
    assert sorted(g.ticket for g in core.store.ready.values()) == [0, 1]
    core.close()
    records = read_buffer_log(path)
    drops = [r for r in records if r["op"] == "drop"]
    assert [(d["reason"], sorted(d["groups"])) for d in drops] == [("poisoned", ids)]
    report = audit([], records, eta=None)
    assert report.ok and report.dropped_groups == 2 and report.in_buffer_groups == 2, report


def test_a_late_ack_of_the_second_failed_lease_still_consumes_it():
    clock = FakeClock()
    core = BufferCore(BufferConfig(gate=GateConfig(batch_size=2, eta=None), store=StoreConfig(lease_s=30)),
                      clock=clock)
    push_two(core)
    core.nack(core.pull_batch(2).lease_id, failed=True)
    slow = core.pull_batch(2)
    clock.now += 31
    core.tick()  # expired: failure 2, marked, but dropped only by the next pull
    assert core.ack(slow.lease_id) == 2, "a slow learner's late ack still consumes the groups"
    assert core.stats()["consumed_groups"] == 2 and core.stats()["dropped_groups"] == {}
    unbounded = BufferCore(BufferConfig(gate=GateConfig(batch_size=2, eta=None), max_deliveries=None))
    push_two(unbounded)
    for _ in range(4):
        unbounded.nack(unbounded.pull_batch(2).lease_id, failed=True)
    assert unbounded.pull_batch(2) is not None, "max_deliveries: None keeps the old behaviour"


def test_the_learner_refuses_a_token_beyond_its_vocabulary_naming_the_sample():
    from learner.batch import BatchError, build_batch

    group = poisoned_group(0, [1, 2, 2**31 - 1])
    build_batch([group])  # without the model's vocabulary: as before
    with pytest.raises(BatchError, match=f"sample '{group.samples[1].sample_id}', field 'response_ids': token id "
                                         "2147483647 at position 2 is not below the vocabulary size 1000"):
        build_batch([make_group(1), group], vocab_size=VOCAB)


def test_a_batch_the_learner_refuses_is_handed_back_and_dropped_and_the_run_goes_on(tmp_path):
    """The controller's side: a refused batch is nacked as failed, and at the second refusal the
    buffer drops it; the next pull gets fresh groups (the run does not stop)."""
    from learner.batch import BatchError
    from services.controller import Controller
    from services.learner_failures import LearnerFailures

    core = BufferCore(BufferConfig(gate=GateConfig(batch_size=2, eta=None)))
    push_two(core)

    class Learner:
        def train_step(self, groups):
            if any(g.group_id in poisoned for g in groups):
                raise BatchError("sample 'x', field 'response_ids': token id beyond the vocabulary")
            return {"learner/version": 1}

    controller = Controller.__new__(Controller)
    controller.cfg = types.SimpleNamespace(buffer=types.SimpleNamespace(max_deliveries=2))
    controller.learner, controller.buffer = Learner(), types.SimpleNamespace(client=core)
    controller.learner_failures = LearnerFailures(tmp_path)
    poisoned = set(core.store.ready)
    for _ in range(2):
        lease = core.pull_batch(2)
        assert controller._train_or_hand_back(types.SimpleNamespace(lease_id=lease.lease_id, groups=[
            types.SimpleNamespace(group_id=g.group_id) for g in core.store.leases[lease.lease_id].groups])) is None
    push_two(core)
    fresh = core.pull_batch(2)
    assert fresh is not None and not {g.group_id for g in core.store.leases[fresh.lease_id].groups} & poisoned
    assert core.stats()["dropped_groups"] == {"poisoned": 2}


def test_a_batch_the_learner_dies_on_is_dropped_at_the_second_resume(tmp_path):
    """The learner's process dies on a batch (a device-side assert, an out-of-memory): the run
    stops, and each resume restores the buffer from a checkpoint that predates the crash, so the
    buffer's own count is gone. The run folder's marker counts the death; at the second resume
    the restored buffer drops the batch as poisoned instead of handing it to the learner a third
    time, and the run goes on with the reissued tickets."""
    from buffer.core import with_failures
    from services.controller import Controller
    from services.learner_failures import LearnerFailures

    core = BufferCore(BufferConfig(gate=GateConfig(batch_size=2, eta=None)))
    push_two(core)
    checkpoint = core.snapshot_records(keep_in_flight=False)
    poisoned = set(core.store.ready)

    class DyingLearner:
        def train_step(self, groups):
            raise RuntimeError("CUDA error: device-side assert triggered (the learner's process died)")

    def run_once():
        """A resumed run: the ledger recovers, the buffer is restored from the checkpoint with the
        counted failures, one step is tried. Returns the buffer."""
        controller = Controller.__new__(Controller)
        controller.cfg = types.SimpleNamespace(buffer=types.SimpleNamespace(max_deliveries=2))
        controller.learner_failures = LearnerFailures(tmp_path)
        controller.learner_failures.recover()
        buffer = BufferCore(BufferConfig(gate=GateConfig(batch_size=2, eta=None)))
        buffer.restore(with_failures(checkpoint, controller.learner_failures.counts))
        controller.learner, controller.buffer = DyingLearner(), types.SimpleNamespace(client=buffer)
        lease = buffer.pull_batch(2)
        if lease is not None:
            groups = [types.SimpleNamespace(group_id=g.group_id) for g in buffer.store.leases[lease.lease_id].groups]
            assert {g.group_id for g in groups} == poisoned
            with pytest.raises(RuntimeError, match="device-side assert"):
                controller._train_or_hand_back(types.SimpleNamespace(lease_id=lease.lease_id, groups=groups))
        return buffer, lease

    for attempt in range(2):  # the first run and the first resume die on the batch
        _, lease = run_once()
        assert lease is not None, f"attempt {attempt}: handed out"
    buffer, lease = run_once()  # the second resume
    assert lease is None, "not handed to the learner a third time"
    stats = buffer.stats()
    assert stats["dropped_groups"] == {"poisoned": 2} and stats["free_tickets"] == 2, "tickets reissued"
    assert json.loads((tmp_path / "learner-failures.json").read_text()) == {g: 2 for g in poisoned}
    assert not (tmp_path / "learner-training.json").exists()


def test_the_run_fills_the_sample_limits_from_its_model(tmp_path):
    from services.config import ConfigError, build_config, fill_sample_limits

    (tmp_path / "config.json").write_text(json.dumps({"vocab_size": 151936, "max_position_embeddings": 4096}))
    cfg = build_config({})
    fill_sample_limits(cfg, tmp_path)
    assert (cfg.buffer.limits.vocab_size, cfg.buffer.limits.max_sequence_tokens) == (151936, 4096)
    assert cfg.buffer.service_config().limits.vocab_size == 151936, "the buffer service gets them"
    cfg = build_config({}, ["rollout.engine.max_model_len=1024", "buffer.limits.vocab_size=1000"])
    fill_sample_limits(cfg, tmp_path)
    assert (cfg.buffer.limits.vocab_size, cfg.buffer.limits.max_sequence_tokens) == (1000, 1024)
    with pytest.raises(ConfigError, match="buffer.limits.vocab_size=200000 exceeds the vocabulary"):
        fill_sample_limits(build_config({}, ["buffer.limits.vocab_size=200000"]), tmp_path)
    assert cfg.buffer.limits.num_experts is None, "a dense model: no routing limit"
    (tmp_path / "config.json").write_text(json.dumps({"vocab_size": 512, "num_local_experts": 8}))  # transformers 5
    cfg = build_config({})
    fill_sample_limits(cfg, tmp_path)
    assert cfg.buffer.limits.num_experts == 8, "an MoE policy: expert ids in routing below 8"
    (tmp_path / "config.json").write_text(json.dumps({"vocab_size": 512, "n_routed_experts": 64}))  # DeepSeek's
    cfg = build_config({})
    fill_sample_limits(cfg, tmp_path)
    assert cfg.buffer.limits.num_experts == 64
