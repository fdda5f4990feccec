"""A shard index: WebDataset's ``wids`` JSON, which lists tar shards with their sample counts.

A dataset named by its index (``dataset: s3://bucket/train.json``, or a local path) is read shard by
shard as the epochs need them: the sweep plans every epoch from the counts alone, so no shard is
fetched before a piece holds one of its samples (:class:`~coordinated_prep.pipeline.sources.tar_shards.TarShardSource`).
The format is the one ``widsindex create`` writes::

    {"__kind__": "wids-shard-index-v1", "wids_version": 1, "name": "train",
     "shardlist": [{"url": "train-0000.tar", "nsamples": 1000, "filesize": 123456}, ...]}

A shard's ``url`` is resolved against ``base_path`` if the index has one, else against the index's
own folder (as ``wids`` does). Besides ``url`` and ``nsamples``, nothing is required. One key is
this project's own and optional: ``classes``, the class names in label order; without it, the
classes are known only once every shard was read (a trainable asking for them then waits for that).
"""

from __future__ import annotations

import json
import os
import posixpath
from dataclasses import dataclass
from urllib.parse import urlsplit
from urllib.request import url2pathname

from coordinated_prep.errors import DatasetError
from coordinated_prep.pipeline.sources.remote import is_url

_FIX = ("write it as `widsindex create` does: {\"wids_version\": 1, \"shardlist\": [{\"url\": \"train-0000.tar\", "
        "\"nsamples\": 1000}, ...]}")


@dataclass(frozen=True)
class ShardIndex:
    """The shards an index lists, in sample order.

    Attributes:
        origin: The index's path or URL (what errors name).
        urls: Each shard's path or URL, resolved.
        counts: Each shard's number of samples.
        classes: The class names in label order, where the index names them; None otherwise.
    """

    origin: str
    urls: tuple[str, ...]
    counts: tuple[int, ...]
    classes: tuple[str, ...] | None


def is_shard_index(dataset: str) -> bool:
    """Whether ``dataset`` names a shard index: a ``.json`` path or URL (a Parquet manifest excepted)."""
    from coordinated_prep.pipeline.sources import PARQUET_MANIFEST

    path = urlsplit(dataset).path if is_url(dataset) else dataset  # a URL's query (?v=2, a signature) aside
    return path.endswith(".json") and not path.endswith(PARQUET_MANIFEST)


def read_shard_index(dataset: str) -> ShardIndex:
    """Read and check the index ``dataset`` names (a local path or a URL, read whole: it is small).

    Raises:
        DatasetError: It cannot be read, is not JSON, or lacks a shard list of ``url`` and ``nsamples``
            entries (naming the index, the entry and the key, with the fix).
    """
    origin = _local(dataset, dataset) if dataset.startswith("file:") else dataset
    try:
        if is_url(origin):
            from coordinated_prep.pipeline.sources.remote import _filesystem

            fs, path = _filesystem(origin)
            with fs.open(path, "rb") as f:
                text = f.read()
        else:
            with open(os.path.expanduser(origin), "rb") as f:
                text = f.read()
        doc = json.loads(text)
    except (FileNotFoundError, PermissionError) as e:
        raise DatasetError(f"shard index {dataset} cannot be opened ({e}); check the path or URL and the "
                           "credentials") from e
    except (OSError, ValueError) as e:
        raise DatasetError(f"shard index {dataset}: cannot be read as JSON ({e}); {_FIX}") from e
    except DatasetError:
        raise
    except Exception as e:  # each filesystem raises its own errors (permissions, the network)
        raise DatasetError(f"shard index {dataset}: cannot be read ({e!r}); check the URL and the credentials") from e
    shards = doc.get("shardlist") if isinstance(doc, dict) else None
    if not isinstance(shards, list) or not shards:
        raise DatasetError(f"shard index {dataset}: no 'shardlist' of shards; {_FIX}")
    base = doc.get("base_path") or ""
    if not isinstance(base, str):
        raise DatasetError(f"shard index {dataset}: 'base_path' is {base!r}, not a path or URL")
    base = _resolve(_folder(origin), base, dataset) if base else _folder(origin)  # a relative one: from the index's
    urls, counts = [], []
    for k, entry in enumerate(shards):
        url = entry.get("url") if isinstance(entry, dict) else None
        n = entry.get("nsamples") if isinstance(entry, dict) else None
        if not isinstance(url, str) or not url or isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise DatasetError(f"shard index {dataset}: shardlist[{k}] is {entry!r}; each shard needs a 'url' and its "
                               "'nsamples' (an int >= 1)")
        urls.append(_resolve(base, url, dataset))
        counts.append(n)
    classes = doc.get("classes")
    if classes is not None and (not isinstance(classes, list) or not classes
                                or not all(isinstance(c, (str, int)) for c in classes)):
        raise DatasetError(f"shard index {dataset}: 'classes' is {classes!r}; it lists the class names in label order "
                           "(or leave it out)")
    missing = [u for u in urls if not is_url(u) and not os.path.isfile(u)]
    if missing:
        raise DatasetError(f"shard index {dataset}: {len(missing)} of its {len(urls)} shards do not exist, first "
                           f"{missing[0]}; fix their url (relative to the index's folder or its base_path)")
    return ShardIndex(dataset, tuple(urls), tuple(counts), None if classes is None else tuple(map(str, classes)))


