"""lm/weight_sync: the wire layout, the broadcast channel end to end in one process (the learner's
publication thread and real transformers engines in threads, each a rank of a real gloo group),
membership (a member that never comes, one whose model does not fit, a restart), the parameter
guard that keeps the parameters still under a send, and the pull channels (one shared object per
version, folder retention by version)."""
from __future__ import annotations

import contextlib
import logging
import threading

import pytest
import torch

from lm.weight_sync import (
    BroadcastSender,
    FolderSender,
    Layout,
    ObjectStoreSender,
    ParameterGuard,
    Publication,
    WeightStore,
    WeightSubscription,
    resolve_weights,
)
from lm.weight_sync.layout import ChunkAssembler, fill_chunk
from rollout_workers.engines.hf_engine import HFEngine

pytestmark = pytest.mark.timeout(240)


def qwen2(hidden: int = 32, seed: int = 0):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    return Qwen2ForCausalLM(Qwen2Config(
        vocab_size=64, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=True))


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("engine-model")
    qwen2(seed=0).save_pretrained(folder)
    return folder


class Learner:
    """The learner's side as `learner.trainer.Learner` wires it: parameters, the guard around the
    optimizer step, and a publication thread around a sender."""

    def __init__(self, sender, snapshot: bool = False, dtype=None):
        self.model = qwen2(seed=1)
        self.guard = ParameterGuard()
        self.version = 0
        self.publication = Publication(sender, self.guard, self.named, snapshot=snapshot, dtype=dtype)

    def named(self) -> dict[str, torch.Tensor]:
        return self.model.state_dict()  # the tied lm_head too: one storage, two names

    @torch.no_grad()
    def step(self, delta: float = 0.01) -> None:
        with self.guard.writing():
            for p in self.model.parameters():
                p.add_(delta)
        self.version += 1

    def publish_and_wait(self, board, timeout: float = 60.0) -> None:
        self.publication.publish(self.version)
        wait_live(board, self.version, timeout)
        self.publication.wait_sent(self.version, timeout)

    def close(self) -> None:
        self.publication.close()


def wait_live(board, version: int, timeout: float = 60.0) -> dict:
    import time

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        payload = board.wait_live(version, deadline - time.monotonic())
        if payload is not None:
            return payload
    raise AssertionError(f"version {version} never went live; members {board.members()}")


class EngineThreads:
    """Rollout workers reduced to their weight loop: each thread asks for newer weights between
    "engine steps" and receives them into its own transformers engine. Stopped with the test."""

    def __init__(self, board, engines: dict[str, HFEngine], paused: set[str] = ()):
        self.board, self.engines = board, engines
        self.stop = threading.Event()
        self.paused = {name: threading.Event() for name in paused}
        self.errors: dict[str, list[str]] = {name: [] for name in engines}
        self.threads = [threading.Thread(target=self._loop, args=(name,), daemon=True) for name in engines]
        self.joined = threading.Semaphore(0)
        self.subscriptions: dict[str, WeightSubscription] = {}

    def _loop(self, name: str) -> None:
        engine = self.engines[name]
        subscription = WeightSubscription(self.board, name, engine.version)  # a member from now on
        self.subscriptions[name] = subscription
        self.joined.release()
        while not self.stop.is_set():
            if name in self.paused and not self.paused[name].is_set():
                self.paused[name].wait(0.05)
                continue
            if subscription.newest_version() > engine.version:
                try:
                    subscription.receive(engine, wait_s=5.0, stop=self.stop)
                except Exception as err:
                    self.errors[name].append(str(err))
            self.stop.wait(0.005)

    def __enter__(self):
        for thread in self.threads:
            thread.start()
        for _ in self.threads:
            assert self.joined.acquire(timeout=60), "an engine thread did not join"
        return self

    def __exit__(self, *exc):
        self.stop.set()
        for paused in self.paused.values():
            paused.set()
        for thread in self.threads:
            thread.join(30)
        assert not any(t.is_alive() for t in self.threads), "an engine thread did not end"


