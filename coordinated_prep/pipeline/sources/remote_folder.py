"""An ImageFolder in object storage (``s3://bucket/photos/``, ``http://host/photos/``): raw files, each
fetched once per node.

The layout is torchvision's ImageFolder, ``<url>/<class>/**/<file>``, with a local folder's image
extensions. Opening lists the tree (on S3 one paged listing of the prefix; over HTTP one request per
folder, reading the server's directory pages, each asked for with its trailing slash) and indexes it as ImageFolder walks a local copy:
classes sorted, and in each class the files sorted by folder, then by name. So index ``i`` names the
same file as a local ImageFolder of the same tree, and the same bytes.

Reading (:meth:`RemoteFolderSource.read_many`, a piece at a time): the files this node has no copy of
are fetched together, up to :data:`BATCH` at a time (fsspec's ``cat_ranges``: concurrent requests of
literal paths, so a piece of 256 files costs a few round trips, not 256), each into the node's shard
cache (``$COORDPREP_CACHE/shards/folder-<key>/``).
Every process of the node, every later epoch and every later sweep read the local copy: one GET per
file and node for the whole sweep (CoorDL's argument for a node cache). One process of the node
fetches a given file: it holds the copy's ``flock`` while it fetches (taken without waiting, for
every missing file of the piece at once); the files another process holds are waited for only
after this process has released its own (so no wait forms a cycle; each wait is bounded by
:data:`~coordinated_prep.pipeline.sources.remote.LOCK_WAIT_S`), then read from the copy, or fetched
here if that holder failed. A copy is written to ``<copy>.part`` and renamed, so it exists whole or
not at all; it is not synced, so one that a crash left short of the size the listing gives (S3's) is
fetched again.

Failures: a file the store says does not exist (listed at opening, deleted since) is that sample's
:class:`~coordinated_prep.errors.SampleError`, skipped as a corrupt image is. Any other failure (a
whole call that failed included, or a copy shorter than the listing's size) is retried, at most
:data:`~coordinated_prep.pipeline.sources.remote.ATTEMPTS` fetches in all with a backoff, then raised
as a :class:`~coordinated_prep.errors.DatasetError` naming the URLs and the fix. A class folder with
no image is refused, as a local ImageFolder's is.

Processes: the filesystem is looked up again in a forked process (fsspec's are not fork-safe), so a
``DataLoader``'s forked workers read too. In a sweep the tree is listed once for the whole sweep: the
group registry lists it (:func:`listing`), in its own process on the driver's node with that node's
fsspec and credentials, and keeps the result in the object store; every process of the sweep's job
that opens the folder (coordinators, prep actors on any node) borrows it
(:mod:`~coordinated_prep.pipeline.sources.shared_index`). Outside a sweep each process lists it itself.
(A folder of tar shards is listed once per sweep too: its shards' URLs.)

Versions: a copy is named after its URL and, where the listing gives them (S3), the file's size and
ETag, so a file replaced at its URL is fetched again. An HTTP directory page gives neither: delete
the folder's copy (``folder-<key>``) to read such files again.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import logging
import os
import posixpath
import time
import urllib.parse
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Sequence

import numpy as np

from coordinated_prep.errors import DatasetError, SampleError
from coordinated_prep.pipeline.sources import remote
from coordinated_prep.pipeline.sources.folder_index import IMAGE_EXTENSIONS

logger = logging.getLogger(__name__)

BATCH = 64  # missing files fetched (and locked) at once: bounds a process's open lock files
MAX_DEPTH = 64  # levels of folders an HTTP listing follows: a server whose pages link into themselves ends here

_FIX = ("check the URL and that the credentials (AWS_* variables, ~/.aws; AWS_ENDPOINT_URL for an S3-compatible "
        "server) reach every node")


def is_remote_folder(dataset: str) -> bool:
    """Whether ``dataset`` is a URL of a folder: neither a tar pattern, nor a ``.tar``, nor a Parquet
    manifest (tar shards or an ImageFolder: :func:`open_remote_folder` lists it to tell)."""
    from coordinated_prep.pipeline.sources.tar_shards import is_tar_pattern

    return (remote.is_url(dataset) and not dataset.startswith("file://") and not is_tar_pattern(dataset)
            and not dataset.endswith((".tar", ".json")))


def open_remote_folder(url: str) -> Any:
    """The dataset a folder URL holds: tar shards if ``*.tar`` files lie at its top (as a local folder
    of shards), otherwise an ImageFolder (:class:`RemoteFolderSource`), from the sweep's listing of it
    (listed here outside a sweep).

    Raises:
        DatasetError: The folder cannot be listed, or holds neither (names the URL and what it may hold).
    """
    from coordinated_prep.pipeline.sources.shared_index import shared_index

    found = shared_index(url)
    if found is None:
        found = listing(url)
    if isinstance(found, tuple):  # (TAR, its shards' URLs)
        from coordinated_prep.pipeline.sources.tar_shards import TarShardSource

        return TarShardSource(url if url.endswith("/") else url + "/", names=found[1])
    return RemoteFolderSource(url, found)


#: What :func:`listing` gives first for a folder of tar shards, with their URLs.
TAR = "tar shards"


def listing(url: str) -> Any:
    """The tree under folder ``url`` (:func:`_tree`: path -> its type, size and version, folders
    included), or ``(TAR, URLs of its shards)`` where ``*.tar`` files lie at its top.

    Raises:
        DatasetError: The folder cannot be listed, or holds neither (names the URL and what it may hold).
    """
    fs, root, top = _top(url)
    shards = remote.shard_urls(fs, root, top)
    if shards:  # from the same request: the folder's top is read once
        return TAR, shards
    files = [e["name"].rsplit("/", 1)[-1] for e in top if e["type"] != "directory"]
    if "coordprep-parquet.json" in files:
        raise DatasetError(f"dataset {url!r} holds no *.tar shards; a Parquet dataset in object storage is named by "
                           f"its manifest's URL ({url.rstrip('/')}/coordprep-parquet.json)")
    if not any(e["type"] == "directory" for e in top):
        raise DatasetError(f"dataset {url!r} holds no class folders and no *.tar shards: a folder in object storage "
                           "is read as an ImageFolder (<url>/<class>/<image>) or as WebDataset tar shards (*.tar at "
                           "its top); a Parquet dataset is named by its manifest's URL (.../coordprep-parquet.json)")
    return _tree(fs, root, url, top)


def _top(url: str) -> tuple[Any, str, list[dict]]:
    """Folder ``url``'s filesystem, path and top entries: one request.

    Raises:
        DatasetError: Nothing is listed under it, or it cannot be listed (names the URL, the cause and the fix).
    """
    fs, root = remote._filesystem(url)
    root = root.rstrip("/")
    try:
        return fs, root, remote.list_folder(fs, root)
    except FileNotFoundError:
        raise DatasetError(f"dataset {url!r} does not exist (nothing is listed under it); check the URL") from None
    except Exception as e:  # each filesystem raises its own errors (ClientError, aiohttp's, OSError)
        raise DatasetError(f"dataset {url!r}: cannot list it ({e!r}); {_FIX}") from e


def reach(url: str) -> None:
    """One request showing that dataset ``url`` can be read from this process, as a sweep asks before
    Ray starts: a folder's top listing, or the details of a shard or a manifest (a pattern's first shard).

    Raises:
        DatasetError: It does not exist or cannot be reached (names the URL, the cause and the fix).
    """
    from coordinated_prep.pipeline.sources.tar_shards import is_tar_pattern, shard_names

    if is_remote_folder(url):
        _top(url)
        return
    first = shard_names(url)[0] if is_tar_pattern(url) else url
    fs, path = remote._filesystem(first)
    try:
        fs.info(path)
    except FileNotFoundError as e:  # over HTTP also a server that cannot be reached: fsspec says so with the cause
        cause = f" ({e.__cause__!r})" if e.__cause__ is not None else ""
        raise DatasetError(f"dataset {url!r}: {first!r} does not exist or cannot be reached{cause}; {_FIX}") from e
    except Exception as e:  # each filesystem raises its own errors
        raise DatasetError(f"dataset {url!r}: cannot reach {first!r} ({e!r}); {_FIX}") from e


#: What a listing keeps of each entry's details: what indexing and naming a copy read.
_LISTED = ("type", "size", "ETag", "etag", "LastModified")


def _tree(fs: Any, root: str, url: str, top: list[dict] | None = None) -> dict[str, dict]:
    """Every path under ``root`` (folders included), with the details :data:`_LISTED` of each.

    A store with a listing of its own (S3, GCS) is asked once for the whole prefix (fsspec's
    ``find``, paged). An HTTP server's folders are pages: each is read once (its trailing slash
    asked for, so no redirect), a level of the tree at a time, up to ``remote.FETCHERS`` pages at
    once, starting from ``top`` (the root's page, if read already).
    """
    if not remote.serves_pages(fs):
        try:
            found = fs.find(root, detail=True, withdirs=True)
        except Exception as e:
            raise DatasetError(f"dataset {url!r}: cannot list it ({e!r}); {_FIX}") from e
        return {path: {k: info[k] for k in _LISTED if k in info} for path, info in found.items()}

    def page(folder: str) -> list[dict]:
        try:
            return remote.list_folder(fs, folder)
        except Exception as e:
            raise DatasetError(f"dataset {url!r}: cannot list its folder {folder!r} ({e!r}); {_FIX}") from e

    found: dict[str, dict] = {}
    level, pages = [root + "/"], {root + "/": top} if top is not None else {}
    seen = set(level)  # a page read once, however many pages link it
    with ThreadPoolExecutor(remote.FETCHERS) as pool:
        for _ in range(MAX_DEPTH + 1):
            if not level:
                return found
            unread = [f for f in level if f not in pages]
            pages.update(zip(unread, pool.map(page, unread)))
            below = []
            for folder in level:
                for entry in pages.pop(folder):
                    if not _below(entry["name"], folder):
                        continue
                    found[entry["name"]] = {k: entry[k] for k in _LISTED if k in entry}
                    if entry["type"] == "directory" and entry["name"] not in seen:  # fsspec keeps links below the page
                        seen.add(entry["name"])
                        below.append(entry["name"])
            level = sorted(below)
    raise DatasetError(f"dataset {url!r}: folders nest deeper than {MAX_DEPTH} levels under it (e.g. {level[0]!r}): "
                       "a server whose pages link into themselves (a symlink loop); serve a tree of folders")


class RemoteFolderSource:
    """The raw files of an ImageFolder at ``url`` (see the module docstring).

    Args:
        url: The folder's URL (``s3://bucket/photos``, ``http://host/photos/``).
        found: Its tree as :func:`listing` gives it (the sweep's); None: listed here.

    Raises:
        DatasetError: The folder cannot be listed, has no class folders, or a class has no images.
    """

    def __init__(self, url: str, found: dict[str, dict] | None = None) -> None:
        self.root = url
        root = remote._filesystem(url)[1].rstrip("/")
        if found is None:
            found = _tree(self.fs, root, url)
        files, ignored, folders = [], [], set()
        for path, info in found.items():
            if path.rstrip("/") == root:
                continue  # the folder itself
            relative = _relative(path, root, url)
            if "/" not in relative:
                if info.get("type") == "directory":
                    folders.add(relative)
                continue  # a file at the top belongs to no class (ImageFolder ignores it too)
            folders.add(relative.split("/", 1)[0])
            if info.get("type") == "directory":
                continue
            if not relative.lower().endswith(IMAGE_EXTENSIONS):
                ignored.append(relative)
                continue
            folder, name = posixpath.split(relative)
            files.append((folder.split("/", 1)[0], folder, name, path, info))
        if ignored:
            logger.warning("dataset %s: ignoring %d file(s) without an image extension %s, e.g. %s", url, len(ignored),
                           list(IMAGE_EXTENSIONS), ignored[0])
        if not files:
            raise DatasetError(f"dataset {url!r}: no images in class folders (<url>/<class>/<image>, extensions "
                               f"{list(IMAGE_EXTENSIONS)}); check the URL")
        empty = sorted(folders - {f[0] for f in files})
        if empty:
            raise DatasetError(f"dataset {url!r}: class folder {empty[0]!r} holds no images with extensions "
                               f"{list(IMAGE_EXTENSIONS)}; add images or remove the folder")
        files.sort(key=lambda f: (f[0], f[1], f[2]))
        self.classes: tuple[str, ...] = tuple(sorted(folders))
        label = {c: k for k, c in enumerate(self.classes)}
        self.labels = np.asarray([label[f[0]] for f in files], dtype=np.int64)
        self._paths = [f[3] for f in files]
        self._sizes = [f[4].get("size") for f in files]  # None where the listing gives none (HTTP)
        key = hashlib.sha256(url.rstrip("/").encode()).hexdigest()[:16]
        self.folder = os.path.join(remote.shard_cache_dir(), f"folder-{key}")
        os.makedirs(self.folder, exist_ok=True)
        self._copies = [os.path.join(self.folder, _copy_name(f[3], f[4])) for f in files]

    @property
    def fs(self) -> Any:
        """The URL's fsspec filesystem, looked up again in a forked process (fsspec's are not fork-safe)."""
        if getattr(self, "_fs_pid", None) != os.getpid():
            self._fs, self._fs_pid = remote._filesystem(self.root)[0], os.getpid()
        return self._fs

    def __getstate__(self) -> dict:
        """Without the filesystem: the process it goes to looks its own up."""
        return {k: v for k, v in self.__dict__.items() if k not in ("_fs", "_fs_pid")}

    def __len__(self) -> int:
        return len(self._paths)

    def describe(self, index: int) -> str:
        """The URL of sample ``index``."""
        return self.fs.unstrip_protocol(self._paths[index])

    def read(self, index: int) -> bytes:
        """The bytes of sample ``index`` (fetched first if this node has no copy)."""
        (data,) = self.read_many([index])
        if isinstance(data, SampleError):
            raise data
        return data

    def read_many(self, indices: Sequence[int]) -> list[bytes | SampleError]:
        """Per index, in order, its bytes or its :class:`SampleError`; the missing files fetched together.

        Raises:
            DatasetError: A file could not be fetched in ``ATTEMPTS`` attempts (names it and the fix).
        """
        got: dict[int, bytes | SampleError] = {}
        for i in dict.fromkeys(indices):
            data = _local(self._copies[i], self._sizes[i])
            if data is not None:
                got[i] = data
        missing = [i for i in dict.fromkeys(indices) if i not in got]
        if missing:
            got.update(self._fetch(missing))
        return [got[i] for i in indices]

    def _fetch(self, indices: list[int]) -> dict[int, bytes | SampleError]:
        """Fetch ``indices``' files under their copies' locks, :data:`BATCH` at a time."""
        got: dict[int, bytes | SampleError] = {}
        for start in range(0, len(indices), BATCH):
            got.update(self._fetch_batch(indices[start:start + BATCH]))
        return got

    def _fetch_batch(self, indices: list[int]) -> dict[int, bytes | SampleError]:
        """Those whose locks are free now are fetched at once; then the others, waited for holding nothing."""
        mine: dict[int, Any] = {}
        others = []
        got: dict[int, bytes | SampleError] = {}
        try:
            try:
                for i in indices:
                    lock = open(self._copies[i] + ".lock", "a+b")
                    try:
                        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
                        mine[i] = lock
                    except BlockingIOError:
                        lock.close()
                        others.append(i)
                    except BaseException:
                        lock.close()
                        raise
                for i in mine:  # a holder that was just done left its copy
                    data = _local(self._copies[i], self._sizes[i])
                    if data is not None:
                        got[i] = data
                got.update(self._download([i for i in mine if i not in got]))
            finally:
                for lock in mine.values():
                    fcntl.flock(lock, fcntl.LOCK_UN)
                    lock.close()
            for i in others:  # another process of the node is fetching it: wait for it, holding nothing
                with remote.node_lock(self._copies[i] + ".lock", f"file {self.describe(i)}"):
                    data = _local(self._copies[i], self._sizes[i])
                    got.update({i: data} if data is not None else self._download([i]))  # that holder failed
        except OSError as e:  # the node's cache (no room, too many open files): not the store's
            raise DatasetError(f"dataset {self.root}: the node's copies in {self.folder} cannot be written or locked "
                               f"({e}); free space there or put $COORDPREP_CACHE on a local disk") from e
        return got

    def _download(self, indices: list[int]) -> dict[int, bytes | SampleError]:
        """Fetch ``indices``' files (the caller holds their locks), all at once, retrying the failed ones."""
        got: dict[int, bytes | SampleError] = {}
        errors: dict[int, BaseException] = {}
        left = indices
        for attempt in range(remote.ATTEMPTS):
            if not left:
                break
            if attempt:
                time.sleep(remote.BACKOFF_S * 2 ** (attempt - 1))  # a backoff between attempts, not a wait for anyone
            paths = [self._paths[i] for i in left]
            try:  # literal paths (cat would glob a name with * ? or [), answered in order
                answers = self.fs.cat_ranges(paths, [None] * len(paths), [None] * len(paths), on_error="return")
            except Exception as e:  # the whole call failed: retried, never taken for a missing file
                answers = [ConnectionError(f"the request failed: {e!r}")] * len(paths)
            retry = []
            for i, answer in zip(left, answers):
                size = self._sizes[i]
                if isinstance(answer, bytes) and size is not None and len(answer) != size:
                    answer = ValueError(f"got {len(answer)} bytes of {size}")
                if isinstance(answer, bytes):
                    _keep(self._copies[i], answer)
                    got[i] = answer
                elif isinstance(answer, FileNotFoundError):
                    got[i] = SampleError(i, self.describe(i), "the store has no such file (it was listed when the "
                                                              "dataset was opened)")
                else:
                    errors[i] = answer if isinstance(answer, BaseException) else ValueError(f"no answer: {answer!r}")
                    retry.append(i)
            if retry:
                logger.warning("fetching %d file(s) of %s failed (attempt %d of %d), e.g. %s: %r", len(retry),
                               self.root, attempt + 1, remote.ATTEMPTS, self.describe(retry[0]), errors[retry[0]])
            left = retry
        if left:
            named = ", ".join(self.describe(i) for i in left[:remote.NAMED])
            more = f" and {len(left) - remote.NAMED} more" if len(left) > remote.NAMED else ""
            raise DatasetError(f"dataset {self.root}: {len(left)} file(s) could not be fetched in {remote.ATTEMPTS} "
                               f"attempts ({named}{more}), last error {errors[left[0]]!r}; {_FIX}") from errors[left[0]]
        return got


def _below(link: str, folder: str) -> bool:
    """Whether a page's ``link`` names something below ``folder``: fsspec keeps the links that start with
    the page's URL, and an escaped ``%2E%2E/`` (``../`` to the server), ``./`` or ``//`` do."""
    if not link.startswith(folder):
        return False
    rest = urllib.parse.unquote(link[len(folder):]).rstrip("/")
    return bool(rest) and all(part not in ("", ".", "..") for part in rest.split("/"))


def _relative(path: str, root: str, url: str) -> str:
    """``path`` under ``root``, its URL escapes decoded (an HTTP listing's names are escaped)."""
    if not path.startswith(root + "/"):
        raise DatasetError(f"dataset {url!r}: its listing names {path!r}, which is not under it (a server that "
                           "links elsewhere, http against https?); serve the folder's files under its URL")
    relative = path[len(root) + 1:]
    return urllib.parse.unquote(relative) if "://" in root else relative


def _copy_name(path: str, info: dict) -> str:
    """A copy's file name: after the file's path and, where the listing gives them, its size and tag."""
    version = "{}:{}".format(info.get("size"), info.get("ETag") or info.get("etag") or info.get("LastModified") or "")
    extension = os.path.splitext(path)[1][:8]
    return hashlib.sha256(f"{path}\0{version}".encode()).hexdigest()[:24] + extension


def _local(copy: str, size: int | None) -> bytes | None:
    """The node's copy; None where there is none, or where it is not the ``size`` the listing gives:
    copies are renamed into place whole but not synced (a sync per file would cost more than the
    file), so a machine that went down may have left one short or empty; it is fetched again."""
    try:
        with open(copy, "rb") as f:
            data = f.read()
    except FileNotFoundError:
        return None
    if size is None:  # an HTTP listing gives no size: at least not a copy the machine left empty
        return data or None
    return data if len(data) == size else None


def _keep(copy: str, data: bytes) -> None:
    """Write the node's copy whole or not at all (the caller holds its lock)."""
    part = copy + ".part"
    try:
        with open(part, "wb") as f:
            f.write(data)
        os.replace(part, copy)
    except OSError:  # no room: no torn .part left behind
        with contextlib.suppress(OSError):
            os.remove(part)
        raise
