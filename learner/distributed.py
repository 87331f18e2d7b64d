"""Data parallelism for the learner: how ranks talk (`LocalComm`, `ProcessGroupComm`) and a group
of learner ranks run as Ray actors (`LearnerGroup`).

Every rank receives the whole pulled batch and trains on its shard (the groups at its position
within each minibatch, see `Learner.train_step`). Losses are normalised by the token and sequence
counts of the whole minibatch, summed over ranks, and gradients are summed (not averaged), so N
ranks make exactly the update one rank makes on the same batch.

CPU: gloo, full replicas, one flattened all-reduce of the gradients per optimizer step.
GPU: nccl with the same all-reduce, or `strategy=fsdp` (torch FSDP2 `fully_shard`, parameters
sharded across ranks). The nccl and FSDP paths are written for GPU machines and are not exercised
by the CPU test suite.
"""
from __future__ import annotations

import datetime
import os
import socket
import tempfile
import uuid
from pathlib import Path

import torch
import torch.distributed as dist


class LocalComm:
    """A world of one: every collective is the identity."""

    rank = 0
    world_size = 1

    def all_reduce_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor

    def all_reduce(self, tensor: torch.Tensor, op: str) -> torch.Tensor:
        return tensor

    def sum_gradients(self, params) -> None:
        return None

    def barrier(self) -> None:
        return None


class ProcessGroupComm:
    """Collectives over an initialised torch.distributed process group."""

    _OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}

    def __init__(self, rank: int, world_size: int, sum_grads: bool = True):
        self.rank = rank
        self.world_size = world_size
        self._sum_grads = sum_grads  # FSDP reduces gradients itself

    def all_reduce(self, tensor: torch.Tensor, op: str) -> torch.Tensor:
        dist.all_reduce(tensor, op=self._OPS[op])
        return tensor

    def all_reduce_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        return self.all_reduce(tensor, "sum")

    def sum_gradients(self, params) -> None:
        """Sum every parameter's gradient over the ranks in one flattened all-reduce."""
        if not self._sum_grads:
            return
        params = [p for p in params if p.requires_grad]
        for p in params:
            if p.grad is None:  # a parameter this rank's shard did not touch still takes part
                p.grad = torch.zeros_like(p)
        flat = torch.cat([p.grad.reshape(-1) for p in params])
        dist.all_reduce(flat, op=dist.ReduceOp.SUM)
        offset = 0
        for p in params:
            n = p.grad.numel()
            p.grad.copy_(flat[offset : offset + n].view_as(p.grad))
            offset += n

    def barrier(self) -> None:
        dist.barrier()


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


_LOOPBACK = ("127.0.0.1", "localhost", "::1")


def rendezvous_url(master_addr: str, master_port: int) -> str:
    """Where the ranks meet. Ranks on one machine (a loopback master_addr) meet through a fresh
    file: torch's TCPStore server listens on every interface whatever address it is given, and a
    local run keeps every socket on 127.0.0.1. Across machines: tcp://master_addr:port."""
    if master_addr in _LOOPBACK:
        return f"file://{tempfile.gettempdir()}/etarl-rendezvous-{uuid.uuid4().hex}"
    return f"tcp://{master_addr}:{master_port or free_port(master_addr)}"


def init_process_group(rank: int, world_size: int, backend: str, init_method: str, timeout_s: float) -> None:
    if dist.is_initialized():
        raise RuntimeError("torch.distributed is already initialised in this process")
    if init_method.startswith("file://") and backend == "gloo":
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # gloo's pair sockets on loopback too
    dist.init_process_group(
        backend=backend,
        init_method=init_method,
        rank=rank,
        world_size=world_size,
        timeout=datetime.timedelta(seconds=timeout_s),
    )


class LearnerRank:
    """One rank of a learner group: joins the process group, then holds a `Learner`.
    Made a Ray actor by `LearnerGroup` (or by services); plain class, plain-dict results."""

    def __init__(self, config, rank: int, init_method: str):
        from learner.trainer import Learner

        torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
        dcfg = config.distributed
        init_process_group(rank, dcfg.world_size, dcfg.backend, init_method, dcfg.timeout_s)
        comm = ProcessGroupComm(rank, dcfg.world_size, sum_grads=dcfg.strategy != "fsdp")
        self.learner = Learner(config, comm=comm)

    def call(self, name: str, *args, **kwargs):
        attr = getattr(self.learner, name)
        return attr(*args, **kwargs) if callable(attr) else attr

    def shutdown(self) -> None:
        self.learner.close_weight_sync()
        if dist.is_initialized():
            dist.destroy_process_group()


class LearnerGroup:
    """`world_size` learner ranks as Ray actors, driven together. Every rank runs each step on
    its shard; rank 0's metrics and weight payloads are returned (all ranks hold the same weights).

    `ray_options` go to each rank's actor (e.g. {"num_cpus": 1} or {"num_gpus": 1})."""

    def __init__(self, config, ray_options: dict | None = None):
        import ray

        dcfg = config.distributed
        self.init_method = rendezvous_url(dcfg.master_addr, dcfg.master_port)
        options = {"num_cpus": 1, **(ray_options or {})}
        actor = ray.remote(LearnerRank)
        self.config = config
        self.world_size = dcfg.world_size
        self.ranks = [actor.options(**options).remote(config, rank, self.init_method)
                      for rank in range(dcfg.world_size)]
        self._call_all("version")  # wait until every rank has joined and loaded the model

    def _call_all(self, method: str, *args, **kwargs) -> list:
        import ray

        return ray.get([r.call.remote(method, *args, **kwargs) for r in self.ranks])

    @property
    def version(self) -> int:
        return self._call_all("version")[0]

    def train_step(self, groups) -> dict[str, float]:
        import ray

        groups_ref = ray.put(list(groups))  # one copy in the object store, read by every rank
        return self._call_all("train_step", groups_ref)[0]

    def attach_weight_board(self, board) -> None:
        """Rank 0 publishes through `board` (the run's `WeightStore` actor) from now on."""
        self._call_all("attach_weight_board", board)

    def publish_weights(self) -> dict:
        """Start publishing the current version (it goes out while the next step runs); rank 0's
        timings. Every rank calls in: with FSDP, gathering the full weights is a collective."""
        return self._call_all("publish_weights")[0]

    def published(self, timeout: float = 120.0) -> dict | None:
        """The live payload once the current version is out (rank 0's board)."""
        import ray

        return ray.get(self.ranks[0].call.remote("published", timeout))

    def weights_payload(self) -> dict:
        """The current weights as one object-store payload (the evaluator's engine)."""
        return self._call_all("weights_payload")[0]

    def state_dict(self) -> dict:
        return self._call_all("state_dict")[0]

    def load_state_dict(self, state: dict) -> None:
        self._call_all("load_state_dict", state)

    def save_checkpoint(self, folder: str) -> None:
        self._call_all("save_checkpoint", str(folder))

    def load_checkpoint(self, folder: str) -> None:
        self._call_all("load_checkpoint", str(folder))

    def save_policy(self, folder: str) -> None:
        self._call_all("save_policy", str(folder))

    def shutdown(self) -> None:
        import ray

        try:
            ray.get([r.shutdown.remote() for r in self.ranks])
        finally:
            for r in self.ranks:
                ray.kill(r)
            if self.init_method.startswith("file://"):
                Path(self.init_method[len("file://"):]).unlink(missing_ok=True)
