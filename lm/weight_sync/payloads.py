"""Weight payloads of the pull channels: a small dict the board (`WeightStore`) holds as the live
version and a worker turns into tensors.
  {"version": v, "kind": "object_ref", "ref": [ObjectRef]}   one shared object in the Ray object store
  {"version": v, "kind": "folder", "path": "/.../v000012"}   a versioned safetensors folder
  {"version": v, "kind": "broadcast"}                         pushed over the weight group (no tensors here)
The ref is wrapped in a list so Ray passes the reference itself, not its value, through actors.

The object holds numpy arrays, not torch tensors: Ray maps numpy arrays of an object read-only
into every reader on the node (zero copy), while torch tensors are unpickled into private copies.
So a node keeps one copy of a version however many engines read it; each engine copies straight
from it into its model. bfloat16, which numpy lacks, travels as its bits (uint16) and is viewed
back on the way out.
"""
from __future__ import annotations

import json
import os
import shutil
import warnings
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from lm.weight_sync.layout import dtype_name

WEIGHTS_FILE = "model.safetensors"
_NUMPY_LACKS = {torch.bfloat16: np.uint16}


def save_weights_folder(state_dict: dict[str, torch.Tensor], folder: str | os.PathLike, version: int) -> Path:
    """Write weights as <folder>/model.safetensors plus a version marker, atomically (rename)."""
    folder = Path(folder)
    tmp = folder.with_name(folder.name + ".tmp")
    tmp.mkdir(parents=True, exist_ok=True)
    tensors, seen = {}, set()
    for name, tensor in state_dict.items():
        tensor = tensor.detach().contiguous().cpu()
        # safetensors refuses tensors that share storage (a tied lm_head): those get their own copy
        tensors[name] = tensor.clone() if tensor.data_ptr() in seen else tensor
        seen.add(tensor.data_ptr())
    save_file(tensors, str(tmp / WEIGHTS_FILE))
    (tmp / "version.json").write_text(json.dumps({"version": version}))
    if folder.exists():
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


def folder_weight_shapes(model_dir: str | os.PathLike) -> tuple[dict[str, tuple[int, ...]], set[str]]:
    """Shapes by name of an HF folder's safetensors weights (headers only, nothing loaded), and the
    names a model built from it may lack: lm_head.weight when the embeddings are tied (the learner
    may send it, the checkpoint need not hold it). A config.json without tie_word_embeddings (one
    whose model class ties by default, as Gemma's, leaves it out) is tied where its weights hold no
    lm_head: a model could not run without one otherwise."""
    from safetensors import safe_open

    model_dir = Path(model_dir)
    shapes = {}
    for path in sorted(model_dir.glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as f:
            shapes.update({name: tuple(f.get_slice(name).get_shape()) for name in f.keys()})
    config = json.loads((model_dir / "config.json").read_text())
    tied = config.get("tie_word_embeddings", "lm_head.weight" not in shapes)
    if tied and "lm_head.weight" not in shapes and "model.embed_tokens.weight" in shapes:
        shapes["lm_head.weight"] = shapes["model.embed_tokens.weight"]
    return shapes, {"lm_head.weight"} if tied else set()


def to_shared_arrays(state: dict[str, torch.Tensor]) -> dict:
    """The object put into the object store: numpy arrays (zero-copy for readers) plus dtypes.
    Names of one storage (a tied lm_head) share one array object, which pickling stores once."""
    arrays, dtypes, by_storage = {}, {}, {}
    for name, tensor in state.items():
        tensor = tensor.detach().cpu().contiguous()
        dtypes[name] = dtype_name(tensor.dtype)
        key = (tensor.data_ptr(), tuple(tensor.shape), tensor.dtype)
        if key not in by_storage:
            if tensor.dtype in _NUMPY_LACKS:
                tensor = tensor.view(getattr(torch, np.dtype(_NUMPY_LACKS[tensor.dtype]).name))
            by_storage[key] = tensor.numpy()
        arrays[name] = by_storage[key]
    return {"arrays": arrays, "dtypes": dtypes}


def from_shared_arrays(obj: dict) -> dict[str, torch.Tensor]:
    """Tensors viewing the object's (read-only, shared) arrays: consumers copy out, never write."""
    out = {}
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        for name, array in obj["arrays"].items():
            out[name] = torch.from_numpy(array).view(getattr(torch, obj["dtypes"][name]))
    return out


def resolve_weights(payload: dict) -> dict[str, torch.Tensor]:
    """Turn a pull payload into a state dict (the shared object's views, or the folder read)."""
    kind = payload.get("kind")
    if kind == "object_ref":
        import ray

        return from_shared_arrays(ray.get(payload["ref"][0]))
    if kind == "folder":
        return load_weights_folder(payload["path"])[1]
    if kind == "broadcast":
        raise ValueError(f"weights v{payload.get('version')} went out over the broadcast group: they are "
                         "received in a send (lm.weight_sync.WeightSubscription), not resolved from a payload")
    raise ValueError(f"unknown weight payload kind {kind!r}")
