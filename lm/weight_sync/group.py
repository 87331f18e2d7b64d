"""The weight group of one generation: a standalone torch process group (gloo on CPU, NCCL on
GPU) of the learner (rank 0) and the engines (1..n), apart from the learner's data-parallel group.

Its ranks meet through `BoardStore`, a torch `Store` kept in the board actor: torch's TCPStore
listens on every interface whatever address it is given, and this one opens no socket at all.
gloo's own pair sockets are bound to the node's address (127.0.0.1 in a local run).
"""
from __future__ import annotations

import datetime
import time
from datetime import timedelta

import torch.distributed as dist

from lm.weight_sync.board import group_prefix


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


class BoardStore(dist.Store):
    """A torch Store whose keys live in the board (`WeightStore.kv_*`)."""

    def __init__(self, board, timeout_s: float):
        super().__init__()
        self.board = board
        self.timeout_s = timeout_s

    def _deadline_loop(self, method: str, *args):
        deadline = time.monotonic() + self.timeout_s
        while True:
            result = call(self.board, method, *args, max(0.01, deadline - time.monotonic()))
            if (result is not None and result is not False) or time.monotonic() >= deadline:
                return result

    def set(self, key, value):
        call(self.board, "kv_set", key, value if isinstance(value, bytes) else bytes(value, "utf-8"))

    def get(self, key):
        value = self._deadline_loop("kv_get", key)
        if value is None:
            raise TimeoutError(f"weight group rendezvous: no rank set {key!r} within {self.timeout_s:.0f}s")
        return value

    def wait(self, keys, timeout=None):
        if not self._deadline_loop("kv_wait", list(keys)):
            raise TimeoutError(f"weight group rendezvous: keys {list(keys)} not set within {self.timeout_s:.0f}s")

    def add(self, key, amount):
        return call(self.board, "kv_add", key, amount)

    def check(self, keys):
        return all(call(self.board, "kv_get", k, 0.0) is not None for k in keys)

    def compare_set(self, key, expected, desired):
        return call(self.board, "kv_compare_set", key, bytes(expected), bytes(desired))

    def delete_key(self, key):
        return call(self.board, "kv_delete", key)

    def num_keys(self):
        return call(self.board, "kv_num_keys")

    def set_timeout(self, timeout):
        self.timeout_s = timeout.total_seconds() if isinstance(timeout, timedelta) else float(timeout)


class WeightGroup:
    """This process's member of the weight group described by a go (generation, world, backend,
    timeout_s). Forming it blocks until every rank has joined (or the timeout)."""

    def __init__(self, board, go: dict, rank: int, address: str):
        self.generation = go["generation"]
        # Kept here: torch holds only the C++ half of a Python store, which must outlive the group.
        self.store = BoardStore(board, go["timeout_s"])
        prefixed = dist.PrefixStore(group_prefix(self.generation), self.store)
        timeout = datetime.timedelta(seconds=go["timeout_s"])
        if go["backend"] == "nccl":
            options = dist.ProcessGroupNCCL.Options()
            options._timeout = timeout
            self.group = dist.ProcessGroupNCCL(prefixed, rank, go["world"], options)
        else:
            options = dist.ProcessGroupGloo._Options()
            options._devices = [dist.ProcessGroupGloo.create_device(hostname=address)]
            options._timeout = timeout
            self.group = dist.ProcessGroupGloo(prefixed, rank, go["world"], options)
