"""Fixtures of the fault-injection suite."""
from __future__ import annotations

import pytest

from services.chaos import BufferService


@pytest.fixture
def buffer_service(tmp_path):
    """A factory of real `python -m buffer serve` processes (same port and log across restarts);
    all are stopped at the end of the test."""
    started = []

    def start(**config) -> BufferService:
        service = BufferService(config, tmp_path).start()
        started.append(service)
        return service

    yield start
    for service in started:
        service.stop()
