"""The drift split: from μ, π_old and each token's version, the gap by staleness, its backend
part (the gap at equal weights) and its drift per version (the slope), on batches built with a
known backend and slope."""
from __future__ import annotations

import math

import pytest
import torch

from learner.drift import bucket_sums, drift_metrics, token_gaps


def batch(backend: float, per_version: float, staleness: list[int], tokens: int = 40, version: int = 10):
    """Rows of `tokens` tokens; row i sampled `staleness[i]` versions ago, its log-ratio chosen so
    that k1 = backend + s · per_version exactly."""
    rows = len(staleness)
    old = -torch.rand(rows, tokens, generator=torch.Generator().manual_seed(0)) - 0.5
    gap = torch.tensor([backend + s * per_version for s in staleness], dtype=torch.float32)[:, None]
    rollout = old + gap  # k1 = log μ − log π_old = gap
    versions = torch.tensor([version - s for s in staleness])[:, None].expand(rows, tokens)
    return old, rollout, versions, version, torch.ones(rows, tokens)


def split_of(*parts):
    return drift_metrics(bucket_sums(*parts))


def test_backend_and_drift_per_version_are_recovered():
    metrics = split_of(*batch(backend=0.01, per_version=0.02, staleness=[0, 0, 1, 1, 2, 3]))
    assert metrics["drift/backend_k1"] == pytest.approx(0.01, abs=1e-6)
    assert metrics["drift/per_version_k1"] == pytest.approx(0.02, abs=1e-6)
    k3 = lambda gap: math.exp(-gap) + gap - 1  # noqa: E731 (k3 of a constant log-ratio -gap)
    assert metrics["drift/by_staleness/2"] == pytest.approx(k3(0.05), rel=1e-5)
    assert metrics["drift/tokens_by_staleness/1"] == 80
    total = (2 * 0.01 + 2 * 0.03 + 0.05 + 0.07) / 6
    assert metrics["drift/total_k1"] == pytest.approx(total, abs=1e-6)


def test_without_fresh_tokens_the_backend_is_not_measured_and_the_intercept_stands_beside_it():
    metrics = split_of(*batch(backend=0.004, per_version=0.01, staleness=[1, 2, 2, 3]))
    assert math.isnan(metrics["drift/backend_k1"]) and math.isnan(metrics["drift/backend_k3"])
    assert metrics["drift/backend_intercept_k1"] == pytest.approx(0.004, abs=1e-6)  # a linear gap: exact
    assert metrics["drift/per_version_k1"] == pytest.approx(0.01, abs=1e-6)


def test_a_gap_growing_faster_than_linearly_puts_the_intercept_below_the_backend():
    # KL grows about with the square of the distance moved: gap(s) = backend + c s^2. The fresh
    # tokens measure the backend; the line through the stale buckets extrapolates below it.
    old, rollout, versions, version, mask = batch(backend=0.0, per_version=0.0, staleness=[0, 1, 2, 3])
    curve = torch.tensor([0.002 + 0.004 * s * s for s in (0, 1, 2, 3)])[:, None]
    metrics = split_of(old, old + curve, versions, version, mask)
    assert metrics["drift/backend_k1"] == pytest.approx(0.002, abs=1e-6)
    assert metrics["drift/backend_intercept_k1"] < 0.0 < metrics["drift/backend_k1"]


def test_one_staleness_only_has_no_slope():
    metrics = split_of(*batch(backend=0.01, per_version=0.02, staleness=[0, 0]))
    assert metrics["drift/backend_k3"] > 0 and math.isnan(metrics["drift/per_version_k3"])
    assert "drift/per_version_from_gap_k3" not in metrics  # nothing stale: nothing to bound


def test_without_a_slope_the_gap_per_version_of_staleness_stands_in():
    # A full window at eta = 1 (here 2): every token equally stale, so no slope; the stand-in is
    # the stale tokens' gap over their staleness, the fresh tokens left out.
    metrics = split_of(*batch(backend=0.004, per_version=0.02, staleness=[2, 2, 2]))
    assert math.isnan(metrics["drift/per_version_k3"])
    assert metrics["drift/per_version_from_gap_k3"] == pytest.approx(metrics["drift/by_staleness/2"] / 2)
    mixed = split_of(*batch(backend=0.004, per_version=0.02, staleness=[0, 1, 3]))
    gap = (mixed["drift/by_staleness/1"] + mixed["drift/by_staleness/3"]) / 2  # equal token counts
    assert mixed["drift/per_version_from_gap_k3"] == pytest.approx(gap / 2)  # mean staleness (1 + 3) / 2


