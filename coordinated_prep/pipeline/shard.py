"""Data-parallel ranks: rank ``r`` of ``k`` takes its slice of every global batch of the trial's epoch.

A data-parallel trial (Ray Train inside Tune, or Ray Train alone) reads one epoch of its group's
stream with all of its ranks together, as ``DistributedSampler`` splits one epoch of a dataset:

- the epoch's samples, in stream order, are cut into *global batches* of ``k x batch_size``
  (``batch_size`` is per rank, as a ``DataLoader``'s under DDP);
- rank ``r`` takes rows ``[r x b, (r + 1) x b)`` of each: disjoint, every sample exactly once
  across the ranks, and a view of the piece like any batch inside one piece;
- the epoch's last global batch of ``m < k x b`` samples gives each rank ``q`` rows: with
  ``drop_last=False`` (``DistributedSampler``'s default) ``q = ceil(m / k)`` and the ``k x q - m``
  missing rows repeat the batch's first samples, marked ``repeats = -c`` for a sample's ``c``-th
  padding copy (not fresh, and told apart from echoes, which are positive); with
  ``drop_last=True`` ``q = m // k`` and the last ``m - k x q`` samples are left out of the epoch.

So every rank cuts the same number of batches per epoch (an all-reduce never waits on a rank that
has none left: unequal counts hang DDP), and the union of the ranks' fresh samples is the epoch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterator

from coordinated_prep.errors import ConfigError
from coordinated_prep.pipeline.batching import Batch, Batcher, select


@dataclass(frozen=True)
class Shard:
    """Which share of each epoch a data-parallel rank reads.

    Args:
        rank: This worker's rank, ``0 <= rank < world``.
        world: Ranks of the trial (its workers).
        drop_last: Leave out the remainder of an epoch that does not split evenly instead of
            padding it with repeats (``DistributedSampler``'s ``drop_last``).
    """

    rank: int
    world: int
    drop_last: bool = False

    def __post_init__(self) -> None:
        for name, value, low in (("world", self.world, 1), ("rank", self.rank, 0)):
            if not isinstance(value, int) or isinstance(value, bool) or value < low:
                raise ConfigError(f"shard: {name}={value!r} must be an integer >= {low}")
        if self.rank >= self.world:
            raise ConfigError(f"shard: rank={self.rank} must be below world={self.world}")
        if not isinstance(self.drop_last, bool):
            raise ConfigError(f"shard: drop_last={self.drop_last!r} must be true or false")

    def samples(self, n: int) -> int:
        """Rows this rank reads of an epoch of ``n`` (pads included)."""
        return n // self.world if self.drop_last else math.ceil(n / self.world)

    def cut(self, whole: Batch, batch_size: int) -> Batch | None:
        """This rank's rows of global batch ``whole`` (of ``world x batch_size`` rows, or fewer at the
        epoch's end); None when the remainder is dropped and this rank's share is empty."""
        m = len(whole)
        if m == self.world * batch_size:
            return _rows(whole, self.rank * batch_size, (self.rank + 1) * batch_size)
        q = m // self.world if self.drop_last else math.ceil(m / self.world)
        if q == 0:
            return None
        positions = range(self.rank * q, (self.rank + 1) * q)
        rows = [(whole, p % m) for p in positions]
        repeats = [int(whole.repeats[p]) if p < m else -(p // m) for p in positions]
        return select(rows, repeats)


class ShardBatcher:
    """A :class:`~coordinated_prep.pipeline.batching.Batcher` of one rank: global batches of
    ``world x batch_size``, of which it hands out this rank's rows (the interface ``echoed`` reads)."""

    def __init__(self, inner: Batcher, batch_size: int, shard: Shard) -> None:
        self._inner = inner
        self.batch_size = batch_size
        self.stats = inner.stats
        self._shard = shard

    def ready(self) -> bool:
        """Whether :meth:`next` would return without waiting for a piece."""
        return self._inner.ready()

    def next(self) -> Batch | None:
        """This rank's next batch, or None once the epoch is spent."""
        whole = self._inner.next()
        return None if whole is None else self._shard.cut(whole, self.batch_size)

    def __iter__(self) -> Iterator[Batch]:
        while (batch := self.next()) is not None:
            yield batch


def _rows(batch: Batch, a: int, b: int) -> Batch:
    """Rows ``[a, b)`` of ``batch``: views of its leaves (and of the piece when it lies inside one)."""
    leaves = [leaf[a:b] for leaf in batch.leaves]
    return Batch(batch.layout, leaves, batch.indices[a:b], batch.stream_epochs[a:b], batch.repeats[a:b])


def rank_counts(n: int, batch_size: int, shard: Shard) -> tuple[int, int]:
    """(rows, batches) one rank reads of an epoch of ``n`` samples: equal for every rank."""
    rows = shard.samples(n)
    full, rest = divmod(n, shard.world * batch_size)
    q = rest // shard.world if shard.drop_last else math.ceil(rest / shard.world)
    return rows, full + (1 if q else 0)

