"""A Parquet record-file dataset written by ``coordprep convert``: shards of encoded samples and a manifest."""

from __future__ import annotations

import collections
import logging
import os
import threading
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from coordinated_prep.errors import DatasetError, SampleError
from coordinated_prep.pipeline.sources.manifest import CONVERT_HINT as _CONVERT_HINT
from coordinated_prep.pipeline.sources.manifest import FORMAT, FORMAT_VERSION, MANIFEST, read_manifest

logger = logging.getLogger(__name__)

__all__ = ["COLUMNS", "FORMAT", "FORMAT_VERSION", "MANIFEST", "SCHEMA", "ParquetSource", "read_manifest"]

#: Columns of every shard: encoded bytes as written by the source, class index, ImageFolder index.
COLUMNS: tuple[str, ...] = ("image", "label", "index")
SCHEMA = pa.schema([("image", pa.binary()), ("label", pa.int64()), ("index", pa.int64())])


class ParquetSource:
    """Samples of a directory of Parquet shards ``part-NNNNN.parquet`` described by ``coordprep-parquet.json``.

    Sample ``i`` is row ``i`` of the shards taken in manifest order, which ``coordprep convert``
    writes in ImageFolder index order, so ``read(i)`` returns the same bytes as the ImageFolder it
    came from. Construction reads the manifest and the small ``label`` and ``index`` columns; a
    read fetches only the ``image`` column of the one row group holding the sample, and keeps the
    last ``cache_row_groups`` row groups so that neighbours are not read again.

    Shard handles are opened on first read, per process (at most ``max_open_files`` at a time),
    and are neither pickled nor shared with forked children: the source can be built, pickled or
    inherited anywhere cheaply.

    Args:
        root: The dataset directory.
        cache_row_groups: Row groups of images kept in memory (a few MiB for ImageNet-sized JPEGs).
        max_open_files: Shard files kept open at once (least recently used closed first).
        origin: Where ``root`` was fetched from (the URL of the folder holding the manifest), for
            what errors name: ``<origin>/<shard file>#row <n>``; None: the local paths.

    Raises:
        DatasetError: Missing or unreadable manifest, another format version, a bad field (a shard
            path outside ``root``, a count that is not an integer: see
            :func:`coordinated_prep.pipeline.sources.manifest.read_manifest`), a missing shard, or a shard
            whose rows do not match the manifest.
    """

    def __init__(self, root: str, cache_row_groups: int = 4, max_open_files: int = 64, origin: str | None = None) -> None:
        self.root = os.path.abspath(os.path.expanduser(root))
        manifest = read_manifest(self.root)
        self.classes: tuple[str, ...] = tuple(manifest["classes"])
        self.row_group_size = int(manifest["row_group_size"])
        self.shards: tuple[str, ...] = tuple(os.path.join(self.root, s["file"]) for s in manifest["shards"])
        self.names = self.shards if origin is None else tuple(f"{origin}/{s['file']}" for s in manifest["shards"])
        self._cache_size = max(1, cache_row_groups)
        self._max_open = max(1, max_open_files)
        labels: list[np.ndarray] = []
        self._group_starts: list[np.ndarray] = []  # per shard: first row of each row group
        starts = [0]
        for path, entry in zip(self.shards, manifest["shards"]):
            shard_labels, groups = _load_shard(path, int(entry["rows"]), starts[-1], len(self.classes))
            labels.append(shard_labels)
            self._group_starts.append(groups)
            starts.append(starts[-1] + len(shard_labels))
        self.labels = np.concatenate(labels) if labels else np.zeros(0, dtype=np.int64)
        self._shard_starts = np.asarray(starts, dtype=np.int64)
        self._reset_handles()

    def __len__(self) -> int:
        return int(self._shard_starts[-1])

    def read(self, index: int) -> bytes:
        """Encoded bytes of sample ``index``, reading at most one row group of the ``image`` column."""
        shard, row = self._locate(index)
        groups = self._group_starts[shard]
        group = int(np.searchsorted(groups, row, side="right")) - 1
        try:
            column = self._row_group(shard, group)
        except (OSError, pa.ArrowException) as e:
            raise SampleError(index, self.describe(index), f"cannot read row group {group} of the shard: {e}; "
                              f"{_CONVERT_HINT}") from e
        value = column[row - int(groups[group])].as_py()
        if value is None:
            raise SampleError(index, self.describe(index), "the image is null; " + _CONVERT_HINT)
        return value

    def describe(self, index: int) -> str:
        """The shard (its path, or its URL) and row of sample ``index``: ``<shard>#row <n>``."""
        shard, row = self._locate(index)
        return f"{self.names[shard]}#row {row}"

    def _locate(self, index: int) -> tuple[int, int]:
        n = len(self)
        i = index + n if index < 0 else index  # negative indices count from the end, as for ImageFolderSource
        if not 0 <= i < n:
            raise IndexError(f"sample index {index} out of range for the {n} samples of {self.root}")
        shard = int(np.searchsorted(self._shard_starts, i, side="right")) - 1
        return shard, i - int(self._shard_starts[shard])

    def _row_group(self, shard: int, group: int) -> pa.ChunkedArray:
        # One lock per source: the cache and the open handles are shared by the threads of a process.
        with self._guard():
            key = (shard, group)
            column = self._cache.get(key)
            if column is not None:
                self._cache.move_to_end(key)
                return column
            column = self._handle(shard).read_row_group(group, columns=["image"], use_threads=False).column(0)
            self._cache[key] = column
            while len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
            return column

    def _handle(self, shard: int) -> pq.ParquetFile:
        handle = self._files.get(shard)
        if handle is None:
            # No pre-buffering: a read fetches one column chunk, so there is nothing to coalesce, and
            # setting up the read cache nearly doubles the cost of a small read (measured here: 148 us against 82).
            handle = pq.ParquetFile(self.shards[shard], pre_buffer=False)
            self._files[shard] = handle
            while len(self._files) > self._max_open:
                self._files.popitem(last=False)[1].close()
        else:
            self._files.move_to_end(shard)
        return handle

    def _guard(self) -> threading.Lock:
        if self._pid != os.getpid():  # a forked child (a DataLoader worker): open its own handles
            self._reset_handles()
        return self._lock

    def _reset_handles(self) -> None:
        self._pid = os.getpid()
        self._lock = threading.Lock()
        self._files: collections.OrderedDict[int, pq.ParquetFile] = collections.OrderedDict()
        self._cache: collections.OrderedDict[tuple[int, int], pa.ChunkedArray] = collections.OrderedDict()

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        for name in ("_pid", "_lock", "_files", "_cache"):
            state.pop(name)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._reset_handles()


