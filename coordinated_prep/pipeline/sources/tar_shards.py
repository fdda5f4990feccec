"""WebDataset tar shards: a sample is the consecutive files that share a key inside a tar.

The layout is WebDataset's (``webdataset.TarWriter`` writes it; so does ``coordprep convert
--format tar``): in each shard, consecutive members ``<key>.<ext>``, where the key is the member's
path up to the first dot of its file name. A sample's image is its first member whose extension is
an image's (:data:`IMAGE_EXTENSIONS`); its label is the integer in its ``cls`` member (as
``TarWriter`` writes ``{"cls": 3}``).

A dataset names its shards in one of these ways:

- a directory whose top level holds ``*.tar`` files and no subdirectory (sorted by name);
- one ``.tar`` file;
- a brace pattern, WebDataset's spelling: ``/data/train-{000000..000063}.tar`` (expanded in order);
- a URL of any of those (``s3://bucket/train-{0000..0063}.tar``, ``https://host/shards/``): each
  shard is fetched whole once per node (:mod:`coordinated_prep.pipeline.sources.remote`) and read
  from the node's copy.

Sample ``i`` is the ``i``-th key of the shards taken in that order, members in their order in the
tar. Construction reads every shard's headers once (a pass that skips the data: about 1 ms per
thousand members on a local disk) and keeps, per sample, its shard, the offset and size of its
image, and its label; a read is one positioned read of the image's bytes. Nothing is held open, so
the source can be built, pickled or inherited by a forked worker anywhere cheaply, as the contract
(:class:`~coordinated_prep.contracts.DataSource`) asks.
"""

from __future__ import annotations

import glob
import os
import re
import tarfile
from typing import Sequence

import numpy as np

from coordinated_prep.errors import DatasetError, SampleError
from coordinated_prep.pipeline.sources.remote import fetched, is_url, list_shards

#: Extensions of a sample's image member, in the order a sample's members are looked at.
IMAGE_EXTENSIONS = ("jpg", "jpeg", "png", "webp", "bmp", "ppm", "pgm", "tif", "tiff")
LABEL_EXTENSION = "cls"

_BRACES = re.compile(r"\{[^{}]*(\.\.|,)[^{}]*\}")
_KEY = re.compile(r"^((?:.*/|)[^./][^.]*)\.([^/]*)$")  # WebDataset's split: key up to the file name's first dot


def local_path(dataset: str) -> str:
    """``dataset`` with a ``file://`` scheme taken off (a local path); other names unchanged."""
    return dataset.removeprefix("file://") if dataset.startswith("file://") else dataset


def is_tar_pattern(dataset: str) -> bool:
    """Whether ``dataset`` is a brace pattern of shards (``...{0000..0063}.tar``)."""
    return bool(_BRACES.search(dataset))


def is_tar_dataset(dataset: str) -> bool:
    """Whether ``dataset`` names tar shards: a brace pattern, a ``.tar`` file, a directory with
    ``*.tar`` at its top level and no subdirectory (a folder with both is read as an ImageFolder), or
    a URL of any of those (a prefix ending in ``/`` for a folder)."""
    dataset = local_path(dataset)
    if is_tar_pattern(dataset) or (dataset.endswith(".tar") and (is_url(dataset) or os.path.isfile(dataset))):
        return True
    if is_url(dataset):
        return dataset.endswith("/")
    if not os.path.isdir(dataset):
        return False
    entries = list(os.scandir(dataset))
    return any(e.name.endswith(".tar") and e.is_file() for e in entries) and not any(e.is_dir() for e in entries)


def shard_names(dataset: str) -> list[str]:
    """The shards ``dataset`` names (paths, or URLs for a remote dataset), in sample order.

    Raises:
        DatasetError: A pattern that matches no file, a shard of it that is missing, or a remote
            folder that cannot be listed.
    """
    dataset = local_path(dataset)
    if is_url(dataset):
        if is_tar_pattern(dataset):
            from braceexpand import braceexpand

            return list(braceexpand(dataset))
        return list_shards(dataset) if dataset.endswith("/") else [dataset]
    if is_tar_pattern(dataset):
        from braceexpand import braceexpand

        paths = [os.path.abspath(os.path.expanduser(p)) for p in braceexpand(dataset)]
        missing = [p for p in paths if not os.path.isfile(p)]
        if missing:
            raise DatasetError(f"dataset {dataset!r}: {len(missing)} of its {len(paths)} shards are missing, first "
                               f"{missing[0]}; fix the pattern's range or copy the shards there")
        return paths
    root = os.path.abspath(os.path.expanduser(dataset))
    if os.path.isfile(root):
        return [root]
    paths = sorted(glob.glob(os.path.join(glob.escape(root), "*.tar")))
    if not paths:
        raise DatasetError(f"dataset {dataset!r} holds no *.tar shards")
    return paths


