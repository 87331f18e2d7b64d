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
from lm.weight_sync.board import WeightStore
from lm.weight_sync.integrity import WeightsRejected
from lm.weight_sync.layout import Layout
from lm.weight_sync.payloads import load_weights_folder, resolve_weights, save_weights_folder
from lm.weight_sync.publication import ParameterGuard, Publication
from lm.weight_sync.senders import BroadcastSender, FolderSender, ObjectStoreSender
from lm.weight_sync.subscription import WeightSubscription, check_fits

__all__ = [
    "BroadcastSender", "FolderSender", "Layout", "ObjectStoreSender", "ParameterGuard", "Publication",
    "WeightStore", "WeightSubscription", "WeightsRejected", "check_fits", "load_weights_folder", "resolve_weights",
    "save_weights_folder",
]
