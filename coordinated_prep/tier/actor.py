"""The node's decoded tier: an actor that owns kept prefix outputs in the object store.

One per node and sweep, created by the node's prep pool (:class:`~coordinated_prep.pool.node.NodePool`)
next to its prep actors when the pool's decoded budget is above zero, and killed with them; every
data group of the node whose pipeline has a shareable prefix uses it through its prep actors
(:class:`~coordinated_prep.tier.client.TierClient`). Its bookkeeping is :class:`~coordinated_prep.tier.book.TierBook`.

Ownership: a prep actor sends a piece's prefix outputs in its ``commit`` call; if they are kept, this
actor puts them into the object store itself (one copy, once per sample and sweep), so the object is
this actor's, not the prep actor's, and survives a prep actor's restart. The actor holds the reference
of every kept object for the sweep; its end (with the node's pool) frees them. Outputs that were not
kept are freed with the call's argument.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, Hashable

import ray

from coordinated_prep import metrics
from coordinated_prep.tier.book import SELF, WAIT, Hit, TierBook

logger = logging.getLogger(__name__)


@ray.remote(num_cpus=0, max_concurrency=1000)
class DecodedTier:
    """Keeps prefix outputs within ``capacity`` bytes of the node's object store.

    Args:
        capacity: The byte budget (:meth:`~coordinated_prep.pool.spec.PoolSpec.decoded_for`).
        node: The node's id (for metrics and reports).
        claim_timeout_s: How long a prep actor's claim holds before others decode the sample.
    """

    def __init__(self, capacity: int, node: str, claim_timeout_s: float = 30.0) -> None:
        self.book = TierBook(capacity, claim_timeout_s)
        self.node = node
        self.refs: dict[int, ray.ObjectRef] = {}
        self.changed = asyncio.Condition()
        self.tags = {"node": node[:16]}
        metrics.set_gauge("decoded_capacity_bytes", capacity, **self.tags)
        metrics.set_gauge("decoded_bytes", 0, **self.tags)
        metrics.declare("decoded_hits", **self.tags)

    async def claim(self, prefix: str, indices: list[int], who: Hashable) -> tuple[list[Any], dict[int, Any]]:
        """Per index a Hit, MINE, WAIT or SELF (:meth:`TierBook.claim`), and the kept objects the hits
        lie in, each in a one-element list (so that Ray passes the reference, not the object)."""
        answers = self.book.claim(prefix, indices, who, time.monotonic())
        metrics.inc("decoded_hits", sum(isinstance(a, Hit) for a in answers), **self.tags)
        return answers, self._boxes(answers)

    async def commit(self, prefix: str, indices: list[int], batch: list[Any], nbytes: int, who: Hashable) -> bool:
        """Keep ``batch`` (the outputs of ``indices``, in order) as one object if it fits; wakes waiters."""
        oid = self.book.commit(prefix, indices, nbytes, who)
        if oid is not None:
            try:
                self.refs[oid] = ray.put(batch)
            except Exception as e:  # the object store refused it (full, out of disk): kept nowhere, nothing charged
                logger.warning("decoded tier on node %s: %d samples could not be stored (%r); admission closes",
                               self.node[:12], len(indices), e)
                self.book.withdraw(oid)
                oid = None
        metrics.set_gauge("decoded_bytes", self.book.used, **self.tags)
        async with self.changed:
            self.changed.notify_all()
        return oid is not None

    async def release(self, prefix: str, indices: list[int], who: Hashable) -> None:
        """End ``who``'s claims on ``indices`` (it could not decode them); wakes waiters."""
        self.book.release(prefix, indices, who)
        async with self.changed:
            self.changed.notify_all()

    async def wait(self, prefix: str, indices: list[int]) -> tuple[list[Any], dict[int, Any]]:
        """Wait until no index is claimed by a live claim; per index then a Hit or SELF, and the
        objects the hits lie in. A wait ends within ``claim_timeout_s``: a key still claimed then
        (claimed anew after an expiry) is SELF, for the waiter to decode."""
        limit = time.monotonic() + self.book.claim_timeout_s
        while True:
            now = time.monotonic()
            answers, deadline = self.book.pending(prefix, indices, now)
            if deadline is None or now >= limit:
                answers = [SELF if a == WAIT else a for a in answers]
                return answers, self._boxes(answers)
            async with self.changed:
                try:
                    await asyncio.wait_for(self.changed.wait(), max(0.0, min(deadline, limit) - now) + 0.01)
                except asyncio.TimeoutError:
                    pass  # a claim expired, or the wait's limit came: looked at again above

    async def report(self) -> dict[str, Any]:
        """Counters, bytes and samples kept, per prefix. ``hits``: samples a claim found kept;
        ``waits``: samples a claim found being decoded by another prep actor (most become hits after
        the wait, which the groups' ``tier_hits`` count); ``misses``: samples claimed or left to the
        asker; ``kept``, ``refused``: samples committed and kept or not; ``expired``: claims taken over."""
        counters = {k: self.book.stats.get(k, 0) for k in ("hits", "misses", "waits", "kept", "refused", "expired")}
        return dict(counters, node=self.node, capacity_bytes=self.book.capacity, used_bytes=self.book.used,
                    full=self.book.full, samples=len(self.book.entries), claims=len(self.book.claims),
                    prefixes=self.book.prefixes())

    def _boxes(self, answers: list[Any]) -> dict[int, Any]:
        return {a.oid: [self.refs[a.oid]] for a in answers if isinstance(a, Hit)}


__all__ = ["DecodedTier"]
