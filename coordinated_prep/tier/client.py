"""A prep actor's side of the node's decoded tier: claim, decode what is its own, commit, wait.

For one piece (:meth:`TierClient.outputs`), a part at a time: one ``claim`` call answers every
sample of the part (kept, yours, being decoded elsewhere, or decode-and-keep-to-yourself); the prep
actor reads and runs the prefix for its own and the unkept samples and sends its own to the tier in
one ``commit`` call (the tier puts them into the object store, as one object it owns). Only after its
last part does it wait for the samples other prep actors are decoding, so waits never form a cycle
(:mod:`coordinated_prep.tier.book`). A wait ends by the claim's deadline at the
latest; what it did not get, the prep actor decodes itself. If the tier cannot be reached (it died
with its node, or a call timed out), the prep actor decodes everything itself from then on and says
so once: the tier only ever saves work, it is never needed for progress.
"""

from __future__ import annotations

import collections
import logging
from typing import Any, Callable, Hashable

import ray

from coordinated_prep.errors import SampleError
from coordinated_prep.naming import NAMESPACE
from coordinated_prep.pipeline.split import packed_bytes
from coordinated_prep.tier.book import MINE, SELF, WAIT, Hit

logger = logging.getLogger(__name__)

_CALL_TIMEOUT_S = 30.0  # a claim, commit or release: bookkeeping only, answered at once
_HELD_OBJECTS = 256  # kept objects a prep actor holds mapped (each up to a claim's outputs, zero-copy)
_CLAIM_BATCH = 64  # samples per claim while a piece has misses (4 claims and commits per 256-sample piece)


