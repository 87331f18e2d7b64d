"""Wire format: a msgpack header plus raw array frames (no pickle, no copies when decoding).

A group is encoded as `[header, prompt_ids, response_ids, rollout_log_probs, loss_mask,
token_versions, token_rewards]` (`GROUP_FRAMES` frames, whatever the group size): the header
(msgpack map) carries the protocol version, the group's scalars and one map per sample with its
lengths; each array frame holds that field of every sample back to back, in sample order, as raw
little-endian values (token_rewards only of the samples that have them). Field-major frames keep
the cost of a group flat in its size: validation is a few numpy calls per field, not per sample,
and ZMQ moves 7 frames, not 5 per sample. A group of an MoE policy carries the routing
(`Sample.routed_experts`) too: an eighth frame with every sample's [T, layers, k] expert ids back
to back, and a `routing` map {layers, k, dtype} in the group header (the same shape for every
sample of the group); a dense group's bytes are unchanged. Encoding copies each field once (the concatenation);
decoding wraps the received frames with `np.frombuffer` and hands every sample read-only views
into them.

On the service a group travels as one *packed group* (`pack_frames`): its frames back to back,
8-byte aligned, after a length table; `unpack_frames` cuts it into zero-copy views again. The
store keeps exactly those bytes, the durable log records them and a pull reply sends them (one
frame per group).

Service messages (`encode_message`, `decode_message_header`) use the same idea:
`[header, *payload]`, header = {"v", "id", "op", "args"} for a request and
{"v", "id", "ok", "result" | "error"} for a reply; the payload is one packed group (push) or
one packed group per frame (pull).

`check_group` validates a group on the wire without building `Sample` objects (what the buffer
does with every push); `decode_group` validates and builds them; `validate_group` runs the same
checks on an in-memory `Group` (the learner's check of a batch). Violations raise `SampleError`
(naming field and sample) or `ProtocolError`: frame count and sizes, dtypes (implied by the
layout, checked by size), lengths that agree, token ids >= 0 and below the vocabulary
(`limits.vocab_size`), prompt + response within the context (`limits.max_sequence_tokens`), a
header within `limits.max_header_bytes` and msgpack's item bounds, finite log-probs <= 0, loss mask in
{0, 1}, finite rewards, versions not ahead of the learner (`max_version`) and not before the
sample's start version, expert ids in range (`limits.num_experts`) and the configured size limits.
"""
from __future__ import annotations

import math
import struct
import sys
from dataclasses import dataclass
from itertools import accumulate
from typing import Any, NamedTuple, Sequence

import msgpack
import numpy as np

from buffer.config import SampleLimits
from buffer.errors import ProtocolError, SampleError
from buffer.sample import ARRAY_FIELDS, ROUTING_DTYPES, Group, Sample, as_field_array, as_routing_array

PROTOCOL_VERSION = 2
_DEFAULT_LIMITS = SampleLimits()
GROUP_FRAMES = 1 + len(ARRAY_FIELDS)
ROUTED_GROUP_FRAMES = GROUP_FRAMES + 1  # an MoE group: the routing frame last

_LITTLE = sys.byteorder == "little"
_SAMPLE_KEYS = {
    "sample_id", "weight_version", "reward", "worker_id", "created_at", "finish_reason",
    "metadata", "n_prompt", "n_response", "has_token_rewards",
}
_GROUP_KEYS = {"v", "group_id", "prompt_index", "samples"}
_ROUTING_KEYS = {"layers", "k", "dtype"}
_ROUTING_WIRE = {dtype.name: dtype.newbyteorder("<") for dtype in ROUTING_DTYPES}
_MAX_ROUTING_WIDTH = 1 << 16  # layers x k of one token: far above any model, a bound on forged headers
_PER_TOKEN = ("rollout_log_probs", "loss_mask", "token_versions", "token_rewards")
_WIRE_DTYPES = {name: dtype.newbyteorder("<") for name, dtype in ARRAY_FIELDS.items()}
_MAX_PACKED_FRAMES = 64


def pack(obj: Any) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)


