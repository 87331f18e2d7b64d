"""etarl's gloo backend for vLLM's weight transfer (`vllm/distributed/weight_transfer/`), so a CPU
run takes the same trainer/engine path as NCCL on GPUs: the learner drives
`init_weight_transfer_engine`, `start_weight_update`, `update_weights` and
`finish_weight_update(weight_version=...)` on each engine, and the bytes arrive inside vLLM's
worker processes (every tensor-parallel rank its own receiver), never through the rollout actor.

`register()` is the `vllm.general_plugins` entry point (pyproject.toml): vLLM calls it in every
process it starts, so its factories know "gloo" (engine side) before the model loads, and the
learner's factory knows it too (trainer side).
"""
from __future__ import annotations

from collections.abc import Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor, wait
from dataclasses import asdict, dataclass
from typing import ClassVar

import torch
from vllm.distributed.weight_transfer.base import (
    ParamMeta,
    TrainerInitInfo,
    TrainerWeightTransferEngine,
    WeightSource,
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)
from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory, WeightTransferTrainerFactory

from lm.weight_sync.gloo_transfer import GlooReceiver, GlooSender, update_info
from lm.weight_sync.layout import Layout

BACKEND = "gloo"


class TensorsSource(WeightSource):
    """One version's tensors (name -> tensor on the learner's rank 0, or a `layout.BucketStream`
    read by name) with the layout they are sent in (names, shapes, the publish dtype): what the
    learner hands every backend. The sender sets both for each send."""

    def __init__(self):
        self.tensors: Mapping[str, torch.Tensor] = {}
        self.layout: Layout | None = None
        self.release = None  # called once the tensors are read: the learner's parameters may change
        # gloo (etarl's) has sent every byte when the iteration ends. vLLM's NCCL and IPC engines have
        # not: NCCL's packed copies run on their own streams, and an IPC engine reads the tensors
        # through their handles after the iteration; those are released when send_weights returns.
        self.release_when_read = True

    def metadata(self) -> list[ParamMeta]:
        return [ParamMeta(m.name, m.torch_dtype, m.shape) for m in self.layout.stored]

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        for meta in self.layout.stored:
            tensor = self.tensors[meta.name]
            yield meta.name, tensor if tensor.dtype == meta.torch_dtype else tensor.to(meta.torch_dtype)
        if self.release_when_read:
            self.read()

    def read(self) -> None:
        """Every byte has left: free the tensors (before the engines have loaded them)."""
        if self.release is not None:
            self.release()


# ---------------------------------------------------------------- engine side (in vLLM's workers)

@dataclass
class GlooInitInfo(WeightTransferInitInfo):
    master_address: str
    master_port: int
    prefix: str
    world_size: int
    timeout_s: float
    rank_offset: int = 1
    address: str | None = None  # this engine's node address, for gloo's sockets


@dataclass
class GlooUpdateInfo(WeightTransferUpdateInfo):
    version: int
    layout: dict
    chunk_bytes: int
    topology: str
    ahead_bytes: int | None = None


class GlooWeightTransferEngine(WeightTransferEngine[GlooInitInfo, GlooUpdateInfo]):
    """Receives a whole version, checks it, then loads it through vLLM's layer-wise reload (so a
    refused or failed receive leaves the model untouched: start and finish have nothing to do)."""

    init_info_cls = GlooInitInfo
    update_info_cls = GlooUpdateInfo
    supports_draft_weight_update = False

    def __init__(self, config, vllm_config, device, model) -> None:
        super().__init__(config, vllm_config, device, model)
        self.receiver = GlooReceiver()

    def init_transfer_engine(self, init_info: GlooInitInfo) -> None:
        parallel = self.parallel_config
        rank = init_info.rank_offset + parallel.data_parallel_index * parallel.world_size + parallel.rank
        self.receiver.init(asdict(init_info), rank)

    def start_weight_update(self) -> None:
        pass

    def receive_weights(self, update_info: GlooUpdateInfo) -> None:
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload, initialize_layerwise_reload

        weights = self.receiver.receive(asdict(update_info))
        initialize_layerwise_reload(self.model)
        try:
            self.model.load_weights(weights)
        finally:
            finalize_layerwise_reload(self.model, self.model_config)
        del weights
        self.receiver.recycle()

    def update_weights(self, update_info: dict) -> None:
        self.receive_weights(self.parse_update_info(update_info))  # host memory: nothing to synchronise

    def finish_weight_update(self) -> None:
        pass

    def shutdown(self) -> None:
        self.receiver.shutdown()


# ---------------------------------------------------------------- trainer side (the learner's rank 0)

@dataclass
class GlooTrainerInitInfo(TrainerInitInfo):
    backend: ClassVar[str] = BACKEND
    address: str = "127.0.0.1"
    world_size: int = 2
    timeout_s: float = 120.0
    chunk_bytes: int = 32 << 20
    topology: str = "chain"
    ahead_bytes: int | None = None


class GlooTrainerWeightTransferEngine(TrainerWeightTransferEngine[GlooTrainerInitInfo]):
    """vLLM's trainer-side contract over etarl's gloo stream. `source` is a `TensorsSource`; the
    version a round carries is set on `version` before `send_weights()`."""

    init_info_cls = GlooTrainerInitInfo

    def __init__(self, *, client, source, init_info: GlooTrainerInitInfo):
        super().__init__(client=client, source=source, is_sender=init_info.is_sender)
        self.settings, self.version = init_info, 0
        self.sender: GlooSender | None = None

    @classmethod
    def trainer_init(cls, init_info: GlooTrainerInitInfo, *, client, source=None):
        if not isinstance(source, TensorsSource):
            raise ValueError("the gloo weight transfer sends a TensorsSource")
        engine = cls(client=client, source=source, init_info=init_info)
        if not engine.is_sender:
            return engine
        engine.sender = GlooSender(init_info.address, init_info.world_size, init_info.timeout_s)
        with ThreadPoolExecutor(max_workers=1) as pool:  # the engines block in the rendezvous meanwhile
            joined = pool.submit(client.init_weight_transfer_engine, engine.sender.init_info())
            try:
                engine.sender.join()
            finally:
                joined.result()
        return engine

    def send_weights(self) -> None:
        if not self.is_sender:
            return
        s, source = self.settings, self.source
        layout = source.layout
        self.client.start_weight_update()
        with ThreadPoolExecutor(max_workers=1) as pool:  # the engines receive while this sends
            received = pool.submit(self.client.update_weights,
                                   update_info(self.version, layout, s.chunk_bytes, s.topology, s.ahead_bytes))
            try:
                self.sender.send(layout, source.tensors, s.chunk_bytes, s.topology)
                source.read()
            except BaseException:
                wait([received])  # the engines' answers (they fail too), then the send's own error
                raise
            received.result()  # an engine that refused the version (the stream itself went through)
        self.client.finish_weight_update(str(self.version))

    def shutdown(self) -> None:
        if self.sender is not None:
            self.sender.shutdown()


def register() -> None:
    """The `vllm.general_plugins` entry point (called once or more per process)."""
    for factory, engine in ((WeightTransferEngineFactory, GlooWeightTransferEngine),
                            (WeightTransferTrainerFactory, GlooTrainerWeightTransferEngine)):
        try:
            factory.register_engine(BACKEND, engine)
        except ValueError:  # registered already in this process
            pass