def test_masked_tokens_do_not_count():
    old, rollout, versions, version, mask = batch(backend=0.0, per_version=0.02, staleness=[0, 1, 2])
    rollout[1, :20] += 5.0  # environment tokens: wild log-probs, out of the loss mask
    mask[1, :20] = 0
    metrics = split_of(old, rollout, versions, version, mask)
    assert metrics["drift/per_version_k1"] == pytest.approx(0.02, abs=1e-6)
    assert metrics["drift/tokens_by_staleness/1"] == 20


def test_k1_and_k3_estimate_the_same_kl():
    """On tokens drawn from μ, both estimate KL(μ ‖ π_old): compare with the exact value."""
    gen = torch.Generator().manual_seed(3)
    mu = torch.softmax(torch.randn(50, generator=gen), -1)
    pi = torch.softmax(torch.log(mu) + 0.3 * torch.randn(50, generator=gen), -1)
    draws = torch.multinomial(mu, 200_000, replacement=True, generator=gen)
    k1, k3 = token_gaps(torch.log(pi)[draws], torch.log(mu)[draws])
    exact = float((mu * (torch.log(mu) - torch.log(pi))).sum())
    assert float(k1.mean()) == pytest.approx(exact, rel=0.05) and float(k3.mean()) == pytest.approx(exact, rel=0.05)


def test_sums_of_two_halves_give_the_split_of_the_whole():
    """Ranks compute sums on their own rows; the all-reduced sums give the whole batch's split."""
    old, rollout, versions, version, mask = batch(backend=0.003, per_version=0.015, staleness=[0, 1, 2, 3, 1, 0])
    whole = bucket_sums(old, rollout, versions, version, mask)
    halves = bucket_sums(old[:3], rollout[:3], versions[:3], version, mask[:3]) + \
        bucket_sums(old[3:], rollout[3:], versions[3:], version, mask[3:])
    assert torch.allclose(whole, halves)
    assert drift_metrics(halves)["drift/per_version_k1"] == pytest.approx(0.015, abs=1e-6)


def test_the_exact_split_separates_backend_and_staleness():
    """Rows sampled by versions 0 and 2 of a policy now at version 3, with a known backend gap
    (μ vs π_θk) and a known staleness gap (π_θk vs π_old): the exact split finds both, and the
    estimate's error is reported beside it."""
    from learner.drift import exact_split

    rows, tokens, version = 4, 50, 3
    staleness = torch.tensor([3, 3, 1, 1])
    generating = -torch.rand(rows, tokens, generator=torch.Generator().manual_seed(1)) - 0.5
    rollout = generating + 0.01  # backend: log μ − log π_θk = 0.01 on every token
    old = generating - 0.02 * staleness[:, None]  # staleness: log π_θk − log π_old = 0.02 per version
    versions = (version - staleness)[:, None].expand(rows, tokens)
    found = exact_split(old, rollout, generating, versions, version, torch.ones(rows, tokens))
    k3 = lambda gap: math.exp(-gap) + gap - 1  # noqa: E731
    assert found["drift/exact_backend_k3"] == pytest.approx(k3(0.01), rel=1e-4)
    per_token = [k3(0.02 * s) for s in (3, 3, 1, 1)]
    assert found["drift/exact_staleness_k3"] == pytest.approx(sum(per_token) / 4, rel=1e-4)
    assert found["drift/exact_per_version_k3"] == pytest.approx(sum(per_token) * tokens / (8 * tokens), rel=1e-4)
    assert math.isfinite(found["drift/estimate_error_backend_k3"]) and found["drift/exact_probe_tokens"] == 200


def test_version_weights_keep_the_window_and_score_with_an_old_version(tmp_path):
    from learner_helpers import build_tiny_policy

    from learner.drift import VersionWeights
    from lm.causal_lm import load_causal_lm

    folder = build_tiny_policy(tmp_path / "policy", seed=1)
    model = load_causal_lm(folder)
    keep = VersionWeights(str(folder), "float32", keep=2)
    for version in range(4):
        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.01)
        keep.remember(version, model.state_dict())
    assert sorted(keep.weights) == [2, 3]
    scorer = keep.model_for(2)
    first = next(iter(keep.weights[2]))
    assert torch.equal(scorer.state_dict()[first], keep.weights[2][first])
    assert not torch.equal(keep.weights[2][first], keep.weights[3][first])