def unpack(frame, limits: SampleLimits | None = None) -> Any:
    """msgpack-decode one header frame within `limits` (its size, then msgpack's own bounds on
    every string, binary, array and map, all checked before any object is built); any failure
    is a ProtocolError: `header_too_large`, `msgpack_limit` or `bad_msgpack`."""
    limits = limits or _DEFAULT_LIMITS
    size = len(frame) if type(frame) is bytes else memoryview(frame).nbytes
    if size > limits.max_header_bytes:
        raise ProtocolError(f"header of {size} bytes exceeds max_header_bytes={limits.max_header_bytes}",
                            "header_too_large")
    try:
        return msgpack.unpackb(frame, raw=False, strict_map_key=True, **_msgpack_bounds(limits))
    except Exception as exc:  # msgpack raises several unrelated types on garbage
        if isinstance(exc, ValueError) and "exceeds max_" in str(exc):
            raise ProtocolError(f"header refused: {exc}", "msgpack_limit") from None
        raise ProtocolError(f"header is not valid msgpack: {type(exc).__name__}: {exc}", "bad_msgpack") from None


def _msgpack_bounds(limits: SampleLimits) -> dict:
    """msgpack's per-item bounds from the limits: a header holds short strings (ids, reasons,
    metadata: 4 UTF-8 bytes a char at most), lists of samples or ids, maps of keys (a reply's
    stats the largest), no binaries of size and no extension types. The bounds refuse an item
    that claims more than a header needs before msgpack builds it; max_header_bytes bounds the
    total, as every item costs at least one byte."""
    chars = 4 * limits.max_string_chars
    return {"max_str_len": chars, "max_bin_len": chars, "max_ext_len": 0,
            "max_array_len": max(limits.max_group_size, limits.max_frames),
            "max_map_len": max(len(_SAMPLE_KEYS), limits.max_metadata_items, 1024)}


def check_frame_count(count: int, limits: SampleLimits | None = None) -> None:
    """A message's frame count within `limits.max_frames` (every frame is an object in memory)."""
    limits = limits or _DEFAULT_LIMITS
    if count > limits.max_frames:
        raise ProtocolError(f"message of {count} frames exceeds max_frames={limits.max_frames}", "too_many_frames")


# ---- encoding ---------------------------------------------------------------------------------

def encode_group(group: Group) -> list:
    """`[header_bytes, *field arrays]` (`GROUP_FRAMES` items). Arrays are numpy buffers (zero copy
    for ZMQ, picklable for Ray). A sample whose per-token arrays disagree in length cannot be
    laid out and raises SampleError here."""
    metas, parts = [], {name: [] for name in ARRAY_FIELDS}
    for s in group.samples:
        t = len(s.response_ids)
        for name in _PER_TOKEN:
            value = getattr(s, name)
            if value is not None and len(value) != t:
                raise SampleError(name, s.sample_id, f"has length {len(value)}, response_ids has {t}")
        for name in ARRAY_FIELDS:
            value = getattr(s, name)
            if value is None and name == "token_versions":
                value = np.full(t, s.weight_version, np.int32)
            if value is not None:
                parts[name].append(as_field_array(value, name, s.sample_id))
        metas.append({
            "sample_id": s.sample_id,
            "weight_version": int(s.weight_version),
            "reward": float(s.reward),
            "worker_id": s.worker_id,
            "created_at": float(s.created_at),
            "finish_reason": s.finish_reason,
            "metadata": dict(s.metadata),
            "n_prompt": len(s.prompt_ids),
            "n_response": t,
            "has_token_rewards": s.token_rewards is not None,
        })
    header = {"v": PROTOCOL_VERSION, "group_id": group.group_id, "prompt_index": int(group.prompt_index),
              "samples": metas}
    routing = _routing_frame(group.samples)
    frames = [_wire_array(parts[name], dtype) for name, dtype in ARRAY_FIELDS.items()]
    if routing is None:
        return [pack(header), *frames]
    header["routing"], frame = routing
    return [pack(header), *frames, frame]


