"""Cutting prepared pieces into a trial's batches: views of a piece where a batch lies inside one.

A batch that lies inside one piece is a view of the piece's memory (for a shared piece, the
object store's pages, mapped read-only by :mod:`coordinated_prep.readonly`); only a batch that
straddles two pieces is copied into memory the trial owns. With the default piece size (256
samples, :func:`coordinated_prep.plan.piece_size`) every batch of a trial whose batch size divides
is a view: epochs start and end at piece boundaries, so the last, smaller batch of an epoch is a
view too. The loaders report the fraction copied and the CPU this costs the trial (``BatchStats``).
"""

from __future__ import annotations

import math
import time
import warnings
from dataclasses import dataclass
from typing import Callable, Iterator

import numpy as np
import torch

from coordinated_prep.pipeline.chunk import PreparedChunk


@dataclass(frozen=True)
class Batch:
    """One minibatch, aligned by position.

    Attributes:
        images: ``torch.uint8`` of shape (N, 3, H, W); normalise on the trial's device. A view of
            shared memory when the batch lies inside one piece: read it, never write into it
            (``normalize`` and every out-of-place op are fine; ``images.clone()`` to write).
        labels: ``torch.int64`` class indices.
        indices: ``torch.int64`` dataset index of each sample.
        stream_epochs: ``torch.int64`` stream epoch whose augmentation draw produced each sample
            (equal to the trial's epoch for a trial that started at piece 0, or unshared).
        repeats: ``torch.int64``: 0 for a sample's first delivery in the trial's epoch (fresh); a
            repeat (an extra view made before augmentation, or an echo:
            :mod:`coordinated_prep.echo`) gets a positive label unique per sample in the epoch,
            ``view x e + copy``. None when building a Batch by hand: all fresh.
    """

    images: torch.Tensor
    labels: torch.Tensor
    indices: torch.Tensor
    stream_epochs: torch.Tensor
    repeats: torch.Tensor = None  # type: ignore[assignment]  # set to zeros in __post_init__ when None

    def __post_init__(self) -> None:
        if self.repeats is None:
            object.__setattr__(self, "repeats", torch.zeros_like(self.labels, dtype=torch.int64))

    def __len__(self) -> int:
        return int(self.labels.shape[0])


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
            :meth:`~coordinated_prep.streams.PieceStream.ready`); None: always.
        left: Pieces ``pieces`` still holds, if known: once they are all taken, the last (smaller)
            batch is at hand too.
    """

    def __init__(self, pieces: Iterator[PreparedChunk], batch_size: int, stats: BatchStats | None = None,
                 ready: Callable[[int], bool] | None = None, left: int | None = None) -> None:
        self._pieces = pieces
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
                self._pending.append((piece, 0))
                self._have += len(piece.labels)
                self._piece_len = len(piece.labels) or self._piece_len
            if not self._have:
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
    if len(piece.labels) - at >= n:  # inside one piece: a view, no copy
        rest = pending[1:] if at + n == len(piece.labels) else [(piece, at + n)] + pending[1:]
        return _batch(piece.images[at : at + n], [(piece, at, at + n)]), rest
    stats.copied += 1
    parts, need, rest = [], n, list(pending)
    while need:
        piece, at = rest.pop(0)
        k = min(need, len(piece.labels) - at)
        parts.append((piece, at, at + k))
        if at + k < len(piece.labels):
            rest.insert(0, (piece, at + k))
        need -= k
    # One copy into trial-owned memory: the batch then pins no shared pieces.
    return _batch(np.concatenate([p.images[a:b] for p, a, b in parts]), parts), rest


def _batch(images: np.ndarray, parts: list[tuple[PreparedChunk, int, int]]) -> Batch:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # torch warns that a shared array is read-only
        pixels = torch.from_numpy(images)
    epochs = np.concatenate([np.full(b - a, p.epoch, dtype=np.int64) for p, a, b in parts])
    # A piece of k views lays them view-major: rows [v*n, (v+1)*n) are view v of its n samples.
    views = np.concatenate([np.arange(a, b, dtype=np.int64) // max(len(p.labels) // p.views, 1) for p, a, b in parts])
    return Batch(images=pixels,
                 labels=torch.from_numpy(np.concatenate([p.labels[a:b] for p, a, b in parts])),
                 indices=torch.from_numpy(np.concatenate([p.indices[a:b] for p, a, b in parts])),
                 stream_epochs=torch.from_numpy(epochs), repeats=torch.from_numpy(views))
