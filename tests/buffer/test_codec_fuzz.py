"""The wire codec against memory exhaustion and garbage (issue 30). A header is bounded in bytes
and by msgpack's per-item limits before any object is built: the issue's 2 MB header of empty
maps, which decoded to 144 MB, is refused at its size; one within the size whose items claim
more than a header needs is refused by msgpack's bounds; forged frame counts (a packed group's,
a message's) are refused before a table is built. Hypothesis then feeds large and nested msgpack
values, truncations and bit flips of valid big groups and request headers: every input is valid
or a `BufferError` with a reason, never another exception. tests/security/test_hostile_groups.py
mutates small groups field by field; this file covers size, depth and the envelope."""
from __future__ import annotations

import struct
import tracemalloc

import msgpack
import pytest
import zmq
from buffer_helpers import make_group
from hypothesis import HealthCheck, given, seed, settings
from hypothesis import strategies as st

from buffer.codec import (PROTOCOL_VERSION, check_frame_count, check_group, decode_group, decode_message_header,
                          encode_group, pack_frames, unpack_frames)
from buffer.config import BufferConfig, SampleLimits
from buffer.errors import BufferError, ProtocolError
from buffer.server import BufferServer


def peak_mib(fn) -> tuple[float, BaseException | None]:
    """Peak memory (MiB, Python allocations) while `fn` runs, and what it raised."""
    tracemalloc.start()
    try:
        fn()
        error = None
    except BaseException as exc:  # noqa: BLE001 (reported to the caller)
        error = exc
    finally:
        peak = tracemalloc.get_traced_memory()[1] / 2**20
        tracemalloc.stop()
    return peak, error


def test_the_issues_2_mb_header_is_refused_before_it_is_decoded():
    """2 MB of empty maps decoded to 144 MB before (72x); now refused at its size, a few MiB peak."""
    n = 2 * 10**6
    header = b"\xdd" + struct.pack(">I", n) + b"\x80" * n  # array32 of n empty maps
    frames = [header, *(b"" for _ in range(6))]
    peak, error = peak_mib(lambda: check_group(frames))
    assert isinstance(error, ProtocolError) and error.reason == "header_too_large", error
    assert "max_header_bytes=1048576" in str(error)
    assert peak < 8, f"{peak:.0f} MiB allocated to refuse a 2 MB header"
    request = msgpack.packb({"v": PROTOCOL_VERSION, "id": "x", "op": "stats", "args": {}})[:-1] + b"\x80"
    assert decode_message_header(request, ("id",)) is not None  # a small header still decodes


def test_an_item_that_claims_more_than_a_header_needs_is_refused_by_msgpacks_bounds():
    big_array = b"\xdd" + struct.pack(">I", 500_000) + b"\x80" * 500_000  # within the byte limit
    peak, error = peak_mib(lambda: check_group([big_array, *(b"" for _ in range(6))]))
    assert isinstance(error, ProtocolError) and error.reason == "msgpack_limit", error
    assert peak < 8, f"{peak:.0f} MiB"
    cases = {"string": msgpack.packb("x" * 20_000), "binary": msgpack.packb(b"x" * 20_000),
             "map": msgpack.packb({str(i): 0 for i in range(2000)}), "ext": msgpack.packb(msgpack.ExtType(1, b"xy"))}
    for name, frame in cases.items():
        with pytest.raises(ProtocolError) as info:
            decode_message_header(frame, ("id",))
        assert info.value.reason == "msgpack_limit", name
    with pytest.raises(ProtocolError, match="max_header_bytes=2048"):  # the bound is the config's
        decode_message_header(msgpack.packb({"v": 2, "pad": "x" * 3000}), ("v",), SampleLimits(max_header_bytes=2048))


def test_forged_frame_counts_are_refused_before_a_table_is_built():
    packed = struct.pack("<I", 2**28) + b"\0" * 64  # claims 268M frames: a 1 GB table
    peak, error = peak_mib(lambda: unpack_frames(packed))
    assert isinstance(error, ProtocolError) and error.reason == "bad_packed_group" and peak < 1
    check_frame_count(1025)
    with pytest.raises(ProtocolError, match="1026 frames exceeds max_frames=1025") as info:
        check_frame_count(1026)
    assert info.value.reason == "too_many_frames"


