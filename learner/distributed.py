"""Data parallelism for the learner: how ranks talk (`LocalComm`, `ProcessGroupComm`) and a group
of learner ranks run as Ray actors (`LearnerGroup`).

Every rank receives the whole pulled batch and trains on its shard (the groups at its position
within each minibatch, see `Learner.train_step`). Losses are normalised by the token and sequence
counts of the whole minibatch, summed over ranks, and gradients are summed (not averaged), so N
ranks make exactly the update one rank makes on the same batch.

`strategy=allreduce`: full replicas, one flattened all-reduce of the gradients per optimizer step.
`strategy=fsdp`: torch FSDP2 `fully_shard`, parameters, gradients and optimizer state sharded
across ranks; every rank makes the same passes (`learner.batch.plan_micro_batches`), a rank without
rows for one running a zero-weight pass, because each pass is a collective. gloo (CPU) runs both
in the test suite; nccl (GPU) runs the same code and is not exercised there.
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
        # FSDP reduces gradients itself; a world of one has nothing to sum (over gloo a GPU's
        # gradients would cross the host and back every optimizer step for nothing)
        self._sum_grads = sum_grads and world_size > 1

    def all_reduce(self, tensor: torch.Tensor, op: str) -> torch.Tensor:
        """The reduced tensor, on the input's device. nccl reduces CUDA tensors only: counts and
        metrics made on the CPU go to this rank's GPU and back."""
        if dist.get_backend() == "nccl" and tensor.device.type != "cuda":
            on_gpu = tensor.to(torch.device("cuda", torch.cuda.current_device()))
            dist.all_reduce(on_gpu, op=self._OPS[op])
            return on_gpu.to(tensor.device)
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


def shard_model(model, mixed_precision: str | None = None):
    """FSDP2: shard every decoder layer, then the root (embeddings, final norm, LM head). With
    `mixed_precision="bfloat16"` FSDP's MixedPrecisionPolicy keeps the sharded master weights (and
    so the optimizer) in float32, gathers and computes with bfloat16 parameters, and reduces the
    gradients in float32: half the all-gather bytes, no autocast re-casting every micro-batch, and
    updates of 1e-6 relative size land on float32 weights (bfloat16 keeps 8 bits of mantissa). The
    CPU suite runs it with gloo; on GPUs it runs with nccl."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    policy = MixedPrecisionPolicy()
    if mixed_precision == "bfloat16":
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    elif mixed_precision is not None:
        raise ValueError(f"mixed_precision must be 'bfloat16' or None, got {mixed_precision!r}")
    for layer in model.model.layers:
        fully_shard(layer, mp_policy=policy)
    fully_shard(model, mp_policy=policy)
    return model


def unique_state_names(model) -> list[str]:
    """The model's state-dict names, a tied tensor under its first name only."""
    seen: set[int] = set()
    names = []
    for name, tensor in model.state_dict(keep_vars=True).items():
        if id(tensor) not in seen:
            seen.add(id(tensor))
            names.append(name)
    return names


