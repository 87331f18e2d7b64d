"""Which device a process computes on: the GPU Ray assigned to it, or the CPU.

`auto` (the default of `learner.device` and `rollout.engine.device`): CUDA when Ray gave this
actor a GPU and CUDA works in this process, else the CPU. A Ray actor that asked for no GPU runs
on the CPU even on a GPU node: Ray leaves CUDA_VISIBLE_DEVICES untouched for it, so opening
`cuda` there would take a GPU another actor owns. Outside Ray (a plain process, `etarl eval`)
`auto` means CUDA if the process sees a GPU. `cuda` insists: an error where there is none.

The device is always `cuda:0` of the process: Ray sets CUDA_VISIBLE_DEVICES to the GPUs it
assigned, so the first visible GPU is the actor's own (a tensor-parallel engine sees all of its
GPUs, and vLLM spreads over them).
"""
from __future__ import annotations

import logging
import sys

import torch

log = logging.getLogger("etarl")
DEVICES = ("auto", "cpu", "cuda")
_warned: set[str] = set()


def ray_gpu_ids() -> list[str] | None:
    """The GPU ids Ray assigned to this process; None outside a Ray actor or task."""
    ray = sys.modules.get("ray")  # never imports Ray: a process that has not is not in Ray
    if ray is None or not ray.is_initialized():
        return None
    from ray._private.worker import global_worker

    if global_worker.mode != ray.WORKER_MODE:
        return None  # the driver
    return [str(g) for g in ray.get_gpu_ids()]


def resolve_device(requested: str, what: str) -> torch.device:
    """The device `what` (e.g. "learner rank 1") computes on; see the module doc."""
    if requested not in DEVICES:
        raise ValueError(f"{what}: device must be one of {DEVICES}, got {requested!r}")
    if requested == "cpu":
        return torch.device("cpu")
    gpus = ray_gpu_ids()
    cuda = torch.cuda.is_available()
    if requested == "cuda":
        if gpus == []:
            raise RuntimeError(f"{what}: device 'cuda', but Ray assigned this actor no GPU; it would use a GPU "
                               f"it does not own. Give the cluster GPUs (see `etarl plan`) or use device 'auto'")
        if not cuda:
            raise RuntimeError(f"{what}: device 'cuda', but CUDA is not available in this process "
                               f"(torch {torch.__version__}); use device 'auto' or 'cpu'")
        return torch.device("cuda", 0)
    wanted = cuda if gpus is None else bool(gpus)
    if not wanted:
        return torch.device("cpu")
    if not cuda:
        if what not in _warned:
            _warned.add(what)
            log.warning("%s: Ray assigned GPU %s but CUDA is not available in this process (torch %s): "
                        "computing on the CPU", what, ",".join(gpus), torch.__version__)
        return torch.device("cpu")
    return torch.device("cuda", 0)


def gpu_memory_peaks(device: torch.device) -> dict[str, int]:
    """This process's peak GPU memory on `device` since it started, in bytes: max_memory_allocated
    by tensors, max_memory_reserved by the caching allocator (what the GPU sees taken); {} on the CPU."""
    if device.type != "cuda":
        return {}
    return {"max_memory_allocated": torch.cuda.max_memory_allocated(device),
            "max_memory_reserved": torch.cuda.max_memory_reserved(device)}
