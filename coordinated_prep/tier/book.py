"""The decoded tier's bookkeeping, pure: which prefix outputs are kept, who is decoding what, the budget.

A pipeline's **prefix** is its deterministic start (read, decode, resize to a working size); its
output for a sample depends on the dataset, the prefix and the sample only, so every data group of
the node whose pipeline has that prefix can use it, in every epoch
(:mod:`coordinated_prep.pipeline.split`). The node's decoded tier keeps prefix outputs in the object
store within a byte budget. This module is its state machine, with time passed in, so that it is
tested without Ray (``tests/test_tier.py``); :class:`~coordinated_prep.tier.actor.DecodedTier` runs
it in an actor.

Life cycle of a prefix output, by key ``(prefix, index)``:

1. **Claimed.** A prep actor about to prepare a piece asks for its samples (:meth:`TierBook.claim`).
   A kept sample is a hit. A sample nobody is decoding is claimed by the asker (``MINE``): it
   decodes it and offers it. A sample another prep actor claimed is ``WAIT``: the asker first
   decodes its own claims, commits them, then waits (:meth:`TierBook.pending`) until that claim is
   committed, released or expired. Claims are answered at once and a prep actor waits only after
   committing its own, so a wait always points to an earlier claim: there is no cycle.
2. **Kept.** The claimer sends the piece's outputs to the tier's actor, which keeps them as one
   object it owns in the object store if the budget has room (:meth:`TierBook.commit`); they are
   then served to every group of the prefix for the rest of the sweep.
3. **Expired.** A claim not committed within ``claim_timeout_s`` (its prep actor died, and Ray has
   not restarted it) expires: waiters decode the sample themselves. A restarted prep actor keeps its
   identity, so its retried piece finds its old claims still its own.
4. **Refused.** Admission follows CoorDL's MinIO: nothing kept is evicted to make room (every epoch
   reads every sample once in a new order, so any kept sample is as good as any other), and once a
   commit does not fit, admission closes: later misses are decoded by whoever needs them (``SELF``)
   and never offered. What was kept stays for the sweep: the tier's actor, and its objects with it,
   end with the node's prep pool.

Invariants (checked after every step of the property test): ``used`` is the sum of the kept
objects' bytes and at most ``capacity``; a kept key is never claimed; every kept key points into a
kept object. Liveness: with nobody acting, a key that is ``WAIT`` now is a hit or ``SELF`` once its
claim's deadline has passed. Another actor may claim an expired key anew (and make it ``WAIT``
again), so the actor's wait is also capped at ``claim_timeout_s`` from its start
(:meth:`~coordinated_prep.tier.actor.DecodedTier.wait`): every wait ends within that.
"""

from __future__ import annotations

import collections
from typing import Hashable, Iterable, NamedTuple, Sequence

Key = tuple[str, int]  # (prefix key, dataset index)

MINE = "mine"  # decode it and offer it
WAIT = "wait"  # another prep actor is decoding it: wait for its commit
SELF = "self"  # decode it yourself and keep it to yourself (the tier is full)


class Hit(NamedTuple):
    """A kept sample: position ``pos`` of kept object ``oid``."""

    oid: int
    pos: int


class _Claim(NamedTuple):
    who: Hashable
    deadline: float


class _Object(NamedTuple):
    prefix: str
    nbytes: int
    keys: tuple[Key, ...]