def fill_shards(model, source_state, device: torch.device) -> None:
    """Give a model sharded on the meta device (`shard_model` of `lm.causal_lm.causal_lm_on_meta`)
    its values: every rank allocates its own shards; rank 0 reads each tensor from `source_state`
    (a mapping by name: the folder's safetensors read tensor by tensor, or a loaded model's state
    dict; None elsewhere) and sends it once, one tensor at a time: a rank never holds more than its
    shards and one full tensor beyond what `source_state` holds. Every rank must call it."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    rank = dist.get_rank()
    if (source_state is None) != (rank != 0):
        raise ValueError(f"rank {rank}: the source belongs to rank 0 only")
    # to_empty() empties buffers too: they were computed at construction (not on meta), keep them.
    buffers = {name: b.detach().clone() for name, b in model.named_buffers()}
    model.to_empty(device=device)
    filled: set[int] = set()
    with torch.no_grad():
        for name, buffer in model.named_buffers():
            buffer.copy_(buffers[name])
        for name, target in model.state_dict(keep_vars=True).items():
            if id(target) in filled:  # a tied name: one tensor
                continue
            filled.add(id(target))
            if rank == 0:
                if name not in source_state:
                    raise KeyError(f"the source model has no {name!r}")
                full = source_state[name].to(device=device, dtype=target.dtype)
            else:
                full = torch.empty(target.shape, dtype=target.dtype, device=device)
            if isinstance(target, DTensor):
                # rank 0's tensor, split by the target's placements: each rank receives its shard
                shard = distribute_tensor(full, target.device_mesh, target.placements, src_data_rank=0)
                target.to_local().copy_(shard.to_local())
            else:
                dist.broadcast(full, src=0)
                target.copy_(full)
            del full


class PeakRSS:
    """The peak resident memory of this process above its level at entry, sampled every
    `interval_s` in a thread (`peak_bytes` once exited): what a phase adds to the host."""

    def __init__(self, interval_s: float = 0.002):
        import psutil

        self._process, self._interval = psutil.Process(), interval_s
        self.peak_bytes = 0

    def __enter__(self):
        import threading

        self._start = self._process.memory_info().rss
        self._peak = self._start
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, name="peak-rss", daemon=True)
        self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._stop.wait(self._interval):
            self._peak = max(self._peak, self._process.memory_info().rss)

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self._peak = max(self._peak, self._process.memory_info().rss)
        self.peak_bytes = self._peak - self._start
        return False


def plan_buckets(sizes: list[int], bucket_bytes: int) -> list[list[int]]:
    """Consecutive positions of `sizes` (bytes) in buckets of at most `bucket_bytes` each; an item
    larger than a bucket gets one of its own."""
    if bucket_bytes < 1:
        raise ValueError(f"bucket_bytes must be >= 1, got {bucket_bytes}")
    buckets: list[list[int]] = []
    used = 0
    for i, size in enumerate(sizes):
        if not buckets or used + size > bucket_bytes:
            buckets.append([])
            used = 0
        buckets[-1].append(i)
        used += size
    return buckets


class FullWeightBuckets:
    """The model's full weights, one bucket of at most `bucket_bytes` (in `dtype`) at a time.

    Under FSDP2 each parameter is a DTensor shard: it is cast to `dtype` on its device (the gather
    then moves bfloat16, not float32) and `full_tensor()` all-gathers it there, so a rank holds its
    shards plus one bucket, never the model.
    Every rank must iterate to the end (each gather is a collective); only a rank with `keep` gets
    the tensors (moved to `out_device`, e.g. the CPU), the others get empty dicts. Names are the
    model's state-dict names, tied ones included (they share one tensor, gathered once, in one
    bucket); `len()` is the number of buckets, known before the first gather.

    A model with LoRA adapters (`learner.lora`) gives its adapted weights merged, W + scale · B A
    computed in float32 and rounded once to `dtype` (as the learner's merged forward rounds it;
    under FSDP each rank merges its own rows of W and B with the whole A, and the merged rows are
    gathered in `dtype`), and the adapters' own names not at all: what leaves is a plain model's
    weights. With `adapters_only` it gives the adapters alone instead (`learner.lora.publish=adapter`),
    each whole, in `dtype`."""

    def __init__(self, model, bucket_bytes: int, dtype: torch.dtype | None = None, keep: bool = True,
                 out_device: torch.device | str | None = None, adapters_only: bool = False):
        from learner.lora import merges
        from lm.lora_weights import is_adapter_name

        # keep_vars: tied names then share one object (a plain state_dict() detaches each anew).
        state = model.state_dict(keep_vars=True)
        if adapters_only:
            state = {name: tensor for name, tensor in state.items() if is_adapter_name(name)}
        merged = {} if adapters_only else merges(model)
        self._merges: dict[int, tuple[torch.Tensor, torch.Tensor, float]] = {}  # tensor index -> (A, B, scale)
        state = {name: tensor for name, tensor in state.items() if not (merged and is_adapter_name(name))}
        self._tensors: list[torch.Tensor] = []
        self._names: list[list[str]] = []
        index_of: dict[int, int] = {}
        for name, tensor in state.items():
            if name in merged:
                a_name, b_name, scale = merged[name]
                self._merges[len(self._tensors)] = (model.get_parameter(a_name), model.get_parameter(b_name), scale)
            if id(tensor) in index_of:
                self._names[index_of[id(tensor)]].append(name)
                continue
            index_of[id(tensor)] = len(self._tensors)
            self._tensors.append(tensor)
            self._names.append([name])
        self._state_order = list(state)
        self.dtype, self.keep, self.out_device = dtype, keep, out_device
        sizes = [t.numel() * (dtype or t.dtype).itemsize for t in self._tensors]
        self.buckets = plan_buckets(sizes, bucket_bytes)
        self.bucket_bytes = [sum(sizes[i] for i in b) for b in self.buckets]

    def __len__(self) -> int:
        return len(self.buckets)

    def meta(self) -> dict[str, torch.Tensor]:
        """Every name's full shape and dtype as meta tensors, nothing gathered (tied names share
        one object): what a send declares before the first bucket exists."""
        metas = [torch.empty(tuple(t.shape), dtype=self.dtype or t.dtype, device="meta") for t in self._tensors]
        by_name = {name: metas[i] for i, names in enumerate(self._names) for name in names}
        return {name: by_name[name] for name in self._state_order}

    def names(self, bucket: int) -> list[str]:
        return [n for i in self.buckets[bucket] for n in self._names[i]]

    def first_names(self, bucket: int) -> list[str]:
        """The bucket's names without tied repeats (what an HF checkpoint stores)."""
        return [self._names[i][0] for i in self.buckets[bucket]]

    def __iter__(self):
        for bucket in self.buckets:
            out: dict[str, torch.Tensor] = {}
            for i in bucket:
                tensor = self._tensors[i].detach()
                if i in self._merges:
                    full = self._merged(i, tensor)
                else:
                    if self.dtype is not None:
                        tensor = tensor.to(self.dtype)  # the shard, on its device: the gather moves the publish dtype
                    full = whole_tensor(tensor)  # a collective under FSDP
                if not self.keep:
                    continue
                if self.out_device is not None:
                    full = full.to(self.out_device)
                for name in self._names[i]:
                    out[name] = full
            yield out

    def _merged(self, i: int, weight: torch.Tensor) -> torch.Tensor:
        """Tensor i (an adapted weight) merged with its adapters, whole, in the publish dtype (collectives
        under FSDP). W's and B's shards hold the same rows of [out, ...] (one mesh, Shard(0)), so a rank
        merges its rows with the whole A (the small gather) and only the merged rows are gathered."""
        from torch.distributed.tensor import DTensor

        from lm.lora_weights import merged_weight

        lora_a, lora_b, scale = self._merges[i]
        dtype = self.dtype or weight.dtype
        a = whole_tensor(lora_a.detach())
        if not isinstance(weight, DTensor):
            return merged_weight(weight, a, whole_tensor(lora_b.detach()), scale, dtype)
        b = lora_b.detach()
        if b.placements != weight.placements or b.device_mesh != weight.device_mesh:
            raise RuntimeError(f"an adapter is sharded as {b.placements}, its weight as {weight.placements}")
        rows = merged_weight(weight.to_local(), a, b.to_local(), scale, dtype)
        return DTensor.from_local(rows, weight.device_mesh, weight.placements, run_check=False, shape=weight.shape,
                                  stride=weight.stride()).full_tensor()


