"""The send side of the three weight channels (`WeightSender.send(version, tensors, release)`).

Each runs on the learner's rank 0, in the publication thread (`publication.Publication`), and
calls `release()` as soon as it no longer reads the tensors (the learner's parameters may then
change). Each returns its timings: `own_s` (the sender's own time: put, write, or send) and
`served_s` (until every reader has the version, where the channel can know it). Every version
carries the digests of its bytes (`integrity`): a pull payload has one per tensor, a broadcast
one per chunk after its last chunk; receivers check them before an engine swaps.
"""
from __future__ import annotations

import logging
import shutil
import time
from pathlib import Path

import torch

from lm.weight_sync import integrity
from lm.weight_sync.board_client import BoardWeightSyncClient, WeightUpdateFailed
from lm.weight_sync.group import call, node_address
from lm.weight_sync.layout import Layout, cast
from lm.weight_sync.payloads import save_weights_folder, to_shared_arrays

log = logging.getLogger(__name__)


class ObjectStoreSender:
    """One shared object per version in the Ray object store (numpy arrays: zero-copy readers)."""

    catch_up_poll_s = None

    def __init__(self, board, dtype: torch.dtype | None = None):
        self.board, self.dtype = board, dtype

    def send(self, version: int, tensors: dict[str, torch.Tensor], release) -> dict:
        import ray

        start = time.perf_counter()
        try:
            cast_tensors = cast(tensors, self.dtype)
            ref = ray.put(to_shared_arrays(cast_tensors))
            digests = integrity.tensor_digests(cast_tensors.items())
        finally:
            release()
        call(self.board, "publish", {"version": version, "kind": "object_ref", "ref": [ref], "integrity": digests})
        return {"own_s": time.perf_counter() - start}

    def close(self) -> None:
        pass


class FolderSender:
    """A safetensors folder per version. A version's folder stays while a reader may still read it
    (it is live, or claimed on the board within `claim_timeout_s`): retention by version."""

    catch_up_poll_s = None

    def __init__(self, board, root: str, dtype: torch.dtype | None = None, claim_timeout_s: float = 600.0):
        self.board, self.root, self.dtype, self.claim_timeout_s = board, Path(root), dtype, claim_timeout_s
        self.written: dict[int, Path] = {}

    def send(self, version: int, tensors: dict[str, torch.Tensor], release) -> dict:
        start = time.perf_counter()
        try:
            cast_tensors = cast(tensors, self.dtype)
            folder = save_weights_folder(cast_tensors, self.root / f"v{version:06d}", version)
            digests = integrity.tensor_digests(cast_tensors.items())
        finally:
            release()
        self.written[version] = folder
        call(self.board, "publish", {"version": version, "kind": "folder", "path": str(folder), "integrity": digests})
        self.prune()
        return {"own_s": time.perf_counter() - start}

    def prune(self) -> list[int]:
        """Delete the folders no reader may still read; the versions deleted."""
        retained = call(self.board, "retained_versions", self.claim_timeout_s)
        for reader in retained["expired_readers"]:
            log.warning("weights: %s held a version for more than %.0fs (weight_sync.claim_timeout_s); its "
                        "claim is dropped", reader, self.claim_timeout_s)
        gone = [v for v in self.written if v not in retained["versions"] and v < max(self.written)]
        for version in gone:
            shutil.rmtree(self.written.pop(version), ignore_errors=True)
        return gone

    def close(self) -> None:
        pass


