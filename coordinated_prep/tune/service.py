"""PrepService: the prep pools and data groups of a Ray job without Tune, for runs of Ray Train alone.

A Tune sweep gets its prep pools from the :class:`~coordinated_prep.CoordinatedSearcher`. Ray Train
alone has no search algorithm, so the driver opens the same machinery around its ``fit()`` calls::

    with coordinated_prep.PrepService(pool={"actors": 2}):
        TorchTrainer(train_fn, train_loop_config={"data": spec}, scaling_config=ScalingConfig(num_workers=2)).fit()

Every Train worker in the driver's Ray job then finds the registry (as a trial of a sweep does):
each run's ranks read disjoint shares of one stream (:mod:`coordinated_prep.trial.shard`), and
concurrent runs with equal specs share a group. Ownership: the service owns the registry, which
owns the pools and coordinators; leaving the ``with`` block destroys them. A run that ends leaves
its groups when its workers' processes end, as there is no Tune to say that it completed: each
coordinator releases a worker's loader at once (it watches the process), and the registry, which
asks the coordinators every few seconds and before a new group starts on a node, then takes the
run's membership back, destroying a group left with no member; so any number of runs, one after
another, fit a node's staging budget (``GroupRegistry``'s module docstring states the rule).
"""

from __future__ import annotations

from typing import Any, Mapping

from coordinated_prep.cache.spec import CacheSpec
from coordinated_prep.pool.spec import PoolSpec
from coordinated_prep.tune.searcher import CoordinatedSearcher


class PrepService:
    """Starts the registry and every node's prep pool on entry and destroys them on exit.

    Args:
        cache: A raw-data cache on every node, as ``CoordinatedSearcher(cache=...)``.
        pool: The prep pool and staging budget of every node, as ``CoordinatedSearcher(pool=...)``.

    Raises:
        ConfigError: A bad ``cache`` or ``pool`` (named).
        PrepError: A node's pool did not start.
    """

    def __init__(self, *, cache: CacheSpec | Mapping[str, Any] | None = None,
                 pool: PoolSpec | Mapping[str, Any] | None = None) -> None:
        self._searcher = CoordinatedSearcher(cache=cache, pool=pool)

    def start(self) -> "PrepService":
        """Start the registry and pools now (idempotent); waits until they are ready."""
        self._searcher.start()
        return self

    def __enter__(self) -> "PrepService":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Destroy every data group, pool and the registry (idempotent)."""
        self._searcher.close()

    def group_reports(self) -> dict[str, dict[str, Any]]:
        """Per data group: samples prepared and served (per rank consumer ``<run>@<rank>``), and more."""
        return self._searcher.group_reports()

    def pool_reports(self) -> dict[str, dict[str, Any]]:
        """Per node: prep actors, reserved CPUs and the staging budget."""
        return self._searcher.pool_reports()