def _routing_frame(samples) -> tuple[dict, np.ndarray] | None:
    """(the header's routing map, the frame) of a group whose samples carry routing; None when none
    does. Every sample must, with one [layers, k] shape and a row per response token."""
    routed = [s for s in samples if s.routed_experts is not None]
    if not routed:
        return None
    shape = np.shape(routed[0].routed_experts)[1:]
    parts = []
    for s in samples:
        r = s.routed_experts
        if r is None and not len(s.response_ids):  # no tokens, no routing (an episode that failed at once)
            r = np.zeros((0, *shape), np.uint8)
        if r is not None:
            r = as_routing_array(r, s.sample_id)  # a field set after construction is checked here too
        if r is None:
            raise SampleError("routed_experts", s.sample_id, f"is missing while sample {routed[0].sample_id!r} of "
                                                             "the group carries routing (all or none)")
        if r.shape[1:] != shape:
            raise SampleError("routed_experts", s.sample_id, f"has [layers, k] {list(r.shape[1:])}, sample "
                                                             f"{routed[0].sample_id!r} of the group {list(shape)}")
        if r.shape[0] != len(s.response_ids):
            raise SampleError("routed_experts", s.sample_id, f"has {r.shape[0]} rows, response_ids has "
                                                             f"{len(s.response_ids)} tokens")
        parts.append(r)
    dtype = max((r.dtype for r in parts), key=lambda d: d.itemsize)
    frame = _wire_array([r.astype(dtype, copy=False).reshape(-1) for r in parts], dtype)
    return {"layers": int(shape[0]), "k": int(shape[1]), "dtype": dtype.name}, frame


def _wire_array(parts: list, dtype: np.dtype) -> np.ndarray:
    """The parts back to back as one contiguous little-endian array."""
    arr = np.concatenate(parts) if parts else np.zeros(0, dtype)
    if not _LITTLE and arr.dtype.itemsize > 1:
        arr = arr.astype(arr.dtype.newbyteorder("<"))
    return arr


# ---- decoding and validation ------------------------------------------------------------------

@dataclass
class GroupView:
    """A validated group on the wire: its header and one array per field (all samples back to
    back), without `Sample` objects. `offsets[field][k]` is where sample k starts in that field."""

    group_id: str
    prompt_index: int
    samples: list[dict]  # the sample headers
    arrays: dict[str, np.ndarray]
    offsets: dict[str, list[int]]
    routing: dict | None = None  # {layers, k, dtype} of an MoE group (its ids in arrays["routed_experts"])

    @property
    def sample_ids(self) -> list[str]:
        return [m["sample_id"] for m in self.samples]

    @property
    def weight_versions(self) -> list[int]:
        return [m["weight_version"] for m in self.samples]

    def index(self) -> "GroupIndex":
        return GroupIndex(self.group_id, self.sample_ids, self.weight_versions, self.prompt_index,
                          max((m["n_response"] for m in self.samples), default=0))

    def field(self, name: str, k: int) -> np.ndarray | None:
        """Sample k's array `name` (a view), None for token_rewards it does not have."""
        start, end = self.offsets[name][k], self.offsets[name][k + 1]
        if name == "token_rewards" and not self.samples[k]["has_token_rewards"]:
            return None
        return self.arrays[name][start:end]

    def routed_experts(self, k: int) -> np.ndarray | None:
        """Sample k's [T, layers, k] expert ids (a view), None in a dense group."""
        if self.routing is None:
            return None
        width = self.routing["layers"] * self.routing["k"]
        start, end = self.offsets["response_ids"][k], self.offsets["response_ids"][k + 1]
        ids = self.arrays["routed_experts"][start * width:end * width]
        return ids.reshape(end - start, self.routing["layers"], self.routing["k"])


