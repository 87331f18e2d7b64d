"""The correction experiments' harness and scripts (benchmarks/staleness_ablation.py,
benchmarks/backend_mismatch.py): staleness is produced exactly as scheduled, the teacher-forced
held-out accuracy equals greedy decoding, and each script's smallest mode runs and writes its
JSON and PNGs with the keys docs/results.md reads."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "benchmarks"))

import experiment_lib as lib  # noqa: E402
import staleness_ablation  # noqa: E402


def test_schedules_give_the_promised_lag():
    assert [staleness_ablation.behaviour_schedule("2")(i) for i in range(5)] == [-2, -1, 0, 1, 2]
    assert [staleness_ablation.behaviour_schedule("0")(i) for i in range(3)] == [0, 1, 2]
    unbounded = staleness_ablation.behaviour_schedule("unbounded")
    lags = [i - unbounded(i) for i in range(0, 40, 8)]
    assert lags == sorted(lags) and lags[-1] > 8  # grows past every finite η in the ablation


def _fake_run(accuracy: float) -> dict:
    evals = [{"step": 0, "accuracy": 0.9, "p_exact": 0.8}, {"step": 1, "accuracy": accuracy, "p_exact": accuracy}]
    return {"steps": [{"step": 1, "reward/mean": 0.5}], "evals": evals, "final": evals[-1]}


def _fake_result(cells: dict[str, float], settings: dict) -> dict:
    return {"settings": settings, "etas": list(cells), "seeds": [0], "command": "x", "wall_seconds": 1.0,
            "runs": {m: {eta: [_fake_run(acc)] for eta, acc in cells.items()} for m in staleness_ablation.METHODS}}


def test_merge_pools_seeds_per_cell_and_refuses_other_settings():
    settings = {"steps": 1}
    merged = staleness_ablation.merge([_fake_result({"0": 0.9, "4": 0.8}, settings),
                                       _fake_result({"8": 0.7, "4": 0.6}, settings)])
    assert merged["etas"] == ["0", "4", "8"]
    summary = staleness_ablation.summarise(merged["runs"], merged["etas"])
    assert summary["naive_ppo"]["4"]["final_accuracy"]["n"] == 2
    assert summary["naive_ppo"]["4"]["final_accuracy"]["mean"] == pytest.approx(0.7)
    assert summary["decoupled_tis"]["8"]["final_accuracy"]["n"] == 1
    with pytest.raises(ValueError, match="different settings"):
        staleness_ablation.merge([_fake_result({"0": 0.9}, settings), _fake_result({"0": 0.9}, {"steps": 2})])


def test_teacher_forced_accuracy_equals_greedy_decoding(tiny_model_dir):
    from lm.causal_lm import load_causal_lm, load_tokenizer
    from rollout_workers.tasks import mixed_problems
    from rollout_workers.tiny_model import greedy_accuracy

    tokenizer = load_tokenizer(tiny_model_dir)
    model = load_causal_lm(tiny_model_dir).eval()
    heldout = lib.HeldOut(tokenizer, [2, 3], 24)
    problems = mixed_problems(["add"], [2, 3], "heldout", 24)
    scores = heldout.evaluate(model)
    assert scores["accuracy"] == pytest.approx(greedy_accuracy(model, tokenizer, problems))
    assert 0.0 < scores["p_exact"] < 1.0


@pytest.mark.slow
def test_staleness_ablation_smallest_mode(tiny_model_dir, tmp_path):
    # the session's tiny model, not the pinned one the committed results ran on (a build fewer)
    out = staleness_ablation.main(["--quick", "--model", str(tiny_model_dir), "--etas", "0,2,unbounded", "--seeds", "1", "--steps", "3",
                                   "--groups", "2", "--eval-every", "1", "--out", str(tmp_path)])
    data = json.loads((tmp_path / "staleness_ablation_quick.json").read_text())
    assert data["etas"] == ["0", "2", "unbounded"] and data["seeds"] == [0]
    assert set(data["summary"]) == set(data["runs"]) == {"naive_ppo", "decoupled_tis"}
    for method in data["runs"]:
        for eta in data["etas"]:
            stats = data["summary"][method][eta]
            assert {"final_accuracy", "final_p_exact", "train_reward_last5", "gap_k1"} <= set(stats)
            assert set(stats["final_accuracy"]) == {"mean", "std", "min", "max", "n"}
            (run,) = data["runs"][method][eta]
            assert [e["step"] for e in run["evals"]] == [0, 1, 2, 3]
            # The learner saw exactly the scheduled staleness.
            schedule = staleness_ablation.behaviour_schedule(eta)
            for i, step in enumerate(run["steps"]):
                assert step["behaviour_version"] == max(0, schedule(i))
                assert step["staleness/max"] == i - step["behaviour_version"]
    # The transformers sampler is the learner's float32 policy: synchronous data has no gap.
    assert abs(data["runs"]["decoupled_tis"]["0"][0]["steps"][0]["gap/k1"]) < 1e-5
    assert out["summary"] == data["summary"]
    for png in ("staleness_ablation_quick_curves.png", "staleness_ablation_quick_final.png"):
        assert (tmp_path / png).stat().st_size > 0


@pytest.mark.slow
def test_backend_mismatch_smallest_mode(tiny_model_dir, tmp_path):
    import backend_mismatch

    backend_mismatch.main(["--quick", "--model", str(tiny_model_dir), "--methods", "token_tis", "--steps", "1", "--groups", "2",
                           "--gap-batches", "1", "--eval-every", "1", "--out", str(tmp_path)])
    data = json.loads((tmp_path / "backend_mismatch_quick.json").read_text())
    assert set(data["runs"]) == set(data["summary"]) == {"token_tis", "fp32_reference"}
    gap = data["token_gap"]
    assert {"mean_abs_dlogp", "max_abs_dlogp", "k1_kl_mu_pi", "k3_kl_mu_pi"} <= set(gap["bfloat16"])
    # bf16 rounding is visible per token; the fp32 sampler matches the fp32 learner closely.
    assert gap["bfloat16"]["mean_abs_dlogp"] > 10 * gap["float32"]["mean_abs_dlogp"]
    assert gap["float32"]["max_abs_dlogp"] < 1e-3
    for stats in data["summary"].values():
        assert {"final_accuracy", "k1_kl_mean_over_training", "entropy_last5", "response_length_last5"} <= set(stats)
    assert (tmp_path / "backend_mismatch_quick_curves.png").stat().st_size > 0
    assert data["model"]["cache_key"] == tiny_model_dir.name, "the JSON names the model that ran"


def test_a_folder_the_kit_did_not_build_is_refused_naming_it(tmp_path):
    with pytest.raises(SystemExit, match="not a tiny-model folder"):
        lib.tiny_model_dir(tmp_path)


@pytest.mark.slow
def test_moe_replay_smallest_mode(tmp_path):
    """benchmarks/moe_replay.py --quick on a briefly warmed tiny-moe: every (N, variant) cell has
    the table's columns, the steps carry the routing mismatch, and one minibatch per batch never
    clips (its update is at the proximal weights)."""
    import moe_replay

    moe_replay.main(["--quick", "--out", str(tmp_path / "moe_replay.json")])
    data = json.loads((tmp_path / "moe_replay.json").read_text())
    assert set(data["table"]) == {"N=1", "N=8"} and all(set(cells) == {"none", "r3"} for cells in data["table"].values())
    for cells in data["table"].values():
        for columns in cells.values():
            assert set(columns) == set(moe_replay.SUMMARY)
    for by_variant in data["runs"].values():
        for (run,) in by_variant.values():
            assert len(run["steps"]) == 4 and all(0.0 <= s["moe/routing_mismatch"] <= 1.0 for s in run["steps"])
    assert data["table"]["N=1"]["none"]["clipfrac"]["mean"] == 0.0
    assert (tmp_path / "moe_replay.png").stat().st_size > 0
