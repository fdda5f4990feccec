"""The stream plan: which samples every piece of the shared stream holds, from the seed alone.

The shared stream is an endless sequence of pieces (chunks) numbered ``g = 0, 1, 2, ...``;
piece ``g`` belongs to stream epoch ``g // chunks_per_epoch``. Each epoch is the whole training
set once. The set is split once, from the seed, into ``segments`` of whole chunks kept in a
fixed order; every epoch shuffles the samples *within* each segment anew.

Why: a trial may join at any segment start ``g0`` and take the pieces ``[g0 + k*C, g0 + (k+1)*C)``
as its epoch ``k`` (``C`` = chunks per epoch). The pieces before a segment start hold the same
set of samples in every epoch, so that window holds every sample exactly once, and a joining
trial need not wait for an epoch boundary, only for the next segment start.

Where the data is read shard by shard as the epochs need it (tar shards named by a shard index),
the split into segments follows the shards: they are taken in an order drawn from the seed, and
each segment is a run of consecutive shards in that order, so a piece needs the few shards of its
segment, not samples from every shard (which would fetch the whole set before the first piece).
"""

from __future__ import annotations

import functools
import math

import numpy as np

_ORDER_STREAM = 0x0DE2  # separates sample-order draws from augmentation draws
#: Samples per piece when a DataSpec leaves ``chunk_size`` unset: a multiple of every power-of-two
#: batch size up to it, so that each batch of such a size is a view of one piece (no copy), and
#: large enough that fetching a piece costs a trial little per batch.
DEFAULT_PIECE = 256
_SMALLEST_PIECE = 32
_PIECES_PER_EPOCH = 8  # an automatic piece is halved (down to 32) until an epoch holds this many


def piece_size(chunk_size: int | None, samples: int) -> int:
    """Samples per piece for a stream of ``samples`` per epoch: ``chunk_size`` if set, else automatic.

    Automatic: ``DEFAULT_PIECE`` (256), halved down to 32 while an epoch would hold fewer than 8
    pieces, so that small datasets keep several join points per epoch. A pure function of the
    spec and the dataset size, so that the coordinator and an unshared trial cut the same pieces.
    """
    if chunk_size is not None:
        return chunk_size
    size = DEFAULT_PIECE
    while size > _SMALLEST_PIECE and samples < _PIECES_PER_EPOCH * size:
        size //= 2
    return size


