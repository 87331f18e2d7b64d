"""Helpers of the fault-injection suite: the buffer tests' group factory, and a learner-like
consumer that records what it trained on (the run's log, for `services.audit`). The process
tooling (the buffer service, a run under test, the reply-losing proxy) is
`services.chaos`."""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "buffer"))  # reuse the buffer tests' helpers

from buffer_helpers import make_group, wait_until  # noqa: E402

from lm.weight_sync import WeightStore  # noqa: E402
from services.audit import Consumption  # noqa: E402

__all__ = ["make_group", "wait_until", "consume_batch", "FlakyWeightStore"]


def consume_batch(client, batch_size: int, timeout: float = 1.0) -> Consumption | None:
    """Pull, "train" and ack one batch as the learner does; the record of what was consumed."""
    batch = client.pull_batch(batch_size, timeout=timeout)
    if batch is None:
        return None
    client.ack(batch.lease_id)
    return Consumption.of_batch(batch)



class FlakyWeightStore(WeightStore):
    """A weight store whose first `bad` reads of the latest payload name a folder that is not
    there: a weight load that fails. Made a Ray actor by the tests, so every process of a
    restarted worker sees the same count."""

    def __init__(self, good: dict, bad: int):
        super().__init__()
        self.publish(good)
        self.bad = bad

    def latest(self, reader: str | None = None) -> dict:
        if self.bad > 0:
            self.bad -= 1
            return {"version": self.latest_version(), "kind": "folder", "path": "/nonexistent/weights"}
        return super().latest(reader)
