"""Fixtures of the fault-injection suite."""
from __future__ import annotations

import pytest
from fault_helpers import ServerProcess, free_port


@pytest.fixture
def buffer_service(tmp_path):
    """A factory of real `python -m buffer serve` processes (same port across restarts); all are
    stopped at the end of the test."""
    started = []

    def start(**config) -> ServerProcess:
        config.setdefault("port", free_port())
        proc = ServerProcess(config, tmp_path).start()
        started.append(proc)
        return proc

    yield start
    for proc in started:
        proc.stop()