def whole_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """The whole tensor: an FSDP shard (DTensor) all-gathered, a plain tensor as it is."""
    from torch.distributed.tensor import DTensor

    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def node_interface(address: str) -> str | None:
    """The network interface that holds `address` (None: no interface of this machine does)."""
    import psutil

    for name, addresses in psutil.net_if_addrs().items():
        if any(a.address == address for a in addresses):
            return name
    return None


def init_process_group(rank: int, world_size: int, backend: str, init_method: str, timeout_s: float,
                       store=None) -> None:
    """Join the process group through `init_method` (a file://) or a ready `store` (a TCPStore)."""
    if dist.is_initialized():
        raise RuntimeError("torch.distributed is already initialised in this process")
    where = {"store": store} if store is not None else {"init_method": init_method}
    dist.init_process_group(backend=backend, rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=timeout_s), **where)


class LearnerRank:
    """One rank of a learner group: learns where it runs (`where`), joins the process group
    (`join`), then holds a `Learner`. Made a Ray actor by `LearnerGroup`; plain-dict results.

    Rendezvous (rank 0, `open_rendezvous`): ranks on one node meet through a fresh file on it;
    ranks on several nodes through a TCPStore that rank 0 serves on a socket it has bound to its
    node's address (torch binds every interface when it opens the port itself). gloo's and NCCL's
    own sockets go on the interface holding the node's address too."""

    def __init__(self, config, rank: int):
        torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
        self.config = config
        self.rank = rank
        self.learner = None
        self._listener: socket.socket | None = None
        self._rendezvous_file: Path | None = None

    def where(self) -> dict:
        """This rank's node (Ray's node id, the node's address) and the GPUs Ray assigned it."""
        import ray

        return {"rank": self.rank, "node_id": ray.get_runtime_context().get_node_id(),
                "address": ray.util.get_node_ip_address(), "gpu_ids": [str(g) for g in ray.get_gpu_ids()],
                "device": None if self.learner is None else str(self.learner.device)}

    def open_rendezvous(self, across_nodes: bool) -> str:
        """Rank 0: where the ranks meet (see the class doc)."""
        if not across_nodes:
            self._rendezvous_file = Path(tempfile.gettempdir()) / f"etarl-rendezvous-{uuid.uuid4().hex}"
            return f"file://{self._rendezvous_file}"
        host = self.where()["address"]
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._listener = socket.create_server((host, self.config.distributed.master_port), family=family)
        port = self._listener.getsockname()[1]
        return f"tcp://[{host}]:{port}" if family == socket.AF_INET6 else f"tcp://{host}:{port}"

    def join(self, init_method: str) -> int:
        """Join the process group, then load the model; the learner's version."""
        dcfg = self.config.distributed
        interface = node_interface(self.where()["address"])
        if interface is not None:
            os.environ.setdefault("GLOO_SOCKET_IFNAME", interface)
            os.environ.setdefault("NCCL_SOCKET_IFNAME", interface)
        store = None
        if init_method.startswith("tcp://"):
            host, _, port = init_method[len("tcp://"):].rpartition(":")
            listen_fd = self._listener.fileno() if self._listener is not None else None
            store = dist.TCPStore(host.strip("[]"), int(port), dcfg.world_size, is_master=self.rank == 0,
                                  timeout=datetime.timedelta(seconds=dcfg.timeout_s), master_listen_fd=listen_fd,
                                  use_libuv=True)
        init_process_group(self.rank, dcfg.world_size, dcfg.backend, init_method, dcfg.timeout_s, store=store)
        self.learner = self._new_learner()
        return self.learner.version

    def _new_learner(self):
        """A learner of this rank's config on the process group it joined."""
        from learner.trainer import Learner

        dcfg = self.config.distributed
        # FSDP reduces the gradients itself; replicas sum them through the comm
        comm = ProcessGroupComm(self.rank, dcfg.world_size, sum_grads=dcfg.strategy != "fsdp")
        return Learner(self.config, comm=comm)

    def call(self, name: str, *args, **kwargs):
        attr = getattr(self.learner, name)
        return attr(*args, **kwargs) if callable(attr) else attr

    def shutdown(self) -> None:
        self.learner.close_weight_sync()
        if dist.is_initialized():
            dist.destroy_process_group()
        if self._listener is not None:
            self._listener.close()
        if self._rendezvous_file is not None:
            self._rendezvous_file.unlink(missing_ok=True)


