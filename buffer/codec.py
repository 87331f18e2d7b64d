"""Wire format: a msgpack header plus raw array frames (no pickle, no copies of array data).

A group is encoded as `[header, a_0, a_1, ...]`: the header (msgpack map) carries the protocol
version, the group's scalars and one map per sample; the arrays follow as raw little-endian
buffers, per sample in the order of `buffer.sample.ARRAY_FIELDS` (token_rewards only when
present). Encoding hands out the numpy buffers themselves; decoding wraps the received frames
with `np.frombuffer` (read-only views, no copy).

On the service a group travels as one *packed group* (`pack_frames`): its frames back to back,
8-byte aligned, after a length table; `unpack_frames` cuts it into zero-copy views again. The
push sends it (one memcpy on the client), the store keeps exactly those bytes, the durable log
records them and a pull reply sends them (one frame per group instead of ~5 per sample keeps
ZMQ's per-frame cost off the hot path).

Service messages (`encode_message`, `decode_message_header`) use the same idea:
`[header, *payload]`, header = {"v", "id", "op", "args"} for a request and
{"v", "id", "ok", "result" | "error"} for a reply; the payload is one packed group (push) or
one packed group per frame (pull).

Decoding validates everything and raises `SampleError` (naming field and sample) or
`ProtocolError`: frame count and sizes, dtypes (implied by the layout, checked by size),
lengths that agree, finite log-probs <= 0, loss mask in {0, 1}, versions not ahead of the learner
(`max_version`) and not before the sample's start version, and the configured size limits.
"""
from __future__ import annotations

import math
import struct
import sys
from typing import Any, Sequence

import msgpack
import numpy as np

from buffer.config import SampleLimits
from buffer.errors import ProtocolError, SampleError
from buffer.sample import ARRAY_FIELDS, Group, Sample

PROTOCOL_VERSION = 1

_LITTLE = sys.byteorder == "little"
_SAMPLE_KEYS = {
    "sample_id", "weight_version", "reward", "worker_id", "created_at", "finish_reason",
    "metadata", "n_prompt", "n_response", "has_token_rewards",
}
_GROUP_KEYS = {"v", "group_id", "prompt_index", "samples"}
# (field, little-endian wire dtype, length key in the sample header), in frame order
_WIRE_LAYOUT = [(name, dtype.newbyteorder("<"), "n_prompt" if name == "prompt_ids" else "n_response")
                for name, dtype in ARRAY_FIELDS.items()]


def pack(obj: Any) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)


def unpack(frame) -> Any:
    """msgpack-decode one frame; any failure is a ProtocolError."""
    try:
        return msgpack.unpackb(frame, raw=False, strict_map_key=True)
    except Exception as exc:  # msgpack raises several unrelated types on garbage
        raise ProtocolError(f"header is not valid msgpack: {type(exc).__name__}: {exc}", "bad_msgpack") from None


def _wire_array(arr: np.ndarray) -> np.ndarray:
    """The array as a contiguous little-endian buffer (a no-op, no copy, in the usual case)."""
    arr = np.ascontiguousarray(arr)
    if not _LITTLE and arr.dtype.itemsize > 1:
        arr = arr.astype(arr.dtype.newbyteorder("<"))
    return arr


def encode_group(group: Group) -> list:
    """`[header_bytes, array, array, ...]`. Arrays are numpy buffers (zero copy for ZMQ, picklable
    for Ray). Construct-time conversion in `Sample` already fixed their dtypes."""
    samples_meta = []
    arrays: list[np.ndarray] = []
    for s in group.samples:
        samples_meta.append({
            "sample_id": s.sample_id,
            "weight_version": int(s.weight_version),
            "reward": float(s.reward),
            "worker_id": s.worker_id,
            "created_at": float(s.created_at),
            "finish_reason": s.finish_reason,
            "metadata": dict(s.metadata),
            "n_prompt": len(s.prompt_ids),
            "n_response": len(s.response_ids),
            "has_token_rewards": s.token_rewards is not None,
        })
        for name in ARRAY_FIELDS:
            value = getattr(s, name)
            if value is not None:
                arrays.append(_wire_array(value))
    header = {"v": PROTOCOL_VERSION, "group_id": group.group_id, "prompt_index": int(group.prompt_index),
              "samples": samples_meta}
    return [pack(header), *arrays]


def group_frame_count(header: dict) -> int:
    return 1 + sum(5 + bool(s.get("has_token_rewards")) for s in header["samples"])


