"""Data-parallel ranks: rank ``r`` of ``k`` takes its slice of every global batch of the trial's epoch.

A data-parallel trial (Ray Train inside Tune, or Ray Train alone) reads one epoch of its group's
stream with all of its ranks together, as ``DistributedSampler`` splits one epoch of a dataset:

- the epoch's rows, in stream order (each piece's ``views`` view-major), are cut into *global
  batches* of ``k x batch_size`` (``batch_size`` is per rank, as a ``DataLoader``'s under DDP);
- rank ``r`` takes rows ``[r x b, (r + 1) x b)`` of each: disjoint, every row exactly once across
  the ranks, and a view of the piece like any batch inside one piece;
- the epoch's last global batch of ``m < k x b`` rows gives each rank ``q`` rows: with
  ``drop_last=False`` (``DistributedSampler``'s default) ``q = ceil(m / k)`` and the ``k x q - m``
  missing rows repeat the batch's first rows, marked ``repeats = -c`` for a row's ``c``-th padding
  copy (not fresh, and told apart from echoes and views, which are positive); with
  ``drop_last=True`` ``q = m // k`` and the last ``m - k x q`` rows are left out of the epoch.

Rules the cut keeps, whatever each rank's node skipped:

1. *Planned places.* A rank's share is a set of places in the epoch's plan (piece ``g``, the
   sample's position in it), never positions among the rows its node happens to hold. Ranks on two
   nodes each read their own node's pieces, and a node may leave broken samples out of a piece
   (``data.on_error="skip"``, a transient read error on one node only): cut from what is left, the
   global batches would shift, one sample would be fresh on two ranks and another on none. So
   :func:`filled` first puts every piece back to its planned length: a skipped sample's place is
   taken by a copy of a row its node has (``repeats = -1``: a pad, never fresh), from the same
   piece where it has rows, else the last row before it in the epoch (or the first after it).
   Only a piece short of samples is copied (into memory the trial owns); the row kept to stand in
   keeps one earlier piece mapped until the next piece with rows arrives.
2. *Equal steps.* Every rank then holds ``views x n`` rows in the same global batches, so it cuts
   :func:`rank_counts` rows in as many batches as each sibling, batch for batch of the same size;
   :func:`rank_steps` gives its steps after a fixed echo (``example:e``, ``batch:e``), which acts
   on those equal batches and so turns them into equal steps (an all-reduce never waits on a rank
   that has none left: unequal counts hang DDP). ``echo="auto"`` echoes while a rank's own data is
   late, and is refused with ranks (:func:`coordinated_prep.trial.loader.train_loader`).
3. *Disjoint fresh rows.* A row is fresh (``repeats == 0``) only at its own planned place, so the
   ranks' fresh rows are disjoint; without skips and with ``drop_last=False`` they are the epoch.

A node on which every sample of the epoch was skipped has no row to pad with: its ranks raise
:class:`~coordinated_prep.errors.PrepError`, which ends the worker group (Ray Train restarts it)
instead of leaving its siblings waiting.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Iterable, Iterator, Sequence

import numpy as np

from coordinated_prep.errors import ConfigError, PrepError
from coordinated_prep.trial.batching import Batch, Batcher, select
from coordinated_prep.pipeline.part import Part
from coordinated_prep.trial.subset import numbered_kept, planned_in_part

if TYPE_CHECKING:
    from coordinated_prep.trial.echo import EchoSpec
    from coordinated_prep.pipeline.chunk import PreparedChunk

logger = logging.getLogger(__name__)

PAD = -1  # ``repeats`` of a copy standing in for a skipped sample (a pad: not fresh, not an echo)


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
        """Rows this rank reads of an epoch of ``n`` rows (pads included)."""
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


def rank_counts(n: int, batch_size: int, shard: Shard) -> tuple[int, int]:
    """(rows, batches) one rank reads of an epoch of ``n`` rows (samples x views): equal for every rank."""
    rows = shard.samples(n)
    full, rest = divmod(n, shard.world * batch_size)
    q = rest // shard.world if shard.drop_last else math.ceil(rest / shard.world)
    return rows, full + (1 if q else 0)


def rank_steps(n: int, views: int, batch_size: int, shard: Shard, echo: EchoSpec) -> int | None:
    """Steps one rank takes in an epoch of ``n`` samples of ``views`` views each, after ``echo``:
    equal for every rank (None for ``echo="auto"``, whose steps vary with the stalls)."""
    rows, batches = rank_counts(n * views, batch_size, shard)
    if echo.mode == "batch":
        return echo.factor * batches  # each of the rank's batches, e times
    return echo.batches_per_epoch(rows, batch_size)  # the rank's rows, e times, in batches of batch_size


def planned_len(g: int, samples: int, chunk_size: int, chunks: int) -> int:
    """Samples the plan puts in piece ``g`` (:meth:`coordinated_prep.plan.StreamPlan.chunk_len`)."""
    chunk = g % chunks
    return chunk_size if chunk < chunks - 1 else samples - chunk * chunk_size


def check_data_parallel(spec: Any, echo: EchoSpec, shard: Shard, trial: str) -> None:
    """Refuse what would give the ranks of a data-parallel trial unequal epochs (an all-reduce would hang)."""
    who = f"train_loader (trial {trial}, rank {shard.rank} of {shard.world})"
    if echo.mode == "auto":
        raise ConfigError(f"{who}: echo='auto' echoes while this rank's data is late, so ranks would cut different "
                          "numbers of batches and DDP's all-reduce would hang; use echo='example:e' or 'batch:e'")
    if spec.views > 1:
        raise ConfigError(f"{who}: data.views={spec.views} lays a piece's views one after another, so the ranks would "
                          "get unequal fresh samples; use views=1 with echo='example:e' for repeats")


def rank_batches(stream: Any, batch_size: int, rows: int, shard: Shard, part: Part | None,
                 stats: Any, who: str) -> "ShardBatcher":
    """One rank's batches of an epoch of ``stream``: its node's pieces (each cut to the trial's ``part``,
    :mod:`coordinated_prep.trial.subset`) put back to their planned lengths (a sample skipped on this
    node leaves a pad, not a shift), cut into global batches of ``world x batch_size`` of which it keeps
    its rows. ``rows``: the epoch's rows (samples x views) over all ranks."""
    s = stream
    numbered: Iterable[tuple[int, Any]] = ((s.position, s.next_piece()) for _ in range(s.chunks_per_epoch))
    if part is None:
        length: Callable[[int], int] = lambda g: planned_len(g, s.samples_per_epoch, s.chunk_size,  # noqa: E731
                                                             s.chunks_per_epoch)
        planned: Callable[[int], np.ndarray] = s.chunk_samples
    else:  # the part's rows of each piece, and its places in the plan
        numbered = numbered_kept(numbered, part)
        planned = lambda g: planned_in_part(s.chunk_samples(g), part)  # noqa: E731
        length = lambda g: len(planned(g))  # noqa: E731
    whole = Batcher(filled(numbered, length, planned, who), batch_size * shard.world, stats, s.ready,
                    s.chunks_per_epoch)
    return ShardBatcher(whole, batch_size, shard, rank_counts(rows, batch_size, shard)[1])


