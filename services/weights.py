"""The publish side of weight sync: the learner's weights of each version reach the workers.

Today through the Ray object store: the learner's rank 0 puts one payload per version
(`lm/weight_sync.py`) and the run's `WeightStore` actor holds the latest, which workers read
between generations (a restarted worker too).
"""
from __future__ import annotations

import time


class WeightPublisher:
    def __init__(self):
        import ray

        from lm.weight_sync import WeightStore

        self.store = ray.remote(num_cpus=0)(WeightStore).remote()

    def publish(self, learner) -> float:
        """Publish the learner group's current weights; the seconds it took."""
        import ray

        start = time.perf_counter()
        payload = learner.publish_weights()
        ray.get(self.store.publish.remote(payload))
        return time.perf_counter() - start

    def latest(self) -> dict | None:
        """The latest published payload (the evaluator scores it)."""
        import ray

        return ray.get(self.store.latest.remote())
