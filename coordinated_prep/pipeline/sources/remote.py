"""Shards in object storage (``s3://``, ``gs://``, ``http(s)://``, any fsspec URL), fetched once per node:
WebDataset tar shards, and the Parquet shards of a dataset ``coordprep convert`` wrote (named by the
URL of its manifest, :func:`fetched_parquet`).

A tar shard's headers lie between its members, so indexing a shard reads all of it: a remote shard
is fetched whole, once, into the node's shard cache (``$COORDPREP_CACHE/shards``, on local disk),
and every process of the node (coordinator, prep actors, trials, their loader workers) indexes and
reads the local copy. That is CoorDL's argument for a node cache, at the granularity object storage
serves well: one GET per shard per node for the whole sweep, however many trials and epochs.

Fetching, per shard: look up its size and version (ETag or modification time: the copy is named
after them, so a shard replaced at its URL is fetched anew), take the copy's lock file (``flock``;
the kernel releases it if its holder dies; a waiter gives up once the holder's ``.part`` has not
grown for :data:`LOCK_WAIT_S`, naming the lock, should a live holder hang), return the copy if an
earlier holder left it, else fetch into ``<copy>.part`` in at most :data:`ATTEMPTS` attempts
(fsspec's own timeouts bound each; a full disk here ends them at once, named), then ``fsync`` and
rename it into place: a copy either exists whole or not at all. A holder that gives up leaves its
error in ``<copy>.failed``; the processes that waited for it raise that error instead of trying
again each (a process that opens the shard later does try again). Credentials come from where each
filesystem looks (``AWS_*`` variables and ``~/.aws`` for ``s3://`` through s3fs,
``AWS_ENDPOINT_URL`` for an S3-compatible server).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import glob
import hashlib
import logging
import os
import re
import shutil
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Sequence

from coordinated_prep.errors import DatasetError

logger = logging.getLogger(__name__)

ATTEMPTS = 3  # fetches of one shard before its error is raised
BACKOFF_S = 0.5  # wait before the second attempt; doubled before each later one
_LOCAL_FULL = (errno.ENOSPC, errno.EDQUOT, errno.EROFS)  # a copy that cannot be written here
LOCK_WAIT_S = 1800.0  # longest wait for another process of the node fetching the same shard, writing nothing
FETCHERS = 16  # shards a process fetches (or looks up) at once
NAMED = 5  # shards that could not be fetched named in one error (the others counted)

_URL = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*://")


def is_url(dataset: str) -> bool:
    """Whether ``dataset`` is a URL (``file://`` included)."""
    return bool(_URL.match(dataset))


def shard_cache_dir() -> str:
    """The node's shard cache: ``$COORDPREP_CACHE/shards`` (``~/.cache/coordinated_prep/shards``)."""
    from coordinated_prep.pipeline.sources.shapes import cache_dir

    return os.path.join(cache_dir(), "shards")


def list_shards(url: str) -> list[str]:
    """The ``*.tar`` objects under ``url`` (a prefix ending in ``/``), sorted: one listing request.

    Raises:
        DatasetError: The listing failed or found no shard (names the URL and the fix).
    """
    fs, path = _filesystem(url)
    try:
        entries = list_folder(fs, path)
    except Exception as e:  # each filesystem raises its own errors (ClientError, aiohttp's, OSError)
        raise DatasetError(f"dataset {url!r}: cannot list its shards ({e!r}); check the URL and the "
                           "credentials, or name the shards with a pattern such as 'train-{0000..0063}.tar'") from e
    found = shard_urls(fs, path, entries)
    if not found:
        raise DatasetError(f"dataset {url!r} holds no *.tar shards; a Parquet dataset in object storage is named by "
                           f"its manifest's URL ({url.rstrip('/')}/coordprep-parquet.json)")
    return found


def list_folder(fs, path: str) -> list[dict]:
    """The entries at the top of folder ``path`` (fsspec's ``ls``, with details): one request. Over
    HTTP the folder's page is asked for with its trailing slash: without one a server answers with a
    redirect to it, a second request per folder."""
    return fs.ls(path.rstrip("/") + "/" if serves_pages(fs) else path.rstrip("/"), detail=True)


def serves_pages(fs) -> bool:
    """Whether ``fs`` lists a folder by reading its page (HTTP), not with a listing of its own (S3, GCS)."""
    return "http" in (fs.protocol if isinstance(fs.protocol, (tuple, list)) else (fs.protocol,))


def shard_urls(fs, path: str, entries: list[dict]) -> list[str]:
    """The URLs of the ``*.tar`` files at the top of folder ``path`` among its ``entries``
    (:func:`list_folder`; a page may link deeper, and S3 lists a prefix with no children as itself), sorted."""
    top = path.rstrip("/")
    return sorted(fs.unstrip_protocol(e["name"]) for e in entries if e.get("type") != "directory"
                  and e["name"].endswith(".tar") and e["name"].rsplit("/", 1)[0] == top)


def fetched(urls: Sequence[str]) -> list[str]:
    """Per URL, the local path of its copy in the node's shard cache, fetched first if missing.

    Raises:
        DatasetError: A shard could not be fetched in :data:`ATTEMPTS` attempts (names the URL,
            the last error and the fix); where several could not, how many, and the first
            :data:`NAMED` of them (so that one run shows every URL to fix).
    """
    folder = shard_cache_dir()
    os.makedirs(folder, exist_ok=True)
    if len(urls) < 2:
        return [_fetch(url, folder) for url in urls]
    # Up to FETCHERS shards at once: each costs a request's latency or more (a HEAD for its version,
    # then a GET if this node lacks it), which one after another add up (64 shards at 50 ms: 3 s of HEADs
    # alone). The pool's exit waits for every fetch, each bounded by ATTEMPTS and fsspec's timeouts.
    with ThreadPoolExecutor(min(FETCHERS, len(urls)), thread_name_prefix="coordprep-fetch") as pool:
        done = [pool.submit(_fetch, url, folder) for url in urls]
    failed = [(url, f.exception()) for url, f in zip(urls, done) if f.exception() is not None]
    if any(not isinstance(e, DatasetError) for _, e in failed):  # a bug of ours, not a shard's: as it is
        raise next(e for _, e in failed if not isinstance(e, DatasetError))
    if len(failed) == 1:
        raise failed[0][1]
    if failed:
        named = ", ".join(url for url, _ in failed[:NAMED]) + (f" and {len(failed) - NAMED} more"
                                                                if len(failed) > NAMED else "")
        raise DatasetError(f"{len(failed)} of {len(urls)} shards could not be fetched ({named}); the first: "
                           f"{failed[0][1]}") from failed[0][1]
    return [f.result() for f in done]


def _fetch(url: str, folder: str) -> str:
    fs, remote = _filesystem(url)
    # The copy is named after the shard's version as well (size and ETag or modification time: one
    # HEAD or stat per shard and opening process), so a shard replaced at its URL is fetched again.
    version = _version(fs, remote, url)
    name = hashlib.sha256(f"{url}\0{version}".encode()).hexdigest()[:16] + "-" + os.path.basename(url.rstrip("/"))
    path = os.path.join(folder, name)
    if os.path.exists(path):
        return path
    asked = time.time()
    with node_lock(path + ".lock", f"shard {url}", progress=path + ".part"):
        if os.path.exists(path):
            return path  # an earlier holder fetched it
        failed = path + ".failed"
        if os.path.exists(failed) and os.path.getmtime(failed) >= asked:
            # The holder this process waited for gave up while it waited: its error, not 3 more GETs
            # per waiting process. A process that asks later tries again (an outage may be over).
            with open(failed) as f:
                raise DatasetError(f.read())
        part = path + ".part"  # one name per copy: what a killed holder left is replaced by the next
        last: BaseException | None = None
        for attempt in range(ATTEMPTS):
            if attempt:
                time.sleep(BACKOFF_S * 2 ** (attempt - 1))  # a backoff between attempts, not a wait for anyone
            try:
                started = time.perf_counter()
                _download(fs, remote, part)
                with open(part, "rb") as f:
                    os.fsync(f.fileno())
                os.replace(part, path)
                if os.path.exists(failed):  # an earlier holder's failure, older than every waiter now
                    os.remove(failed)
                logger.info("fetched %s into the node's shard cache (%d bytes, %.2f s)", url, os.path.getsize(path),
                            time.perf_counter() - started)
                return path
            except Exception as e:  # each filesystem raises its own errors; all are retried alike but a full disk
                if isinstance(e, OSError) and e.errno in _LOCAL_FULL:  # here, not the store's: no retry helps
                    raise DatasetError(f"shard {url}: the node's shard cache {os.path.dirname(path)} cannot hold it "
                                       f"({e}); free space there or point $COORDPREP_CACHE at a larger local "
                                       "disk") from e
                last = e
                logger.warning("fetching %s failed (attempt %d of %d): %r", url, attempt + 1, ATTEMPTS, e)
            finally:
                if os.path.exists(part):
                    os.remove(part)
        message = (f"shard {url}: could not be fetched in {ATTEMPTS} attempts, last error {last!r}; check that the "
                   "URL exists and the credentials (AWS_* variables, ~/.aws; AWS_ENDPOINT_URL for an S3-compatible "
                   "server) reach every node")
        try:  # for the processes waiting on the lock now (above); without it, each tries again itself
            with open(failed + ".tmp", "w") as f:
                f.write(message)
            os.replace(failed + ".tmp", failed)
        except OSError as e:
            logger.warning("could not leave the error of %s for the node's other openers: %r", url, e)
    raise DatasetError(message)


def fetched_parquet(manifest_url: str) -> str:
    """A Parquet dataset in object storage, named by its manifest's URL (``.../coordprep-parquet.json``,
    as ``coordprep convert`` wrote it), fetched whole into the node's shard cache: the manifest, then
    every shard it lists, each once per node and looked up by every opener, as a tar shard is
    (:func:`fetched`: a file replaced at its URL is fetched again). Returns a local directory that
    :class:`~coordinated_prep.pipeline.sources.parquet.ParquetSource` reads: hard links to the copies,
    laid out as the manifest says, named after the copies (so after every file's version). Built
    under a temporary name and renamed into place, so it exists whole or not at all; a process that
    finds it made by another uses that one. What a killed builder left is removed by the next one
    after :data:`LOCK_WAIT_S`.

    Raises:
        DatasetError: The manifest or a shard could not be fetched, the manifest is not one, or the
            node's cache cannot hold hard links (names the URL and the fix).
    """
    from coordinated_prep.pipeline.sources.manifest import MANIFEST, read_manifest

    base = manifest_url.rsplit("/", 1)[0]
    try:
        [manifest] = fetched([manifest_url])
    except DatasetError as e:
        raise DatasetError(f"dataset {manifest_url}: its manifest (what `coordprep convert` writes beside the "
                           f"shards) could not be read: {e}") from None
    cache = os.path.dirname(manifest)
    prefix = "parquet-" + hashlib.sha256(manifest_url.encode()).hexdigest()[:16]
    for left in glob.glob(os.path.join(cache, prefix + ".tmp-*")):  # a builder killed midway (never a live one:
        found = _state(left)  # a builder makes its folder after the fetch); None: another opener's, gone since
        if found is not None and time.time() - found[1] / 1e9 > LOCK_WAIT_S:
            shutil.rmtree(left, ignore_errors=True)
    with _staging(cache, prefix) as staging:  # the manifest read where it would lie, each file's path checked
        try:
            os.link(manifest, os.path.join(staging, MANIFEST))
            entries = read_manifest(staging)["shards"]
        except DatasetError as e:
            raise DatasetError(str(e).replace(staging, base)) from None
        except OSError as e:
            raise _no_links(manifest_url, cache, e) from e
    copies = fetched([f"{base}/{entry['file']}" for entry in entries])  # may take long: no folder of ours waits
    name = hashlib.sha256("\0".join([manifest, *copies]).encode()).hexdigest()[:16]
    folder = os.path.join(cache, f"{prefix}-{name}")
    if os.path.isdir(folder):
        return folder
    with _staging(cache, prefix) as staging:
        try:
            for source, target in [(manifest, MANIFEST), *((c, e["file"]) for c, e in zip(copies, entries))]:
                target = os.path.join(staging, target)
                if os.path.dirname(target) != staging:
                    os.makedirs(os.path.dirname(target), exist_ok=True)
                os.link(source, target)
            os.rename(staging, folder)
        except OSError as e:
            if not os.path.isdir(folder):  # else another process of the node renamed its own first: the same files
                raise _no_links(manifest_url, cache, e) from e
    return folder


@contextlib.contextmanager
def _staging(cache: str, prefix: str):
    """A new folder in ``cache`` to build in, removed at the end unless it was renamed."""
    staging = tempfile.mkdtemp(dir=cache, prefix=prefix + ".tmp-")
    try:
        yield staging
    finally:
        if os.path.isdir(staging):
            shutil.rmtree(staging, ignore_errors=True)


def _no_links(url: str, cache: str, e: OSError) -> DatasetError:
    return DatasetError(f"dataset {url}: cannot lay out the node's copies in {cache} ({e}); put $COORDPREP_CACHE "
                        "on a local disk that supports hard links")


class node_lock:
    """The exclusive ``flock`` of ``lock_path`` for the ``with`` block, waited for as long as the holder
    makes progress, and at most :data:`LOCK_WAIT_S` without it.

    The kernel releases a dead holder's lock; the deadline covers a live holder that hangs. A flock
    cannot be waited for with a timeout, so a held lock is waited for in a thread of its own, blocked
    in the kernel (no polling). Every :data:`LOCK_WAIT_S` the caller looks at ``progress``, the file
    the holder writes (its ``.part``): if it grew or changed since the last look, the wait goes on (a
    large shard may take longer than that to fetch); if not, or without ``progress``, the caller
    raises. The thread, once it gets the lock, releases it at once and closes its file: an abandoned
    wait never keeps the lock.
    """

    def __init__(self, lock_path: str, what: str, progress: str | None = None) -> None:
        self.path, self.what = lock_path, what  # what the holder writes, for the error: "shard <url>"
        self.progress = progress
        self.file = open(lock_path, "a+b")

    def __enter__(self) -> None:
        try:
            fcntl.flock(self.file, fcntl.LOCK_EX | fcntl.LOCK_NB)  # not held: no thread
            return
        except BlockingIOError:
            pass
        except BaseException:
            self.file.close()
            raise
        taken, guard, state = threading.Event(), threading.Lock(), {"abandoned": False}

        def wait() -> None:
            fcntl.flock(self.file, fcntl.LOCK_EX)  # returns when the holder finishes or dies
            with guard:
                if state["abandoned"]:
                    fcntl.flock(self.file, fcntl.LOCK_UN)
                    self.file.close()
                else:
                    taken.set()

        threading.Thread(target=wait, name="coordprep-shard-lock", daemon=True).start()
        seen = _state(self.progress)
        while not taken.wait(LOCK_WAIT_S):
            now = _state(self.progress)
            if now is not None and now != seen:
                seen = now  # the holder is writing: wait on
                continue
            with guard:
                if not taken.is_set():
                    state["abandoned"] = True  # the thread releases the lock and closes the file
                    raise DatasetError(
                        f"{self.what}: another process of this node has been fetching it and wrote nothing for "
                        f"{LOCK_WAIT_S:g} s, and still holds {self.path}; find it with 'fuser {self.path}' and end "
                        "it (its download hung: check the network to the store), then open the dataset again")
            return

    def __exit__(self, *exc: object) -> None:
        fcntl.flock(self.file, fcntl.LOCK_UN)
        self.file.close()


def _state(path: str | None) -> tuple[int, int] | None:
    """``path``'s size and modification time (None: no path, or no such file)."""
    try:
        info = os.stat(path) if path else None
    except FileNotFoundError:
        return None
    return (info.st_size, info.st_mtime_ns) if info else None


def _download(fs, remote: str, local: str) -> None:
    """One attempt at copying ``remote`` to ``local`` (bounded by the filesystem's own timeouts)."""
    fs.get_file(remote, local)


def _version(fs, remote: str, url: str) -> str:
    """The shard's size and, where the store gives one, its ETag or modification time."""
    try:
        info = fs.info(remote)
    except FileNotFoundError:
        raise DatasetError(f"shard {url} does not exist; check the URL (a pattern's range, the bucket and "
                           "prefix)") from None
    except Exception as e:  # each filesystem raises its own errors (permissions, the network)
        raise DatasetError(f"shard {url}: cannot be looked up ({e!r}); check the URL and that the credentials "
                           "(AWS_* variables, ~/.aws; AWS_ENDPOINT_URL for an S3-compatible server) reach every "
                           "node") from e
    tag = next((info[k] for k in ("ETag", "etag", "LastModified", "last_modified", "mtime", "Last-Modified")
                if info.get(k) is not None), "")
    return f"{info.get('size')}:{tag}"


def _filesystem(url: str):
    try:
        import fsspec

        return fsspec.core.url_to_fs(url)
    except (ImportError, ValueError) as e:  # fsspec names the package a protocol needs (s3fs, gcsfs)
        raise DatasetError(f"dataset {url!r}: no filesystem for it here ({e}); install the package fsspec names, "
                           "e.g. pip install 'coordinated-prep[s3]' for s3://") from e