class StreamPlan:
    """Pure function from a piece number to the sample indices it holds.

    Args:
        sample_ids: Dataset indices of the training samples (any order; sorted internally).
        seed: Seed of the partition into segments and of each epoch's shuffle.
        chunk_size: Samples per piece; only the last piece of an epoch may be smaller.
        segments: Requested join points per epoch (capped at the number of pieces; over shards, more
            where a segment would span more than :data:`SHARDS_PER_SEGMENT` shards).
        shard_sizes: Samples per shard, where the dataset is read shard by shard (indices ``0 ..
            sizes[0] - 1`` are shard 0's, and so on): segments are then runs of shards in a seeded
            order. None: segments are drawn from a permutation of all samples.
    """

    def __init__(self, sample_ids: np.ndarray, seed: int, chunk_size: int, segments: int,
                 shard_sizes: tuple[int, ...] | None = None) -> None:
        ids = np.sort(np.asarray(sample_ids, dtype=np.int64))
        if ids.size == 0:
            raise ValueError("StreamPlan needs at least one sample")
        if chunk_size < 1 or segments < 1:
            raise ValueError(f"chunk_size={chunk_size} and segments={segments} must be >= 1")
        self.seed = seed
        self.chunk_size = chunk_size
        self.samples_per_epoch = int(ids.size)
        self.chunks_per_epoch = math.ceil(ids.size / chunk_size)
        self.segment_chunks = math.ceil(self.chunks_per_epoch / min(segments, self.chunks_per_epoch))
        if shard_sizes is not None:  # a piece draws from its segment's shards: a few, however many there are
            most = SHARDS_PER_SEGMENT * ids.size // (len(shard_sizes) * chunk_size)  # pieces in that many shards
            self.segment_chunks = max(1, min(self.segment_chunks, most))
        if shard_sizes is None:
            partition = np.random.default_rng((_ORDER_STREAM, seed)).permutation(ids)
        else:
            partition = _by_shards(ids, shard_sizes, seed)
        step = self.segment_chunks * chunk_size
        self._segments = tuple(partition[i : i + step] for i in range(0, ids.size, step))
        # Per plan (a cache on the method would keep every plan alive): pieces of one segment and
        # epoch are asked for one after another, so a few recent orders suffice.
        self._segment_order = functools.lru_cache(maxsize=64)(self._draw_segment_order)

    def __getstate__(self) -> dict:
        """Without the cache (a bound wrapper pickle refuses): worker processes draw their own."""
        return {k: v for k, v in self.__dict__.items() if k != "_segment_order"}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._segment_order = functools.lru_cache(maxsize=64)(self._draw_segment_order)

    @property
    def num_segments(self) -> int:
        """Join points per epoch."""
        return len(self._segments)

    def locate(self, g: int) -> tuple[int, int]:
        """``(epoch, chunk within epoch)`` of piece ``g``."""
        return divmod(g, self.chunks_per_epoch)

    def chunk_samples(self, g: int) -> np.ndarray:
        """Dataset indices held by piece ``g``, in delivery order."""
        epoch, chunk = self.locate(g)
        segment, offset = divmod(chunk, self.segment_chunks)
        order = self._segment_order(epoch, segment)
        return order[offset * self.chunk_size : (offset + 1) * self.chunk_size]

    def chunk_len(self, g: int) -> int:
        """Number of samples in piece ``g``."""
        _, chunk = self.locate(g)
        if chunk < self.chunks_per_epoch - 1:
            return self.chunk_size
        return self.samples_per_epoch - chunk * self.chunk_size

    def is_join_point(self, g: int) -> bool:
        """Whether a trial may start its first epoch at piece ``g``."""
        return self.locate(g)[1] % self.segment_chunks == 0

    def next_join_point(self, g: int) -> int:
        """The first join point at or after piece ``g``."""
        epoch, chunk = self.locate(g)
        segment = math.ceil(chunk / self.segment_chunks)
        if segment >= self.num_segments:
            return (epoch + 1) * self.chunks_per_epoch
        return epoch * self.chunks_per_epoch + segment * self.segment_chunks

    def _draw_segment_order(self, epoch: int, segment: int) -> np.ndarray:
        rng = np.random.default_rng((_ORDER_STREAM, self.seed, epoch, segment))
        order = rng.permutation(self._segments[segment])
        order.setflags(write=False)
        return order


#: Where the data is read shard by shard, a segment spans about this many shards at most (the plan takes
#: more segments than asked where needed): the first piece needs these, not ``1/segments`` of the shards.
SHARDS_PER_SEGMENT = 8


def _by_shards(ids: np.ndarray, shard_sizes: tuple[int, ...], seed: int) -> np.ndarray:
    """``ids`` (sorted) grouped by shard, the shards in an order drawn from ``seed``."""
    starts = np.cumsum([0, *shard_sizes])
    if ids[-1] >= starts[-1]:
        raise ValueError(f"sample {ids[-1]} lies past the {starts[-1]} samples of the shards")
    shard = np.searchsorted(starts, ids, side="right") - 1
    rank = np.empty(len(shard_sizes), dtype=np.int64)
    rank[np.random.default_rng((_ORDER_STREAM, seed, len(shard_sizes))).permutation(len(shard_sizes))] = \
        np.arange(len(shard_sizes))
    return ids[np.argsort(rank[shard], kind="stable")]


def stream_plan(num_samples: int, seed: int, holdout: float, chunk_size: int | None, segments: int,
                shard_sizes: tuple[int, ...] | None = None) -> StreamPlan:
    """The plan of a data group over a dataset of ``num_samples`` (its training split, its piece size),
    read shard by shard if ``shard_sizes`` is given (:class:`StreamPlan`)."""
    train_ids, _ = holdout_split(num_samples, holdout)
    return StreamPlan(train_ids, seed, piece_size(chunk_size, len(train_ids)), segments, shard_sizes)


def holdout_split(num_samples: int, holdout: float) -> tuple[np.ndarray, np.ndarray]:
    """Split dataset indices into (train, held out), fixed per dataset size whatever the seed.

    The split does not depend on the data seed so that trials of different groups are evaluated
    on the same held-out samples.
    """
    order = np.random.default_rng((_ORDER_STREAM, num_samples)).permutation(num_samples)
    held = int(round(num_samples * holdout))
    if num_samples - held < 1:
        raise ValueError(f"holdout={holdout} leaves no training samples out of {num_samples}")
    return np.sort(order[held:]).astype(np.int64), np.sort(order[:held]).astype(np.int64)
