"""Cache policies as pure bookkeeping: which keys are held, and hit/miss counts. No Ray, no bytes.

:class:`MinioPolicy` is CoorDL's: admit until full, never evict. Training reads every sample once
per epoch in a fresh random order, so any recency policy evicts exactly what the rest of the epoch
will not touch again and keeps what it will; :class:`LruPolicy` is here to show that side by side.
"""

from __future__ import annotations

import collections
from typing import Hashable


class _Policy:
    """What both policies keep: the keys held with their sizes, bytes used, hits and misses."""

    def __init__(self, capacity_bytes: int) -> None:
        self.capacity_bytes = capacity_bytes
        self.used_bytes = 0
        self.hits = 0
        self.misses = 0
        self._sizes: collections.OrderedDict[Hashable, int] = collections.OrderedDict()

    def __contains__(self, key: Hashable) -> bool:
        return key in self._sizes

    def __len__(self) -> int:
        return len(self._sizes)

    def lookup(self, key: Hashable) -> bool:
        """Count and return whether ``key`` is held."""
        hit = key in self._sizes
        self.hits += hit
        self.misses += not hit
        return hit


class MinioPolicy(_Policy):
    """No-evict admission: the first items offered are kept until the capacity is full.

    Admission closes at the first item that does not fit, so the cached set is a prefix of the
    first epoch's reads and stays fixed: the hit rate from then on is the cached fraction.

    Args:
        capacity_bytes: Most bytes held.
    """

    def __init__(self, capacity_bytes: int) -> None:
        super().__init__(capacity_bytes)
        self.full = False  # admission closed

    def admit(self, key: Hashable, nbytes: int) -> bool:
        """Offer ``key`` of ``nbytes`` after a miss; True if it is now held (it never leaves)."""
        if key in self._sizes:
            return True
        if self.full or self.used_bytes + nbytes > self.capacity_bytes:
            self.full = True
            return False
        self._sizes[key] = nbytes
        self.used_bytes += nbytes
        return True


class LruPolicy(_Policy):
    """Least-recently-used replacement (what the OS page cache approximates), for comparison.

    Args:
        capacity_bytes: Most bytes held.
    """

    def lookup(self, key: Hashable) -> bool:
        """Count and return whether ``key`` is held; a hit makes it the most recent."""
        hit = super().lookup(key)
        if hit:
            self._sizes.move_to_end(key)
        return hit

    def admit(self, key: Hashable, nbytes: int) -> bool:
        """Hold ``key``, evicting the least recently used items to make room; False if it is too big."""
        if nbytes > self.capacity_bytes:
            return False
        self.used_bytes += nbytes - self._sizes.get(key, 0)  # a key held already is counted once
        self._sizes[key] = nbytes
        self._sizes.move_to_end(key)
        while self.used_bytes > self.capacity_bytes:
            _, size = self._sizes.popitem(last=False)
            self.used_bytes -= size
        return True
