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


class _Method:
    """A registry actor method: ``.remote()`` answers its name (the fake ``ray.get`` passes it through)."""

    def __init__(self, name: str) -> None:
        self.name = name

    def remote(self) -> str:
        return self.name


class _FakeRegistry:
    def __getattr__(self, name: str) -> _Method:
        return _Method(name)


@pytest.mark.parametrize("method, asked", [("group_reports", "reports"), ("pool_reports", "pools"),
                                           ("eval_reports", "eval_reports"), ("cache_reports", "cache_reports"),
                                           ("decoded_reports", "decoded_reports")])
def test_each_report_asks_its_registry_method_and_is_empty_before_the_registry(monkeypatch, method, asked):
    from coordinated_prep.tune import searcher as module

    searcher = CoordinatedSearcher(cache={"capacity_bytes": "1MiB"})
    assert getattr(searcher, method)() == {}  # no registry yet: nothing to ask
    monkeypatch.setattr(module.ray, "get", lambda ref, timeout: {"asked": ref, "timeout": timeout})
    searcher._registry = _FakeRegistry()
    assert getattr(searcher, method)() == {"asked": asked, "timeout": module._CALL_TIMEOUT_S}
    assert searcher.group_reports_ref() == "reports"


def test_cache_reports_are_empty_without_a_cache(monkeypatch):
    from coordinated_prep.tune import searcher as module

    monkeypatch.setattr(module.ray, "get", lambda ref, timeout: {"asked": ref})
    searcher = CoordinatedSearcher()
    searcher._registry = _FakeRegistry()
    assert searcher.cache_reports() == {} and searcher.decoded_reports() == {"asked": "decoded_reports"}
