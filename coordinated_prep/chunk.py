"""Preparing one piece of the stream: the same function in prep actors and in unshared trials."""

from __future__ import annotations

import time
from typing import NamedTuple

import numpy as np

from coordinated_prep.contracts import DataSource, Preprocessor
from coordinated_prep.errors import SampleError


class PreparedChunk(NamedTuple):
    """One prepared piece: arrays aligned by position; Ray stores each array zero-copy."""

    images: np.ndarray  # uint8 (n, 3, size, size)
    labels: np.ndarray  # int64 (n,)
    indices: np.ndarray  # int64 (n,): dataset index of each sample
    epoch: int  # the stream epoch whose augmentation draws produced these samples


class ChunkTiming(NamedTuple):
    """Seconds spent per stage preparing one piece."""

    fetch_s: float  # reading encoded bytes
    transform_s: float  # decoding and augmenting


def prepare_chunk(
    source: DataSource, preprocessor: Preprocessor, seed: int, epoch: int, indices: np.ndarray, size: int,
) -> tuple[PreparedChunk, ChunkTiming]:
    """Read, decode and augment the samples ``indices`` for stream epoch ``epoch``.

    Raises:
        SampleError: A sample's file cannot be read or decoded; names the index and the file.
    """
    images = np.empty((len(indices), 3, size, size), dtype=np.uint8)
    fetch_s = transform_s = 0.0
    for i, index in enumerate(indices.tolist()):
        t0 = time.perf_counter()
        data = source.read(index)
        t1 = time.perf_counter()
        try:
            images[i] = preprocessor.train(data, seed, epoch, index)
        except Exception as e:  # decoders raise RuntimeError/ValueError/OSError: name the file
            raise SampleError(index, source.describe(index), f"cannot decode or transform: {e}") from e
        transform_s += time.perf_counter() - t1
        fetch_s += t1 - t0
    labels = source.labels[indices]
    chunk = PreparedChunk(images, labels, np.asarray(indices, dtype=np.int64), epoch)
    return chunk, ChunkTiming(fetch_s, transform_s)
