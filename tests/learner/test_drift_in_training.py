"""The drift split where it is measured: a learner step over a batch whose groups were sampled by
three versions of the policy (0, 1 and 2 versions stale), with a float32 sampler (no backend gap)
and with a perturbed one (a backend gap), and the exact probe scoring rows with the weights that
sampled them."""
from __future__ import annotations

import math

import pytest
import torch
from learner_helpers import build_tiny_policy, sample_groups

from learner.config import LearnerConfig
from learner.drift import bucket_sums, drift_metrics
from learner.trainer import Learner


@pytest.fixture(scope="module")
def versions(tmp_path_factory):
    """Policy folders of versions 0, 1, 2 of one learner that trains fast (lr 2e-2)."""
    root = tmp_path_factory.mktemp("versions")
    first = build_tiny_policy(root / "v0", seed=3)
    learner = Learner(LearnerConfig(model_path=str(first), lr=2e-2, rollout_correction="disabled"))
    folders = [first]
    groups = sample_groups(first, n_groups=4, n=4, seed=10)  # the same groups twice: one direction
    for v in (1, 2):
        learner.train_step(groups)
        folders.append(learner.save_policy(root / f"v{v}"))
    return folders


def mixed_batch(folders, noise: float, seed: int = 0):
    """Groups on the same prompts sampled by versions 0, 1 and 2 (prompt indexes kept apart)."""
    groups = []
    for v, folder in enumerate(folders):
        for g in sample_groups(folder, n_groups=4, n=6, version=v, seed=seed, logprob_noise=noise,
                               max_new_tokens=8):
            g.prompt_index += 10 * v
            g.group_id = f"v{v}-{g.group_id}"
            for sample in g.samples:
                sample.group_id, sample.sample_id = g.group_id, f"v{v}-{sample.sample_id}"
            groups.append(g)
    return groups


def learner_at_version_2(folders, **overrides) -> Learner:
    return Learner(LearnerConfig(model_path=str(folders[2]), lr=1e-6, **overrides), version=2)


def test_a_step_reports_the_drift_split_of_its_batch(versions):
    groups = mixed_batch(versions, noise=0.0)
    learner = learner_at_version_2(versions)
    # The split from the learner's own π_old, computed apart from the step.
    from learner.batch import build_batch

    batch = build_batch(groups, learner_version=2)
    with torch.no_grad():
        old, _ = learner._no_grad_log_probs(batch)
    want = drift_metrics(bucket_sums(old, batch.rollout_log_probs, batch.token_versions, 2, batch.response_mask))

    got = learner.train_step(groups)
    for key, value in want.items():
        assert got[key] == pytest.approx(value, rel=1e-9, abs=1e-12), key
    # A float32 sampler with the learner's weights: no backend gap; the policy moved, so the gap
    # grows with staleness and the slope is positive.
    assert abs(got["drift/backend_k3"]) < 1e-6
    assert got["drift/by_staleness/0"] < 1e-6 < got["drift/by_staleness/1"] < got["drift/by_staleness/2"]
    assert got["drift/per_version_k3"] > 0
    assert got["drift/tokens_by_staleness/0"] > 0 and got["drift/tokens_by_staleness/2"] > 0
    assert "drift/exact_backend_k3" not in got  # the probe is off by default


def test_a_perturbed_sampler_shows_as_backend_gap(versions):
    got = learner_at_version_2(versions).train_step(mixed_batch(versions, noise=0.3))
    assert got["drift/backend_k3"] > 0.01
    assert got["drift/backend_k3"] == pytest.approx(got["drift/by_staleness/0"])


@pytest.mark.parametrize("noise", [0.0, 0.3], ids=["float32-sampler", "perturbed-sampler"])
def test_the_exact_probe_scores_rows_with_the_weights_that_sampled_them(versions, noise):
    learner = learner_at_version_2(versions, diagnostics={"exact_drift_every": 1, "exact_drift_rows": 72,
                                                          "keep_versions": 3})
    # The probe keeps versions as the learner reaches them; one that started at version 2 has
    # seen only 2, so give it 0 and 1 the way a run would have (the weights each version had).
    from lm.causal_lm import load_causal_lm

    for v in (0, 1):
        learner.drift_probe.remember(v, load_causal_lm(versions[v]).state_dict())
    got = learner.train_step(mixed_batch(versions, noise=noise))
    assert got["drift/exact_probe_tokens"] > 0
    if noise == 0.0:
        # μ is π_θk exactly: the whole gap is staleness, and the estimate's backend part agrees.
        assert abs(got["drift/exact_backend_k3"]) < 1e-6
        assert got["drift/exact_staleness_k3"] > 1e-4
    else:
        assert got["drift/exact_backend_k3"] > 0.01
        # The estimate's backend (fresh tokens) and the exact one (every row) agree within 20 %.
        assert got["drift/backend_k3"] == pytest.approx(got["drift/exact_backend_k3"], rel=0.2)
    assert got["drift/exact_per_version_k3"] > 0
    assert math.isfinite(got["drift/estimate_error_per_version_k3"])


def test_the_probe_remembers_the_versions_inside_the_window(versions):
    learner = Learner(LearnerConfig(model_path=str(versions[0]), lr=1e-3,
                                    diagnostics={"exact_drift_every": 2, "keep_versions": 2}))
    groups = sample_groups(versions[0], n_groups=2, n=3, seed=1)  # sampled by version 0
    probed = []
    for _ in range(5):
        probed.append("drift/exact_probe_tokens" in learner.train_step(groups))
    # Due at versions 0, 2 and 4; from version 2 on, version 0 has left the kept window, so
    # these rows cannot be scored with the weights that sampled them and nothing is reported.
    assert probed == [True, False, False, False, False]
    assert sorted(learner.drift_probe.weights.weights) == [3, 4]


def test_the_probe_copies_only_the_versions_a_probe_will_use(versions):
    learner = Learner(LearnerConfig(model_path=str(versions[0]), lr=1e-3,
                                    diagnostics={"exact_drift_every": 5, "keep_versions": 2}))
    copied = []
    remember = learner.drift_probe.remember
    learner.drift_probe.remember = lambda version, state: (copied.append(version), remember(version, state))
    groups = sample_groups(versions[0], n_groups=2, n=3, seed=1)
    for _ in range(11):
        learner.train_step(groups)
    assert copied == [0, 4, 5, 9, 10], "due at 0, 5, 10: each with the version before it"


def test_diagnostics_are_set_at_the_top_level_and_sized_to_the_window():
    from services.config import ConfigError, build_config

    cfg = build_config({}, ["diagnostics.exact_drift_every=5", "buffer.gate.eta=3"])
    assert cfg.learner.diagnostics.exact_drift_every == 5 and cfg.learner.diagnostics.keep_versions == 4
    cfg = build_config({}, ["diagnostics.exact_drift_every=5", "buffer.gate.eta=auto", "buffer.gate.eta_max=6"])
    assert cfg.learner.diagnostics.keep_versions == 7
    with pytest.raises(ConfigError, match="exact_drift_evry"):
        build_config({}, ["diagnostics.exact_drift_evry=5"])
    # a saved config holds them as learner.diagnostics: a resume's top-level override wins, sized anew
    saved = cfg.model_dump(mode="json")
    cfg = build_config(saved, ["diagnostics.exact_drift_every=1", "buffer.gate.eta=1"])
    assert cfg.learner.diagnostics.exact_drift_every == 1 and cfg.learner.diagnostics.keep_versions == 2