def test_the_service_refuses_a_message_of_too_many_frames_and_counts_it():
    server = BufferServer(BufferConfig(port=0)).start()
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.linger = 0
    try:
        sock.connect(server.endpoint)
        request = msgpack.packb({"v": PROTOCOL_VERSION, "id": "f", "op": "stats", "args": {}})
        sock.send_multipart([request, *(b"" for _ in range(5000))])
        assert sock.poll(10_000)
        reply = msgpack.unpackb(sock.recv_multipart()[0])
        assert reply["error"]["reason"] == "too_many_frames"
        sock.send_multipart([request])
        assert sock.poll(10_000)
        stats = msgpack.unpackb(sock.recv_multipart()[0])["result"]
        assert stats["bad_messages"] == {"too_many_frames": 1}
    finally:
        sock.close()
        ctx.term()
        server.stop()


LIMITS = SampleLimits(max_header_bytes=64 << 10, vocab_size=1000, max_sequence_tokens=4096)
# Large and nested values: deep lists and maps, long strings and binaries, huge and odd numbers.
values = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(-2**63, 2**64 - 1), st.floats(), st.text(max_size=40),
              st.binary(max_size=40), st.sampled_from(["x" * 20_000, b"\0" * 70_000, 2**31 - 1, -1])),
    lambda inner: st.one_of(st.lists(inner, max_size=8), st.dictionaries(st.text(max_size=6), inner, max_size=8)),
    max_leaves=60)


def assert_valid_or_refused(fn) -> None:
    try:
        fn()
    except BufferError as exc:
        assert exc.reason and str(exc)


@seed(30)
@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_large_groups_truncated_flipped_or_with_nested_values_never_crash(data):
    group = make_group(ticket=data.draw(st.integers(0, 9)), n=data.draw(st.integers(1, 64)),
                       tokens=data.draw(st.sampled_from([1, 7, 300, 3000])))
    frames = [bytes(memoryview(f)) for f in encode_group(group)]
    kind = data.draw(st.sampled_from(["truncate", "flip", "nest", "packed"]))
    if kind == "truncate":
        i = data.draw(st.integers(0, len(frames) - 1))
        frames[i] = frames[i][: data.draw(st.integers(0, max(len(frames[i]) - 1, 0)))]
    elif kind == "flip":
        header = bytearray(frames[0])
        for _ in range(data.draw(st.integers(1, 8))):
            header[data.draw(st.integers(0, len(header) - 1))] ^= 1 << data.draw(st.integers(0, 7))
        frames[0] = bytes(header)
    elif kind == "nest":
        header = msgpack.unpackb(frames[0])
        target = header if data.draw(st.booleans()) else header["samples"][0]
        target[data.draw(st.sampled_from(sorted(target)))] = data.draw(values)
        frames[0] = msgpack.packb(header)
    else:
        packed = bytearray(pack_frames(frames))
        cut = data.draw(st.integers(0, len(packed)))
        packed = packed[:cut] + bytes(data.draw(st.binary(max_size=16)))
        assert_valid_or_refused(lambda: decode_group(unpack_frames(bytes(packed)), LIMITS, max_version=0))
        return
    assert_valid_or_refused(lambda: decode_group(frames, LIMITS, max_version=0))


@seed(31)
@settings(max_examples=150, deadline=None)
@given(header=values, cut=st.integers(0, 64))
def test_request_headers_of_any_shape_decode_or_are_refused(header, cut):
    frame = msgpack.packb({"v": PROTOCOL_VERSION, "id": "x", "op": "stats", "args": header})
    assert_valid_or_refused(lambda: decode_message_header(frame, ("id", "op", "args")))
    assert_valid_or_refused(lambda: decode_message_header(frame[: len(frame) - cut], ("id", "op", "args")))