def _load_shard(path: str, rows: int, first: int, num_classes: int) -> tuple[np.ndarray, np.ndarray]:
    """Check one shard against the manifest; returns its labels and its row groups' first rows."""
    if not os.path.isfile(path):
        raise DatasetError(f"dataset shard {path} is missing (the manifest lists it); {_CONVERT_HINT}")
    try:
        with pq.ParquetFile(path) as shard:
            meta = shard.metadata
            if meta.num_rows != rows:
                raise DatasetError(f"dataset shard {path} holds {meta.num_rows} rows, but the manifest says {rows}; "
                                   + _CONVERT_HINT)
            if shard.schema_arrow.names != list(COLUMNS):
                raise DatasetError(f"dataset shard {path} has columns {shard.schema_arrow.names}, expected "
                                   f"{list(COLUMNS)}; {_CONVERT_HINT}")
            table = shard.read(columns=["label", "index"], use_threads=False)  # the small columns only
            group_rows = [meta.row_group(k).num_rows for k in range(meta.num_row_groups)]
    except (OSError, pa.ArrowException) as e:
        raise DatasetError(f"dataset shard {path} cannot be read as Parquet: {e}; {_CONVERT_HINT}") from None
    labels = table.column("label").to_numpy().astype(np.int64, copy=False)
    if not np.array_equal(table.column("index").to_numpy(), np.arange(first, first + rows)):
        raise DatasetError(f"dataset shard {path}: its index column is not rows {first}..{first + rows - 1} in "
                           f"order (shards out of order in the manifest?); {_CONVERT_HINT}")
    if rows and not (labels.min() >= 0 and labels.max() < num_classes):
        raise DatasetError(f"dataset shard {path}: labels outside [0, {num_classes}) of the manifest's classes; "
                           + _CONVERT_HINT)
    return labels, np.cumsum([0, *group_rows[:-1]], dtype=np.int64)
