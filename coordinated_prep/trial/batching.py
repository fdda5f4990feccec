"""Cutting prepared pieces into a trial's batches: views of a piece where a batch lies inside one.

A batch that lies inside one piece is a view of the piece's memory (for a shared piece, the
object store's pages, copy-on-write in the trial by :mod:`coordinated_prep.pages`); only a batch that
straddles two pieces is copied into memory the trial owns. With the default piece size (256
samples, :func:`coordinated_prep.plan.piece_size`) every batch of a trial whose batch size divides
is a view: epochs start and end at piece boundaries, so the last, smaller batch of an epoch is a
view too. The loaders report the fraction copied and the CPU this costs the trial (``BatchStats``).
"""

from __future__ import annotations

import collections.abc
import math
import time
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Mapping, Sequence

import numpy as np
import torch

from coordinated_prep.pipeline.chunk import PreparedChunk
from coordinated_prep.pipeline.structure import Layout, collate


class Batch:
    """One minibatch: the structure ``torch.utils.data.default_collate`` gives for its samples, and
    where each sample came from.

    ``images, targets = batch`` and ``for images, targets in loader`` unpack :attr:`data`,
    ``batch[k]`` indexes it and ``model(**batch)`` spreads dict samples, so a training loop written for a
    ``DataLoader`` runs unchanged; ``len(batch)`` is the number of samples. (With a ``collate_fn`` the
    loaders yield what it returns instead.)

    Attributes:
        data: The collated batch. A stacked leaf is a tensor that is a view of shared memory when
            the batch lies inside one piece, writable as a ``DataLoader``'s (a write stays in this
            trial: :mod:`coordinated_prep.pages`). A ragged leaf
            (:mod:`coordinated_prep.pipeline.structure`) is a list of per-sample tensors.
        indices: ``torch.int64`` dataset index of each sample.
        stream_epochs: ``torch.int64`` stream epoch whose draws produced each sample (equal to the
            trial's epoch for a trial that started at piece 0, or unshared; -1: evaluation).
        repeats: ``torch.int64``: 0 for a sample's first delivery in the trial's epoch (fresh); a
            repeat (an extra view made before augmentation, or an echo:
            :mod:`coordinated_prep.trial.echo`) gets a positive label unique per sample in the epoch,
            ``view x e + copy``.
        layout: The samples' layout; ``leaves`` the collated leaves in its order.
    """

    __slots__ = ("data", "leaves", "layout", "indices", "stream_epochs", "repeats", "collate_fn")

    def __init__(self, layout: Layout, leaves: Sequence[Any], indices: torch.Tensor, stream_epochs: torch.Tensor,
                 repeats: torch.Tensor | None = None) -> None:
        self.layout, self.leaves = layout, list(leaves)
        self.data = collate(layout.tree, layout.present(self.leaves))
        if not isinstance(self.data, (tuple, list)) and isinstance(self.data, Mapping):  # tuples: no ABC check
            self.__class__ = _MappingBatch
        self.indices, self.stream_epochs = indices, stream_epochs
        self.repeats = repeats if repeats is not None else torch.zeros_like(indices)
        self.collate_fn: Callable[[list[Any]], Any] | None = None

    def replace(self, **changes: Any) -> "Batch":
        """A copy with ``indices``, ``stream_epochs`` or ``repeats`` replaced."""
        fields = {"indices": self.indices, "stream_epochs": self.stream_epochs, "repeats": self.repeats, **changes}
        return Batch(self.layout, self.leaves, **fields)

    def samples(self) -> list[Any]:
        """The batch's samples, each in the structure and types the dataset gave (a tuple stays a
        tuple, a ``tv_tensors.BoundingBoxes`` keeps its format and canvas size, an int label is an
        int): what a ``DataLoader`` hands its ``collate_fn``. A stacked leaf's sample is a view of
        its row (a write stays in this trial: :mod:`coordinated_prep.pages`)."""
        return self.layout.samples(self.leaves, len(self))

    def collated(self, collate_fn: Callable[[list[Any]], Any]) -> "Batch":
        """This batch with :attr:`data` = ``collate_fn(self.samples())``, as a ``DataLoader`` with that
        ``collate_fn`` would yield it."""
        self.data = collate_fn(self.samples())
        self.collate_fn = collate_fn
        return self

    def to(self, *args: Any, **kwargs: Any) -> "Batch":
        """The batch with every tensor of :attr:`data` moved as ``Tensor.to(*args, **kwargs)`` moves
        it (Lightning moves a batch to the device through this)."""
        out = Batch.__new__(type(self))
        for name in Batch.__slots__:
            setattr(out, name, getattr(self, name))
        out.data = _moved(self.data, args, kwargs)
        return out

    def __len__(self) -> int:
        return int(self.indices.shape[0])

    def __iter__(self) -> Iterator[Any]:
        return iter(self.data)

    def __getitem__(self, key: Any) -> Any:
        return self.data[key]

    @property
    def keys(self) -> Callable[[], Any]:
        """For dict samples, :attr:`data`'s ``keys``: ``model(**batch)`` works as with a ``DataLoader``'s
        dict batch. Other batches have none (``hasattr(batch, "keys")`` is False, as for a tuple)."""
        if not isinstance(self.data, Mapping):
            raise AttributeError("keys: this batch's data is not a mapping")
        return self.data.keys

    @property
    def images(self) -> torch.Tensor:
        """The inputs of ``(input, target)`` samples (``data[0]``)."""
        return self.data[0]

    @property
    def labels(self) -> torch.Tensor:
        """The targets of ``(input, target)`` samples (``data[1]``)."""
        return self.data[1]


