"""One node's prep pool: its prep actors, the CPUs they reserve, the node's staging budget, and its
decoded tier (:mod:`coordinated_prep.tier`).

Ownership: the sweep's :class:`~coordinated_prep.stream.registry.GroupRegistry` creates one ``NodePool``
per node when the sweep starts (every live node) or when a trial first runs on a node that joined
later, and kills its actors in ``shutdown``; the actors are the registry's (Ray's owner), so they
outlive any one coordinator. The exception is a pool that starts on prep actors lent by the
driver (kept warm from its previous sweep, :mod:`coordinated_prep.pool.warm`): the driver owns
those; the pool hands them this sweep's cache and tier when it starts and never kills them.
Coordinators hold handles and submit pieces to them, and own the pieces they get back. The pool
starts before the first trial is placed: its actors reserve their CPUs before Tune's trials can
take them, and have imported torch by the time the first piece is asked for (a warm start).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from coordinated_prep.cache.layout import CacheLayout
from coordinated_prep.cache.spec import CacheSpec
from coordinated_prep.errors import PrepError
from coordinated_prep.pool.spec import PoolSpec
from coordinated_prep.pool.prep_actor import PrepActor
from coordinated_prep.tier.actor import DecodedTier

#: How long a prep actor's claim on a sample holds before others decode it themselves (a piece
#: takes about a second; a claimer that died and was restarted finds its claims its own again).
CLAIM_TIMEOUT_S = 30.0

logger = logging.getLogger(__name__)


def node_table() -> dict[str, tuple[float, float]]:
    """Per live node id: (CPUs, object store bytes)."""
    return {n["NodeID"]: (n["Resources"].get("CPU", 0.0), n["Resources"].get("object_store_memory", 2**30))
            for n in ray.nodes() if n["Alive"]}


class NodePool:
    """The prep actors of one node and its staging budget.

    Args:
        node: The node's id.
        cpus: The node's CPUs.
        store_bytes: The node's object store size.
        spec: The sweep's pool options.
        cache: The sweep's cache layout and options, handed to the prep actors; None: no cache.
        lent: Prep actors of this node's shape lent by the driver (``pool.keep_warm``), used
            instead of new ones; None: the pool starts its own.
    """

    def __init__(self, node: str, cpus: float, store_bytes: float, spec: PoolSpec,
                 cache: tuple[CacheLayout, CacheSpec] | None, lent: list[Any] | None = None) -> None:
        self.node = node
        self.spec = spec
        n, each = spec.shape_for(cpus)
        self.reserved_cpus = n * each
        self.budget_bytes = spec.budget_for(store_bytes)
        self.decoded_bytes = spec.decoded_for(store_bytes)
        affinity = NodeAffinitySchedulingStrategy(node_id=node, soft=False)
        self.tier: Any = None
        if self.decoded_bytes > 0:
            self.tier = DecodedTier.options(scheduling_strategy=affinity).remote(self.decoded_bytes, node,
                                                                                 CLAIM_TIMEOUT_S)
        tier = (self.tier, CLAIM_TIMEOUT_S) if self.tier is not None else None
        self.lent = bool(lent)
        if lent:  # warm: this sweep's cache and tier, and nothing of the last sweep's kept
            self.actors: list[Any] = list(lent)
            self._started = [a.reset.remote(cache, tier) for a in self.actors]
        else:
            self.actors = [PrepActor.options(num_cpus=each, scheduling_strategy=affinity).remote(cache, tier)
                           for _ in range(n)]
            self._started = [a.__ray_ready__.remote() for a in self.actors]
        logger.info("node %s: prep pool of %d actors reserving %.2f CPUs, staging budget %d bytes, decoded tier "
                    "%d bytes", node, n, self.reserved_cpus, self.budget_bytes, self.decoded_bytes)

    async def ready(self) -> None:
        """Wait until every actor is placed and has imported what it needs.

        Raises:
            PrepError: The pool did not start within ``start_timeout_s`` or an actor died starting,
                naming the node, the CPUs asked for and the fix.
        """
        try:
            tier = [self.tier.__ray_ready__.remote()] if self.tier is not None else []
            await asyncio.wait_for(asyncio.gather(*self._started, *tier), self.spec.start_timeout_s)
        except (asyncio.TimeoutError, ray.exceptions.RayError) as e:
            raise PrepError(
                f"the prep pool of node {self.node} ({len(self.actors)} actors reserving {self.reserved_cpus:.2f} "
                f"CPUs) did not start within pool.start_timeout_s={self.spec.start_timeout_s}s: {e!r}; lower "
                "pool.cpus (0 reserves none) or pool.actors, or free CPUs on that node"
            ) from None

    def kill(self) -> None:
        """Kill every actor (no restart) but lent ones, which the driver keeps or kills; pieces their
        coordinators own are unaffected."""
        for actor in self.actors:
            if not self.lent:
                ray.kill(actor, no_restart=True)
        if self.tier is not None:  # its kept objects are freed with it (it owns them)
            ray.kill(self.tier, no_restart=True)

    async def tier_report(self) -> dict[str, Any] | None:
        """The decoded tier's counters and bytes (:meth:`DecodedTier.report`); None without a tier."""
        if self.tier is None:
            return None
        return await asyncio.wait_for(self.tier.report.remote(), 30.0)
