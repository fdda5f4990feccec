"""The contracts between the parts: a data source and a preprocessing backend."""

from __future__ import annotations

from typing import Any, Protocol, Sequence, runtime_checkable

import numpy as np


@runtime_checkable
class DataSource(Protocol):
    """Random access to encoded samples and their labels.

    Implementations must be cheap to construct in every process that reads (coordinator,
    prep actors, trials) and must give the same index the same sample in each of them.
    """

    root: str
    classes: tuple[str, ...]
    labels: np.ndarray  # int64, one per sample, indexed like the samples

    def __len__(self) -> int: ...

    def read(self, index: int) -> bytes:
        """Encoded bytes of sample ``index`` (a JPEG stays a JPEG); raises SampleError."""
        ...

    def describe(self, index: int) -> str:
        """Where sample ``index`` lives (a file path), for error messages."""
        ...


@runtime_checkable
class BatchSource(DataSource, Protocol):
    """A data source that reads many samples in one call (the node caches answer per piece)."""

    def read_many(self, indices: Sequence[int]) -> list[Any]:
        """Per index, in order: its encoded bytes (``bytes`` or a read-only uint8 array) or the
        :class:`~coordinated_prep.errors.SampleError` that reading it raised."""
        ...



def read_many(source: DataSource, indices: Sequence[int]) -> list[Any]:
    """Per index, its encoded bytes or the SampleError reading it raised: in one call where ``source``
    reads many (a :class:`BatchSource`: a node cache, a shard index fetching a piece's shards together)."""
    from coordinated_prep.errors import SampleError

    if hasattr(source, "read_many"):  # not isinstance(BatchSource): that would ask for every member (classes)
        return source.read_many(indices)
    out: list[Any] = []
    for index in indices:
        try:
            out.append(source.read(index))
        except SampleError as e:
            out.append(e)
    return out

class Preprocessor(Protocol):
    """Turns encoded samples into uint8 arrays of shape (3, size, size).

    Augmentation must be a pure function of (seed, epoch, sample index, view): the same inputs give
    the same bytes in any process, whichever actor does the work.
    """

    def train(self, data: bytes, seed: int, epoch: int, index: int) -> np.ndarray:
        """Decode and randomly augment one training sample (``data``: bytes or a uint8 array)."""
        ...

    def train_views(self, data: bytes, seed: int, epoch: int, index: int, views: int) -> np.ndarray:
        """Decode one training sample once and augment it ``views`` times: uint8 (views, 3, size, size).

        View 0 equals :meth:`train`'s output; view ``v``'s draw is a pure function of (seed, epoch,
        index, v)."""
        ...

    def eval(self, data: bytes) -> np.ndarray:
        """Decode, resize and centre-crop one evaluation sample."""
        ...


@runtime_checkable
class BatchPreprocessor(Preprocessor, Protocol):
    """A preprocessor that also prepares many samples in one call (DALI works a batch at a time)."""

    def train_batch(self, datas: Sequence[bytes], seed: int, epoch: int, indices: Sequence[int],
                    views: Sequence[int] | None = None) -> np.ndarray:
        """Decode and augment ``datas`` into uint8 (n, 3, size, size), aligned with ``indices``
        (and with ``views``, each row's view number; None: all view 0)."""
        ...