class _MappingBatch(Batch):
    """A batch of dict samples: a ``Mapping`` of its data's keys, as a ``DataLoader``'s dict batch is
    (Lightning finds its batch size through ``values()``; ``dict(batch)`` is the collated dict).
    ``len(batch)`` stays the number of samples."""

    __slots__ = ()

    def values(self) -> Any:
        return self.data.values()

    def items(self) -> Any:
        return self.data.items()

    def get(self, key: Any, default: Any = None) -> Any:
        return self.data.get(key, default)

    def __contains__(self, key: Any) -> bool:
        return key in self.data


collections.abc.Mapping.register(_MappingBatch)


def _moved(value: Any, args: tuple, kwargs: dict) -> Any:
    """``value`` with each tensor ``.to(*args, **kwargs)``, through lists, tuples and dicts."""
    if isinstance(value, torch.Tensor):
        return value.to(*args, **kwargs)
    if isinstance(value, tuple) and hasattr(value, "_fields"):
        return type(value)(*(_moved(v, args, kwargs) for v in value))
    if isinstance(value, (list, tuple)):
        return type(value)(_moved(v, args, kwargs) for v in value)
    if isinstance(value, dict):
        return {k: _moved(v, args, kwargs) for k, v in value.items()}
    return value.to(*args, **kwargs) if hasattr(value, "to") and callable(value.to) else value


@dataclass
class BatchStats:
    """What cutting batches cost the trial: batches, how many were copies, CPU seconds spent.

    ``cpu_s`` is this thread's CPU time inside the batcher (reading piece answers, mapping pieces,
    slicing and copying), not the time spent blocked waiting for a piece.
    """

    batches: int = 0
    copied: int = 0
    cpu_s: float = 0.0

    @property
    def copied_fraction(self) -> float:
        """Share of batches that were copied (straddling two pieces) rather than views."""
        return self.copied / self.batches if self.batches else 0.0

    @property
    def cpu_ms_per_batch(self) -> float:
        """Trial-side CPU milliseconds per batch."""
        return 1000 * self.cpu_s / self.batches if self.batches else 0.0


class Batcher:
    """Cuts batches of ``batch_size`` from ``pieces`` in order, and says whether the next is at hand.

    Args:
        pieces: The pieces, in stream order (``next`` may block until a piece is prepared).
        batch_size: Samples per batch; the last batch may be smaller.
        stats: Counters to add batches, copies and CPU time to.
        ready: Whether the next ``k`` pieces can be had without waiting (the stream's
            :meth:`~coordinated_prep.trial.streams.PieceStream.ready`); None: always.
        left: Pieces ``pieces`` still holds, if known: once they are all taken, the last (smaller)
            batch is at hand too.
        drop_last: Leave that last batch out if it is smaller than ``batch_size`` (a ``DataLoader``'s
            ``drop_last``).
    """

    def __init__(self, pieces: Iterator[PreparedChunk], batch_size: int, stats: BatchStats | None = None,
                 ready: Callable[[int], bool] | None = None, left: int | None = None, drop_last: bool = False) -> None:
        self._pieces = pieces
        self._drop_last = drop_last
        self.batch_size = batch_size
        self.stats = stats if stats is not None else BatchStats()
        self._ready = ready
        self._left = left
        self._pending: list[tuple[PreparedChunk, int]] = []  # (piece, first sample not yet batched)
        self._have = 0
        self._piece_len = batch_size  # samples per piece, as last seen (to count the pieces a batch needs)
        self._done = False

    def ready(self) -> bool:
        """Whether :meth:`next` would return without waiting for a piece to be prepared."""
        if self._done or self._have >= self.batch_size or self._left == 0 or self._ready is None:
            return True
        need = math.ceil((self.batch_size - self._have) / max(self._piece_len, 1))
        return self._ready(need if self._left is None else min(need, self._left))

    def next(self) -> Batch | None:
        """The next batch, or None once the pieces are spent (blocks while a piece is prepared)."""
        cpu = time.thread_time()  # CPU spent reading answers and mapping pieces counts too
        try:
            while not self._done and self._have < self.batch_size:
                piece = next(self._pieces, None)
                if piece is None:
                    self._done = True
                    break
                if self._left is not None:
                    self._left -= 1
                if not len(piece):  # every row skipped, or none in the trial's part: nothing to cut
                    continue
                self._pending.append((piece, 0))
                self._have += len(piece)
                self._piece_len = len(piece)
            if not self._have or (self._drop_last and self._have < self.batch_size):  # (the pieces are spent)
                self._pending, self._have = [], 0
                return None
            n = min(self.batch_size, self._have)
            batch, self._pending = _take(self._pending, n, self.stats)
            self._have -= n
            return batch
        finally:
            self.stats.cpu_s += time.thread_time() - cpu

    def __iter__(self) -> Iterator[Batch]:
        while (batch := self.next()) is not None:
            yield batch


