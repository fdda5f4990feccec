"""Preparing one piece of the stream: the same function in prep actors and in unshared trials."""

from __future__ import annotations

import time
from typing import Literal, NamedTuple

import numpy as np

from coordinated_prep.contracts import BatchPreprocessor, BatchSource, DataSource, Preprocessor
from coordinated_prep.errors import SampleError
from coordinated_prep.readonly import padded_base, padded_empty


class PreparedChunk(NamedTuple):
    """One prepared piece: arrays aligned by position; Ray stores each array zero-copy.

    Images prepared by :func:`prepare_chunk` and :func:`eval_chunk` lie in a buffer padded by a
    page on each side (:func:`~coordinated_prep.readonly.padded_empty`), and the piece pickles that
    whole buffer, so that a trial can map the images' pages read-only without touching another
    object's bytes (:mod:`coordinated_prep.readonly`).

    A piece of a group with ``views`` = k > 1 (echoing before augmentation) holds k augmented views
    of each of its n samples, view-major: rows ``[v*n, (v+1)*n)`` are view ``v``, so ``labels`` and
    ``indices`` repeat k times and the views of one sample lie n rows apart.
    """

    images: np.ndarray  # uint8 (n * views, 3, size, size)
    labels: np.ndarray  # int64 (n * views,)
    indices: np.ndarray  # int64 (n * views,): dataset index of each row
    epoch: int  # the stream epoch whose augmentation draws produced these samples
    views: int = 1  # augmented views per sample, laid view-major

    def __reduce__(self) -> tuple:
        found = padded_base(self.images)
        if found is None:
            return PreparedChunk, tuple(self)
        base, offset = found
        return _unpickle_padded, (base, offset, self.images.shape, self.labels, self.indices, self.epoch, self.views)


def _unpickle_padded(base: np.ndarray, offset: int, shape: tuple[int, ...], labels: np.ndarray,
                     indices: np.ndarray, epoch: int, views: int = 1) -> PreparedChunk:
    nbytes = int(np.prod(shape))
    return PreparedChunk(base[offset : offset + nbytes].reshape(shape), labels, indices, epoch, views)


class ChunkTiming(NamedTuple):
    """Seconds spent per stage preparing one piece, and the samples left out of it."""

    fetch_s: float  # reading encoded bytes
    transform_s: float  # decoding and augmenting
    skipped: tuple[tuple[int, str, str], ...] = ()  # (index, path, reason) under on_error="skip"
    finished_at: float = 0.0  # wall-clock time (time.time) the prep actor finished; 0 when unset
    cpu_s: float = 0.0  # CPU seconds of the preparing process (threads included); 0 when unset
    storage_reads: int = 0  # samples the preparing process read from storage itself
    cache_hits: int = 0  # samples that came from a node's raw-data cache


