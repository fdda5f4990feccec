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
take them, and import torch while the trials start (their first piece waits for that). A pool
left to size itself (``PoolSpec(actors=None)``, not lent) starts one actor and grows while the
trials wait for it (:mod:`coordinated_prep.pool.elastic`); the registry adds each new actor to the
pool and to every coordinator of the node.

Such a pool (unless kept warm) also *lends* its CPUs: its actors reserve none themselves, and the
pool holds its shares of the node's CPUs as placement groups of one bundle each, pinned to the node
by its ``ray.io/node-id`` label. They are the registry's, like the actors: created here, removed by
:meth:`NodePool.release` when the growth rule gives a share back to Tune, and by ``kill`` at the end
of the sweep (Ray also removes them with the registry, their creator).
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from typing import Any

import ray
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from coordinated_prep.cache.layout import CacheLayout
from coordinated_prep.cache.spec import CacheSpec
from coordinated_prep.errors import PrepError
from coordinated_prep.naming import NAMESPACE
from coordinated_prep.pool.elastic import SHARE_TIMEOUT_S, Growth
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
        spec.check_store(store_bytes, node)
        self.node = node
        self.spec = spec
        most, self.each = spec.shape_for(cpus)
        # Sized by demand: one actor to start with, up to ``most`` (a lent pool is the driver's, as it is).
        grows = spec.grows and not lent and most > 1
        # A kept pool's actors hold their CPUs themselves: the next sweep borrows them as they are.
        self.growth = Growth(most, lends=not spec.keep_warm and self.each > 0) if grows else None
        self.lends = self.growth is not None and self.growth.lends
        self.shares: list[Any] = []  # a lending pool's placement groups, one share of CPUs each
        n = 1 if self.growth is not None else most
        self.budget_bytes = spec.budget_for(store_bytes)
        self.decoded_bytes = spec.decoded_for(store_bytes)
        affinity = self._affinity = NodeAffinitySchedulingStrategy(node_id=node, soft=False)
        self.tier: Any = None
        tier = None  # what the prep actors are handed: the tier's name (a handle in an actor's constructor
        # arguments makes Ray keep them in the object store for its restarts, and log an error saying so)
        if self.decoded_bytes > 0:
            name = f"coordprep-tier-{node[:12]}-{uuid.uuid4().hex[:12]}"
            self.tier = DecodedTier.options(name=name, namespace=NAMESPACE, scheduling_strategy=affinity).remote(
                self.decoded_bytes, node, CLAIM_TIMEOUT_S)
            tier = (name, CLAIM_TIMEOUT_S)
        self._handed = tier
        self._cache = cache
        self.starting: Any = None  # an actor or a share asked for by the growth, until it is added or given up
        self.given_up_why = ""  # why the last one asked for was given up
        self.lent = bool(lent)
        if lent:  # warm: this sweep's cache and tier, and nothing of the last sweep's kept
            self.actors: list[Any] = list(lent)
            self._started = [a.reset.remote(cache, tier) for a in self.actors]
        else:
            self.actors = [self._new_actor() for _ in range(n)]
            self._started = [a.__ray_ready__.remote() for a in self.actors]
            if self.lends:
                self.shares = [self._new_share() for _ in range(n)]
                self._started += [pg.ready() for pg in self.shares]
        logger.info("node %s: prep pool of %d actors (at most %d) reserving %.2f CPUs each, staging budget %d bytes, "
                    "decoded tier %d bytes", node, n, most, self.each, self.budget_bytes, self.decoded_bytes)

    @property
    def reserved_cpus(self) -> float:
        """The logical CPUs the pool reserves now: its actors', or the shares a lending pool holds."""
        return (len(self.shares) if self.lends else len(self.actors)) * self.each

    def _new_actor(self) -> Any:
        return PrepActor.options(num_cpus=0 if self.lends else self.each,
                                 scheduling_strategy=self._affinity).remote(self._cache, self._handed)

    def _new_share(self) -> Any:
        """A placement group holding one actor's share of this node's CPUs."""
        return placement_group([{"CPU": self.each}], bundle_label_selector=[{"ray.io/node-id": self.node}])

    async def reserve(self) -> bool:
        """Take one share of the node's CPUs again (a lending pool); True once it is held.

        A share that is not placed within ``SHARE_TIMEOUT_S`` (the trials hold the CPUs) is removed
        and given up.
        """
        self.starting = share = self._new_share()
        try:
            await asyncio.wait_for(share.ready(), min(SHARE_TIMEOUT_S, self.spec.start_timeout_s))
        except asyncio.CancelledError:  # the sweep ends meanwhile
            remove_placement_group(share)
            raise
        except (asyncio.TimeoutError, ray.exceptions.RayError) as e:
            logger.info("node %s: a share of %.2f CPUs was not placed (%r); the pool holds %d", self.node, self.each,
                        e, len(self.shares))
            remove_placement_group(share)
            waited = min(SHARE_TIMEOUT_S, self.spec.start_timeout_s)
            self.given_up_why = (f"no CPU came free for its share within {waited:.0f} s"
                                 if isinstance(e, asyncio.TimeoutError) else f"its share failed: {e!r}")
            return False
        finally:
            self.starting = None
        self.shares.append(share)
        return True

    def release(self) -> None:
        """Give one share of the node's CPUs back to Tune (a lending pool); its actors keep running."""
        remove_placement_group(self.shares[-1])  # first: a share that failed to go stays the pool's to remove
        self.shares.pop()

    async def grow(self) -> bool:
        """Start one more actor and add it once it can prepare (imported torch); True if it was added.

        An actor that does not start within ``start_timeout_s`` (no CPU of the node came free) or
        dies starting is killed and given up: the pool goes on with the actors it has. A lending
        pool first takes the new actor's share of CPUs (:meth:`reserve`), and gives it back if the
        actor is given up.
        """
        if self.lends and not await self.reserve():  # its share first: it needs a CPU that is free
            return False
        self.starting = actor = self._new_actor()
        try:
            await asyncio.wait_for(actor.imported.remote(), self.spec.start_timeout_s)
        except asyncio.CancelledError:  # the sweep ends while it starts
            ray.kill(actor, no_restart=True)
            raise
        except (asyncio.TimeoutError, ray.exceptions.RayError) as e:
            logger.info("node %s: a new prep actor did not start (%r); the pool keeps its %d", self.node, e,
                        len(self.actors))
            ray.kill(actor, no_restart=True)
            if self.lends:
                self.release()
            self.given_up_why = (f"it did not start within pool.start_timeout_s={self.spec.start_timeout_s}s (no CPU "
                                 "free)" if isinstance(e, asyncio.TimeoutError) else f"it died starting: {e!r}")
            return False
        finally:
            self.starting = None
        self.actors.append(actor)
        return True

    async def ready(self) -> None:
        """Wait until every actor is placed (it holds its CPUs); each imports torch meanwhile, and
        its first piece waits for that (:class:`~coordinated_prep.pool.prep_actor.PrepActor`). The
        decoded tier is not waited for: a prep actor's call waits for it, and one it cannot reach
        only means decoding again.

        Raises:
            PrepError: The pool did not start within ``start_timeout_s`` or an actor died starting,
                naming the node, the CPUs asked for and the fix.
        """
        try:
            await asyncio.wait_for(asyncio.gather(*self._started), self.spec.start_timeout_s)
        except (asyncio.TimeoutError, ray.exceptions.RayError) as e:
            raise PrepError(
                f"the prep pool of node {self.node} ({len(self.actors)} actors reserving {self.reserved_cpus:.2f} "
                f"CPUs) did not start within pool.start_timeout_s={self.spec.start_timeout_s}s: {e!r}; lower "
                "pool.cpus (0 reserves none) or pool.actors, or free CPUs on that node"
            ) from None

    def kill(self) -> None:
        """Kill every actor (no restart) but lent ones, which the driver keeps or kills, and remove the
        shares of CPUs the pool holds; pieces their coordinators own are unaffected."""
        for actor in self.actors + ([self.starting] if self.starting is not None else []):
            if isinstance(actor, PlacementGroup):  # a share starting
                remove_placement_group(actor)
            elif not self.lent:
                ray.kill(actor, no_restart=True)
        for share in self.shares:
            remove_placement_group(share)
        self.shares = []
        if self.tier is not None:  # its kept objects are freed with it (it owns them)
            ray.kill(self.tier, no_restart=True)

    async def tier_report(self) -> dict[str, Any] | None:
        """The decoded tier's counters and bytes (:meth:`DecodedTier.report`); None without a tier."""
        if self.tier is None:
            return None
        return await asyncio.wait_for(self.tier.report.remote(), 30.0)