def assert_engine_has(engine: HFEngine, learner: Learner, dtype=None) -> None:
    got = engine.model.state_dict()
    for name, want in learner.named().items():
        want = want if dtype is None else want.to(dtype).to(got[name].dtype)
        assert torch.equal(got[name], want), name


# ---------------------------------------------------------------- the wire


def test_layout_round_trips_tensors_across_chunk_boundaries():
    tensors = {"a": torch.randn(5, 7), "b": torch.arange(3, dtype=torch.int64), "c": torch.randn(200),
               "d": torch.randn(1, 1)}
    tensors["tied"] = tensors["a"]  # one storage under two names (a tied lm_head): its bytes go once
    layout = Layout.from_wire(Layout.of(tensors.items(), dtype=None).to_wire())
    assert all(m.offset % 64 == 0 for m in layout.tensors)
    assert layout.tensors[-1].alias_of == "a" and layout.total_bytes == 192 + 64 + 832 + 64
    for chunk_bytes in (64, 128, 4096):  # chunks far smaller than "c", and one holding everything
        assembler, got = ChunkAssembler(layout), {}
        for span in layout.chunks(chunk_bytes):
            buf = torch.empty(span[1] - span[0], dtype=torch.uint8)
            fill_chunk(buf, layout, span, tensors)
            got.update({name: t.clone() for name, t in assembler.feed(span, buf)})
        assert assembler.complete and sorted(got) == sorted(tensors)
        assert all(torch.equal(got[k], tensors[k]) for k in tensors)
    # Cast on the way: the bytes are bfloat16, the values those of the cast.
    bf16 = Layout.of([("c", tensors["c"])], dtype=torch.bfloat16)
    assert bf16.total_bytes == 448 and bf16.tensors[0].dtype == "bfloat16"
    buf = torch.empty(bf16.total_bytes, dtype=torch.uint8)
    fill_chunk(buf, bf16, (0, bf16.total_bytes), {"c": tensors["c"]})
    (_, c), = ChunkAssembler(bf16).feed((0, bf16.total_bytes), buf)
    assert torch.equal(c, tensors["c"].to(torch.bfloat16))


def test_a_layout_that_does_not_fit_names_the_tensor():
    model = qwen2()
    shapes = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    ok = Layout.of((k, v) for k, v in model.state_dict().items() if k != "lm_head.weight")
    ok.check_fits(shapes, may_lack={"lm_head.weight"})
    other = Layout.of(qwen2(hidden=48).state_dict().items())
    with pytest.raises(ValueError, match=r"tensor 'model.embed_tokens.weight' has shape \[64, 48\], the model's is \[64, 32\]"):
        other.check_fits(shapes)
    with pytest.raises(ValueError, match="it has no tensor 'extra.weight'"):
        Layout.of([("extra.weight", torch.zeros(2))]).check_fits(shapes)
    with pytest.raises(ValueError, match="tensor 'lm_head.weight' is missing"):
        ok.check_fits(shapes)


def test_a_folders_expected_weights_take_a_tied_lm_head_from_its_config_or_its_weights(tmp_path):
    """What a vLLM engine checks a version against (folder_weight_shapes): a tied model's lm_head is
    the embeddings' shape and may be left out; a config.json that says nothing of tying (a model
    class that ties by default, as Gemma's, omits it) is tied when its weights hold no lm_head, and
    a layout with one (the learner sends every name) fits it."""
    import json

    from safetensors.torch import save_file

    from lm.weight_sync.payloads import folder_weight_shapes

    state = {k: v.contiguous() for k, v in qwen2().state_dict().items()}
    without_head = {k: v for k, v in state.items() if k != "lm_head.weight"}
    untied = without_head | {"lm_head.weight": state["lm_head.weight"].clone()}
    cases = {"says tied": ({"tie_word_embeddings": True}, False, True),
             "says nothing, no lm_head": ({}, False, True),
             "says untied": ({"tie_word_embeddings": False}, True, False),
             "says nothing, an lm_head": ({}, True, False)}
    for name, (config, with_head, tied) in cases.items():
        folder = tmp_path / name.replace(" ", "_").replace(",", "")
        folder.mkdir()
        (folder / "config.json").write_text(json.dumps({"model_type": "qwen2", **config}))
        save_file(untied if with_head else without_head, str(folder / "model.safetensors"))
        shapes, may_lack = folder_weight_shapes(folder)
        assert shapes["lm_head.weight"] == tuple(state["model.embed_tokens.weight"].shape), name
        assert may_lack == ({"lm_head.weight"} if tied else set()), name
        Layout.of(state.items()).check_fits(shapes, may_lack)


