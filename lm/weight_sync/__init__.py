"""Weight channels: how each version of the learner's weights reaches the rollout engines.

Three channels (`learner.weight_sync.channel`), one protocol around the board (`WeightStore`):
  object_store  one shared object per version in the Ray object store (small models);
  folder        a safetensors folder per version, kept while a reader may still read it;
  broadcast     vLLM's weight transfer: the learner drives each engine's weight update through the
                board (`board_client`) and sends each version once, into vLLM's own worker
                processes: nccl, ipc (vLLM's), or gloo (etarl's, `vllm_plugin`, `gloo_transfer`:
                in chunks down a chain).
The learner side: `Publication` (a thread on rank 0; the next step starts while it sends) around
a sender of `senders`. The worker side: `WeightSubscription.receive(engine, ...)` at the worker's
interrupt point. The wire: `layout.Layout` (the metadata header) and `stream` (chunks).
Every version carries digests of its bytes (`integrity`), checked with a NaN/inf check before an
engine swaps; a version that fails is refused (`WeightsRejected`) and the engine keeps its weights.
"""
import importlib

# Each name's module, imported on first use (PEP 562): the board's actor process (`WeightStore`,
# a Ray actor of its own in every run) imports `lm.weight_sync.board` alone, without torch (3-5 s
# of CPU a run on 2 cores), while `from lm.weight_sync import X` reads as before.
_HOMES = {
    "BroadcastSender": "senders", "FolderSender": "senders", "ObjectStoreSender": "senders",
    "Layout": "layout", "ParameterGuard": "publication", "Publication": "publication", "WeightStore": "board",
    "WeightSubscription": "subscription", "check_fits": "subscription", "WeightsRejected": "integrity",
    "load_weights_folder": "payloads", "resolve_weights": "payloads", "save_weights_folder": "payloads",
}
__all__ = sorted(_HOMES)


def __getattr__(name: str):
    if name not in _HOMES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{_HOMES[name]}"), name)
    globals()[name] = value  # once
    return value