def decode_group(frames: Sequence, limits: SampleLimits | None = None, max_version: int | None = None) -> Group:
    """Decode and validate one group from its frames (bytes, memoryview or zmq.Frame)."""
    limits = limits or SampleLimits()
    if not frames:
        raise ProtocolError("a group needs at least a header frame", "bad_group")
    header = unpack(frames[0])
    _check_group_header(header, limits)
    expected = group_frame_count(header)
    if len(frames) != expected:
        raise ProtocolError(f"group {header['group_id']!r}: header describes {expected} frames, got {len(frames)}",
                            "bad_frame_count")
    samples = []
    cursor = 1
    for meta in header["samples"]:
        sample, cursor = _decode_sample(meta, header["group_id"], frames, cursor, limits)
        samples.append(sample)
    group = Group(group_id=header["group_id"], samples=samples, prompt_index=header["prompt_index"])
    validate_group(group, limits, max_version)
    return group


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_group_header(header, limits: SampleLimits) -> None:
    if not isinstance(header, dict):
        raise ProtocolError(f"group header must be a map, got {type(header).__name__}", "bad_group")
    if header.get("v") != PROTOCOL_VERSION:
        raise ProtocolError(f"group protocol version {header.get('v')!r}, expected {PROTOCOL_VERSION}",
                            "bad_protocol_version")
    if set(header) != _GROUP_KEYS:
        raise ProtocolError(f"group header keys {sorted(header)}, expected {sorted(_GROUP_KEYS)}", "bad_group")
    if not isinstance(header["group_id"], str) or not header["group_id"]:
        raise SampleError("group_id", None, "must be a non-empty string")
    if not _is_int(header["prompt_index"]) or header["prompt_index"] < 0:
        raise SampleError("prompt_index", None, f"must be an int >= 0, got {header['prompt_index']!r}")
    samples = header["samples"]
    if not isinstance(samples, list) or not samples:
        raise SampleError("samples", None, f"group {header['group_id']!r} must hold at least one sample")
    if len(samples) > limits.max_group_size:
        raise SampleError("samples", None, f"{len(samples)} samples exceed max_group_size={limits.max_group_size}")
    for meta in samples:
        if not isinstance(meta, dict) or set(meta) != _SAMPLE_KEYS:
            keys = sorted(meta) if isinstance(meta, dict) else type(meta).__name__
            raise ProtocolError(f"sample header keys {keys}, expected {sorted(_SAMPLE_KEYS)}", "bad_sample")


def _decode_sample(meta: dict, group_id: str, frames: Sequence, cursor: int, limits: SampleLimits):
    sid = meta["sample_id"]
    if not isinstance(sid, str) or not sid:
        raise SampleError("sample_id", None, f"must be a non-empty string, got {sid!r}")
    lengths = {"n_prompt": limits.max_prompt_tokens, "n_response": limits.max_response_tokens}
    for key, limit in lengths.items():
        if not _is_int(meta[key]) or not 0 <= meta[key] <= limit:
            raise SampleError(key, sid, f"must be an int in [0, {limit}], got {meta[key]!r}")
    arrays = {"token_rewards": None}
    for name, dtype, length_key in _WIRE_LAYOUT:
        if name == "token_rewards" and not meta["has_token_rewards"]:
            continue
        n = meta[length_key]
        buf = frames[cursor]
        cursor += 1
        size = len(buf) if type(buf) is bytes else memoryview(buf).nbytes
        if size != n * dtype.itemsize:
            raise SampleError(name, sid, f"frame has {size} bytes, expected {n * dtype.itemsize} for {dtype}[{n}]")
        arrays[name] = np.frombuffer(buf, dtype=dtype, count=n)
    for key in ("worker_id", "finish_reason"):
        if not isinstance(meta[key], str):
            raise SampleError(key, sid, f"must be a string, got {type(meta[key]).__name__}")
    for key in ("reward", "created_at"):
        if not isinstance(meta[key], (int, float)) or isinstance(meta[key], bool):
            raise SampleError(key, sid, f"must be a number, got {type(meta[key]).__name__}")
    if not _is_int(meta["weight_version"]):
        raise SampleError("weight_version", sid, f"must be an int, got {meta['weight_version']!r}")
    if not isinstance(meta["metadata"], dict):
        raise SampleError("metadata", sid, f"must be a map, got {type(meta['metadata']).__name__}")
    sample = Sample(
        sample_id=sid, group_id=group_id, reward=float(meta["reward"]), weight_version=meta["weight_version"],
        worker_id=meta["worker_id"], created_at=float(meta["created_at"]), finish_reason=meta["finish_reason"],
        metadata=meta["metadata"], **arrays,
    )
    return sample, cursor