# ---------------------------------------------------------------- broadcast


def broadcast_sender(board, topology="chain", chunk_bytes=4096, ready_timeout_s=30.0, dtype=None, ahead_chunks=4):
    return BroadcastSender(board, "gloo", topology, chunk_bytes, ready_timeout_s, timeout_s=60.0, address="127.0.0.1",
                           dtype=dtype, ahead_bytes=ahead_chunks * chunk_bytes)


@pytest.mark.parametrize("topology", ["chain", "star"])
def test_broadcast_brings_every_engine_to_each_version(model_dir, topology):
    """Three engines, two versions in bfloat16, chunks much smaller than the embedding: every
    engine holds exactly the learner's weights (as cast), and the group formed for the first
    version is reused for the second (same members), as are each engine's receive buffers (new
    host memory for every version costs the kernel zeroing each page)."""
    board = WeightStore()
    learner = Learner(broadcast_sender(board, topology, dtype=torch.bfloat16))
    engines = {f"worker-{i}": HFEngine(model_dir) for i in range(3)}
    try:
        with EngineThreads(board, engines) as threads:
            generations, buffers = [], []
            for _ in range(2):
                learner.step()
                learner.publish_and_wait(board)
                generations.append({m["session"] for m in board.members().values()})
                for engine in engines.values():
                    assert engine.version == learner.version
                    assert_engine_has(engine, learner, torch.bfloat16)
                buffers.append({name: spare_buffers(e) for name, e in engines.items()})
            for name in engines:
                assert buffers[0][name] and buffers[1][name] == buffers[0][name], "the same buffers, none new"
            stats = learner.publication.last
        assert not any(threads.errors.values()), threads.errors
        assert stats["engines"] == 3 and stats["version"] == 2 and stats["served_s"] >= stats["own_s"] > 0
        assert board.generation() == 1, "the same members keep their group"
    finally:
        learner.close()


def spare_buffers(engine: HFEngine) -> set[int]:
    """Where the receive buffers an engine's receiver keeps between versions live (chunks and the
    assembly of tensors that span chunks)."""
    spare = engine._receiver._spare
    return {b.data_ptr() for b in spare["chunks"]} | {b.data_ptr() for bs in spare["assembly"].values() for b in bs}


def test_a_member_that_never_comes_is_named_left_out_and_catches_up(model_dir, caplog):
    """worker-1 joins, then stops reaching its interrupt point: version 1 waits for it only
    `ready_timeout_s`, names it and goes to worker-0. When worker-1 asks again it gets the live
    version in a catch-up send, in a new group generation."""
    board = WeightStore()
    learner = Learner(broadcast_sender(board, ready_timeout_s=1.0))
    engines = {"worker-0": HFEngine(model_dir), "worker-1": HFEngine(model_dir)}
    caplog.set_level(logging.WARNING, logger="lm.weight_sync")
    try:
        with EngineThreads(board, engines, paused={"worker-1"}) as threads:
            learner.step()
            learner.publish_and_wait(board)
            assert engines["worker-0"].version == 1 and engines["worker-1"].version == 0
            assert "worker-1 left out of this send" in caplog.text and "worker-0 left out" not in caplog.text
            first_generation = board.generation()
            threads.paused["worker-1"].set()  # it comes back, one version behind
            wait_for(lambda: engines["worker-1"].version == 1)
            assert_engine_has(engines["worker-1"], learner)
            assert board.generation() > first_generation
            # From now on both are members again: the next version reaches both.
            learner.step()
            learner.publish_and_wait(board)
            assert {e.version for e in engines.values()} == {2}
        assert not any(threads.errors.values()), threads.errors
    finally:
        learner.close()