class ShardBatcher:
    """A :class:`~coordinated_prep.trial.batching.Batcher` of one rank: global batches of
    ``world x batch_size``, of which it hands out this rank's rows (the interface ``echoed`` reads).

    ``inner`` cuts the global batches from pieces put back to their planned lengths (:func:`filled`),
    so this rank cuts ``batches`` per epoch, the count :func:`rank_counts` gives, as every sibling
    does. An epoch that ends short of them (pieces missing, not samples) raises: the ranks would
    take unequal steps, and an error ends the worker group where a short rank would hang its siblings.
    """

    def __init__(self, inner: Batcher, batch_size: int, shard: Shard, batches: int) -> None:
        self._inner = inner
        self.batch_size = batch_size
        self.stats = inner.stats
        self._shard = shard
        self._planned = self._left = batches

    def ready(self) -> bool:
        """Whether :meth:`next` would return without waiting for a piece."""
        return self._inner.ready()

    def next(self) -> Batch | None:
        """This rank's next batch, or None once the epoch is spent."""
        while (whole := self._inner.next()) is not None:
            mine = self._shard.cut(whole, self.batch_size)
            if mine is not None:
                self._left -= 1
                return mine
        if self._left > 0:
            raise PrepError(f"rank {self._shard.rank} of {self._shard.world}: this epoch held "
                            f"{self._planned - self._left} of its {self._planned} planned batches (pieces were "
                            "missing); its sibling ranks would wait for the rest")
        return None

    def __iter__(self) -> Iterator[Batch]:
        while (batch := self.next()) is not None:
            yield batch


