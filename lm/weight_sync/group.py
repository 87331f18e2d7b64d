"""The weight group of one generation: a standalone gloo process group of the learner (rank 0) and
every receiving process of the engines (1..n; a tensor-parallel engine has one per rank), apart
from the learner's data-parallel group. vLLM's own backends (NCCL, IPC) form theirs themselves.

Rendezvous: the sender opens a `TCPStore` (vLLM's NCCL engine does the same) and every receiver,
inside vLLM's worker processes too, joins it with the address, port and key prefix of the init
info. torch's TCPStore listens on every interface whatever address it is given: the keys live
under a 128-bit random prefix per generation, so a process that did not get the init info over
the board cannot join or disturb the group; the gloo pair sockets bind to the node's address.
"""
from __future__ import annotations

import datetime
import secrets

import torch.distributed as dist


def call(handle, method: str, *args):
    """Call `method` on a plain object or on a Ray actor handle (then wait for the result)."""
    fn = getattr(handle, method)
    if hasattr(fn, "remote"):
        import ray

        return ray.get(fn.remote(*args))
    return fn(*args)


def node_address() -> str:
    """This process's node address as Ray knows it (127.0.0.1 in a local run or outside Ray)."""
    try:
        import ray

        if ray.is_initialized():
            return ray.util.get_node_ip_address()
    except ImportError:
        pass
    return "127.0.0.1"


class Rendezvous:
    """The sender's end: a store the receivers join (`init_info()` tells them where and how)."""

    def __init__(self, address: str, world: int, timeout_s: float):
        self.address, self.world, self.timeout_s = address, world, timeout_s
        self.store = dist.TCPStore(address, 0, world, True, timeout=datetime.timedelta(seconds=timeout_s),
                                   wait_for_workers=False)
        self.prefix = secrets.token_hex(16)

    def init_info(self) -> dict:
        return {"master_address": self.address, "master_port": int(self.store.port), "prefix": self.prefix,
                "world_size": self.world, "timeout_s": self.timeout_s, "rank_offset": 1}

    def join(self) -> dist.ProcessGroup:
        """Rank 0's group (blocks until every rank has joined, or the timeout)."""
        return gloo_group(dist.PrefixStore(self.prefix, self.store), 0, self.world, self.timeout_s, self.address)


def join_group(init_info: dict, rank: int, address: str | None = None) -> tuple[dist.ProcessGroup, dist.Store]:
    """A receiver's group and the store it keeps alive (torch holds only the C++ half of a store)."""
    timeout = datetime.timedelta(seconds=init_info["timeout_s"])
    store = dist.TCPStore(init_info["master_address"], int(init_info["master_port"]), int(init_info["world_size"]),
                          False, timeout=timeout)
    group = gloo_group(dist.PrefixStore(init_info["prefix"], store), rank, int(init_info["world_size"]),
                       init_info["timeout_s"], address or node_address())
    return group, store


def gloo_group(store: dist.Store, rank: int, world: int, timeout_s: float, address: str) -> dist.ProcessGroup:
    options = dist.ProcessGroupGloo._Options()
    options._devices = [dist.ProcessGroupGloo.create_device(hostname=address)]
    options._timeout = datetime.timedelta(seconds=timeout_s)
    return dist.ProcessGroupGloo(store, rank, world, options)
