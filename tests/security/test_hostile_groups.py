"""Fuzzing pushes with hypothesis: valid groups mutated field by field and frame by frame
(values of the wrong type, NaN and huge numbers, missing and unknown keys, truncated, extended,
dropped and duplicated frames, flipped bytes in the packed group). The codec either returns a
valid group or raises a `BufferError` naming what is wrong, never anything else; the real service
answers every such push with an error reply (never `internal`), counts every one, and keeps
serving. tests/buffer/test_hostile_input.py fuzzes the request envelope; tests/buffer/test_codec.py
has the hand-picked bad samples (NaN and positive log-probs, mismatched lengths, versions from the
future)."""
from __future__ import annotations

import math
import sys
from pathlib import Path

import msgpack
import pytest
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "buffer"))  # the buffer tests' helpers
from buffer_helpers import make_group  # noqa: E402

from buffer.client import BufferClient  # noqa: E402
from buffer.codec import PROTOCOL_VERSION, decode_group, encode_group, pack_frames, unpack_frames  # noqa: E402
from services.chaos import BufferService  # noqa: E402
from buffer.config import SampleLimits  # noqa: E402
from buffer.errors import BufferError  # noqa: E402

LIMITS = SampleLimits(max_group_size=8, max_prompt_tokens=64, max_response_tokens=64, max_message_bytes=1 << 20)
GROUP_KEYS = ["v", "group_id", "prompt_index", "samples"]
SAMPLE_KEYS = ["sample_id", "weight_version", "reward", "worker_id", "created_at", "finish_reason", "metadata",
               "n_prompt", "n_response", "has_token_rewards"]

# Integers within msgpack's range (-2**63 .. 2**64 - 1): a sender cannot pack others, so the test's
# own packb would fail on them (one run in a few hundred drew one inside a dict)
MSGPACK_INTS = st.integers(-2**63, 2**64 - 1)
weird = st.one_of(
    st.none(), st.booleans(), MSGPACK_INTS, st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from([math.nan, math.inf, -1, 0, 2**31, 10**12]), st.text(max_size=8), st.binary(max_size=8),
    st.lists(st.integers(-3, 3), max_size=3), st.dictionaries(st.text(max_size=3), MSGPACK_INTS, max_size=2),
)


def mutate(data, frames: list[bytes]) -> list[bytes]:
    """One random mutation of a valid group's frames."""
    kind = data.draw(st.sampled_from(["set", "delete", "add", "truncate", "extend", "replace", "drop", "repeat"]))
    if kind in ("set", "delete", "add"):
        header = msgpack.unpackb(frames[0])
        target = header
        keys = GROUP_KEYS
        if data.draw(st.booleans()):
            target = header["samples"][data.draw(st.integers(0, len(header["samples"]) - 1))]
            keys = SAMPLE_KEYS
        key = data.draw(st.sampled_from(keys)) if kind != "add" else data.draw(st.text(min_size=1, max_size=6))
        if kind == "delete":
            target.pop(key, None)
        else:
            target[key] = data.draw(weird)
        return [msgpack.packb(header), *frames[1:]]
    i = data.draw(st.integers(0, len(frames) - 1))
    frame = frames[i]
    if kind == "truncate":
        frame = frame[: data.draw(st.integers(0, max(len(frame) - 1, 0)))]
    elif kind == "extend":
        frame = frame + data.draw(st.binary(min_size=1, max_size=16))
    elif kind == "replace":
        frame = data.draw(st.binary(max_size=64))
    elif kind == "drop":
        return frames[:i] + frames[i + 1:]
    else:
        return frames[: i + 1] + [frame] + frames[i + 1:]
    return frames[:i] + [frame] + frames[i + 1:]


def valid_frames(data) -> list[bytes]:
    group = make_group(ticket=data.draw(st.integers(0, 5)), version=data.draw(st.integers(0, 2)),
                       n=data.draw(st.integers(1, 3)), tokens=data.draw(st.integers(1, 5)))
    return [bytes(memoryview(f)) for f in encode_group(group)]


@settings(max_examples=400, deadline=None)
@given(data=st.data())
def test_the_codec_refuses_mutated_groups_with_a_buffer_error(data):
    frames = mutate(data, valid_frames(data))
    try:
        group = decode_group(frames, LIMITS, max_version=2)
    except BufferError as exc:
        assert exc.reason and str(exc)
        return
    decode_group([bytes(memoryview(f)) for f in encode_group(group)], LIMITS, max_version=2)  # harmless: valid


@settings(max_examples=200, deadline=None)
@given(data=st.data())
def test_flipped_bytes_in_a_packed_group_are_a_buffer_error_or_harmless(data):
    packed = bytearray(pack_frames(valid_frames(data)))
    for _ in range(data.draw(st.integers(1, 4))):
        packed[data.draw(st.integers(0, len(packed) - 1))] = data.draw(st.integers(0, 255))
    try:
        decode_group(unpack_frames(bytes(packed)), LIMITS, max_version=2)
    except BufferError as exc:
        assert exc.reason


@pytest.fixture(scope="module")
def service(tmp_path_factory):
    proc = BufferService({"limits": LIMITS.model_dump(), "gate": {"eta": None}},
                         tmp_path_factory.mktemp("fuzz")).start()
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.linger = 0
    sock.connect(proc.endpoint)
    yield proc, sock, {"errors": 0, "accepted": 0}
    sock.close()
    ctx.term()
    proc.stop()


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_the_service_answers_every_mutated_push(service, data):
    proc, sock, tally = service
    with BufferClient(proc.endpoint) as client:
        permit = client.acquire_permit("fuzz", timeout=5)
    accepted = False
    try:  # hypothesis may end an example at any draw: the permit must come back whatever happens
        frames = valid_frames(data)
        header = msgpack.unpackb(frames[0])
        header["prompt_index"] = permit.ticket  # valid apart from the mutation
        frames = mutate(data, [msgpack.packb(header), *frames[1:]])
        request = msgpack.packb({"v": PROTOCOL_VERSION, "id": "x", "op": "push_groups",
                                 "args": {"permit_ids": [permit.permit_id]}})
        sock.send_multipart([request, pack_frames(frames)])
        assert sock.poll(10_000), "no reply"
        reply = msgpack.unpackb(sock.recv_multipart()[0])
        accepted = reply["ok"]
        if accepted:
            tally["accepted"] += 1
        else:
            assert reply["error"]["reason"] != "internal", reply
            assert reply["error"]["message"]
            tally["errors"] += 1
    finally:
        if not accepted:
            with BufferClient(proc.endpoint) as client:
                client.release_permit(permit.permit_id)


def test_every_refused_push_was_counted_and_the_service_still_serves(service):
    proc, _, tally = service
    assert tally["errors"] > 50, tally  # the fuzzer really produced bad pushes
    with BufferClient(proc.endpoint) as client:
        stats = client.stats()
        counted = sum(stats["bad_messages"].values()) + sum(stats["request_errors"].values())
        assert counted == tally["errors"]
        assert "internal" not in stats["bad_messages"]
        assert stats["pushed_groups"] == tally["accepted"] and stats["running"] == 0
        permit = client.acquire_permit("w", timeout=1)
        assert client.push_group(make_group(permit.ticket), permit.permit_id)["duplicate"] is False
    assert proc.proc.poll() is None
