"""pass@k against brute-force enumeration of k-subsets; the evaluation loop on a toy generator."""
import itertools
import math

import pytest

from rollout_workers.data import Problem
from services.evaluation import EvalPrompt, evaluate, mean_pass_at_k, pass_at_k


@pytest.mark.parametrize("n,c,k", [(5, 0, 1), (5, 2, 1), (5, 2, 3), (6, 3, 4), (7, 1, 7), (4, 4, 2), (8, 5, 4)])
def test_pass_at_k_equals_fraction_of_k_subsets_with_a_correct_sample(n, c, k):
    outcomes = [1] * c + [0] * (n - c)
    subsets = list(itertools.combinations(outcomes, k))
    expected = sum(any(s) for s in subsets) / len(subsets)
    assert pass_at_k(n, c, k) == pytest.approx(expected, abs=1e-12)


def test_pass_at_1_is_the_pass_rate_and_large_n_does_not_overflow():
    assert pass_at_k(10, 3, 1) == pytest.approx(0.3)
    value = pass_at_k(2000, 7, 100)  # C(2000, 100) overflows a float; the product form does not
    assert value == pytest.approx(1 - math.comb(1993, 100) / math.comb(2000, 100), rel=1e-9)


def test_pass_at_k_rejects_bad_counts():
    with pytest.raises(ValueError, match="n >= k"):
        pass_at_k(3, 1, 4)
    with pytest.raises(ValueError, match="c must be in"):
        pass_at_k(4, 5, 2)
    with pytest.raises(ValueError, match="k must be >= 1"):
        pass_at_k(4, 1, 0)
    with pytest.raises(TypeError, match="c must be an int"):
        pass_at_k(4, 1.5, 2)
    with pytest.raises(ValueError, match="no prompts"):
        mean_pass_at_k([], 4, 2)


def test_evaluate_greedy_accuracy_and_pass_at_k():
    # Prompt i is answered correctly by greedy decoding iff i is even; sampled answers are
    # correct for the first i of 4 samples (so c = min(i, 4)).
    prompts = [EvalPrompt(prompt_ids=[i], problem=Problem(f"{i}?", str(i))) for i in range(4)]
    calls = []

    def generate(batch, n, temperature, seed):
        calls.append((n, temperature))
        if temperature == 0.0:
            return [[[p[0] if p[0] % 2 == 0 else -1]] for p in batch]
        return [[[p[0]] if j < p[0] else [-1] for j in range(n)] for p in batch]

    def score(prompt, responses):
        return [1.0 if response == [int(prompt.problem.answer)] else 0.0 for response in responses]

    metrics = evaluate(generate, score, prompts, n_samples=4, k=2, temperature=0.7)
    assert calls == [(1, 0.0), (4, 0.7)]
    assert metrics["eval/accuracy"] == pytest.approx(0.5)
    counts = [0, 1, 2, 3]
    assert metrics["eval/pass@2"] == pytest.approx(sum(pass_at_k(4, c, 2) for c in counts) / 4)
    assert metrics["eval/pass@1"] == pytest.approx(sum(counts) / 16)
    with pytest.raises(ValueError, match="empty"):
        evaluate(generate, score, [], n_samples=4, k=2, temperature=0.7)
    assert not any("by_source" in key for key in metrics)  # one data source: nothing per source

    # Held-out prompts of two data sources (two files, say): each gets its own accuracy and pass@k.
    sources = ["gsm8k", "math", "gsm8k", "math"]
    mixed = [EvalPrompt(p.prompt_ids, Problem(p.problem.prompt, p.problem.answer, data_source=s))
             for p, s in zip(prompts, sources)]
    by_source = evaluate(generate, score, mixed, n_samples=4, k=2, temperature=0.7)
    assert by_source["eval/accuracy"] == metrics["eval/accuracy"]
    assert by_source["eval/by_source/gsm8k/accuracy"] == 1.0 and by_source["eval/by_source/math/accuracy"] == 0.0
    assert by_source["eval/by_source/math/num_prompts"] == 2
    assert by_source["eval/by_source/math/pass@2"] == pytest.approx((pass_at_k(4, 1, 2) + pass_at_k(4, 3, 2)) / 2)
    assert by_source["eval/by_source/gsm8k/pass@1"] == pytest.approx((0 + 2) / 8)


def test_a_reward_that_raises_scores_zero_in_evaluation_and_is_logged_once(tiny_model_dir, tmp_path, caplog):
    """The held-out evaluation goes through the same reward as training: one that raises on an
    answer scores it 0, the evaluation finishes, and the failure is logged once, not per answer."""
    import logging

    from services.config import load_config
    from services.evaluation import PolicyEvaluator

    (tmp_path / "picky_reward.py").write_text(
        "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
        "    if solution_str != ground_truth:\n        raise ValueError('cannot parse ' + repr(solution_str))\n"
        "    return 1.0\n")
    cfg = load_config(None, [f"run.model={tiny_model_dir}", "rollout.task.families=[add]",
                             "rollout.task.difficulties=[3]", "eval.num_prompts=12", "eval.n_samples=0",
                             "eval.engine=hf", f"rollout.reward={tmp_path / 'picky_reward.py'}:compute_score",
                             "learner.lora.rank=4", "learner.lora.publish=adapter"])
    evaluator = PolicyEvaluator.from_config(cfg, tiny_model_dir)
    assert evaluator.engine.lora is None  # the folder is a whole model (a run's merged policy/), no adapter on top
    try:
        with caplog.at_level(logging.WARNING):
            metrics = evaluator.evaluate_payload(None)
    finally:
        evaluator.close()
    assert metrics["eval/num_prompts"] == 12 and metrics["eval/accuracy"] < 1.0  # 3-digit sums: some are wrong
    failures = [r for r in caplog.records if "eval: reward" in r.getMessage()]
    assert len(failures) == 1 and "ValueError: cannot parse" in failures[0].getMessage()
