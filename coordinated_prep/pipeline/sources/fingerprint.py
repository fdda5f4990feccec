"""A dataset index's fingerprint: whether two nodes' copies of a dataset index the same samples.

Every process indexes its own copy of a dataset, and the node caches exchange samples by
(dataset path, index). Two copies that differ (a file added, removed or changed on one node) would
make one node serve another's image bytes under its own label. Each node fingerprints its index
when a group starts there, and :func:`check_same_index` refuses a mismatch with both nodes named.

What is digested, per kind of source (never the image bytes: the check must stay cheap):

- ImageFolder: the class names, and per sample in index order its path relative to the root, its
  label and its file size;
- Parquet: the manifest's classes, row-group size and shard list (file, rows), each shard's file
  size, and the labels column;
- ``builtin:`` datasets: their name and size (they are generated deterministically on each node,
  and their files may differ by a byte between image library versions without mattering);
- tar shards named by a shard index: the index's shards (URL, samples) and classes, if it names
  them (reading the shards for their labels would fetch every one, which the index is there to
  avoid; each shard is checked against its count when it is read);
- any other source: its length, classes and labels.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass

import numpy as np

from coordinated_prep.contracts import DataSource
from coordinated_prep.errors import DatasetError


@dataclass(frozen=True)
class Fingerprint:
    """A digest of one copy's index, with the counts an error message can show.

    Attributes:
        digest: SHA-256 (hex) of the index, as the module docstring lists per kind of source.
        kind: ``imagefolder``, ``parquet``, ``builtin``, ``tar shards`` (a shard index) or ``other``.
        samples: Samples indexed.
        classes: Classes indexed.
        total_bytes: Sum of the sizes digested (files, or shards); 0 where no size is read.
    """

    digest: str
    kind: str
    samples: int
    classes: int
    total_bytes: int

    def describe(self) -> str:
        """The counts, for a message: ``"3000 samples in 10 classes, 12.3 MiB"``."""
        size = f", {self.total_bytes / 2**20:.1f} MiB" if self.total_bytes else ""
        return f"{self.samples} samples in {self.classes} classes{size} ({self.kind} index {self.digest[:12]})"


def index_fingerprint(source: DataSource, dataset: str | None = None) -> Fingerprint:
    """The fingerprint of ``source``'s index on this node.

    Args:
        source: The opened data source (``coordinated_prep.pipeline.sources.open_source(dataset)``).
        dataset: The ``DataSpec.dataset`` it was opened from; a ``builtin:`` name gets a stable value.

    Raises:
        DatasetError: A file of the index vanished since the source was opened (naming it).
    """
    from coordinated_prep.pipeline.sources.imagefolder import ImageFolderSource

    h = hashlib.sha256()
    index = getattr(source, "index", None)
    if index is not None and hasattr(index, "counts"):  # a ShardIndex (its shards are read as needed)
        _add(h, "shard index", *(index.classes or ()))
        for url, n in zip(index.urls, index.counts):
            _add(h, url, str(n))
        return Fingerprint(h.hexdigest(), "tar shards", len(source), len(index.classes or ()), 0)
    classes = tuple(source.classes)
    _add(h, "classes", *classes)
    if dataset is not None and dataset.startswith("builtin:"):
        _add(h, "builtin", dataset, str(len(source)))
        return Fingerprint(h.hexdigest(), "builtin", len(source), len(classes), 0)
    if isinstance(source, ImageFolderSource):
        total = 0
        for path, label in zip(source.paths, source.labels.tolist()):
            size = _size(path, source.root)
            total += size
            _add(h, os.path.relpath(path, source.root), str(label), str(size))
        return Fingerprint(h.hexdigest(), "imagefolder", len(source), len(classes), total)
    shards = getattr(source, "shards", None)
    if shards is not None and hasattr(source, "row_group_size"):  # a ParquetSource (pyarrow not imported here)
        from coordinated_prep.pipeline.sources.manifest import read_manifest

        manifest = read_manifest(source.root)
        _add(h, "parquet", str(manifest["row_group_size"]))
        total = 0
        for entry, path in zip(manifest["shards"], shards):
            size = _size(path, source.root)
            total += size
            _add(h, entry["file"], str(entry["rows"]), str(size))
        h.update(np.ascontiguousarray(source.labels, dtype="<i8").tobytes())
        return Fingerprint(h.hexdigest(), "parquet", len(source), len(classes), total)
    _add(h, "other", str(len(source)))
    h.update(np.ascontiguousarray(source.labels, dtype="<i8").tobytes())
    return Fingerprint(h.hexdigest(), "other", len(source), len(classes), 0)


def check_same_index(dataset: str, first_node: str, first: Fingerprint, node: str, found: Fingerprint) -> None:
    """Refuse a copy of ``dataset`` on ``node`` whose index differs from the one on ``first_node``.

    Args:
        dataset: The ``DataSpec.dataset`` both nodes opened.
        first_node: The node whose fingerprint the others must match (e.g. the group's first).
        first: That node's fingerprint.
        node: The node being checked.
        found: Its fingerprint.

    Raises:
        DatasetError: Naming the dataset, both nodes and both indexes' counts, and the fix.
    """
    if first.digest == found.digest:
        return
    if (first.samples, first.classes) != (found.samples, found.classes):
        what = "different sample or class counts"
    elif first.total_bytes != found.total_bytes:
        what = "the same counts, but files of other sizes"
    else:
        what = "the same counts and sizes, but other file names or labels"
    raise DatasetError(
        f"dataset {dataset!r} differs between nodes ({what}): node {first_node} indexes {first.describe()}, node "
        f"{node} indexes {found.describe()}. Nodes exchange samples by index, so a node would be served another "
        "node's image under its own label; make the copies identical (e.g. rsync -a --delete) or put the dataset "
        "on a shared filesystem"
    )


def _add(h: "hashlib._Hash", *fields: str) -> None:
    for field in fields:  # length-prefixed: ("ab", "c") and ("a", "bc") digest differently
        data = field.encode("utf-8", "surrogateescape")
        h.update(len(data).to_bytes(8, "little"))
        h.update(data)


def _size(path: str, root: str) -> int:
    try:
        return os.stat(path).st_size
    except OSError as e:
        raise DatasetError(f"dataset {root!r}: {path} is indexed but cannot be read now ({e.strerror or e}); "
                           "was the dataset changed while the sweep runs?") from None
