"""Weights are checked by content before an engine swaps (lm/weight_sync/integrity.py): on every
channel reachable on CPU (object store, folder, broadcast over gloo), a version whose bytes were
damaged after the sender hashed them, or that holds a NaN, is refused by the receiving engine,
which keeps its old weights; the refusal is counted and names the version, the channel and the
tensor; a good version after it loads. And the rollout worker carries on with the version it has."""
from __future__ import annotations

import json
import logging
import math
import time

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from test_weight_sync import (  # noqa: F401  (model_dir is a fixture)
    EngineThreads,
    Learner,
    assert_engine_has,
    broadcast_sender,
    model_dir,
    qwen2,
    wait_for,
    wait_live,
)

from lm.weight_sync import FolderSender, ObjectStoreSender, WeightStore, WeightSubscription, integrity, senders
from lm.weight_sync.integrity import WeightsRejected
from lm.weight_sync.layout import Layout, fill_chunk
from lm.weight_sync.payloads import WEIGHTS_FILE, load_weights_folder
from rollout_workers.engines.hf_engine import HFEngine

pytestmark = pytest.mark.timeout(120)

DAMAGED = "model.layers.1.mlp.down_proj.weight"


def snapshot(engine: HFEngine) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in engine.model.state_dict().items()}


def assert_unchanged(engine: HFEngine, before: dict[str, torch.Tensor], version: int = 0) -> None:
    assert engine.version == version
    now = engine.model.state_dict()
    assert all(torch.equal(now[k], before[k]) for k in before), "the engine's weights changed"


def weights(seed: int, nan_in: str | None = None) -> dict[str, torch.Tensor]:
    state = qwen2(seed=seed).state_dict()
    if nan_in is not None:
        state[nan_in] = state[nan_in].clone()
        state[nan_in].view(-1)[3] = math.nan
    return state


class FolderEngine(HFEngine):
    """An engine that reads a folder itself (as a multiprocess vLLM core does)."""

    def load_weights_folder(self, version, path):
        self.load_weights(version, load_weights_folder(path)[1])


def flip_in_file(folder: str, name: str) -> None:
    """Flip one bit of tensor `name`'s bytes in the folder's safetensors file (on-disk damage)."""
    path = f"{folder}/{WEIGHTS_FILE}"
    with open(path, "r+b") as f:
        header_len = int.from_bytes(f.read(8), "little")
        start = json.loads(f.read(header_len))[name]["data_offsets"][0]
        f.seek(8 + header_len + start + 5)
        byte = f.read(1)[0]
        f.seek(8 + header_len + start + 5)
        f.write(bytes([byte ^ 0x10]))


@pytest.mark.parametrize("channel", ["object_store", "folder", "folder_read_by_engine"])
def test_a_pull_version_damaged_in_store_or_holding_a_nan_is_refused(channel, model_dir, tmp_path, monkeypatch,
                                                                     caplog, request):
    if channel == "object_store":
        request.getfixturevalue("ray_cluster")
    board = WeightStore()
    sender = ObjectStoreSender(board) if channel == "object_store" else FolderSender(board, str(tmp_path))
    engine = FolderEngine(model_dir) if channel == "folder_read_by_engine" else HFEngine(model_dir)
    subscription = WeightSubscription(board, "worker-0", engine.version)
    before = snapshot(engine)
    caplog.set_level(logging.WARNING, logger="lm.weight_sync")

    # v1: one bit of a tensor flips after the sender hashed it (in the stored object, on disk).
    if channel == "object_store":
        real = senders.to_shared_arrays

        def damaged(state):
            obj = real(state)
            array = obj["arrays"][DAMAGED].copy()
            array.reshape(-1).view("uint8")[5] ^= 0x10
            return {**obj, "arrays": {**obj["arrays"], DAMAGED: array}}

        monkeypatch.setattr(senders, "to_shared_arrays", damaged)
        sender.send(1, weights(seed=1), lambda: None)
        monkeypatch.setattr(senders, "to_shared_arrays", real)
    else:
        sender.send(1, weights(seed=1), lambda: None)
        flip_in_file(board.latest()["path"], DAMAGED)
    kind = "folder" if channel.startswith("folder") else "object_store"
    with pytest.raises(WeightsRejected, match=rf"weights v1 \({kind}\) refused: tensor '{DAMAGED}' does not match"):
        subscription.receive(engine, wait_s=1.0)
    assert_unchanged(engine, before)
    assert subscription.rejected_total == 1 and f"v1 ({kind}) refused: tensor '{DAMAGED}'" in caplog.text
    assert subscription.receive(engine, wait_s=1.0) is None, "a stored version refused once is not read again"
    assert subscription.rejected_total == 1 and subscription.refused_newest().version == 1

    # v2: the learner's weights hold a NaN (hashed as they are: the digest matches).
    sender.send(2, weights(seed=2, nan_in="model.norm.weight"), lambda: None)
    with pytest.raises(WeightsRejected, match=r"weights v2 .* tensor 'model.norm.weight' holds a NaN or an inf"):
        subscription.receive(engine, wait_s=1.0)
    assert_unchanged(engine, before)
    assert subscription.rejected_total == 2

    # v3: good, and loaded.
    good = weights(seed=3)
    sender.send(3, good, lambda: None)
    assert subscription.receive(engine, wait_s=1.0) == 3 and engine.version == 3
    got = engine.model.state_dict()
    assert all(torch.equal(got[k], good[k]) for k in good)
    assert subscription.rejected_total == 2 and subscription.refused_newest() is None