def check_group(frames: Sequence, limits: SampleLimits | None = None, max_version: int | None = None) -> GroupView:
    """Validate one group from its frames (bytes, memoryview or zmq.Frame) without building samples."""
    limits = limits or _DEFAULT_LIMITS
    if not frames:
        raise ProtocolError("a group needs at least a header frame", "bad_group")
    header = unpack(frames[0], limits)
    _check_group_header(header, limits)
    routing = header.get("routing")
    expected = GROUP_FRAMES if routing is None else ROUTED_GROUP_FRAMES
    if len(frames) != expected:
        raise ProtocolError(f"group {header['group_id']!r}: expected {expected} frames, got {len(frames)}",
                            "bad_frame_count")
    metas = header["samples"]
    seen = set()
    for meta in metas:
        _check_sample_header(meta, limits, max_version)
        if meta["sample_id"] in seen:
            raise SampleError("sample_id", meta["sample_id"], f"appears twice in group {header['group_id']!r}")
        seen.add(meta["sample_id"])
    offsets = _field_offsets(metas)
    arrays = {}
    for (name, dtype), frame in zip(_WIRE_DTYPES.items(), frames[1:]):
        n = offsets[name][-1]
        size = len(frame) if type(frame) is bytes else memoryview(frame).nbytes
        if size != n * dtype.itemsize:
            raise SampleError(name, None, f"frame has {size} bytes, expected {n * dtype.itemsize} for {dtype}[{n}] "
                                          f"(group {header['group_id']!r})")
        arrays[name] = np.frombuffer(frame, dtype=dtype, count=n)
    if routing is not None:
        dtype = _ROUTING_WIRE[routing["dtype"]]
        n = offsets["response_ids"][-1] * routing["layers"] * routing["k"]
        frame = frames[-1]
        size = len(frame) if type(frame) is bytes else memoryview(frame).nbytes
        if size != n * dtype.itemsize:
            raise SampleError("routed_experts", None, f"frame has {size} bytes, expected {n * dtype.itemsize} for "
                                                      f"{dtype}[{n}] (group {header['group_id']!r})")
        arrays["routed_experts"] = np.frombuffer(frame, dtype=dtype, count=n)
    view = GroupView(header["group_id"], header["prompt_index"], metas, arrays, offsets, routing)
    if not _arrays_valid(view, max_version, limits.vocab_size):
        for k in range(len(metas)):
            _check_sample_arrays(view, k, max_version, limits.vocab_size)
        raise SampleError("samples", None, f"group {view.group_id!r} failed an array check")  # unreachable
    if routing is not None:
        _check_routing(view, limits.num_experts)
    return view


def _check_routing(view: GroupView, num_experts: int | None) -> None:
    """Expert ids >= 0 and below `num_experts` (when known); the error names the sample."""
    ids = view.arrays["routed_experts"]
    if not ids.size or (ids.min() >= 0 and (num_experts is None or ids.max() < num_experts)):
        return
    for k, meta in enumerate(view.samples):
        mine = view.routed_experts(k)
        bad = np.argwhere((mine < 0) | (mine >= (num_experts if num_experts is not None else np.inf)))
        if len(bad):
            t, layer, slot = (int(x) for x in bad[0])
            raise SampleError("routed_experts", meta["sample_id"],
                              f"expert id {int(mine[t, layer, slot])} at token {t}, layer {layer} is not in "
                              f"[0, {num_experts if num_experts is not None else 'inf'})")


def decode_group(frames: Sequence, limits: SampleLimits | None = None, max_version: int | None = None) -> Group:
    """Decode and validate one group; its samples' arrays are read-only views into the frames."""
    view = check_group(frames, limits, max_version)
    samples = [
        Sample(sample_id=m["sample_id"], group_id=view.group_id, reward=float(m["reward"]),
               weight_version=m["weight_version"], worker_id=m["worker_id"], created_at=float(m["created_at"]),
               finish_reason=m["finish_reason"], metadata=m["metadata"], routed_experts=view.routed_experts(k),
               **{name: view.field(name, k) for name in ARRAY_FIELDS})
        for k, m in enumerate(view.samples)
    ]
    return Group(group_id=view.group_id, samples=samples, prompt_index=view.prompt_index)


def pulled_limits(limits: SampleLimits) -> SampleLimits:
    """The limits a pulled group is decoded with: those of a push, less the checks against the
    model (vocabulary, context). A group the buffer holds passed them when it was pushed; one that
    did not (a log written under other limits) reaches the learner, which checks the vocabulary
    against its own model and refuses the batch naming the sample, so the run hands it back and
    the buffer drops it as poisoned, instead of a pull failing for good."""
    if limits.vocab_size is None and limits.max_sequence_tokens is None and limits.num_experts is None:
        return limits
    return limits.model_copy(update={"vocab_size": None, "max_sequence_tokens": None, "num_experts": None})