def test_an_engine_whose_model_does_not_fit_is_refused_by_tensor_name(model_dir, tmp_path, caplog):
    other_dir = tmp_path / "other"
    qwen2(hidden=48).save_pretrained(other_dir)
    board = WeightStore()
    learner = Learner(broadcast_sender(board, ready_timeout_s=60.0))  # never waited for: it said why
    engines = {"worker-0": HFEngine(model_dir), "worker-odd": HFEngine(other_dir)}
    caplog.set_level(logging.WARNING, logger="lm.weight_sync")
    try:
        with EngineThreads(board, engines) as threads:
            for version in (1, 2):
                learner.step()
                learner.publish_and_wait(board)
                assert engines["worker-0"].version == version
        why = "tensor 'model.embed_tokens.weight' has shape [64, 32], the model's is [64, 48]"
        assert threads.errors["worker-odd"] and all(why in e for e in threads.errors["worker-odd"])
        assert engines["worker-odd"].version == 0, "its weights were never touched"
        assert f"weights v1: worker-odd left out of this send (weight_sync.ready_timeout_s=60s): weights do not " \
               f"fit the model: {why}" in caplog.text
    finally:
        learner.close()


def gate_receivers(monkeypatch, gate: threading.Event, ranks: set[int] | None = None) -> threading.Event:
    """Make the receivers of these ranks (None: all) slow: each takes the first chunk of a
    version, then waits until `gate` opens. Returns the event set when one is waiting."""
    from lm.weight_sync import gloo_transfer

    reading = threading.Event()

    class GatedStream(gloo_transfer.ReceiveStream):
        def _take_chunk(self):
            if self._taken == 1 and (ranks is None or self.rank in ranks):
                reading.set()
                assert gate.wait(60)
            return super()._take_chunk()

    monkeypatch.setattr(gloo_transfer, "ReceiveStream", GatedStream)
    return reading


@pytest.mark.parametrize("snapshot", [False, True])
def test_the_parameters_stay_still_under_a_send(model_dir, snapshot, monkeypatch):
    """An optimizer step taken while a slow engine is still receiving version 1: without a
    snapshot it waits for the send (blocked time counted), with one it goes ahead; either way the
    engine ends with version 1's weights, not the stepped ones. With a snapshot the learner goes
    on stepping and publishing while the send is stuck: the versions in between are skipped and
    the engine then gets the newest. The engine may hold one chunk it has not taken
    (`receive_ahead_mb`), so the send waits for it."""
    board = WeightStore()
    learner = Learner(broadcast_sender(board, chunk_bytes=1024, ahead_chunks=1), snapshot=snapshot)
    gate = threading.Event()
    reading = gate_receivers(monkeypatch, gate)
    engine = HFEngine(model_dir)
    try:
        with EngineThreads(board, {"slow": engine}), opened_at_exit(gate):
            learner.step()
            want = {k: v.clone() for k, v in learner.named().items()}
            learner.publication.publish(learner.version)
            assert reading.wait(60)
            stepped = threading.Thread(target=learner.step)
            stepped.start()
            if snapshot:
                stepped.join(60)
                assert not stepped.is_alive(), "with a snapshot the optimizer step does not wait"
            gate.set()
            stepped.join(60)
            wait_live(board, 1)
            got = engine.model.state_dict()
            assert engine.version == 1 and learner.publication.wait_sent(1)["engines"] == 1
            assert all(torch.equal(got[k], want[k]) for k in want), "the engine got the weights of version 1"
            assert not torch.equal(learner.model.model.norm.weight, want["model.norm.weight"])
            assert (learner.guard.take_blocked_s() > 0) != snapshot
            if snapshot:
                gate.clear()
                reading.clear()
                learner.publication.publish(learner.version)  # v2: the engine holds it up again
                assert reading.wait(60)
                for _ in range(3):  # v3, v4, v5 while v2 is stuck
                    wait_for(lambda: learner.guard.readers == 0)  # the last version's copy is made
                    learner.step()
                    learner.publication.publish(learner.version)
                assert learner.guard.take_blocked_s() == 0, "the stuck send never held the learner up"
                gate.set()
                wait_for(lambda: engine.version == 5)
                assert_engine_has(engine, learner)
                learner.publication.wait_sent(5)  # the engine serves v5 a moment before its send is recorded
                sent = [s["version"] for s in learner.publication.recent]
                assert sent[0] == 1 and sent[1] == 2 and sent[-1] == 5 and len(sent) < 5, sent
    finally:
        gate.set()
        learner.close()


