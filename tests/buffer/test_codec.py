"""The sample record and its wire codec: round trips, zero copy, and validation that names the
field and the sample."""
import msgpack
import numpy as np
import pytest
from buffer_helpers import make_group

from buffer.codec import (GROUP_FRAMES, PROTOCOL_VERSION, check_group, decode_group, encode_group, pack_frames,
                          unpack_frames, validate_group)
from buffer.config import SampleLimits
from buffer.errors import ProtocolError, SampleError
from buffer.sample import Group, Sample


def wire(group):
    return [bytes(memoryview(f)) for f in encode_group(group)]


def test_round_trip_keeps_every_field():
    g = make_group(ticket=7, version=3, n=3, tokens=5)
    s = g.samples[1]
    s.token_rewards = np.array([0.0, 0.5, -1.0, 0.0, 2.0], np.float32)
    s.token_versions = np.array([3, 3, 4, 4, 5], np.int32)
    s.loss_mask = np.array([1, 1, 0, 0, 1], np.uint8)
    s.metadata = {"task": "gsm8k", "turns": 2, "score": 0.5, "ok": True}
    out = decode_group(wire(g), max_version=5)
    assert out.group_id == g.group_id and out.prompt_index == 7 and out.weight_version == 3
    for a, b in zip(g.samples, out.samples):
        for name in ("sample_id", "group_id", "reward", "weight_version", "worker_id", "created_at",
                     "finish_reason", "metadata"):
            assert getattr(a, name) == getattr(b, name), name
        for name in ("prompt_ids", "response_ids", "rollout_log_probs", "loss_mask", "token_versions"):
            np.testing.assert_array_equal(getattr(a, name), getattr(b, name))
            assert getattr(b, name).dtype == getattr(a, name).dtype
    np.testing.assert_array_equal(out.samples[1].token_rewards, s.token_rewards)
    assert out.samples[0].token_rewards is None


def test_frames_are_field_major_and_decoding_does_not_copy():
    g = make_group(ticket=0, n=3, tokens=1000)
    frames = encode_group(g)
    assert len(frames) == GROUP_FRAMES == 7  # whatever the group size
    np.testing.assert_array_equal(frames[2], np.concatenate([s.response_ids for s in g.samples]))
    received = wire(g)
    out = decode_group(received)
    for k, s in enumerate(out.samples):
        view = s.response_ids
        assert np.shares_memory(view, np.frombuffer(received[2], np.uint8)) and not view.flags.writeable
        np.testing.assert_array_equal(view, g.samples[k].response_ids)


def test_check_group_validates_without_building_samples():
    g = make_group(ticket=4, version=2, n=3)
    view = check_group(wire(g), max_version=2)
    assert (view.group_id, view.prompt_index) == (g.group_id, 4)
    assert view.sample_ids == g.sample_ids and view.weight_versions == [2, 2, 2]
    with pytest.raises(SampleError, match="ahead of the learner"):
        check_group(wire(g), max_version=1)


def test_validate_group_checks_an_in_memory_group():
    g = make_group(ticket=0, version=1)
    validate_group(g, max_version=1)
    g.samples[1].rollout_log_probs = np.array([-1.0, np.nan, -1.0, -1.0], np.float32)
    with pytest.raises(SampleError) as info:
        validate_group(g)
    assert (info.value.field, info.value.sample_id) == ("rollout_log_probs", g.samples[1].sample_id)
    g = make_group(ticket=0)
    g.samples[0].group_id = "elsewhere"
    with pytest.raises(SampleError, match="group_id"):
        validate_group(g)


def test_header_is_msgpack_with_protocol_version():
    header = msgpack.unpackb(wire(make_group(0))[0])
    assert header["v"] == PROTOCOL_VERSION and header["prompt_index"] == 0


def corrupt_header(frames, **changes):
    header = msgpack.unpackb(frames[0])
    sample_changes = changes.pop("sample", {})
    header.update(changes)
    header["samples"][0].update(sample_changes)
    return [msgpack.packb(header), *frames[1:]]


