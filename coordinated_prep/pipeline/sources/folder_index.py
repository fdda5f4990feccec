"""An ImageFolder's index (classes, files, labels), walked once and shared zero-copy between processes.

Walking a tree of 200,000 files costs a process about a second even with a warm dentry cache, and an
ImageNet-sized tree several. In a sweep the walk is done once per dataset and node
(:mod:`coordinated_prep.pipeline.sources.shared_index`), and every other process of the node (coordinators,
prep actors, trials) maps the result from the object store: the file names are one byte array and
an offset array, not a million Python strings.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Iterator, Sequence, overload

import numpy as np

from coordinated_prep.errors import DatasetError

logger = logging.getLogger(__name__)

#: Extensions read as images (lower case); the same matching rule as torchvision's.
IMAGE_EXTENSIONS: tuple[str, ...] = (".jpg", ".jpeg", ".png")


@dataclass(frozen=True)
class FolderIndex:
    """What walking an ImageFolder found, in index order.

    Attributes:
        root: The dataset directory (absolute).
        classes: Sorted class folder names; label ``k`` is ``classes[k]``.
        names: Every file's path relative to ``root`` (``os.fsencode``), concatenated.
        offsets: int64 (n + 1): file ``i`` is ``names[offsets[i]:offsets[i + 1]]``.
        labels: int64 (n): each file's label.
        ignored: Files without an image extension that the walk left out, and the first of them.
    """

    root: str
    classes: tuple[str, ...]
    names: np.ndarray
    offsets: np.ndarray
    labels: np.ndarray
    ignored: tuple[int, str | None] = (0, None)

    def __len__(self) -> int:
        return len(self.labels)

    def path(self, index: int) -> str:
        """The absolute path of file ``index``."""
        start, end = self.offsets[index], self.offsets[index + 1]
        return os.path.join(self.root, os.fsdecode(self.names[start:end].tobytes()))


class PathList(Sequence[str]):
    """The files of a :class:`FolderIndex` as a read-only sequence of absolute paths, built on access."""

    def __init__(self, index: FolderIndex) -> None:
        self._index = index

    def __len__(self) -> int:
        return len(self._index)

    @overload
    def __getitem__(self, i: int) -> str: ...

    @overload
    def __getitem__(self, i: slice) -> list[str]: ...

    def __getitem__(self, i: int | slice) -> str | list[str]:
        if isinstance(i, slice):
            return [self._index.path(k) for k in range(*i.indices(len(self)))]
        if not -len(self) <= i < len(self):
            raise IndexError(f"sample index {i} out of range for {len(self)} samples")
        return self._index.path(i % len(self))

    def __iter__(self) -> Iterator[str]:
        return (self._index.path(k) for k in range(len(self)))


def scan(root: str) -> FolderIndex:
    """Walk ``root`` like ``torchvision.datasets.ImageFolder``: sorted class folders, then sorted files.

    Raises:
        DatasetError: ``root`` is missing, has no class folders, or a class has no images.
    """
    root = os.path.abspath(os.path.expanduser(root))
    if not os.path.isdir(root):
        raise DatasetError(f"dataset {root!r}: no such directory; give an ImageFolder root, a Parquet dataset "
                           "directory written by `coordprep convert`, WebDataset tar shards (a folder of *.tar, or a "
                           "pattern such as 'shards-{0000..0063}.tar'), or 'builtin:shapes'")
    classes = sorted(e.name for e in os.scandir(root) if e.is_dir())
    if not classes:
        raise DatasetError(f"dataset {root!r}: no class subfolders; expected the ImageFolder layout root/<class>/<image>")
    names: list[bytes] = []
    labels: list[int] = []
    ignored: list[str] = []
    for label, name in enumerate(classes):
        found = _images_under(root, name, ignored)
        if not found:
            raise DatasetError(f"dataset {root!r}: class folder {name!r} holds no images with extensions "
                               f"{list(IMAGE_EXTENSIONS)}; add images or remove the folder")
        names.extend(found)
        labels.extend([label] * len(found))
    offsets = np.zeros(len(names) + 1, dtype=np.int64)
    np.cumsum([len(n) for n in names], out=offsets[1:])
    blob = np.frombuffer(b"".join(names), dtype=np.uint8)
    return FolderIndex(root, tuple(classes), blob, offsets, np.asarray(labels, dtype=np.int64),
                       (len(ignored), ignored[0] if ignored else None))


def _images_under(root: str, folder: str, ignored: list[str]) -> list[bytes]:
    found: list[bytes] = []
    for dirpath, _, filenames in sorted(os.walk(os.path.join(root, folder), followlinks=True)):
        relative = os.path.relpath(dirpath, root)
        for name in sorted(filenames):
            path = os.path.join(relative, name)
            if name.lower().endswith(IMAGE_EXTENSIONS):
                found.append(os.fsencode(path))
            else:
                ignored.append(os.path.join(root, path))
    return found
