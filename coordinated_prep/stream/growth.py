"""A node's prep pool sized by demand, at the registry: the tick that reads the trials' waits, adds
actors, and gives shares of CPUs back or takes them again (the rule is :mod:`coordinated_prep.pool.elastic`)."""

from __future__ import annotations

import asyncio
import logging
import time

import ray

from coordinated_prep import metrics
from coordinated_prep.naming import CALL_TIMEOUT_S
from coordinated_prep.pool.elastic import GROW, RELEASE, TICK_S
from coordinated_prep.pool.node import NodePool

logger = logging.getLogger(__name__)


class PoolGrowth:
    """The registry's half for growing pools (:class:`~coordinated_prep.stream.registry.GroupRegistry`
    inherits it).

    It owns one tick task per node whose pool sizes itself (``_growers``), started with the pool
    and ended at shutdown, and reads the registry's ``_pools`` and ``_groups``.
    """

    def _start_growing(self, pool: NodePool) -> None:
        """Tick ``pool``'s growth until shutdown (a pool of a fixed size or lent has none)."""
        _gauges(pool)
        if pool.growth is None:
            return
        self._closing = self._closing or asyncio.Event()
        self._growers[pool.node] = asyncio.get_running_loop().create_task(self._grow(pool, self._closing))

    async def _grow(self, pool: NodePool, closing: asyncio.Event) -> None:
        """Every ``TICK_S``: the seconds the node's trials were blocked on their pieces since the last
        tick (summed over its groups), its trials and whether a lease clock ran go to the growth rule;
        an actor it asks for is started, then handed to every coordinator of the node (a coordinator
        started meanwhile got the pool's list); a share it gives back or asks for is removed or taken."""
        seen: dict = {}  # per coordinator, its answer at the last look; None: when that look was
        began = seen[None] = time.monotonic()
        while not pool.growth.settled:
            try:
                await asyncio.wait_for(closing.wait(), TICK_S)
                return  # the sweep ends
            except asyncio.TimeoutError:
                pass
            try:
                await self._tick(pool, seen, began)
            except Exception:  # a bug here must not end the sweep; the pool keeps the actors it has
                logger.exception("node %s: the prep pool's growth failed; it keeps its %d actors", pool.node,
                                 len(pool.actors))
                return

    async def _look(self, pool: NodePool, seen: dict) -> tuple[float, int, bool, float]:
        """The node's demand since the last look (``seen``: per coordinator, its answer then; at ``None``,
        when): seconds its trials were blocked, its trials, whether a lease clock ran, and the seconds since."""
        coordinators = [g.actor for g in self._groups.values() if g.node == pool.node and g.actor is not None]
        answers = await asyncio.gather(*(asyncio.wait_for(a.demand.remote(), CALL_TIMEOUT_S) for a in coordinators),
                                       return_exceptions=True)
        waited, trials, leased = 0.0, 0, False
        for actor, answer in zip(coordinators, answers):
            if isinstance(answer, dict):  # a coordinator that died or is slow counts nothing this tick
                last = seen.get(actor, {"waited_s": 0.0, "lease_s": 0.0})
                waited += answer["waited_s"] - last["waited_s"]
                leased = leased or answer["lease_s"] > last["lease_s"]
                trials += answer["trials"]
                seen[actor] = answer
        for gone in [a for a in seen if a is not None and a not in coordinators]:  # bounded by the live groups
            del seen[gone]
        now = time.monotonic()
        since, seen[None] = now - seen[None], now
        return waited, trials, leased, since

    async def _tick(self, pool: NodePool, seen: dict, began: float) -> None:
        """One look at the node's demand, and the actor the rule asks for, if any."""
        waited, trials, leased, since = await self._look(pool, seen)
        # the waits over the time they were counted in: a tick, or more where a look took long
        what = pool.growth.tick(waited, trials, leased, max(TICK_S, since), time.monotonic() - began)
        if what is None:
            return
        if what == RELEASE:
            pool.release()
            logger.info("node %s: %s", pool.node, pool.growth.decisions[-1][2])
            _gauges(pool)
            return
        logger.info("node %s: %s; %s", pool.node, pool.growth.decisions[-1][2],
                    f"starting prep actor {pool.growth.actors + 1} of at most {pool.growth.most}" if what == GROW
                    else f"taking {pool.each:.2f} CPUs back for its actors")
        added = await (pool.grow() if what == GROW else pool.reserve())
        await self._look(pool, seen)  # the trials' waits during that start are not the next window's
        pool.growth.started(added, time.monotonic() - began, "" if added else pool.given_up_why)
        _gauges(pool)
        if added and what == GROW:
            await self._hand_actors(pool)

    async def _hand_actors(self, pool: NodePool) -> None:
        """Every coordinator of ``pool``'s node submits to all its actors from now on (bounded; one
        that does not answer is gone or will be replaced with the pool's list)."""
        coordinators = [g.actor for g in self._groups.values() if g.node == pool.node and g.actor is not None]
        for answer in await asyncio.gather(*(asyncio.wait_for(a.set_actors.remote(pool.actors), CALL_TIMEOUT_S)
                                             for a in coordinators), return_exceptions=True):
            if isinstance(answer, (ray.exceptions.RayError, asyncio.TimeoutError)):
                logger.info("node %s: a coordinator did not take the grown pool: %r", pool.node, answer)

    async def _stop_growing(self) -> None:
        """End every tick task (each ends at its next wait; one starting an actor is cancelled: the
        pool's ``kill`` ends that actor)."""
        for task in self._growers.values():
            task.cancel()
        await asyncio.gather(*self._growers.values(), return_exceptions=True)
        self._growers.clear()


def _gauges(pool: NodePool) -> None:
    """The node pool's actors and reserved CPUs, on the metrics endpoint."""
    metrics.set_gauge("prep_actors", len(pool.actors), node=pool.node[:16])
    metrics.set_gauge("prep_reserved_cpus", pool.reserved_cpus, node=pool.node[:16])