def validate_group(group: Group, limits: SampleLimits, max_version: int | None) -> None:
    """The record contract; raises SampleError naming the field and the sample. The array checks
    run once over the whole group (a few numpy calls); only a failing group is searched sample by
    sample to name the culprit."""
    if not group.samples:
        raise SampleError("samples", None, f"group {group.group_id!r} is empty")
    if len(group.samples) > limits.max_group_size:
        raise SampleError("samples", None, f"{len(group.samples)} samples exceed max_group_size={limits.max_group_size}")
    seen = set()
    for s in group.samples:
        if s.sample_id in seen:
            raise SampleError("sample_id", s.sample_id, f"appears twice in group {group.group_id!r}")
        seen.add(s.sample_id)
        _validate_shape_and_scalars(s, group.group_id, limits, max_version)
    if not _group_arrays_valid(group.samples, max_version):
        for s in group.samples:
            _validate_arrays(s, max_version)
        raise SampleError("samples", None, f"group {group.group_id!r} failed an array check")  # unreachable


def validate_sample(s: Sample, group_id: str, limits: SampleLimits, max_version: int | None) -> None:
    _validate_shape_and_scalars(s, group_id, limits, max_version)
    _validate_arrays(s, max_version)


def _validate_shape_and_scalars(s: Sample, group_id: str, limits: SampleLimits, max_version: int | None) -> None:
    sid = s.sample_id
    if s.group_id != group_id:
        raise SampleError("group_id", sid, f"is {s.group_id!r} but the sample is in group {group_id!r}")
    if len(s.prompt_ids) > limits.max_prompt_tokens:
        raise SampleError("prompt_ids", sid, f"{len(s.prompt_ids)} tokens exceed max_prompt_tokens")
    t = len(s.response_ids)
    if t > limits.max_response_tokens:
        raise SampleError("response_ids", sid, f"{t} tokens exceed max_response_tokens")
    for name in ("rollout_log_probs", "loss_mask", "token_versions", "token_rewards"):
        arr = getattr(s, name)
        if arr is not None and len(arr) != t:
            raise SampleError(name, sid, f"has length {len(arr)}, response_ids has {t}")
    if not math.isfinite(s.reward):
        raise SampleError("reward", sid, f"must be finite, got {s.reward}")
    if s.weight_version < 0:
        raise SampleError("weight_version", sid, f"must be >= 0, got {s.weight_version}")
    if max_version is not None and s.weight_version > max_version:
        raise SampleError("weight_version", sid, f"{s.weight_version} is ahead of the learner (version {max_version})")
    _validate_scalars(s, limits)


def _group_arrays_valid(samples: list[Sample], max_version: int | None) -> bool:
    """All of `_validate_arrays` at once for the whole group."""
    def cat(*names):
        return np.concatenate([getattr(s, n) for s in samples for n in names])

    ids, lp, mask, tv = cat("prompt_ids", "response_ids"), cat("rollout_log_probs"), cat("loss_mask"), cat("token_versions")
    if ids.size and ids.min() < 0:
        return False
    # max() is NaN if any NaN (and NaN <= 0 is False); a float64 sum is finite iff every value is
    if lp.size and not (lp.max() <= 0 and math.isfinite(lp.sum(dtype=np.float64))):
        return False
    if mask.size and mask.max() > 1:
        return False
    if tv.size:
        starts = np.repeat([s.weight_version for s in samples], [len(s.token_versions) for s in samples])
        if (tv < starts).any() or (max_version is not None and tv.max() > max_version):
            return False
    rewards = [s.token_rewards for s in samples if s.token_rewards is not None]
    return not rewards or math.isfinite(np.concatenate(rewards).sum(dtype=np.float64))