class LearnerGroup:
    """`world_size` learner ranks as Ray actors, driven together. Every rank runs each step on
    its shard; rank 0's metrics and weight payloads are returned (all ranks hold the same weights).

    `rank_options[r]`: rank r's Ray options (its resources and placement-group bundle; services
    builds them from the placement plan); `ray_options`: options every rank gets (e.g.
    {"num_cpus": 0}). The ranks meet where they landed: see `LearnerRank`."""

    rank_class = LearnerRank  # what each rank's actor runs

    def __init__(self, config, ray_options: dict | None = None, rank_options: list[dict] | None = None):
        import ray

        dcfg = config.distributed
        if rank_options is not None and len(rank_options) != dcfg.world_size:
            raise ValueError(f"{len(rank_options)} rank placements for world_size={dcfg.world_size}")
        actor = ray.remote(self.rank_class)
        self.config = config
        self.world_size = dcfg.world_size
        placed = rank_options or [{}] * self.world_size
        self.ranks = [actor.options(**{"num_cpus": 1, **(ray_options or {}), **placed[r]}).remote(config, r)
                      for r in range(self.world_size)]
        try:
            across_nodes = len({w["node_id"] for w in self.where()}) > 1
            self.init_method = ray.get(self.ranks[0].open_rendezvous.remote(across_nodes))
            ray.get([r.join.remote(self.init_method) for r in self.ranks])  # every rank joins, loads the model
        except BaseException:
            self._kill()
            raise

    def _call_all(self, method: str, *args, **kwargs) -> list:
        import ray

        return ray.get([r.call.remote(method, *args, **kwargs) for r in self.ranks])

    def where(self) -> list[dict]:
        """Each rank's node, GPU ids and device."""
        import ray

        return ray.get([r.where.remote() for r in self.ranks])

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
            self._kill()

    def _kill(self) -> None:
        import ray

        for r in self.ranks:
            ray.kill(r)
