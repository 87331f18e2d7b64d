"""Evaluation on a rollout worker's engine (RolloutWorker.evaluate_heldout, driven by
services/evaluation.py): one version for the whole evaluation. The worker's own weight load that
comes while it runs waits for it, and a batch the worker's loop is generating is waited for; the
engine here is a stand-in that records who is inside it."""
from __future__ import annotations

import threading
import time

import torch

from lm.weight_sync import WeightStore, save_weights_folder
from rollout_workers.config import RolloutConfig
from rollout_workers.engines.base import Completion, GenerationEngine
from rollout_workers.worker import RolloutWorker
from services.evaluation import heldout_metrics


class GateEngine(GenerationEngine):
    """Answers every request with EOS; a call waits on `release` while `hold` is set, and
    `inside` counts the calls in progress (two at once would be a failure of the turns)."""

    def __init__(self):
        self.version = 0
        self.inside = 0
        self.overlaps = 0
        self.hold = threading.Event()
        self.release = threading.Event()
        self.entered = threading.Event()

    def _enter(self):
        self.inside += 1
        self.overlaps += self.inside > 1
        self.entered.set()
        if self.hold.is_set():
            assert self.release.wait(10)

    def generate_batch(self, requests, interrupt=None):
        self._enter()
        try:
            return [[Completion([1], [0.0], "stop") for _ in range(params.n)] for _, params in requests]
        finally:
            self.inside -= 1

    def load_weights(self, version, weights):
        self.load_weights_folder(version, None)

    def load_weights_folder(self, version, folder):  # the folder channel's way in
        self._enter()
        try:
            self.version = version
        finally:
            self.inside -= 1


def spec(**changes):
    return {"num_prompts": 6, "seed": 0, "n_samples": 2, "temperature": 1.0, "max_new_tokens": 4,
            "min_version": 0, "wait_s": 10.0, **changes}


def test_an_evaluation_holds_one_version_and_waits_for_a_generation_in_flight(tiny_model_dir, tmp_path):
    engine, board = GateEngine(), WeightStore()
    cfg = RolloutConfig(model_path=str(tiny_model_dir), reward="exact", weight_poll_s=0.0,
                        task={"families": ["reverse"], "difficulties": [2], "num_prompts": 16})
    worker = RolloutWorker(cfg, "worker-0", weight_store=board, engine=engine)
    worker._ensure_started()
    try:
        # The loop is inside a batch when the evaluation comes: the evaluation waits for it.
        engine.hold.set()
        loop = threading.Thread(target=worker._generate_with_updates, args=([([3, 4], worker._sampling_params(0))],))
        loop.start()
        assert engine.entered.wait(10)
        results = []
        evaluation = threading.Thread(target=lambda: results.append(worker.evaluate_heldout(spec())))
        evaluation.start()
        time.sleep(0.3)
        assert not results and engine.inside == 1  # still waiting for the loop's call to end
        engine.release.set()
        loop.join(10)
        evaluation.join(10)
        (out,) = results
        assert out["version"] == 0 and len(out["greedy"]) == 6 and [len(r) for r in out["sampled"]] == [2] * 6
        assert set(heldout_metrics(out["greedy"], out["sampled"], 2)) >= {"eval/accuracy", "eval/pass@2"}

        # The loop's weight load (here from a folder) that comes during an evaluation waits until it has ended.
        folder = save_weights_folder({"w": torch.zeros(2)}, tmp_path / "v1", 1)
        board.publish({"version": 1, "kind": "folder", "path": str(folder)})
        engine.hold.set()
        engine.release.clear()
        engine.entered.clear()
        evaluation = threading.Thread(target=lambda: results.append(worker.evaluate_heldout(spec())))
        evaluation.start()
        assert engine.entered.wait(10)
        load = threading.Thread(target=worker.load_latest_weights)
        load.start()
        time.sleep(0.3)
        assert engine.version == 0  # the load waits its turn
        engine.release.set()
        evaluation.join(10)
        load.join(10)
        assert results[-1]["version"] == 0 and engine.version == 1
        assert engine.overlaps == 0
    finally:
        engine.release.set()
        worker.close()