def validate_group(group: Group, limits: SampleLimits | None = None, max_version: int | None = None) -> None:
    """The record contract for an in-memory group (the same checks as a decode)."""
    for s in group.samples:
        if s.group_id != group.group_id:
            raise SampleError("group_id", s.sample_id, f"is {s.group_id!r} but the sample is in group "
                                                       f"{group.group_id!r}")
    check_group(encode_group(group), limits, max_version)


def _field_offsets(metas: list[dict]) -> dict[str, list[int]]:
    """Per field, where each sample starts in that field's frame (and, last, the frame's length)."""
    prompt = [0, *accumulate(m["n_prompt"] for m in metas)]
    response = [0, *accumulate(m["n_response"] for m in metas)]
    rewards = [0, *accumulate(m["n_response"] if m["has_token_rewards"] else 0 for m in metas)]
    return {name: prompt if name == "prompt_ids" else rewards if name == "token_rewards" else response
            for name in ARRAY_FIELDS}


def _is_int(value) -> bool:
    return type(value) is int  # msgpack gives exact types; bool is not an int here


def _is_number(value) -> bool:
    return type(value) is int or type(value) is float


def _check_group_header(header, limits: SampleLimits) -> None:
    if not isinstance(header, dict):
        raise ProtocolError(f"group header must be a map, got {type(header).__name__}", "bad_group")
    if header.get("v") != PROTOCOL_VERSION:
        raise ProtocolError(f"group protocol version {header.get('v')!r}, expected {PROTOCOL_VERSION}",
                            "bad_protocol_version")
    if set(header) != _GROUP_KEYS and set(header) != _GROUP_KEYS | {"routing"}:
        raise ProtocolError(f"group header keys {sorted(header, key=str)}, expected {sorted(_GROUP_KEYS)} "
                            f"(and 'routing')", "bad_group")
    routing = header.get("routing")
    if routing is not None:
        if not isinstance(routing, dict) or set(routing) != _ROUTING_KEYS:
            raise ProtocolError(f"group routing must be a map of {sorted(_ROUTING_KEYS)}", "bad_group")
        layers, k = routing["layers"], routing["k"]
        if not (_is_int(layers) and _is_int(k) and layers >= 1 and k >= 1 and layers * k <= _MAX_ROUTING_WIDTH):
            raise SampleError("routed_experts", None, f"routing of [layers, k] [{layers!r:.20}, {k!r:.20}]: both "
                                                      f"must be ints >= 1, layers x k <= {_MAX_ROUTING_WIDTH}")
        if routing["dtype"] not in _ROUTING_WIRE:
            raise SampleError("routed_experts", None, f"routing dtype {routing['dtype']!r:.20} is not one of "
                                                      f"{sorted(_ROUTING_WIRE)}")
    group_id = header["group_id"]
    if not isinstance(group_id, str) or not group_id or len(group_id) > limits.max_string_chars:
        raise SampleError("group_id", None, f"must be a non-empty string of at most {limits.max_string_chars} chars")
    if not _is_int(header["prompt_index"]) or header["prompt_index"] < 0:
        raise SampleError("prompt_index", None, f"must be an int >= 0, got {header['prompt_index']!r}")
    samples = header["samples"]
    if not isinstance(samples, list) or not samples:
        raise SampleError("samples", None, f"group {group_id!r} must hold at least one sample")
    if len(samples) > limits.max_group_size:
        raise SampleError("samples", None, f"{len(samples)} samples exceed max_group_size={limits.max_group_size}")
    for meta in samples:
        if not isinstance(meta, dict) or set(meta) != _SAMPLE_KEYS:
            keys = sorted(meta, key=str) if isinstance(meta, dict) else type(meta).__name__
            raise ProtocolError(f"sample header keys {keys}, expected {sorted(_SAMPLE_KEYS)}", "bad_sample")