def write_shard_index(path: str, urls: list[str], counts: list[int], classes: list[str] | None = None,
                      name: str | None = None) -> None:
    """Write a ``wids`` index at ``path`` (``urls`` relative to its folder, or absolute), atomically."""
    doc: dict = {"__kind__": "wids-shard-index-v1", "wids_version": 1,
                 "name": name or os.path.splitext(os.path.basename(path))[0],
                 "shardlist": [{"url": u, "nsamples": int(n)} for u, n in zip(urls, counts)]}
    if classes is not None:
        doc["classes"] = list(classes)
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(doc, f, indent=1)
    os.replace(tmp, path)


def _folder(origin: str) -> str:
    if is_url(origin):  # its query (a signature, a version) is the index's own, not its folder's
        parts = urlsplit(origin)
        return f"{parts.scheme}://{parts.netloc}{parts.path.rsplit('/', 1)[0]}/"
    return os.path.dirname(os.path.abspath(os.path.expanduser(origin)))


def _local(url: str, index: str) -> str:
    """The local path of a ``file:`` URL (``file:///p``, ``file://localhost/p``, ``file:/p``; percent-decoded)."""
    parts = urlsplit(url)
    if parts.netloc not in ("", "localhost"):
        raise DatasetError(f"shard index {index}: {url!r} names the host {parts.netloc!r}; a file: URL is read on "
                           "each node itself: write file:///path (or a plain path)")
    return url2pathname(parts.path)


def _resolve(base: str, url: str, index: str) -> str:
    """``url`` (a shard's, or a base_path) against ``base``, as ``wids`` resolves it: a URL as it is, a
    path from the base's folder or, in a URL's, from its host or bucket; ``file://`` as a local path."""
    if url.startswith("file:"):
        return _local(url, index)
    if is_url(url):
        return url
    if not is_url(base):
        return os.path.normpath(os.path.join(base, os.path.expanduser(url)))
    parts = urlsplit(base)  # a base_path's query, if any, is not the shards'
    scheme, host, path = parts.scheme, parts.netloc, parts.path.lstrip("/")
    joined = posixpath.normpath(posixpath.join(path, url))  # a leading / starts at the host
    if joined == ".." or joined.startswith("../"):
        raise DatasetError(f"shard index {index}: {url!r} climbs above {scheme}://{host}/; fix the url")
    return f"{scheme}://{host}/{joined.lstrip('/')}"
