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

import logging
import math
from dataclasses import dataclass
from typing import Iterator

from coordinated_prep.errors import ConfigError, PrepError
from coordinated_prep.pipeline.batching import Batch, Batcher, select

logger = logging.getLogger(__name__)


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
    ``world x batch_size``, of which it hands out this rank's rows (the interface ``echoed`` reads).

    It cuts ``batches`` per epoch, the count :func:`rank_counts` gives for the epoch's planned
    samples, whatever the pieces held: where broken samples were skipped (``on_error="skip"``) and
    the epoch came out shorter on this rank's node than on a sibling's (a transient read error on
    one node), it repeats its last batch (``repeats`` negative, as pads) so the ranks' counts stay
    equal and their all-reduce does not wait for a batch that never comes.
    """

    def __init__(self, inner: Batcher, batch_size: int, shard: Shard, batches: int) -> None:
        self._inner = inner
        self.batch_size = batch_size
        self.stats = inner.stats
        self._shard = shard
        self._left = batches
        self._last: Batch | None = None

    def ready(self) -> bool:
        """Whether :meth:`next` would return without waiting for a piece."""
        return self._inner.ready()

    def next(self) -> Batch | None:
        """This rank's next batch, or None once the epoch is spent."""
        while (whole := self._inner.next()) is not None:
            self._last = whole
            mine = self._shard.cut(whole, self.batch_size)
            if mine is not None:
                self._left -= 1
                self._last = mine
                return mine
        if self._left <= 0:
            return None
        rank, world = self._shard.rank, self._shard.world
        if self._last is None:  # raising ends the worker group (Ray Train restarts it): its siblings do not hang
            raise PrepError(f"rank {rank} of {world}: every sample of this epoch was skipped as broken on this node "
                            "(data.on_error='skip'); check the dataset, or use on_error='raise' to see the first")
        logger.warning("rank %d of %d: this epoch held fewer samples than planned (broken samples skipped); a batch "
                       "of repeats pads it so every rank cuts the same number of batches", rank, world)
        self._left -= 1
        last = self._last  # this rank's last batch, or the epoch's short remainder it had no rows of
        rows = range(min(len(last), self.batch_size))
        return select([(last, i) for i in rows], [min(int(last.repeats[i]), 0) - 1 for i in rows])

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