@pytest.mark.parametrize("mutate, field", [
    (lambda s: s.rollout_log_probs.__setitem__(1, np.nan), "rollout_log_probs"),
    (lambda s: s.rollout_log_probs.__setitem__(0, 0.25), "rollout_log_probs"),
    (lambda s: s.loss_mask.__setitem__(0, 2), "loss_mask"),
    (lambda s: setattr(s, "weight_version", 9), "weight_version"),
    (lambda s: s.token_versions.__setitem__(2, 9), "token_versions"),
    (lambda s: s.token_versions.__setitem__(2, 0), "token_versions"),
    (lambda s: setattr(s, "reward", float("inf")), "reward"),
    (lambda s: setattr(s, "token_rewards", np.array([np.nan] * 4, np.float32)), "token_rewards"),
    (lambda s: setattr(s, "metadata", {"x": [1, 2]}), "metadata"),
    (lambda s: setattr(s, "response_ids", np.array([1, -5, 2, 3], np.int32)), "response_ids"),
])
def test_invalid_sample_names_field_and_sample(mutate, field):
    g = make_group(ticket=0, version=1)
    s = g.samples[0]
    s.rollout_log_probs = s.rollout_log_probs.copy()
    s.loss_mask, s.token_versions = s.loss_mask.copy(), s.token_versions.copy()
    mutate(s)
    with pytest.raises(SampleError) as info:
        decode_group(wire(g), max_version=3)
    assert info.value.field == field and info.value.sample_id == s.sample_id
    assert field in str(info.value) and s.sample_id in str(info.value)


def test_length_mismatch_is_caught_on_both_sides():
    g = make_group(ticket=0)
    g.samples[0].loss_mask = np.ones(3, np.uint8)  # response has 4 tokens
    with pytest.raises(SampleError, match="loss_mask"):
        decode_group(wire(g))
    frames = wire(make_group(ticket=0))
    frames[3] = frames[3][:-4]  # one log-prob short (2 samples of 4 tokens)
    with pytest.raises(SampleError, match="rollout_log_probs.*frame has 28 bytes, expected 32"):
        decode_group(frames)


def test_size_limits():
    limits = SampleLimits(max_response_tokens=3, max_group_size=2)
    with pytest.raises(SampleError, match="n_response"):
        decode_group(wire(make_group(ticket=0, tokens=4)), limits)
    with pytest.raises(SampleError, match="max_group_size"):
        decode_group(wire(make_group(ticket=0, n=3, tokens=2)), limits)


@pytest.mark.parametrize("frames_of, reason", [
    (lambda f: [b"\xc1garbage", *f[1:]], "bad_msgpack"),
    (lambda f: corrupt_header(f, v=PROTOCOL_VERSION + 1), "bad_protocol_version"),
    (lambda f: corrupt_header(f, extra=1), "bad_group"),
    (lambda f: f[:-1], "bad_frame_count"),
    (lambda f: [msgpack.packb([1, 2, 3])], "bad_group"),
    (lambda f: [], "bad_group"),
])
def test_malformed_group_is_a_protocol_error(frames_of, reason):
    with pytest.raises(ProtocolError) as info:
        decode_group(frames_of(wire(make_group(ticket=0))))
    assert info.value.reason == reason


def test_wrongly_typed_header_fields():
    frames = wire(make_group(ticket=0))
    with pytest.raises(SampleError, match="weight_version"):
        decode_group(corrupt_header(frames, sample={"weight_version": "3"}))
    with pytest.raises(SampleError, match="prompt_index"):
        decode_group(corrupt_header(frames, prompt_index=-1))
    with pytest.raises(SampleError, match="reward"):
        decode_group(corrupt_header(frames, sample={"reward": "high"}))


def test_sample_construction_converts_losslessly_and_refuses_lossy():
    s = Sample(sample_id="s", group_id="g", prompt_ids=[1, 2], response_ids=np.array([3], np.int64),
               rollout_log_probs=[-0.5], loss_mask=[1], reward=1, weight_version=2)
    assert s.response_ids.dtype == np.int32 and s.token_versions.tolist() == [2]
    with pytest.raises(SampleError, match="response_ids"):
        Sample(sample_id="s", group_id="g", prompt_ids=[1], response_ids=[2**40], rollout_log_probs=[-0.5],
               loss_mask=[1], reward=1, weight_version=0)
    with pytest.raises(SampleError, match="prompt_ids"):
        Sample(sample_id="s", group_id="g", prompt_ids=[[1]], response_ids=[1], rollout_log_probs=[-0.5],
               loss_mask=[1], reward=1, weight_version=0)


