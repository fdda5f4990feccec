"""CoordinatedSearcher without Ray: the concurrency Tune reads from it."""

from __future__ import annotations

import pytest
from ray.tune.execution.tune_controller import _get_max_pending_trials
from ray.tune.search import BasicVariantGenerator, ConcurrencyLimiter

from coordinated_prep import CoordinatedSearcher
from coordinated_prep.errors import ConfigError


@pytest.mark.parametrize("limit, pending", [(0, 200), (4, 4)])
def test_trials_may_start_together_not_one_by_one(limit, pending):
    # Tune allows one pending trial for a SearchAlgorithm unless it finds a ConcurrencyLimiter
    # on `search_alg.searcher`; concurrent trials would then start about a second apart.
    searcher = CoordinatedSearcher(max_concurrent=limit)
    assert isinstance(searcher.searcher, ConcurrencyLimiter)
    assert _get_max_pending_trials(searcher) == pending


def test_a_variant_generator_passed_in_sets_the_pending_limit():
    # A sweep's `search: {type: random, seed: ...}` passes Tune's generator, limited, itself.
    searcher = CoordinatedSearcher(BasicVariantGenerator(max_concurrent=3, random_state=0))
    assert _get_max_pending_trials(searcher) == 3


def test_bad_limits_are_named():
    with pytest.raises(ConfigError, match="max_concurrent=-1"):
        CoordinatedSearcher(max_concurrent=-1)