def _check_sample_header(meta: dict, limits: SampleLimits, max_version: int | None) -> None:
    """The scalars of one sample header (a per-sample hot path: exact type checks, no helpers)."""
    sid, short = meta["sample_id"], limits.max_string_chars
    if type(sid) is not str or not sid:
        raise SampleError("sample_id", None, f"must be a non-empty string, got {sid!r:.60}")
    if len(sid) > short:
        raise SampleError("sample_id", sid[:64], f"longer than max_string_chars={short}")
    n_prompt, n_response = meta["n_prompt"], meta["n_response"]
    if type(n_prompt) is not int or not 0 <= n_prompt <= limits.max_prompt_tokens:
        raise SampleError("n_prompt", sid, f"must be an int in [0, {limits.max_prompt_tokens}], got {n_prompt!r:.60}")
    if type(n_response) is not int or not 0 <= n_response <= limits.max_response_tokens:
        raise SampleError("n_response", sid,
                          f"must be an int in [0, {limits.max_response_tokens}], got {n_response!r:.60}")
    if limits.max_sequence_tokens is not None and n_prompt + n_response > limits.max_sequence_tokens:
        raise SampleError("n_response", sid, f"prompt ({n_prompt}) + response ({n_response}) tokens exceed "
                                             f"max_sequence_tokens={limits.max_sequence_tokens} (the engine's context)")
    if type(meta["has_token_rewards"]) is not bool:
        raise SampleError("has_token_rewards", sid, f"must be a bool, got {meta['has_token_rewards']!r:.60}")
    for key in ("worker_id", "finish_reason"):
        if type(meta[key]) is not str or len(meta[key]) > short:
            raise SampleError(key, sid, f"must be a string of at most {short} chars, got {type(meta[key]).__name__}")
    for key in ("reward", "created_at"):
        if not _is_number(meta[key]) or not math.isfinite(meta[key]):
            raise SampleError(key, sid, f"must be a finite number, got {meta[key]!r:.60}")
    version = meta["weight_version"]
    if type(version) is not int or version < 0:
        raise SampleError("weight_version", sid, f"must be an int >= 0, got {version!r:.60}")
    if max_version is not None and version > max_version:
        raise SampleError("weight_version", sid, f"{version} is ahead of the learner (version {max_version})")
    if meta["metadata"] != {}:
        _check_metadata(meta["metadata"], sid, limits)


def _check_metadata(metadata, sid: str, limits: SampleLimits) -> None:
    if not isinstance(metadata, dict):
        raise SampleError("metadata", sid, f"must be a map, got {type(metadata).__name__}")
    if len(metadata) > limits.max_metadata_items:
        raise SampleError("metadata", sid, f"{len(metadata)} items exceed max_metadata_items")
    for key, value in metadata.items():
        if not isinstance(key, str) or len(key) > limits.max_string_chars:
            raise SampleError("metadata", sid, f"key {key!r:.60} must be a short string")
        if not isinstance(value, (str, int, float, bool)):
            raise SampleError("metadata", sid, f"value of {key!r} must be str, int, float or bool, got {type(value).__name__}")
        if isinstance(value, str) and len(value) > limits.max_string_chars:
            raise SampleError("metadata", sid, f"value of {key!r} longer than max_string_chars")


def _arrays_valid(view: GroupView, max_version: int | None, vocab_size: int | None) -> bool:
    """Every array check of `_check_sample_arrays`, for the whole group in a few numpy calls."""
    a = view.arrays
    for name in ("prompt_ids", "response_ids"):
        if a[name].size and (a[name].min() < 0 or vocab_size is not None and a[name].max() >= vocab_size):
            return False
    lp = a["rollout_log_probs"]
    # max() is NaN if any NaN (and NaN <= 0 is False); a float64 sum is finite iff every value is
    if lp.size and not (lp.max() <= 0 and math.isfinite(lp.sum(dtype=np.float64))):
        return False
    if a["loss_mask"].size and a["loss_mask"].max() > 1:
        return False
    tv = a["token_versions"]
    if tv.size:
        versions = view.weight_versions
        if min(versions) == max(versions):  # the usual group: one start version, no per-token compare
            too_early = tv.min() < versions[0]
        else:
            too_early = (tv < np.repeat(versions, np.diff(view.offsets["token_versions"]))).any()
        if too_early or (max_version is not None and tv.max() > max_version):
            return False
    tr = a["token_rewards"]
    return not tr.size or math.isfinite(tr.sum(dtype=np.float64))