def batched(pieces: Iterator[PreparedChunk], batch_size: int, stats: BatchStats | None = None) -> Iterator[Batch]:
    """Batches of ``batch_size`` cut from ``pieces`` in order; the last may be smaller.

    Args:
        pieces: The pieces, in stream order.
        batch_size: Samples per batch.
        stats: Counters to add this pass's batches, copies and CPU time to.
    """
    return iter(Batcher(pieces, batch_size, stats))


def _take(pending: list[tuple[PreparedChunk, int]], n: int,
          stats: BatchStats) -> tuple[Batch, list[tuple[PreparedChunk, int]]]:
    """Cut the first ``n`` samples off ``pending``; returns (batch, rest)."""
    stats.batches += 1
    piece, at = pending[0]
    if len(piece) - at >= n:  # inside one piece: views, no copy
        rest = pending[1:] if at + n == len(piece) else [(piece, at + n)] + pending[1:]
        return _batch([(piece, at, at + n)]), rest
    stats.copied += 1
    parts, need, rest = [], n, list(pending)
    while need:
        piece, at = rest.pop(0)
        k = min(need, len(piece) - at)
        parts.append((piece, at, at + k))
        if at + k < len(piece):
            rest.insert(0, (piece, at + k))
        need -= k
    return _batch(parts), rest


def _batch(parts: list[tuple[PreparedChunk, int, int]]) -> Batch:
    """The batch of rows ``[a, b)`` of each piece: stacked leaves are views of a single piece, one copy
    into trial-owned memory across pieces (the batch then pins no shared pieces)."""
    layout = parts[0][0].layout
    leaves: list[Any] = []
    for j, spec in enumerate(layout.leaves):
        if spec.kind == "dense":
            rows = [p.leaves[j][a:b] for p, a, b in parts]
            leaves.append(_tensor(rows[0] if len(rows) == 1 else np.concatenate(rows), spec.dtype))
        elif spec.kind == "ragged":
            leaves.append([_tensor(p.leaves[j][i], spec.dtype) for p, a, b in parts for i in range(a, b)])
        else:
            leaves.append([p.leaves[j][i] for p, a, b in parts for i in range(a, b)])
    labels = [_labels(p, a, b) for p, a, b in parts]
    epochs, views = (np.concatenate([label[k] for label in labels]) for k in (0, 1))
    return Batch(layout, leaves, torch.from_numpy(np.concatenate([p.indices[a:b] for p, a, b in parts])),
                 torch.from_numpy(epochs), torch.from_numpy(views))


def _labels(piece: PreparedChunk, a: int, b: int) -> tuple[np.ndarray, np.ndarray]:
    """(stream epochs, repeats) of rows ``[a, b)`` of ``piece``: its epoch, and each row's view (a piece of
    k views lays them view-major: rows [v*n, (v+1)*n) are view v of its n samples). A piece put back to
    its planned length (:class:`~coordinated_prep.trial.shard.FilledPiece`) labels each row itself."""
    own = getattr(piece, "row_labels", None)
    if own is not None:
        return own[0][a:b], own[1][a:b]
    views = np.arange(a, b, dtype=np.int64) // max(len(piece) // piece.views, 1)
    return np.full(b - a, piece.epoch, dtype=np.int64), views


def _tensor(array: np.ndarray, dtype: str) -> torch.Tensor:
    """A tensor sharing ``array``'s memory (bfloat16 from its int16 bits)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # Ray flags the store's arrays read-only; pages.py guards them
        out = torch.from_numpy(array)
    return out.view(torch.bfloat16) if dtype == "bfloat16" else out


def select(rows: Sequence[tuple[Batch, int]], repeats: Sequence[int]) -> Batch:
    """One batch of the given (batch, row) pairs, copied into memory the trial owns (echoing)."""
    first = rows[0][0]
    leaves: list[Any] = []
    for j, spec in enumerate(first.layout.leaves):
        if spec.kind == "dense":
            leaves.append(torch.stack([b.leaves[j][r] for b, r in rows]))
        else:
            leaves.append([b.leaves[j][r] for b, r in rows])
    pick = lambda name: torch.stack([getattr(b, name)[r] for b, r in rows])  # noqa: E731
    return Batch(first.layout, leaves, pick("indices"), pick("stream_epochs"),
                 torch.tensor(list(repeats), dtype=torch.int64))