def test_group_weight_version_is_the_oldest():
    g = make_group(ticket=0, version=4, n=3)
    g.samples[1].weight_version = 2
    assert Group(g.group_id, g.samples, 0).weight_version == 2


def test_packed_group_round_trip_is_aligned_and_zero_copy():
    frames = wire(make_group(ticket=0, n=3, tokens=7))
    packed = pack_frames(frames)
    views = unpack_frames(packed)
    assert [bytes(v) for v in views] == frames
    base = np.frombuffer(packed, np.uint8)
    for v in views[1:-1]:  # the last frame, token_rewards, is empty here
        arr = np.frombuffer(v, np.uint8)
        assert np.shares_memory(arr, base) and arr.ctypes.data % 8 == 0
    assert decode_group(views).group_id == decode_group(frames).group_id


@pytest.mark.parametrize("packed", [b"", b"\x00\x00\x00\x00", b"\x05\x00\x00\x00", b"\x01\x00\x00\x00\xff\x00\x00\x00"])
def test_broken_packed_group_is_a_protocol_error(packed):
    with pytest.raises(ProtocolError) as info:
        unpack_frames(packed)
    assert info.value.reason == "bad_packed_group"


# ---- MoE routing (Sample.routed_experts) ------------------------------------------------------

def routed_group(experts: int = 8, layers: int = 3, k: int = 2, tokens: int = 5):
    g = make_group(ticket=1, n=3, tokens=tokens)
    rng = np.random.default_rng(0)
    g.samples = [Sample(**{**s.__dict__, "routed_experts": rng.integers(0, experts, (tokens, layers, k))})
                 for s in g.samples]  # int64 in: stored compact
    return g


@pytest.mark.parametrize("experts, dtype", [(8, np.uint8), (300, np.int16)])
def test_routing_round_trips_compact_in_a_frame_of_its_own(experts, dtype):
    g = routed_group(experts)
    assert all(s.routed_experts.dtype == dtype for s in g.samples)
    frames = encode_group(g)
    assert len(frames) == GROUP_FRAMES + 1 and msgpack.unpackb(frames[0])["routing"] == {
        "layers": 3, "k": 2, "dtype": np.dtype(dtype).name}
    received = wire(g)
    out = decode_group(received, SampleLimits(num_experts=experts))
    for a, b in zip(g.samples, out.samples):
        np.testing.assert_array_equal(a.routed_experts, b.routed_experts)
        assert b.routed_experts.shape == (5, 3, 2) and np.shares_memory(
            b.routed_experts, np.frombuffer(received[-1], np.uint8))
    dense = make_group(ticket=1, n=3)
    assert len(encode_group(dense)) == GROUP_FRAMES and decode_group(wire(dense)).samples[0].routed_experts is None


def test_bad_routing_names_the_sample():
    g = routed_group()
    bad = g.samples[1]
    with pytest.raises(SampleError, match=rf"{bad.sample_id}', field 'routed_experts': expert id 8 at token 2, layer"):
        bad.routed_experts[2, 1, 0] = 8
        decode_group(wire(g), SampleLimits(num_experts=8))
    with pytest.raises(SampleError, match=rf"{bad.sample_id}', field 'routed_experts': has 4 rows, response_ids has 5"):
        bad.routed_experts = bad.routed_experts[:4]
        encode_group(g)
    with pytest.raises(SampleError, match=rf"{bad.sample_id}', field 'routed_experts': has \[layers, k\] \[3, 1\]"):
        bad.routed_experts = np.zeros((5, 3, 1), np.uint8)
        encode_group(g)
    with pytest.raises(SampleError, match=rf"{bad.sample_id}', field 'routed_experts': is missing while"):
        bad.routed_experts = None
        encode_group(g)
    with pytest.raises(SampleError, match=r"'x', field 'routed_experts': expected a \[tokens, layers, k\]"):
        Sample(sample_id="x", group_id="g", prompt_ids=[1], response_ids=[2], rollout_log_probs=[-1.0],
               loss_mask=[1], reward=0.0, weight_version=0, routed_experts=[[1, 2]])
    frames = wire(routed_group())
    with pytest.raises(SampleError, match="routed_experts.*frame has 29 bytes, expected 90"):
        check_group([*frames[:-1], frames[-1][:29]])
    with pytest.raises(ProtocolError, match="expected 8 frames, got 7"):
        check_group(frames[:-1])