def test_a_slow_engine_down_the_chain_holds_up_neither_the_learner_nor_the_engines_before_it(model_dir,
                                                                                             monkeypatch):
    """A chain of two engines whose last one is stuck taking chunks: while the version fits in
    what an engine may hold ahead (`receive_ahead_mb`), the learner's send ends (the parameters are
    free again: no snapshot here) and the first engine serves the version; the stuck one then gets
    exactly the same weights."""
    board = WeightStore()
    learner = Learner(broadcast_sender(board, chunk_bytes=1024, ahead_chunks=10_000))
    gate = threading.Event()
    reading = gate_receivers(monkeypatch, gate, ranks={2})  # b-slow, last in the chain
    engines = {"a-fast": HFEngine(model_dir), "b-slow": HFEngine(model_dir)}
    try:
        with EngineThreads(board, engines) as threads, opened_at_exit(gate):
            learner.step()
            want = {k: v.clone() for k, v in learner.named().items()}
            learner.publication.publish(learner.version)
            assert reading.wait(60)
            wait_for(lambda: engines["a-fast"].version == 1 and learner.guard.readers == 0)
            assert not gate.is_set() and engines["b-slow"].version < 1, "the slow engine is still stuck"
            gate.set()
            wait_live(board, 1)
            wait_for(lambda: engines["b-slow"].version == 1)
            for engine in engines.values():
                got = engine.model.state_dict()
                assert all(torch.equal(got[k], want[k]) for k in want)
        assert not any(threads.errors.values()), threads.errors
    finally:
        gate.set()
        learner.close()


@contextlib.contextmanager
def opened_at_exit(gate: threading.Event):
    try:
        yield
    finally:
        gate.set()  # before the engine threads are joined


def wait_for(condition, timeout: float = 60.0):
    import time

    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.01)


# ---------------------------------------------------------------- pull channels


def test_object_store_channel_puts_one_shared_object_per_version(ray_cluster):
    """A reader maps the version's arrays read-only out of the shared object (no private copy),
    bfloat16 included."""
    import ray

    board = WeightStore()
    release_calls = []
    state = {"w": torch.randn(8, 4), "b": torch.randn(4)}
    ObjectStoreSender(board, torch.bfloat16).send(3, state, lambda: release_calls.append(1))
    payload = board.latest()
    assert payload["version"] == 3 and release_calls == [1]

    @ray.remote(num_cpus=0)
    def read(payload):
        from lm.weight_sync.payloads import from_shared_arrays

        obj = ray.get(payload["ref"][0])
        tensors = from_shared_arrays(obj)
        return ({k: a.flags.writeable for k, a in obj["arrays"].items()},
                {k: (str(t.dtype), t.float().tolist()) for k, t in tensors.items()})

    writeable, got = ray.get(read.remote(payload))
    assert writeable == {"w": False, "b": False}, "the reader's arrays are views of the shared object"
    for name, tensor in state.items():
        assert got[name] == ("torch.bfloat16", tensor.to(torch.bfloat16).float().tolist())
    assert torch.equal(resolve_weights(payload)["w"], state["w"].to(torch.bfloat16))