def flip_received_chunk(monkeypatch, chunk: int, armed) -> list[int]:
    """Damage chunk `chunk` of a broadcast on its way into rank 1 while `armed()` (rank 1 then
    forwards the damaged bytes down the chain). Returns the ranks that got damaged bytes."""
    from lm.weight_sync import gloo_transfer

    hits = []

    class DamagingStream(gloo_transfer.ReceiveStream):
        def _post(self, k):
            buf, work = super()._post(k)
            if k != chunk or self.rank != 1 or not armed():
                return buf, work

            class Damaged:
                def wait(self_):
                    work.wait()
                    buf[5] ^= 0x10
                    hits.append(k)

            return buf, Damaged()

    monkeypatch.setattr(gloo_transfer, "ReceiveStream", DamagingStream)
    return hits


def test_a_broadcast_chunk_damaged_on_the_way_is_refused_then_resent(model_dir, monkeypatch, caplog):
    """Rank 1 receives chunk 3 with a flipped bit and forwards it down the chain: both engines
    refuse the version (naming the first tensor of that chunk) and keep their weights while the
    damage lasts; they ask again (damage in transit may not recur) and then load it."""
    board = WeightStore()
    learner = Learner(broadcast_sender(board, chunk_bytes=4096))
    engines = {"worker-0": HFEngine(model_dir), "worker-1": HFEngine(model_dir)}
    before = {name: snapshot(e) for name, e in engines.items()}
    damage = [True]
    flip_received_chunk(monkeypatch, 3, lambda: damage[0])
    layout = Layout.of(learner.named().items())
    span = layout.chunks(4096)[3]
    first = next(m.name for m in layout.stored if m.offset < span[1] and m.end > span[0])
    caplog.set_level(logging.WARNING, logger="lm.weight_sync")
    try:
        with EngineThreads(board, engines) as threads:
            learner.step()
            learner.publication.publish(learner.version)
            wait_for(lambda: all(threads.subscriptions[n].rejected_total >= 2 for n in engines))  # refused, resent
            for name, engine in engines.items():
                assert_unchanged(engine, before[name])
                assert all(f"weights v1 (broadcast) refused: tensor '{first}' (or another in chunk 3" in e
                           for e in threads.errors[name]), threads.errors[name]
            assert f"weights v1: worker-1 failed to load it: weights v1 (broadcast) refused: tensor '{first}'" \
                   in caplog.text
            damage[0] = False
            wait_for(lambda: all(e.version == 1 for e in engines.values()))
            for engine in engines.values():
                assert_engine_has(engine, learner)
            assert not any(s.refused for s in threads.subscriptions.values()), "damage in transit: asked again"
    finally:
        learner.close()


def test_a_broadcast_version_holding_a_nan_is_refused_for_good_and_the_next_loads(model_dir):
    board = WeightStore()
    learner = Learner(broadcast_sender(board, topology="star", chunk_bytes=4096))
    engines = {"worker-0": HFEngine(model_dir), "worker-1": HFEngine(model_dir)}
    before = {name: snapshot(e) for name, e in engines.items()}
    try:
        with EngineThreads(board, engines) as threads:
            learner.step()
            with torch.no_grad():
                learner.model.model.layers[0].self_attn.q_proj.weight[2, 2] = -math.inf
            learner.publish_and_wait(board)
            # the subscription marks the refusal before its engine thread records the error: wait for both
            wait_for(lambda: all(s.refused for s in threads.subscriptions.values())
                     and all(threads.errors[name] for name in engines))
            for name, engine in engines.items():
                assert_unchanged(engine, before[name])
                assert threads.errors[name] == [
                    "weights v1 (broadcast) refused: tensor 'model.layers.0.self_attn.q_proj.weight' holds a NaN or "
                    "an inf; the engine keeps its weights"]
            assert all(m["have"] == 0 for m in board.members().values()), "the board knows they still hold v0"
            with torch.no_grad():
                learner.model.model.layers[0].self_attn.q_proj.weight[2, 2] = 0.5
            learner.step()
            learner.publish_and_wait(board)
            wait_for(lambda: all(e.version == 2 for e in engines.values()))
            for engine in engines.values():
                assert_engine_has(engine, learner)
            assert all(s.rejected_total == 1 for s in threads.subscriptions.values()), "v1 was never asked for again"
    finally:
        learner.close()