class TierClient:
    """Gets prefix outputs for a prep actor's pieces through the node's decoded tier.

    Args:
        tier: The node's :class:`~coordinated_prep.tier.actor.DecodedTier` handle (see :meth:`named`).
        who: This prep actor's identity (its actor id: the same after a restart).
        claim_timeout_s: The tier's claim timeout (a wait lasts at most this long).
    """

    def __init__(self, tier: Any, who: Hashable, claim_timeout_s: float) -> None:
        self.tier = tier
        self.who = who
        self.claim_timeout_s = claim_timeout_s
        self.broken: str | None = None
        self._objects: collections.OrderedDict[int, list[Any]] = collections.OrderedDict()

    @classmethod
    def named(cls, name: str, who: Hashable, claim_timeout_s: float) -> "TierClient":
        """A client of the tier actor called ``name``; one that decodes everything itself (and says
        so) if that actor is gone already."""
        client = cls(None, who, claim_timeout_s)
        try:
            client.tier = ray.get_actor(name, namespace=NAMESPACE)
        except ValueError as e:
            client._broke(e)
        return client

    def outputs(self, prefix: str, ids: list[int], produce: Callable[[list[int]], list[Any]]) -> tuple[list[Any], int, int]:
        """Per index of ``ids``, its prefix output (or the SampleError making it raised); and how many
        were made here (decodes) and how many came from the tier (hits).

        ``produce(indices)`` reads and runs the prefix of ``indices`` in this process. The piece is
        claimed ``_CLAIM_BATCH`` samples at a time, each part decoded and committed before the next
        is claimed, so that two prep actors preparing the same samples for two groups (groups of one
        seed cut the same pieces) split the decoding between them instead of one waiting for the
        other's whole piece; once a part is all hits, the rest is claimed at once.
        """
        values: list[Any] = [None] * len(ids)
        decodes = hits = 0
        waits: list[int] = []
        start = 0
        while start < len(ids):
            step = _CLAIM_BATCH if start == 0 or decodes or waits else len(ids) - start
            part = list(range(start, min(len(ids), start + step)))
            start += len(part)
            if self.broken is not None:
                for k, value in zip(part, produce([ids[k] for k in part])):
                    values[k] = value
                decodes += len(part)
                continue
            made, got, wait = self._claim(prefix, ids, part, values, produce)
            decodes, hits, waits = decodes + made, hits + got, waits + wait
        if waits and self.broken is not None:  # the tier failed meanwhile: decode them here
            for k, value in zip(waits, produce([ids[k] for k in waits])):
                values[k] = value
            decodes += len(waits)
        elif waits:
            try:
                later, boxes = ray.get(self.tier.wait.remote(prefix, [ids[k] for k in waits]),
                                       timeout=self.claim_timeout_s + _CALL_TIMEOUT_S)
                sub: list[Any] = [None] * len(waits)
                hits += self._fill(sub, later, boxes)
            except (ray.exceptions.RayError, ray.exceptions.GetTimeoutError) as e:
                self._broke(e)
                later, sub = [SELF] * len(waits), [None] * len(waits)
            own = [j for j, a in enumerate(later) if not isinstance(a, Hit)]
            for j, value in zip(own, produce([ids[waits[j]] for j in own])):
                sub[j] = value
            decodes += len(own)
            for k, value in zip(waits, sub):
                values[k] = value
        return values, decodes, hits

    def _claim(self, prefix: str, ids: list[int], part: list[int], values: list[Any],
               produce: Callable[[list[int]], list[Any]]) -> tuple[int, int, list[int]]:
        """Claim the samples at positions ``part``; fill the hits, make and commit this actor's own and
        the unkept; the decodes, the hits, and the positions to wait for."""
        try:
            answers, boxes = ray.get(self.tier.claim.remote(prefix, [ids[k] for k in part], self.who),
                                     timeout=_CALL_TIMEOUT_S)
            sub: list[Any] = [None] * len(part)
            hits = self._fill(sub, answers, boxes)
        except (ray.exceptions.RayError, ray.exceptions.GetTimeoutError) as e:
            self._broke(e)
            try:  # the tier may have recorded claims before the call failed: they end now, not in 30 s
                self.tier.release.remote(prefix, [ids[k] for k in part], self.who)
            except Exception:  # the actor is gone: so are its claims
                pass
            answers, sub, hits = [SELF] * len(part), [None] * len(part), 0
        todo = [j for j, a in enumerate(answers) if a in (MINE, SELF)]
        try:
            made = produce([ids[part[j]] for j in todo])
        except BaseException:  # a structure error, an interrupt: the claims end now, not at their deadline
            mine = [ids[part[j]] for j in todo if answers[j] == MINE]
            if mine and self.broken is None:
                self.tier.release.remote(prefix, mine, self.who)
            raise
        for j, value in zip(todo, made):
            sub[j] = value
        for j, k in enumerate(part):
            values[k] = sub[j]
        self._offer(prefix, ids, values, [part[j] for j in todo if answers[j] == MINE])
        return len(todo), hits, [part[j] for j, a in enumerate(answers) if a == WAIT]

    def _offer(self, prefix: str, ids: list[int], values: list[Any], mine: list[int]) -> None:
        """Commit this actor's claims that it decoded; release those it could not."""
        good = [k for k in mine if not isinstance(values[k], SampleError)]
        bad = [ids[k] for k in mine if isinstance(values[k], SampleError)]
        try:
            if good:
                batch = [values[k] for k in good]  # the tier puts its own copy: it outlives this actor
                ray.get(self.tier.commit.remote(prefix, [ids[k] for k in good], batch, packed_bytes(batch), self.who),
                        timeout=_CALL_TIMEOUT_S)
            if bad:
                ray.get(self.tier.release.remote(prefix, bad, self.who), timeout=_CALL_TIMEOUT_S)
        except (ray.exceptions.RayError, ray.exceptions.GetTimeoutError) as e:
            self._broke(e)

    def _fill(self, values: list[Any], answers: list[Any], boxes: dict[int, list[Any]]) -> int:
        """Put the kept outputs the answers point to into ``values``; how many."""
        need = [oid for oid in boxes if oid not in self._objects]
        got = dict(zip(need, ray.get([boxes[oid][0] for oid in need], timeout=_CALL_TIMEOUT_S))) if need else {}
        hits = 0
        for k, answer in enumerate(answers):
            if isinstance(answer, Hit):
                batch = got.get(answer.oid) or self._objects[answer.oid]
                values[k] = batch[answer.pos]
                hits += 1
        for oid in boxes:  # the most recently used last; the least recently used go
            self._objects[oid] = got.get(oid) or self._objects[oid]
            self._objects.move_to_end(oid)
        while len(self._objects) > _HELD_OBJECTS:
            self._objects.popitem(last=False)
        return hits

    def _broke(self, error: BaseException) -> None:
        self.broken = f"{type(error).__name__}: {error}"
        logger.warning("the node's decoded tier cannot be reached (%s); this prep actor decodes every sample itself "
                       "from now on", self.broken)