class TierBook:
    """Kept prefix outputs, claims in flight and the byte budget of one node's decoded tier.

    Args:
        capacity: Most bytes of kept objects.
        claim_timeout_s: How long a claim holds before its waiters decode the sample themselves.
    """

    def __init__(self, capacity: int, claim_timeout_s: float) -> None:
        if capacity < 0 or claim_timeout_s <= 0:
            raise ValueError(f"capacity={capacity} must be >= 0 and claim_timeout_s={claim_timeout_s} > 0")
        self.capacity = capacity
        self.claim_timeout_s = claim_timeout_s
        self.used = 0
        self.full = capacity == 0
        self.entries: dict[Key, Hit] = {}
        self.objects: dict[int, _Object] = {}
        self.claims: dict[Key, _Claim] = {}
        self.stats: collections.Counter[str] = collections.Counter()
        self._next_oid = 0

    def claim(self, prefix: str, indices: Sequence[int], who: Hashable, now: float) -> list[Hit | str]:
        """Per index: a :class:`Hit`, ``MINE``, ``WAIT`` or ``SELF`` (see the module's life cycle)."""
        out: list[Hit | str] = []
        for index in indices:
            key = (prefix, int(index))
            hit = self.entries.get(key)
            claim = self.claims.get(key)
            if hit is not None:
                self.stats["hits"] += 1
                out.append(hit)
            elif claim is not None and claim.who != who and claim.deadline > now:
                self.stats["waits"] += 1
                out.append(WAIT)
            else:
                if claim is not None:  # its own (a retried piece) or expired: it ends here
                    del self.claims[key]
                    if claim.who != who:
                        self.stats["expired"] += 1
                self.stats["misses"] += 1
                if self.full:
                    out.append(SELF)
                    continue
                self.claims[key] = _Claim(who, now + self.claim_timeout_s)
                out.append(MINE)
        return out

    def commit(self, prefix: str, indices: Sequence[int], nbytes: int, who: Hashable) -> int | None:
        """Keep one object holding the outputs of ``indices`` (in that order) if it fits.

        Every claim on these keys ends, whoever held it (a late commit after an expiry serves the
        waiters as well as the new claimer's would). Returns the object's id, or None if it was not
        kept (it does not fit, which closes admission, or every key is kept already).
        """
        keys = tuple((prefix, int(i)) for i in indices)
        for key in keys:
            self.claims.pop(key, None)
        fresh = [k for k in keys if k not in self.entries]
        if not fresh:
            return None
        if self.used + nbytes > self.capacity:
            self.full = True
            self.stats["refused"] += len(fresh)
            return None
        oid = self._next_oid
        self._next_oid += 1
        self.objects[oid] = _Object(prefix, nbytes, keys)
        for pos, key in enumerate(keys):
            if key in fresh:
                self.entries[key] = Hit(oid, pos)
        self.used += nbytes
        self.stats["kept"] += len(fresh)
        return oid

    def withdraw(self, oid: int) -> None:
        """Undo the commit of object ``oid``, whose outputs could not be stored after all (the object
        store refused them): its samples are no longer kept, its bytes are freed, and admission closes."""
        kept = self.objects.pop(oid)
        for key in kept.keys:
            if self.entries.get(key, (None,))[0] == oid:
                del self.entries[key]
                self.stats["kept"] -= 1
                self.stats["refused"] += 1
        self.used -= kept.nbytes
        self.full = True

    def release(self, prefix: str, indices: Iterable[int], who: Hashable) -> None:
        """End ``who``'s claims on ``indices`` without keeping anything (decoding them failed)."""
        for index in indices:
            key = (prefix, int(index))
            claim = self.claims.get(key)
            if claim is not None and claim.who == who:
                del self.claims[key]

    def pending(self, prefix: str, indices: Sequence[int], now: float) -> tuple[list[Hit | str], float | None]:
        """Where waited-for ``indices`` stand: per index a Hit, ``WAIT`` (claim live) or ``SELF``
        (claim ended without a commit that was kept, or expired); and the earliest deadline among
        the live claims (None if none: the wait is over)."""
        out: list[Hit | str] = []
        deadline: float | None = None
        for index in indices:
            key = (prefix, int(index))
            hit = self.entries.get(key)
            claim = self.claims.get(key)
            if hit is not None:
                out.append(hit)
            elif claim is not None and claim.deadline > now:
                out.append(WAIT)
                deadline = claim.deadline if deadline is None else min(deadline, claim.deadline)
            else:
                out.append(SELF)
        return out, deadline

    def prefixes(self) -> dict[str, dict[str, int]]:
        """Per prefix: samples and bytes kept."""
        out: dict[str, dict[str, int]] = {}
        for obj in self.objects.values():
            entry = out.setdefault(obj.prefix, {"samples": 0, "bytes": 0})
            entry["bytes"] += obj.nbytes
        for prefix, _ in self.entries:
            out[prefix]["samples"] += 1
        return out
