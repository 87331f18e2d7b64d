"""Fixtures of the buffer tests."""
from __future__ import annotations

import pytest
from buffer_helpers import ServerProcess, free_port


@pytest.fixture
def server_process(tmp_path):
    """A factory of real server processes; all are stopped at the end of the test."""
    started = []

    def start(**config) -> ServerProcess:
        config.setdefault("port", free_port())
        proc = ServerProcess(config, tmp_path).start()
        started.append(proc)
        return proc

    yield start
    for proc in started:
        proc.stop()
