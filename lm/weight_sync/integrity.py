"""Content checks of a weight version before an engine swaps to it: a digest of its bytes and a
non-finite check of its floating tensors. Both sides of every channel use this module (and only
it), so the check moves with the channel when the broadcast moves onto vLLM's weight transfer.

The digest is CRC-32 (4 bytes) over a tensor's raw bytes in C order, in the publish dtype:
  pull channels (object store, folder): one digest per tensor, computed by the sender on the
      tensors it puts or writes, carried on the board in the version's payload (`"integrity"`),
      so a reader checks the stored object or folder against what the learner published;
  broadcast: one digest per chunk, computed by the sender right after it fills the chunk (while
      the chunk before it is on the wire) and sent after the last chunk as a trailer; each
      receiver recomputes them over what arrived.
A CRC, not a cryptographic hash: what it guards against is damage (a disk, a copy, a transfer
that flips or drops bytes) and a diverged learner, at 7 GB/s where BLAKE2b does 1.1 (0.5 s per
side per version at 303M, measured by benchmarks/weight_integrity.py). A forger who can rewrite
the run's folder or object store owns the run already (its checkpoints, its config).
A receiver that finds a mismatch or a NaN/inf keeps its old weights (`WeightsRejected`).
"""
from __future__ import annotations

import zlib
from collections.abc import Iterable, Mapping

import torch

ALGORITHM = "crc32"
DIGEST_BYTES = 4
# Types whose NaN/inf a min/max reduction shows (NaN propagates through it): one fast pass.
_MINMAX_DTYPES = {torch.float16, torch.bfloat16, torch.float32, torch.float64}


class WeightsRejected(ValueError):
    """A weight version failed its content check: the engine keeps the weights it has.
    `retry`: whether asking again may help (bytes damaged on the way; a stored object or a NaN
    the learner sent stays bad)."""

    def __init__(self, version: int, channel: str, tensor: str, why: str, retry: bool = False):
        self.version, self.channel, self.tensor, self.why, self.retry = version, channel, tensor, why, retry
        super().__init__(f"weights v{version} ({channel}) refused: tensor {tensor!r} {why}; "
                         f"the engine keeps its weights")


class _Crc32:
    """A running CRC-32 with hashlib's update/digest shape (zlib drops the GIL on big buffers)."""

    def __init__(self):
        self.value = 0

    def update(self, data) -> None:
        self.value = zlib.crc32(data, self.value)

    def digest(self) -> bytes:
        return self.value.to_bytes(DIGEST_BYTES, "little")


def new_hash() -> _Crc32:
    return _Crc32()


def raw_bytes(tensor: torch.Tensor) -> memoryview:
    """A tensor's bytes in C order, as a buffer the CRC reads without a copy (a device tensor
    is copied to host first)."""
    flat = tensor.detach().reshape(-1)
    if flat.device.type != "cpu":
        flat = flat.cpu()
    flat = flat.contiguous()
    if flat.numel() == 0:
        return memoryview(b"")
    return memoryview(flat.view(torch.uint8).numpy())


def digest(tensor: torch.Tensor) -> bytes:
    h = new_hash()
    h.update(raw_bytes(tensor))
    return h.digest()


def _storage_key(tensor: torch.Tensor) -> tuple:
    return tensor.data_ptr(), tuple(tensor.shape), tensor.stride(), tensor.dtype


def tensor_digests(named: Iterable[tuple[str, torch.Tensor]]) -> dict:
    """The pull channels' metadata: a digest per tensor name (names of one storage, a tied
    lm_head, are hashed once)."""
    done, out = {}, {}
    for name, tensor in named:
        key = _storage_key(tensor) if tensor.numel() else None
        if key is None or key not in done:
            value = digest(tensor).hex()
            if key is not None:
                done[key] = value
        out[name] = done[key] if key is not None else value
    return {"algorithm": ALGORITHM, "tensors": out}


def first_nonfinite(named: Iterable[tuple[str, torch.Tensor]]) -> str | None:
    """The name of the first floating tensor holding a NaN or an inf (None: all finite). One
    min/max pass per tensor, NaN propagating through it; other float types go through isfinite."""
    seen = set()
    for name, tensor in named:
        if not tensor.is_floating_point() or tensor.numel() == 0:
            continue
        key = _storage_key(tensor)
        if key in seen:
            continue
        seen.add(key)
        if tensor.dtype in _MINMAX_DTYPES:
            lo, hi = torch.aminmax(tensor.detach().reshape(-1))
            finite = bool(torch.isfinite(lo) & torch.isfinite(hi))
        else:  # float8 and the like: isfinite after a cast
            finite = bool(torch.isfinite(tensor.detach().float()).all())
        if not finite:
            return name
    return None


