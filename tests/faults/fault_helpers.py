"""Helpers of the fault-injection suite: the buffer tests' group factory and server process, a
TCP proxy that can lose replies (a client losing its connection), and a learner-like consumer
that records what it trained on (the run's log, for `services.audit`)."""
from __future__ import annotations

import selectors
import socket
import sys
import threading
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "buffer"))  # reuse the buffer tests' helpers

from buffer_helpers import ServerProcess, free_port, make_group, wait_until  # noqa: E402

from services.audit import Consumption  # noqa: E402

__all__ = ["ServerProcess", "free_port", "make_group", "wait_until", "ReplyLosingProxy", "consume_batch", "consumption"]


class ReplyLosingProxy:
    """A TCP proxy on 127.0.0.1 in front of a server. While `holding`, bytes from the server are
    kept back; `release()` forwards them on connections the client still has open and drops them
    on connections the client closed: exactly a reply lost with its connection."""

    def __init__(self, target_port: int):
        self.target = ("127.0.0.1", target_port)
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.holding = False
        self.dropped_bytes = 0
        self._pairs: dict[socket.socket, tuple[socket.socket, bool]] = {}  # sock -> (peer, from_server)
        self._held: dict[socket.socket, bytearray] = {}  # client sock -> bytes from the server
        self._lock = threading.Lock()
        self._selector = selectors.DefaultSelector()
        self._selector.register(self.listener, selectors.EVENT_READ)
        self._stop = False
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()

    @property
    def endpoint(self) -> str:
        return f"tcp://127.0.0.1:{self.port}"

    def hold(self) -> None:
        with self._lock:
            self.holding = True

    def release(self) -> None:
        with self._lock:
            self.holding = False
            for client, data in list(self._held.items()):
                if client in self._pairs:
                    client.sendall(bytes(data))
                else:
                    self.dropped_bytes += len(data)
            self._held.clear()

    def close(self) -> None:
        self._stop = True
        self._thread.join(2)
        for sock in [self.listener, *self._pairs]:
            sock.close()

    def _loop(self) -> None:
        while not self._stop:
            for key, _ in self._selector.select(0.05):
                with self._lock:
                    if key.fileobj is self.listener:
                        self._accept()
                    else:
                        self._forward(key.fileobj)

    def _accept(self) -> None:
        client, _ = self.listener.accept()
        server = socket.create_connection(self.target)
        self._pairs[client] = (server, False)
        self._pairs[server] = (client, True)
        for sock in (client, server):
            self._selector.register(sock, selectors.EVENT_READ)

    def _forward(self, sock: socket.socket) -> None:
        if sock not in self._pairs:
            return
        peer, from_server = self._pairs[sock]
        try:
            data = sock.recv(65536)
        except OSError:
            data = b""
        if not data:  # one side closed: close both, and whatever was held for it is lost
            client = peer if from_server else sock
            self.dropped_bytes += len(self._held.pop(client, b""))
            for s in (sock, peer):
                self._pairs.pop(s, None)
                self._selector.unregister(s)
                s.close()
            return
        if from_server and self.holding:
            self._held.setdefault(peer, bytearray()).extend(data)
        else:
            peer.sendall(data)


def consume_batch(client, batch_size: int, timeout: float = 1.0) -> Consumption | None:
    """Pull, "train" and ack one batch as the learner does; the record of what was consumed."""
    batch = client.pull_batch(batch_size, timeout=timeout)
    if batch is None:
        return None
    client.ack(batch.lease_id)
    return consumption(batch)


def consumption(batch) -> Consumption:
    """The audit's record of a trained `PulledBatch`."""
    return Consumption(batch.version, [g.group_id for g in batch.groups], [g.prompt_index for g in batch.groups],
                       [s.weight_version for g in batch.groups for s in g.samples])