def prepare_chunk(
    source: DataSource, preprocessor: Preprocessor, seed: int, epoch: int, indices: np.ndarray, size: int,
    on_error: Literal["raise", "skip"] = "raise", views: int = 1,
) -> tuple[PreparedChunk, ChunkTiming]:
    """Read, decode and augment the samples ``indices`` for stream epoch ``epoch``.

    With ``views`` = k > 1 each sample is read and decoded once and augmented k times (view ``v``'s
    crop drawn from seed, epoch, index and ``v``; view 0's is the draw of ``views=1``), laid
    view-major (see :class:`PreparedChunk`). A DALI backend decodes the crop window of each view
    (its ROI decoder), so there k views cost k partial decodes.

    All samples are read first (the fetch stage), then transformed: in one call for a
    :class:`BatchPreprocessor` (DALI), else one by one. With ``on_error="skip"`` a sample that cannot
    be read or decoded is left out of the piece (so every trial reading the piece leaves it out
    alike) and reported in the timing's ``skipped``; a failed batch is retried sample by sample to
    find the culprit.

    Raises:
        SampleError: With ``on_error="raise"``, a sample's file cannot be read or decoded; names the
            index and the file.
    """
    skipped: list[tuple[int, str, str]] = []
    t0 = time.perf_counter()
    ids = indices.tolist()
    if isinstance(source, BatchSource):
        reads = source.read_many(ids)
    else:
        reads = []
        for index in ids:
            try:
                reads.append(source.read(index))
            except SampleError as e:
                reads.append(e)
    blobs: list[tuple[int, bytes]] = []
    for index, data in zip(ids, reads):
        if not isinstance(data, SampleError):
            blobs.append((index, data))
        elif on_error == "raise":
            raise data
        else:
            skipped.append((data.index, data.path, data.reason))
    t1 = time.perf_counter()
    images: np.ndarray | None = None
    kept: list[int] = []
    if isinstance(preprocessor, BatchPreprocessor) and blobs:
        try:
            datas, ids_ = [d for _, d in blobs] * views, [i for i, _ in blobs] * views  # view-major
            if views == 1:
                batch = preprocessor.train_batch(datas, seed, epoch, ids_)
            else:
                batch = preprocessor.train_batch(datas, seed, epoch, ids_, [v for v in range(views) for _ in blobs])
            images = padded_empty(batch.shape)
            images[...] = batch  # into a padded buffer, so trials can map it read-only
            kept = [i for i, _ in blobs]
        except Exception:  # one bad sample fails the whole batch: find it sample by sample below
            images = None
    if images is None:
        n = len(blobs)
        images = padded_empty((views * n, 3, size, size))
        rows = images.reshape(views, n, 3, size, size) if n else images  # view-major, written in place
        kept = []
        for index, data in blobs:
            try:
                if views == 1:
                    rows[0, len(kept)] = preprocessor.train(data, seed, epoch, index)
                else:
                    rows[:, len(kept)] = preprocessor.train_views(data, seed, epoch, index, views)
            except Exception as e:  # decoders raise RuntimeError/ValueError/OSError: name the file
                error = SampleError(index, source.describe(index), f"cannot decode or transform: {e}")
                if on_error == "raise":
                    raise error from e
                skipped.append((error.index, error.path, error.reason))
                continue
            kept.append(index)
        if len(kept) < n:  # skipped samples: close the gaps of every view (rare; one copy)
            if views == 1:
                images = images[: len(kept)]
            else:
                packed = padded_empty((views * len(kept), 3, size, size))
                packed.reshape(views, len(kept), 3, size, size)[...] = rows[:, : len(kept)]
                images = packed
    fetch_s, transform_s = t1 - t0, time.perf_counter() - t1
    ids = np.asarray(kept, dtype=np.int64)
    if views > 1:
        ids = np.tile(ids, views)
    chunk = PreparedChunk(images, source.labels[ids], ids, epoch, views)
    return chunk, ChunkTiming(fetch_s, transform_s, tuple(skipped))


def eval_chunk(source: DataSource, preprocessor: Preprocessor, indices: np.ndarray,
               on_error: Literal["raise", "skip"] = "raise",
               skipped: list[tuple[int, str, str]] | None = None) -> PreparedChunk:
    """Read, decode, resize and centre-crop the held-out samples ``indices`` (deterministic; epoch -1).

    With ``on_error="skip"`` a sample that cannot be read or decoded is left out of the piece and
    appended to ``skipped`` as (index, path, reason), as :func:`prepare_chunk` does for training.

    Raises:
        SampleError: With ``on_error="raise"``, a sample's file cannot be read or decoded; names the
            index and the file.
    """
    rows: list[np.ndarray] = []
    kept: list[int] = []
    for index in indices.tolist():
        try:
            data = source.read(index)
            try:
                image = preprocessor.eval(data)
            except Exception as e:  # decoders raise RuntimeError/ValueError/OSError: name the file
                raise SampleError(index, source.describe(index), f"cannot decode or transform: {e}") from e
        except SampleError as error:
            if on_error == "raise":
                raise
            if skipped is not None:
                skipped.append((error.index, error.path, error.reason))
            continue
        rows.append(image)
        kept.append(index)
    ids = np.asarray(kept, dtype=np.int64)
    if not rows:  # no samples: nothing to protect
        return PreparedChunk(np.empty((0, 3, 0, 0), dtype=np.uint8), source.labels[ids], ids, -1)
    images = padded_empty((len(rows), *rows[0].shape))
    for k, image in enumerate(rows):
        images[k] = image
    return PreparedChunk(images, source.labels[ids], ids, -1)