class BroadcastSender:
    """Rank 0 of the weight group, through vLLM's weight transfer: announce, wait for the members
    (bounded), then drive a trainer engine of vLLM's factory (`gloo`: etarl's, registered by
    `vllm_plugin`; `nccl`, `ipc`: vLLM's own) whose client is the board (`BoardWeightSyncClient`).

    Settings: backend (gloo|nccl|ipc), topology (gloo: chain|star), chunk_bytes, ready_timeout_s (how
    long a member may take to reach its interrupt point), timeout_s (the group's collective timeout,
    and how long a member may take to answer a call), address (this node's), ahead_bytes (gloo: what
    a member may hold received but not yet forwarded; None: a whole version)."""

    catch_up_poll_s = 0.5

    def __init__(self, board, backend: str, topology: str, chunk_bytes: int, ready_timeout_s: float,
                 timeout_s: float, address: str | None = None, dtype: torch.dtype | None = None,
                 ahead_bytes: int | None = None):
        from lm.weight_sync import vllm_plugin

        vllm_plugin.register()  # the learner's process loads no vLLM plugins by itself
        self.board, self.dtype = board, dtype
        self.backend, self.topology, self.chunk_bytes = backend, topology, int(chunk_bytes)
        self.ready_timeout_s, self.timeout_s = ready_timeout_s, float(timeout_s)
        self.ahead_bytes = ahead_bytes
        self.address = address or node_address()
        self.source = vllm_plugin.TensorsSource()
        self._trainer = None  # the trainer engine of the current generation
        self._generation = None

    def send(self, version: int, tensors, release, catch_up: bool = False, layout: Layout | None = None) -> dict:
        """Send `version` to every member (a new version: waiting for them, bounded) or to the
        members behind it (`catch_up`: a restarted or late engine, no waiting). `tensors`: a
        mapping, or a `layout.BucketStream` read by name with its `layout` given."""
        layout = layout or Layout.of(tensors.items(), self.dtype)
        started = time.perf_counter()
        try:
            if not catch_up:
                call(self.board, "announce", version, layout.to_wire())
                self._wait_ready(version)
            send = call(self.board, "start_send", version, {"backend": self.backend, "timeout_s": self.timeout_s},
                        not catch_up)
            for worker, why in send["left_out"].items():
                log.warning("weights v%d: %s left out of this send (weight_sync.ready_timeout_s=%.0fs): %s; it "
                            "rejoins when it next asks", version, worker, self.ready_timeout_s, why)
            own_start = read_at = time.perf_counter()
            if send["members"]:
                read = []  # when the tensors were read: the sender's own part ends there

                def released():
                    read.append(time.perf_counter())
                    release()

                self._send(send, version, tensors, released, layout)
                read_at = read[0] if read else time.perf_counter()
            own_s = read_at - own_start
        finally:
            release()
            if not catch_up:  # live even after a failed send: the members that missed it catch up
                call(self.board, "publish", {"version": version, "kind": "broadcast"})
        return {"own_s": own_s, "served_s": time.perf_counter() - started if send["members"] else 0.0,
                "ready_wait_s": own_start - started, "engines": len(send["members"])}

    def _wait_ready(self, version: int) -> None:
        deadline = time.monotonic() + self.ready_timeout_s
        while call(self.board, "wait_ready", version, max(0.0, deadline - time.monotonic())):
            if time.monotonic() >= deadline:
                return

    def _send(self, send: dict, version: int, tensors, release, layout: Layout) -> None:
        """Every call of the round goes to the members; the round ends when all have finished (the
        version is served) or, after a failure, once the others are finished or aborted."""
        client = BoardWeightSyncClient(self.board, version, send["members"], self.timeout_s)
        self.source.tensors, self.source.release, self.source.layout = tensors, release, layout
        self.source.release_when_read = self.backend == "gloo"  # see TensorsSource
        try:
            trainer = self._trainer_of(send, client)
            trainer.client, trainer.version = client, version
            trainer.send_weights()
        except WeightUpdateFailed as err:
            if err.op not in ("update", "finish") or err.unanswered:  # a member may be gone: so is the group
                self._failed(err, version, send, client)
            # The stream went through: the others finish, the group stays; those named keep their
            # weights and get the next version.
            client.end()
            for worker, why in err.errors.items():
                log.warning("weights v%d: %s failed to load it: %s", version, worker, why)
        except Exception as err:
            self._failed(err, version, send, client)
        finally:
            self.source.tensors, self.source.release, self.source.layout = {}, None, None

    def _failed(self, err: Exception, version: int, send: dict, client: BoardWeightSyncClient):
        """The group itself failed (a member died, the rendezvous timed out): a new one next time."""
        self._drop_trainer()
        call(self.board, "forget_generation")
        client.end()
        raise RuntimeError(f"weights v{version}: the send to {sorted(send['members'])} failed "
                           f"({type(err).__name__}: {err})") from err

    def _trainer_of(self, send: dict, client: BoardWeightSyncClient):
        """The trainer engine of this send's generation (a new generation: a new group)."""
        if self._trainer is not None and self._generation == send["generation"]:
            return self._trainer
        from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

        self._drop_trainer()  # the old generation's group goes before the new one forms
        self._trainer = WeightTransferTrainerFactory.trainer_init(self._init_info(send["world"]), client=client,
                                                                  source=self.source)
        self._generation = send["generation"]
        return self._trainer

    def _init_info(self, world: int):
        if self.backend == "ipc":  # an engine on the learner's GPU: CUDA IPC handles, no group
            from vllm.distributed.weight_transfer.ipc_engine import IPCTrainerInitInfo

            return IPCTrainerInitInfo(rank=0)
        if self.backend == "nccl":
            from vllm.distributed.weight_transfer.nccl_engine import NCCLTrainerInitInfo

            return NCCLTrainerInitInfo(master_address=self.address, master_port=_free_port(self.address),
                                       world_size=world, rank=0)
        from lm.weight_sync.vllm_plugin import GlooTrainerInitInfo

        return GlooTrainerInitInfo(rank=0, address=self.address, world_size=world, timeout_s=self.timeout_s,
                                   chunk_bytes=self.chunk_bytes, topology=self.topology,
                                   ahead_bytes=self.ahead_bytes)

    def _drop_trainer(self) -> None:
        trainer, self._trainer, self._generation = self._trainer, None, None
        if trainer is not None:
            trainer.shutdown()

    def close(self) -> None:
        self._drop_trainer()


def _free_port(address: str) -> int:
    import socket

    with socket.socket() as probe:
        probe.bind((address, 0))
        return probe.getsockname()[1]