def check_tensors(version: int, channel: str, tensors: Mapping[str, torch.Tensor], integrity: dict | None) -> None:
    """WeightsRejected naming the first tensor whose bytes differ from the published digest, or
    the first holding a NaN/inf. `integrity` None (a payload built by hand, not by a sender):
    the finite check only."""
    if integrity is not None:
        _check_algorithm(version, channel, integrity)
        expected = integrity["tensors"]
        missing = [name for name in expected if name not in tensors]
        if missing:
            raise WeightsRejected(version, channel, missing[0], "is missing (it has a published digest)")
        checked = {}
        for name, tensor in tensors.items():
            key = _storage_key(tensor) if tensor.numel() else (name,)
            if key not in checked:
                checked[key] = digest(tensor).hex()
            _compare(version, channel, name, checked[key], expected.get(name))
    bad = first_nonfinite(tensors.items())
    if bad is not None:
        raise WeightsRejected(version, channel, bad, "holds a NaN or an inf")


def check_folder(version: int, path: str, integrity: dict | None) -> None:
    """`check_tensors` over a safetensors folder, read a tensor at a time (for an engine that
    reads the folder itself, e.g. a multiprocess vLLM core: it then loads what was checked)."""
    from safetensors import safe_open

    from lm.weight_sync.payloads import WEIGHTS_FILE

    with safe_open(f"{path}/{WEIGHTS_FILE}", framework="pt") as f:
        names = list(f.keys())
        if integrity is not None:
            _check_algorithm(version, "folder", integrity)
            missing = sorted(set(integrity["tensors"]) - set(names))
            if missing:
                raise WeightsRejected(version, "folder", missing[0], "is missing (it has a published digest)")
        for name in names:
            tensor = f.get_tensor(name)
            if integrity is not None:
                _compare(version, "folder", name, digest(tensor).hex(), integrity["tensors"].get(name))
            if first_nonfinite([(name, tensor)]) is not None:
                raise WeightsRejected(version, "folder", name, "holds a NaN or an inf")


def _compare(version: int, channel: str, name: str, got: str, want: str | None) -> None:
    if want is None:
        raise WeightsRejected(version, channel, name, "has no published digest")
    if got != want:
        raise WeightsRejected(version, channel, name, f"does not match its published digest ({ALGORITHM} "
                                                      f"{got[:12]}.. != {want[:12]}..)")


def _check_algorithm(version: int, channel: str, integrity: dict) -> None:
    if integrity.get("algorithm") != ALGORITHM:
        raise WeightsRejected(version, channel, "*", f"was hashed with {integrity.get('algorithm')!r}, this "
                                                     f"engine checks {ALGORITHM}")


# ---------------------------------------------------------------- broadcast: per-chunk digests


def trailer_bytes(chunks: int) -> int:
    """Size of the trailer that follows a stream of `chunks` chunks: their digests, in order."""
    return max(1, chunks) * DIGEST_BYTES


def pack_trailer(digests: list[bytes], device: torch.device | str = "cpu") -> torch.Tensor:
    data = b"".join(digests) or bytes(DIGEST_BYTES)
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).to(device)


def unpack_trailer(trailer: torch.Tensor, chunks: int) -> list[bytes]:
    data = bytes(raw_bytes(trailer))
    return [data[k * DIGEST_BYTES:(k + 1) * DIGEST_BYTES] for k in range(chunks)]


def check_chunks(version: int, layout, spans: list[tuple[int, int]], got: list[bytes], sent: list[bytes]) -> None:
    """WeightsRejected naming the first tensor in the first chunk whose bytes differ from what the
    sender hashed (damaged on the way: asking again may help)."""
    for k, (start, end) in enumerate(spans):
        if k >= len(got) or k >= len(sent) or got[k] != sent[k]:
            name = next((m.name for m in layout.stored if m.offset < end and m.end > start and m.nbytes), "(padding)")
            raise WeightsRejected(version, "broadcast", name, f"(or another in chunk {k}, bytes {start}..{end}) does "
                                  f"not match the digest the sender took ({ALGORITHM})", retry=True)