class TarShardSource:
    """The samples of WebDataset tar shards (see the module docstring).

    Args:
        dataset: A directory of shards, one shard, or a brace pattern.
        names: Its shards (their URLs), where they were listed already (a sweep's listing of a folder
            URL); None: listed here.

    Raises:
        DatasetError: No shard, a missing shard, a file that is not a tar, a sample with no image
            member or no integer ``cls`` member (each named by shard and key, with the fix).
    """

    def __init__(self, dataset: str, names: Sequence[str] | None = None) -> None:
        dataset = local_path(dataset)
        remote = is_url(dataset)
        self.root = dataset if is_tar_pattern(dataset) or remote else os.path.abspath(os.path.expanduser(dataset))
        # what errors name: paths, or the URLs
        self.urls: tuple[str, ...] = tuple(shard_names(dataset) if names is None else names)
        self.shards: tuple[str, ...] = tuple(fetched(self.urls)) if remote else self.urls  # local paths
        shard, offsets, sizes, labels, keys = [], [], [], [], []
        for s, (path, name) in enumerate(zip(self.shards, self.urls)):
            for key, (offset, size), label in _index_shard(path, name):
                shard.append(s)
                offsets.append(offset)
                sizes.append(size)
                labels.append(label)
                keys.append(key)
        self._shard = np.asarray(shard, dtype=np.int32)
        self._offset = np.asarray(offsets, dtype=np.int64)
        self._size = np.asarray(sizes, dtype=np.int64)
        self._keys: tuple[str, ...] = tuple(keys)
        self.labels = np.asarray(labels, dtype=np.int64)
        self.classes: tuple[str, ...] = tuple(str(c) for c in range(int(self.labels.max()) + 1 if len(labels) else 0))

    def __len__(self) -> int:
        return len(self._keys)

    def read(self, index: int) -> bytes:
        """The image bytes of sample ``index`` (one positioned read)."""
        i = self._locate(index)
        path = self.shards[int(self._shard[i])]
        size = int(self._size[i])
        try:
            with open(path, "rb") as f:
                data = os.pread(f.fileno(), size, int(self._offset[i]))
        except OSError as e:
            raise SampleError(index, self.describe(index), f"cannot read the shard: {e}") from e
        if len(data) != size:
            raise SampleError(index, self.describe(index), f"the shard ends {size - len(data)} bytes into the image "
                              "(truncated since it was indexed); copy the shard again")
        return data

    def read_many(self, indices: Sequence[int]) -> list[bytes | SampleError]:
        """Per index, its image bytes or the SampleError reading it raised."""
        found: list[bytes | SampleError] = []
        for i in indices:
            try:
                found.append(self.read(int(i)))
            except SampleError as e:
                found.append(e)
        return found

    def describe(self, index: int) -> str:
        """``<shard path>#<key>`` of sample ``index``."""
        i = self._locate(index)
        return f"{self.urls[int(self._shard[i])]}#{self._keys[i]}"

    def _locate(self, index: int) -> int:
        n = len(self)
        i = index + n if index < 0 else index  # negative indices count from the end, as for ImageFolderSource
        if not 0 <= i < n:
            raise IndexError(f"sample index {index} out of range for the {n} samples of {self.root}")
        return i


def _index_shard(path: str, name: str) -> list[tuple[str, tuple[int, int], int]]:
    """Per sample of shard ``path`` (named ``name`` in errors), in order: (key, (offset, size) of its
    image, label). A sample is a run of consecutive members with one key, as WebDataset groups them;
    a key that comes back after another, or an extension twice in one sample, is refused (WebDataset
    would read two samples, or fail)."""
    found: list[tuple[str, tuple[int, int], int]] = []
    seen: set[str] = set()
    try:
        with tarfile.open(path, "r:") as tar:  # "r:": uncompressed, as WebDataset's shards are read with seeks
            key, parts = None, {}
            for member in tar:
                match = _KEY.match(member.name) if member.isfile() else None
                if match is None:  # a file with no extension is part of no sample (WebDataset skips it too)
                    continue
                if member.issparse():  # its data lies in pieces: one positioned read would return other bytes
                    raise DatasetError(f"shard {name}, member {member.name!r} is a sparse file (GNU tar -S); write "
                                       "shards without --sparse, as webdataset.TarWriter does")
                if match.group(1) != key:
                    if key is not None:
                        found.append(_sample(tar, name, key, parts))
                    key, parts = match.group(1), {}
                    if key in seen:
                        raise DatasetError(f"shard {name}, sample {key!r}: its members are not consecutive (another "
                                           "sample's lie between them); write each sample's files one after another, "
                                           "as webdataset.TarWriter does")
                    seen.add(key)
                ext = match.group(2).lower()
                if ext in parts:
                    raise DatasetError(f"shard {name}, sample {key!r}: two {ext!r} members; a sample holds one file "
                                       "per extension")
                parts[ext] = member
            if key is not None:
                found.append(_sample(tar, name, key, parts))
    except (tarfile.TarError, OSError) as e:
        raise DatasetError(f"shard {name} is not a readable tar file ({e}); an uncompressed tar is needed "
                           "(write shards with webdataset.TarWriter or `coordprep convert --format tar`)") from e
    return found


def _sample(tar: tarfile.TarFile, name: str, key: str,
            parts: dict[str, tarfile.TarInfo]) -> tuple[str, tuple[int, int], int]:
    image = next((parts[e] for e in IMAGE_EXTENSIONS if e in parts), None)
    if image is None:
        raise DatasetError(f"shard {name}, sample {key!r}: no image member (has {sorted(parts)}; one of "
                           f"{list(IMAGE_EXTENSIONS)} is needed)")
    return key, (image.offset_data, image.size), _label(tar, name, key, parts)


def _label(tar: tarfile.TarFile, name: str, key: str, parts: dict[str, tarfile.TarInfo]) -> int:
    member = parts.get(LABEL_EXTENSION)
    if member is None:
        raise DatasetError(f"shard {name}, sample {key!r}: no {LABEL_EXTENSION!r} member with its class index (has "
                           f"{sorted(parts)}); write one per sample, as webdataset.TarWriter does with "
                           "{'__key__': ..., 'jpg': ..., 'cls': 3}")
    text = tar.extractfile(member).read(64)  # type: ignore[union-attr]  (a file member)
    try:
        label = int(text.decode("ascii").strip())
    except (UnicodeDecodeError, ValueError):
        label = -1
    if label < 0:
        raise DatasetError(f"shard {name}, sample {key!r}: its {LABEL_EXTENSION!r} member holds {text[:32]!r}, not "
                           "a class index (an integer >= 0)")
    return label
