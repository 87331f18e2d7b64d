"""Weight publication payloads, shared by the learner (publisher) and the workers (consumers).

A payload is a small dict that travels through a Ray actor (`WeightStore`) or any other channel:
  {"version": v, "kind": "object_ref", "ref": [ObjectRef]}   one put into the Ray object store
  {"version": v, "kind": "folder", "path": "/.../v000012"}   a versioned safetensors folder
The ref is wrapped in a list so Ray passes the reference itself, not its value, through actors.
"""
from __future__ import annotations

import json
import os
import threading
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

WEIGHTS_FILE = "model.safetensors"


def save_weights_folder(state_dict: dict[str, torch.Tensor], folder: str | os.PathLike, version: int) -> Path:
    """Write weights as <folder>/model.safetensors plus a version marker, atomically (rename)."""
    folder = Path(folder)
    tmp = folder.with_name(folder.name + ".tmp")
    tmp.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.detach().contiguous().cpu() for k, v in state_dict.items()}
    save_file(tensors, str(tmp / WEIGHTS_FILE))
    (tmp / "version.json").write_text(json.dumps({"version": version}))
    if folder.exists():
        import shutil

        shutil.rmtree(folder)
    tmp.rename(folder)
    return folder


def load_weights_folder(folder: str | os.PathLike) -> tuple[int, dict[str, torch.Tensor]]:
    folder = Path(folder)
    path = folder / WEIGHTS_FILE
    if not path.is_file():
        raise FileNotFoundError(f"weights folder {str(folder)!r} has no {WEIGHTS_FILE}")
    version = json.loads((folder / "version.json").read_text())["version"]
    return int(version), load_file(str(path))


def resolve_weights(payload: dict) -> dict[str, torch.Tensor]:
    """Turn a payload into a state dict (fetching from the object store or reading the folder)."""
    kind = payload.get("kind")
    if kind == "object_ref":
        import ray

        return ray.get(payload["ref"][0])
    if kind == "folder":
        return load_weights_folder(payload["path"])[1]
    raise ValueError(f"unknown weight payload kind {kind!r}")


class WeightStore:
    """Holds the latest published payload. Run as a Ray actor by the controller; the learner
    calls publish(), workers call latest() between generations (a restarted worker too)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._payload: dict | None = None

    def publish(self, payload: dict) -> None:
        with self._lock:
            if self._payload is not None and payload["version"] < self._payload["version"]:
                raise ValueError(
                    f"weight version went backwards: {payload['version']} < {self._payload['version']}"
                )
            self._payload = payload

    def latest_version(self) -> int:
        with self._lock:
            return -1 if self._payload is None else int(self._payload["version"])

    def latest(self) -> dict | None:
        with self._lock:
            return self._payload
