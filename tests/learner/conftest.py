"""Fixtures of the learner tests."""
from __future__ import annotations

import pytest

import learner_helpers
from learner_helpers import SharedRanks


@pytest.fixture(scope="module")
def _rank_pool(ray_cluster):
    from ray import cloudpickle

    # By value: the rank processes, which cannot import this folder's modules, run RebuildableRank.
    cloudpickle.register_pickle_by_value(learner_helpers)
    pool: list[SharedRanks] = []
    yield pool
    for group in pool:
        group.shutdown()


@pytest.fixture
def two_ranks(_rank_pool, request):
    """`two_ranks(config)`: a two-rank learner group (Ray actors, gloo) of `config`, on the two rank
    processes the module's tests share (the first call starts them). After a failed test they are
    ended: a rank left inside a collective would hold the next test until its timeout."""
    def group_of(config) -> SharedRanks:
        if _rank_pool:
            return _rank_pool[0].rebuild(config)
        _rank_pool.append(SharedRanks(config, ray_options={"num_cpus": 0}))
        return _rank_pool[0]

    failed_before = request.session.testsfailed
    yield group_of
    if request.session.testsfailed != failed_before and _rank_pool:
        _rank_pool.pop().shutdown()