def test_the_worker_carries_on_with_its_version_after_a_refusal(model_dir, tmp_path):
    """A refused version neither restarts the worker nor stalls it: it generates with the version it
    has (so its samples are tagged with it), is not interrupted for the refused version, counts
    the refusal, and loads the next good version."""
    from rollout_workers.config import RolloutConfig
    from rollout_workers.worker import RolloutWorker

    board = WeightStore()
    sender = FolderSender(board, str(tmp_path))
    engine = HFEngine(model_dir)
    worker = RolloutWorker(RolloutConfig(model_path=str(model_dir), weight_poll_s=0.0, weight_wait_s=120.0,
                                         interrupt_on_update=True, error_backoff_s=0.0),
                           "worker-0", None, board, engine=engine)
    sender.send(1, weights(seed=1, nan_in="lm_head.weight"), lambda: None)
    started = time.monotonic()
    worker._wait_for_weights(1)  # what a permit of learner version 1 asks for
    assert time.monotonic() - started < 60, "it did not wait out weight_wait_s for a refused version"
    assert engine.version == 0 and not worker._new_weights_waiting(), "no interrupt for a refused version"
    stats = worker.stats()
    assert stats["weight_loads_rejected_total"] == 1 and stats["weight_load_failures_total"] == 0
    assert "weights v1 (folder) refused: tensor " in stats["last_error"]
    sender.send(2, weights(seed=2), lambda: None)
    assert worker._new_weights_waiting() and worker.load_weights_or_restart() and engine.version == 2
    assert worker.stats()["weight_loads_rejected_total"] == 1 and worker.stats()["loaded_version"] == 2


# ---------------------------------------------------------------- the checks themselves


@settings(max_examples=40, deadline=None, derandomize=True)
@given(st.data())
def test_any_flipped_bit_of_a_chunked_stream_names_its_chunk(data):
    """Tensors of several dtypes cut into chunks: flipping any one bit of the stream fails exactly
    that chunk's digest, and the refusal names a tensor lying in it."""
    sizes = data.draw(st.lists(st.integers(0, 300), min_size=1, max_size=6))
    dtypes = data.draw(st.lists(st.sampled_from([torch.float32, torch.bfloat16, torch.int64, torch.float16]),
                                min_size=len(sizes), max_size=len(sizes)))
    gen = torch.Generator().manual_seed(len(sizes))
    tensors = {f"t{i}": (torch.randn(n, generator=gen) * 50).to(d) for i, (n, d) in enumerate(zip(sizes, dtypes))}
    layout = Layout.of(tensors.items())
    spans = layout.chunks(data.draw(st.sampled_from([64, 128, 1024])))
    if not spans:
        return
    chunks = []
    for span in spans:
        buf = torch.zeros(span[1] - span[0], dtype=torch.uint8)
        fill_chunk(buf, layout, span, tensors)
        chunks.append(buf)
    sent = [integrity.digest(c) for c in chunks]
    integrity.check_chunks(7, layout, spans, [integrity.digest(c) for c in chunks], sent)
    k = data.draw(st.integers(0, len(spans) - 1))
    pos = data.draw(st.integers(0, chunks[k].numel() - 1))
    chunks[k][pos] ^= 1 << data.draw(st.integers(0, 7))
    got = [integrity.digest(c) for c in chunks]
    assert [g != s for g, s in zip(got, sent)] == [i == k for i in range(len(spans))]
    with pytest.raises(WeightsRejected, match=rf"v7 \(broadcast\) refused: tensor '.*' \(or another in chunk {k},") as err:
        integrity.check_chunks(7, layout, spans, got, sent)
    named = next((m for m in layout.stored if m.name == err.value.tensor), None)
    if named is not None:
        assert named.offset < spans[k][1] and named.end > spans[k][0]
    else:
        assert err.value.tensor == "(padding)"
    assert err.value.retry


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
def test_every_nan_and_inf_is_found_and_integers_are_not_checked(dtype):
    clean = {"a": torch.randn(33).to(dtype), "ids": torch.arange(5), "b": torch.randn(4, 4).to(dtype),
             "empty": torch.empty(0, dtype=dtype)}
    assert integrity.first_nonfinite(clean.items()) is None
    for bad in (math.nan, math.inf, -math.inf):
        for name in ("a", "b"):
            state = {k: v.clone() for k, v in clean.items()}
            state[name].view(-1)[-1] = bad
            assert integrity.first_nonfinite(state.items()) == name
    big = torch.full((8,), torch.finfo(dtype).max, dtype=dtype)  # finite, though its sum is not
    assert integrity.first_nonfinite([("big", big)]) is None