def _check_sample_arrays(view: GroupView, k: int, max_version: int | None, vocab_size: int | None) -> None:
    """The array checks of sample k, raising SampleError that names the field and the sample."""
    sid, version = view.samples[k]["sample_id"], view.samples[k]["weight_version"]
    for name in ("prompt_ids", "response_ids"):
        ids = view.field(name, k)
        if (ids < 0).any():
            raise SampleError(name, sid, "token ids must be >= 0")
        if vocab_size is not None and ids.size and ids.max() >= vocab_size:
            at = int(np.argmax(ids >= vocab_size))
            raise SampleError(name, sid, f"token id {int(ids[at])} at position {at} is not below the vocabulary "
                                         f"size {vocab_size}")
    lp = view.field("rollout_log_probs", k)
    if not np.isfinite(lp).all():
        raise SampleError("rollout_log_probs", sid, f"not finite at token {int(np.argmin(np.isfinite(lp)))}")
    if (lp > 0).any():
        raise SampleError("rollout_log_probs", sid, f"log-prob {float(lp.max())} > 0 at token {int(np.argmax(lp))}")
    if (view.field("loss_mask", k) > 1).any():
        raise SampleError("loss_mask", sid, "values must be 0 or 1")
    rewards = view.field("token_rewards", k)
    if rewards is not None and not np.isfinite(rewards).all():
        raise SampleError("token_rewards", sid, "not finite")
    tv = view.field("token_versions", k)
    if len(tv):
        if int(tv.min()) < version:
            raise SampleError("token_versions", sid, f"{int(tv.min())} is before weight_version {version}")
        if max_version is not None and int(tv.max()) > max_version:
            raise SampleError("token_versions", sid, f"{int(tv.max())} is ahead of the learner (version {max_version})")


# ---- service messages -------------------------------------------------------------------------

def encode_message(header: dict, payload: Sequence = ()) -> list:
    return [pack({"v": PROTOCOL_VERSION, **header}), *payload]


def decode_message_header(frame, required: Sequence[str], limits: SampleLimits | None = None) -> dict:
    """Decode and check a request/reply header frame (bounded by `limits`, see `unpack`)."""
    header = unpack(frame, limits)
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
    # A group has GROUP_FRAMES; the bound keeps a forged count from building a table of millions
    # of sizes (4 bytes each on the wire, a Python int each here), and lets wrong counts through
    # to the group check, which names them.
    if count > _MAX_PACKED_FRAMES:
        raise ProtocolError(f"packed group claims {count} frames, more than {_MAX_PACKED_FRAMES}", "bad_packed_group")
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


def first_frame_span(first_bytes) -> tuple[int, int] | None:
    """(start, end) of a packed group's first frame (its header) from the group's first bytes
    (8 are enough to know where it ends), or None if they cannot say."""
    view = memoryview(first_bytes).cast("B")
    if view.nbytes < 8:
        return None
    count, size = struct.unpack_from("<2I", view)
    table = 4 * (count + 1)
    return (table + (-table % 8), table + (-table % 8) + size) if count else None


def frames_nbytes(frames: Sequence) -> int:
    return sum(memoryview(f).nbytes for f in frames)


class GroupIndex(NamedTuple):
    group_id: str
    sample_ids: list[str]
    weight_versions: list[int]
    prompt_index: int
    response_tokens: int  # the longest response


def group_index(header_frame) -> GroupIndex:
    """What the store keeps of a group, from its already validated header (decoded without the
    limits: a log written under larger limits still replays)."""
    header = msgpack.unpackb(header_frame, raw=False, strict_map_key=True)
    samples = header["samples"]
    return GroupIndex(header["group_id"], [s["sample_id"] for s in samples], [s["weight_version"] for s in samples],
                      header["prompt_index"], max((s["n_response"] for s in samples), default=0))
