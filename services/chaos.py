"""Fault injection for real etarl processes (the fault-injection tests and `benchmarks/soak.py`):
a training run as a child process whose Ray actors can be found by their process titles
(`ray::RolloutWorker`, `ray::LearnerRank.call`) and SIGKILLed, its listening sockets, its
Prometheus metrics and its step log; and a TCP proxy that loses replies with their connection.
Only processes of the run it started are ever signalled."""
from __future__ import annotations

import json
import os
import selectors
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import psutil

REPO = Path(__file__).resolve().parents[1]


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now, for a child process to bind (it may be taken in between:
    the services that take one fail loudly if so)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


class TrainProcess:
    """`python -m services.cli train ...` in its own session, output to RUN_DIR/../NAME.out."""

    def __init__(self, run_dir: Path, args: list[str], name: str):
        self.run_dir = run_dir
        self.out = run_dir.parent / f"{name}.out"
        env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false",
               "RAY_USAGE_STATS_ENABLED": "0"}
        env.pop("RAY_ADDRESS", None)
        self.proc = subprocess.Popen([sys.executable, "-m", "services.cli", "train", *args], cwd=REPO, env=env,
                                     stdout=open(self.out, "wb"), stderr=subprocess.STDOUT, start_new_session=True)
        self.seen: dict[int, psutil.Process] = {}

    def processes(self) -> list[psutil.Process]:
        """The run's process tree (also remembered, so stragglers can be cleaned up)."""
        try:
            root = psutil.Process(self.proc.pid)
            tree = [root, *root.children(recursive=True)]
        except psutil.NoSuchProcess:
            return []
        for p in tree:
            self.seen.setdefault(p.pid, p)
        return tree

    def titled(self, prefix: str) -> list[psutil.Process]:
        """Ray actor processes by title: `ray::RolloutWorker`, `ray::LearnerRank.call`, ..."""
        found = []
        for p in self.processes():
            try:
                if " ".join(p.cmdline()).startswith(prefix):
                    found.append(p)
            except psutil.Error:
                pass
        return found

    def steps(self) -> list[dict]:
        path = self.run_dir / "metrics.jsonl"
        rows = []
        if path.is_file():
            for line in path.read_text().splitlines():
                try:
                    row = json.loads(line)
                except ValueError:
                    continue  # a line being written
                if "audit/groups" in row:
                    rows.append(row)
        return rows

    def wait_for(self, predicate, what: str, timeout: float = 300.0, interval: float = 0.2):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            value = predicate()
            if value:
                return value
            if self.proc.poll() is not None:
                raise AssertionError(f"etarl train exited ({self.proc.returncode}) waiting for {what}:\n{self.tail()}")
            time.sleep(interval)
        raise AssertionError(f"timed out waiting for {what}:\n{self.tail()}")

    def tail(self, chars: int = 4000) -> str:
        return self.out.read_text(errors="replace")[-chars:]

    def wait(self, timeout: float) -> int:
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill_all()
            raise

    def kill_all(self) -> None:
        """SIGKILL the run and every process of its tree seen alive (nothing else)."""
        self.processes()
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        for p in self.seen.values():
            try:
                p.kill()
            except psutil.Error:
                pass


def listening_sockets(processes: list[psutil.Process]) -> list[tuple[str, str, int]]:
    """(process title, ip, port) of every listening TCP socket of these processes."""
    out = []
    for p in processes:
        try:
            title = f"{p.name()}: {' '.join(p.cmdline())[:200]}"
            for c in p.net_connections(kind="tcp"):
                if c.status == psutil.CONN_LISTEN:
                    out.append((title, c.laddr.ip, c.laddr.port))
        except psutil.Error:
            pass
    return out


def scrape(port: int) -> dict[tuple[str, tuple], float]:
    """The Prometheus exporter's samples: {(name, sorted label items): value}."""
    from prometheus_client.parser import text_string_to_metric_families

    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


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
        try:
            server = socket.create_connection(self.target)
        except OSError:  # the server is down (being restarted): the client will connect again
            client.close()
            return
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


class BufferService:
    """`python -m buffer serve` as a child process that can be SIGKILLed and started again on the
    same port and log (as Kubernetes restarts a pod)."""

    def __init__(self, config: dict, workdir: Path):
        self.config = dict(config)
        if not self.config.get("port"):
            self.config["port"] = free_port()
        self.path = Path(workdir) / "buffer-service.yaml"
        self.path.write_text(json.dumps(self.config))  # JSON is YAML
        self.output = Path(workdir) / "buffer-service.out"
        self.proc: subprocess.Popen | None = None
        self.starts = 0

    @property
    def endpoint(self) -> str:
        return f"tcp://127.0.0.1:{self.config['port']}"

    def start(self, timeout: float = 180.0) -> "BufferService":
        env = {**os.environ, "PYTHONPATH": str(REPO)}
        offset = self.output.stat().st_size if self.output.exists() else 0
        self.proc = subprocess.Popen([sys.executable, "-m", "buffer", "serve", "--config", str(self.path),
                                      "--log-level", "WARNING"], cwd=REPO, env=env,
                                     stdout=open(self.output, "ab"), stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout
        while "serving on" not in self.output.read_bytes()[offset:].decode(errors="replace"):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the buffer service did not start:\n{self.output.read_text(errors='replace')[-2000:]}")
            time.sleep(0.05)
        self.starts += 1
        return self

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait()

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.kill()