def _validate_arrays(s: Sample, max_version: int | None) -> None:
    sid = s.sample_id
    if (s.prompt_ids < 0).any() or (s.response_ids < 0).any():
        field = "prompt_ids" if (s.prompt_ids < 0).any() else "response_ids"
        raise SampleError(field, sid, "token ids must be >= 0")
    lp = s.rollout_log_probs
    if not np.isfinite(lp).all():
        raise SampleError("rollout_log_probs", sid, f"not finite at token {int(np.argmin(np.isfinite(lp)))}")
    if (lp > 0).any():
        raise SampleError("rollout_log_probs", sid, f"log-prob {float(lp.max())} > 0 at token {int(np.argmax(lp))}")
    if (s.loss_mask > 1).any():
        raise SampleError("loss_mask", sid, "values must be 0 or 1")
    if s.token_rewards is not None and not np.isfinite(s.token_rewards).all():
        raise SampleError("token_rewards", sid, "not finite")
    tv = s.token_versions
    if len(tv):
        if int(tv.min()) < s.weight_version:
            raise SampleError("token_versions", sid, f"{int(tv.min())} is before weight_version {s.weight_version}")
        if max_version is not None and int(tv.max()) > max_version:
            raise SampleError("token_versions", sid, f"{int(tv.max())} is ahead of the learner (version {max_version})")


def _validate_scalars(s: Sample, limits: SampleLimits) -> None:
    sid = s.sample_id
    for name in ("sample_id", "group_id", "worker_id", "finish_reason"):
        if len(getattr(s, name)) > limits.max_string_chars:
            raise SampleError(name, sid, f"longer than max_string_chars={limits.max_string_chars}")
    if len(s.metadata) > limits.max_metadata_items:
        raise SampleError("metadata", sid, f"{len(s.metadata)} items exceed max_metadata_items")
    for key, value in s.metadata.items():
        if not isinstance(key, str) or len(key) > limits.max_string_chars:
            raise SampleError("metadata", sid, f"key {key!r} must be a short string")
        if not isinstance(value, (str, int, float, bool)):
            raise SampleError("metadata", sid, f"value of {key!r} must be str, int, float or bool, got {type(value).__name__}")
        if isinstance(value, str) and len(value) > limits.max_string_chars:
            raise SampleError("metadata", sid, f"value of {key!r} longer than max_string_chars")


# ---- service messages -------------------------------------------------------------------------

def encode_message(header: dict, payload: Sequence = ()) -> list:
    return [pack({"v": PROTOCOL_VERSION, **header}), *payload]


def decode_message_header(frame, required: Sequence[str]) -> dict:
    """Decode and check a request/reply header frame."""
    header = unpack(frame)
    if not isinstance(header, dict):
        raise ProtocolError(f"message header must be a map, got {type(header).__name__}", "bad_header")
    if header.get("v") != PROTOCOL_VERSION:
        raise ProtocolError(f"protocol version {header.get('v')!r}, expected {PROTOCOL_VERSION}", "bad_protocol_version")
    missing = [k for k in required if k not in header]
    if missing:
        raise ProtocolError(f"message header misses {missing}", "bad_header")
    return header


def pack_frames(frames: Sequence) -> bytes:
    """One contiguous buffer: u32 count, u32 sizes[count], then each frame padded to 8 bytes."""
    sizes = [memoryview(f).nbytes for f in frames]
    parts = [struct.pack(f"<{len(sizes) + 1}I", len(sizes), *sizes)]
    parts.append(bytes(-len(parts[0]) % 8))
    for frame, size in zip(frames, sizes):
        parts.append(frame)
        if size % 8:
            parts.append(bytes(-size % 8))
    return b"".join(parts)


def unpack_frames(packed) -> list[memoryview]:
    """The frames of a packed group, as views into it (no copy)."""
    view = memoryview(packed).cast("B")
    if view.nbytes < 4:
        raise ProtocolError(f"packed group of {view.nbytes} bytes has no length table", "bad_packed_group")
    (count,) = struct.unpack_from("<I", view)
    table = 4 * (count + 1)
    if count == 0 or table > view.nbytes:
        raise ProtocolError(f"packed group claims {count} frames in {view.nbytes} bytes", "bad_packed_group")
    sizes = struct.unpack_from(f"<{count}I", view, 4)
    frames, offset = [], table + (-table % 8)
    for size in sizes:
        if offset + size > view.nbytes:
            raise ProtocolError("packed group is shorter than its length table says", "bad_packed_group")
        frames.append(view[offset:offset + size])
        offset += size + (-size % 8)
    return frames


def frames_nbytes(frames: Sequence) -> int:
    return sum(memoryview(f).nbytes for f in frames)


def group_index(header_frame) -> tuple[str, list[str], list[int]]:
    """(group_id, sample ids, sample weight versions) from an already validated group header."""
    header = unpack(header_frame)
    samples = header["samples"]
    return header["group_id"], [s["sample_id"] for s in samples], [s["weight_version"] for s in samples]