class FilledPiece:
    """A piece put back to its planned length: rows in trial-owned memory, each with its ``row_labels``
    (stream epoch, and repeats: its view, or :data:`PAD` where a copy stands in for a skipped sample,
    perhaps a row of an earlier piece). A Batcher reads it as a
    :class:`~coordinated_prep.pipeline.chunk.PreparedChunk`."""

    __slots__ = ("layout", "leaves", "indices", "epoch", "views", "row_labels")

    def __init__(self, like: Any, rows: Sequence[tuple[Any, int]], repeats: Sequence[int]) -> None:
        self.layout, self.epoch, self.views = like.layout, like.epoch, like.views
        leaves: list[Any] = []
        for j, spec in enumerate(like.layout.leaves):
            picked = [p.leaves[j][r] for p, r in rows]
            leaves.append(np.stack(picked) if spec.kind == "dense" else picked)
        self.leaves = tuple(leaves)
        self.indices = np.array([int(p.indices[r]) for p, r in rows], dtype=np.int64)
        self.row_labels = (np.array([p.epoch for p, _ in rows], dtype=np.int64), np.asarray(repeats, dtype=np.int64))

    def __len__(self) -> int:
        return len(self.indices)


def filled(pieces: Iterable[tuple[int, PreparedChunk]], length: Callable[[int], int],
           planned: Callable[[int], np.ndarray], who: str) -> Iterator[PreparedChunk | FilledPiece]:
    """``pieces`` (piece number, piece), each put back to its planned length (rule 1 of the module).

    Args:
        pieces: This node's pieces of one epoch, in order.
        length: Samples the plan puts in piece ``g``.
        planned: Dataset indices the plan puts in piece ``g``, in order (asked only of a short piece).
        who: The rank, for the error.

    Raises:
        PrepError: Every sample of the epoch was skipped on this node (no row to pad with).
    """
    held: list[tuple[int, PreparedChunk]] = []  # pieces with no row before the epoch's first row (in order)
    spare: tuple[Any, int] | None = None  # the last row of this node's epoch so far, to stand in where none is
    warned = False  # once per epoch: a node that skips, skips in many pieces
    for g, piece in pieces:
        if len(piece) == 0 and spare is None and (held or length(g)):  # nothing to stand in yet: kept in order
            held.append((g, piece))
            continue
        if len(piece) == length(g) * piece.views:
            out: Any = piece
        else:
            if not warned:
                warned = True
                logger.warning("%s: piece %d held %d of its %d planned samples (broken samples skipped on this "
                               "node); copies of its other rows stand in for them, so the rank's share and steps "
                               "stay its siblings'", who, g, len(piece) // piece.views, length(g))
            out = _fill(piece, planned(g), spare)
        if len(piece):
            spare = (piece, len(piece) // piece.views - 1)
        for h, empty in held:  # they come first; the epoch's first row stands in for theirs (a piece the
            yield _fill(empty, planned(h), (piece, 0)) if length(h) else empty  # plan leaves empty: as it is)
        held = []
        yield out
    if held:
        raise PrepError(f"{who}: every sample of this epoch was skipped as broken on this node "
                        "(data.on_error='skip'); check the dataset, or use on_error='raise' to see the first")


def _fill(piece: Any, planned: np.ndarray, spare: tuple[Any, int] | None) -> FilledPiece:
    """``piece`` with a stand-in at each planned place whose sample it lacks (view-major, as pieces are).

    A stand-in copies the piece's own rows in turn, or ``spare`` when it has none."""
    have = len(piece) // piece.views
    where = {int(i): k for k, i in enumerate(piece.indices[:have].tolist())}
    places: list[tuple[Any, int, int]] = []  # per planned place: (piece, row of view 0, rows per view of it)
    labels: list[int] = []  # per planned place: 0 (its own sample, fresh in view 0) or PAD
    holes = 0
    for index in planned.tolist():
        if index in where:
            places.append((piece, where[index], have))
            labels.append(0)
            continue
        if have:
            places.append((piece, holes % have, have))
        else:
            source, row = spare  # type: ignore[misc]  # filled() holds an empty piece until a row exists
            places.append((source, row, len(source) // source.views))
        labels.append(PAD)
        holes += 1
    rows = [(p, v * per + r) for v in range(piece.views) for p, r, per in places]
    repeats = [v if label == 0 else PAD for v in range(piece.views) for label in labels]
    return FilledPiece(piece, rows, repeats)


def _rows(batch: Batch, a: int, b: int) -> Batch:
    """Rows ``[a, b)`` of ``batch``: views of its leaves (and of the piece when it lies inside one)."""
    leaves = [leaf[a:b] for leaf in batch.leaves]
    return Batch(batch.layout, leaves, batch.indices[a:b], batch.stream_epochs[a:b], batch.repeats[a:b])