def test_folder_channel_keeps_every_version_a_reader_may_still_read(tmp_path, caplog):
    board = WeightStore()
    sender = FolderSender(board, str(tmp_path), claim_timeout_s=600.0)
    state = {"w": torch.zeros(3)}

    def on_disk():
        return sorted(int(p.name[1:]) for p in tmp_path.iterdir())

    sender.send(1, state, lambda: None)
    assert board.latest("slow-reader")["version"] == 1  # slow-reader is reading v1 ...
    sender.send(2, state, lambda: None)
    assert board.latest("quick-reader")["version"] == 2
    board.loaded("quick-reader", 2)
    sender.send(3, state, lambda: None)
    assert on_disk() == [1, 3], "v1 is still being read, v2 nobody reads, v3 is live"
    board.loaded("slow-reader", 1)
    sender.send(4, state, lambda: None)
    assert on_disk() == [4]
    # A reader that never says it is done pins a version only until its claim times out.
    board.latest("vanished")
    sender.claim_timeout_s = 0.0
    caplog.set_level(logging.WARNING, logger="lm.weight_sync")
    sender.send(5, state, lambda: None)
    assert on_disk() == [5] and "vanished held a version" in caplog.text
    assert board.latest()["version"] == 5 and torch.equal(resolve_weights(board.latest())["w"], state["w"])


def test_the_broadcast_settings_resolve_by_backend():
    """`auto`/None settings: gloo on CPU sends down a chain from a snapshot and lets an engine hold a
    whole version ahead (host memory); nccl on GPU uses its own broadcast, no snapshot, and four
    chunks ahead (device memory). Explicit settings win."""
    from learner.config import BroadcastSync

    assert BroadcastSync().resolved("cpu") == ("gloo", "chain", True, None)
    assert BroadcastSync(bucket_mb=16).resolved("cuda:0") == ("nccl", "star", False, 64 * 2**20)
    assert BroadcastSync(receive_ahead_mb=8, snapshot=False).resolved("cpu") == ("gloo", "chain", False, 8 * 2**20)
    with pytest.raises(ValueError, match="receive_ahead_mb"):
        BroadcastSync(receive_ahead_mb=0)


@pytest.mark.parametrize(("backend", "released_when_iterated"), [("gloo", True), ("nccl", False), ("ipc", False)])
def test_the_learner_tensors_stay_leased_until_vllms_device_transfers_return(backend, released_when_iterated):
    """gloo (etarl's) has sent every byte when its trainer's iteration of the source ends, so the
    learner's parameters are released then; vLLM's NCCL (packed copies on its own streams) and IPC
    (the engine reads through handles after the iteration) are not done until send_weights returns.
    The stand-in trainer below replaces vLLM's CUDA trainers, which cannot run on this CPU
    machine: it iterates the source as they do, then records whether the lease was still held."""
    events = []

    class IteratingTrainer:
        client = version = None

        def __init__(self, source):
            self.source = source

        def send_weights(self):
            list(self.source)
            events.append("iterated")  # an IPC engine reads the tensors only now

    sender = BroadcastSender(object(), backend, "chain", 1 << 20, 1.0, 1.0, "127.0.0.1", torch.float32)
    sender._trainer, sender._generation = IteratingTrainer(sender.source), 0
    tensors = {"w": torch.zeros(4)}
    sender._send({"members": {"engine-0": 1}, "generation": 0}, 1, tensors, lambda: events.append("released"),
                  Layout.of(tensors.items(), torch.float32))
    assert events == (["released", "iterated"] if released_when_iterated else ["iterated"])


def test_the_boards_process_imports_no_torch():
    """The board (`WeightStore`) is a Ray actor of its own in every run: its process imports
    `lm.weight_sync.board` and, through the package, nothing of torch (3-5 s of CPU a run)."""
    import subprocess
    import sys

    import lm.weight_sync as weight_sync

    probe = "import sys, lm.weight_sync.board; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.strip() == "False"
    assert all(getattr(weight_sync, name) for name in weight_sync.__all__)
    with pytest.raises(AttributeError, match="no attribute 'Nothing'"):
        weight_sync.Nothing  # noqa: B018
