"""The publish side of weight sync: the learner's weights of each version reach the workers.

The run's board (`lm.weight_sync.WeightStore`, a threaded Ray actor) carries no tensors: the
learner's rank 0 publishes through the channel of `learner.weight_sync` around it, in a thread of
its own, so a step's publication costs the learner only the hand-over (and an optimizer step that
comes before the send is done waits for it: the blocked time). Workers reach each version at their
interrupt points (`lm.weight_sync.WeightSubscription`); a restarted worker gets the live one.
"""
from __future__ import annotations

_BOARD_THREADS_PER_WORKER = 3  # a worker's wait for its go or next weight-update call, its answer, a stats call
# The last finished send's timings (it may end after the step that published it):
_LAST_SEND = {"own_s": "timing_s/weight_sync_send",  # the learner's own time sending (or putting, writing)
              "served_s": "timing_s/weight_sync_served",  # from the announcement until every engine has it
              "sync_s": "timing_s/weight_sync_total"}  # from the hand-over until every engine has it


class WeightPublisher:
    def __init__(self, num_workers: int = 1):
        import ray

        from lm.weight_sync import WeightStore

        threads = 16 + _BOARD_THREADS_PER_WORKER * num_workers  # long polls must not queue behind each other
        self.store = ray.remote(WeightStore).options(num_cpus=0, max_concurrency=threads).remote()
        self._learner = None

    def publish(self, learner) -> dict[str, float]:
        """Start publishing the learner group's current version; the step's weight-sync timings
        under their metric names (the last finished send's, for what takes longer than a step)."""
        if self._learner is not learner:
            learner.attach_weight_board(self.store)
            self._learner = learner
        t = learner.publish_weights()
        out = {"timing_s/weight_sync": t["publish_s"], "timing_s/weight_sync_blocked": t["blocked_s"],
               "weight_sync/failures": float(t["failures"]),
               **{name: t[k] for k, name in _LAST_SEND.items() if k in t}}
        if "engines" in t:
            out["weight_sync/engines"] = float(t["engines"])
        return out

