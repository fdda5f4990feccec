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
import logging
import os
import re
import sys
import tarfile
import threading
from typing import Iterable, Iterator, Sequence

import numpy as np

from coordinated_prep.errors import DatasetError, SampleError
from coordinated_prep.pipeline.sources.remote import FETCHERS, fetched, is_url, list_shards
from coordinated_prep.pipeline.sources.shard_index import ShardIndex, is_shard_index, read_shard_index

logger = logging.getLogger(__name__)

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
        dataset: A directory of shards, one shard, a brace pattern, or a shard index's path or URL.
        names: Its shards (their URLs), where they were listed already (a sweep's listing of a folder
            URL); None: listed here.

    Raises:
        DatasetError: No shard, a missing shard, a file that is not a tar, a sample with no image
            member or no integer ``cls`` member (each named by shard and key, with the fix).
    """

    def __init__(self, dataset: str, names: Sequence[str] | None = None) -> None:
        dataset = local_path(dataset)
        remote = is_url(dataset)
        self.index: ShardIndex | None = read_shard_index(dataset) if is_shard_index(dataset) else None
        self.root = dataset if is_tar_pattern(dataset) or remote or self.index else os.path.abspath(
            os.path.expanduser(dataset))
        if self.index is not None:  # read as the epochs need them (the module docstring)
            self.urls: tuple[str, ...] = self.index.urls
            self._shards = _LazyShards(self.index)
            self.labels = _LazyLabels(self._shards)
            self._classes = self.index.classes
            return
        # what errors name: paths, or the URLs
        self.urls = tuple(shard_names(dataset) if names is None else names)
        paths = tuple(fetched(self.urls)) if remote else self.urls  # local paths
        self._shards = _Shards(paths, self.urls)
        self.labels = np.concatenate([s.labels for s in self._shards.loaded]) if paths else np.zeros(0, np.int64)
        self._classes = _classes(self.labels)

    @property
    def shards(self) -> tuple[str, ...]:
        """Each shard's local path (of its copy in the node's shard cache, for a URL): fetched first if missing."""
        self._shards.ensure(range(len(self.urls)))
        return tuple(self._shards.shard(s).path for s in range(len(self.urls)))

    @property
    def shard_sizes(self) -> tuple[int, ...] | None:
        """Samples per shard where the shards are read as the epochs need them (a shard index): the
        stream plan then takes shards in a seeded order (:class:`~coordinated_prep.plan.StreamPlan`);
        None where every shard is read at the start."""
        return None if self.index is None else self.index.counts

    @property
    def classes(self) -> tuple[str, ...]:
        """The class names: ``0``, ``1``, ... up to the largest label, unless a shard index names them
        (one that does not: known once every shard was read, which asking here does)."""
        if self._classes is None:
            logger.warning("shard index %s names no classes: reading its %d shards for their labels (name them in "
                           "its 'classes' key to start without that)", self.root, len(self.urls))
            self._classes = _classes(np.asarray(self.labels))
        return self._classes

    def __len__(self) -> int:
        return self._shards.total

    def read(self, index: int) -> bytes:
        """The image bytes of sample ``index`` (one positioned read)."""
        shard, j = self._locate(index)
        size = int(shard.sizes[j])
        try:
            with open(shard.path, "rb") as f:
                data = os.pread(f.fileno(), size, int(shard.offsets[j]))
        except OSError as e:
            raise SampleError(index, self.describe(index), f"cannot read the shard: {e}") from e
        if len(data) != size:
            raise SampleError(index, self.describe(index), f"the shard ends {size - len(data)} bytes into the image "
                              "(truncated since it was indexed); copy the shard again")
        return data

    def read_many(self, indices: Sequence[int]) -> list[bytes | SampleError]:
        """Per index, its image bytes or the SampleError reading it raised (a piece's shards that
        are not here yet fetched together first, as at a folder's start)."""
        self._shards.ensure(self._shards.find(self._checked(int(i)))[0] for i in indices)
        found: list[bytes | SampleError] = []
        for i in indices:
            try:
                found.append(self.read(int(i)))
            except SampleError as e:
                found.append(e)
        return found

    def describe(self, index: int) -> str:
        """``<shard path>#<key>`` of sample ``index``."""
        s, j = self._shards.find(self._checked(index))
        key = self._shards.key(s, j)
        return f"{self.urls[s]}#{key}"

    def _checked(self, index: int) -> int:
        n = len(self)
        i = index + n if index < 0 else index  # negative indices count from the end, as for ImageFolderSource
        if not 0 <= i < n:
            raise IndexError(f"sample index {index} out of range for the {n} samples of {self.root}")
        return i

    def _locate(self, index: int) -> tuple["_Shard", int]:
        s, j = self._shards.find(self._checked(index))
        return self._shards.shard(s), j


def _classes(labels: np.ndarray) -> tuple[str, ...]:
    return tuple(str(c) for c in range(int(labels.max()) + 1 if len(labels) else 0))


class _Shard:
    """One shard's local copy and, per sample in order, its image's offset and size, key and label."""

    def __init__(self, path: str, name: str) -> None:
        found = _index_shard(path, name)
        self.path = path
        self.offsets = np.asarray([f[1][0] for f in found], dtype=np.int64)
        self.sizes = np.asarray([f[1][1] for f in found], dtype=np.int64)
        self.keys = tuple(f[0] for f in found)
        self.labels = np.asarray([f[2] for f in found], dtype=np.int64)


class _Shards:
    """Every shard, indexed at the start (a folder, a pattern, a listed URL)."""

    def __init__(self, paths: Sequence[str], names: Sequence[str]) -> None:
        self.loaded = [_Shard(path, name) for path, name in zip(paths, names)]
        self._starts = np.cumsum([0] + [len(s.keys) for s in self.loaded])
        self.total = int(self._starts[-1])

    def find(self, i: int) -> tuple[int, int]:
        s = int(np.searchsorted(self._starts, i, side="right")) - 1
        return s, i - int(self._starts[s])

    def shard(self, s: int) -> _Shard:
        return self.loaded[s]

    def ensure(self, shards: Iterable[int]) -> None:
        """Have these shards here (all are, at the start)."""

    def key(self, s: int, j: int) -> str:
        return self.shard(s).keys[j]


class _LazyShards(_Shards):
    """The shards of an index: each fetched (a URL) and indexed on its first read in this process, and
    checked against the index's count. Not pickled: every process reads its own (the node's copies)."""

    def __init__(self, index: ShardIndex) -> None:
        self.index = index
        self._starts = np.cumsum([0, *index.counts])
        self.total = int(self._starts[-1])
        self.loaded = {}
        self._lock = threading.Lock()
        self._behind: Iterator[str] | None = None  # the shards left to fetch behind the reads

    def __getstate__(self) -> dict:
        return {"index": self.index, "_starts": self._starts, "total": self.total}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state, loaded={}, _lock=threading.Lock(), _behind=None)

    def shard(self, s: int) -> _Shard:
        found = self.loaded.get(s)
        if found is not None:
            return found
        url = self.index.urls[s]
        if is_url(url):  # outside the lock: threads fetch other shards meanwhile (each shard has its node lock)
            path = fetched([url])[0]
            self._start_behind()
        else:
            path = url
        with self._lock:  # a prep actor's threads read one piece's samples together
            if s not in self.loaded:
                if not os.path.isfile(path):
                    raise DatasetError(f"shard {url}, listed in the shard index {self.index.origin}, does not exist; "
                                       "fix its url in the index (relative to the index's folder or base_path)")
                shard = _Shard(path, url)
                if len(shard.keys) != self.index.counts[s]:
                    raise DatasetError(f"shard {url} holds {len(shard.keys)} samples, its index {self.index.origin} "
                                       f"says {self.index.counts[s]}; write the index again (widsindex create) "
                                       "after the shards changed")
                n = len(self.index.classes or ())
                if n and len(shard.labels) and shard.labels.max() >= n:  # labels are >= 0 (_label)
                    j = int(np.argmax(shard.labels >= n))
                    raise DatasetError(f"shard {url}: sample {shard.keys[j]!r} has class {shard.labels[j]}, but its index "
                                       f"{self.index.origin} names {n} classes (0 to {n - 1}); list every class in its "
                                       "'classes', or fix the shard's .cls files")
                self.loaded[s] = shard
        return self.loaded[s]

    def ensure(self, shards: Iterable[int]) -> None:
        """Fetch the missing ones of ``shards`` together, as a folder's are at its start.

        Raises:
            DatasetError: A shard could not be fetched (:func:`~coordinated_prep.pipeline.sources.remote.fetched`).
        """
        urls = self.index.urls
        remote = [urls[s] for s in sorted(set(shards)) if s not in self.loaded and is_url(urls[s])]
        if len(remote) > 1:  # one is fetched by its first read
            fetched(remote)
            self._start_behind()

    def _start_behind(self) -> None:
        """Once per process, the first shards being here: the others follow behind, in threads (not in
        a DataLoader worker: its trial's own process does that, and the workers come and go)."""
        torch = sys.modules.get("torch")
        if self._behind is not None or (torch is not None and torch.utils.data.get_worker_info() is not None):
            return
        with self._lock:
            if self._behind is None:
                self._behind = iter(urls := [u for u in self.index.urls if is_url(u)])
                for k in range(min(FETCHERS, len(urls))):
                    threading.Thread(target=self._fetch_behind, name=f"coordprep-behind-{k}", daemon=True).start()

    def _fetch_behind(self) -> None:
        """Shards into the node's shard cache, one at a time, until none is left: daemon threads (an executor's
        queue would hold the process's exit), so a process that is done exits, and a copy it cut short is
        replaced by the next fetcher. A read that needs a shard fetches it itself, or waits on its lock."""
        while True:
            with self._lock:
                if (url := next(self._behind, None)) is None:  # type: ignore[arg-type]
                    return
            try:
                fetched([url])
            except Exception as e:  # that shard's own read raises its error, naming it
                logger.info("fetching shard %s of %s behind the reads failed: %r", url, self.index.origin, e)

    def key(self, s: int, j: int) -> str:
        found = self.loaded.get(s)  # an error's description must not fetch the shard it names
        return found.keys[j] if found is not None else f"sample {j}"


class _LazyLabels:
    """The labels of a shard index's samples, each read with its shard (``np.asarray``: every shard)."""

    def __init__(self, shards: _LazyShards) -> None:
        self._shards = shards

    def __len__(self) -> int:
        return self._shards.total

    def __getitem__(self, index):
        if isinstance(index, (int, np.integer)):
            if not -len(self) <= index < len(self):  # before a shard is fetched for it
                raise IndexError(f"label index {index} out of range for the {len(self)} samples of {self._shards.index.origin}")
            s, j = self._shards.find(int(index) + (len(self) if index < 0 else 0))
            return self._shards.shard(s).labels[j]
        return np.asarray(self)[index]

    def __array__(self, dtype=None, copy=None):
        self._shards.ensure(range(len(self._shards.index.counts)))  # fetched together, not one after another
        every = np.concatenate([self._shards.shard(s).labels for s in range(len(self._shards.index.counts))])
        return every if dtype is None else every.astype(dtype)


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
