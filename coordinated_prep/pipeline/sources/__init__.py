"""Data sources: where encoded samples come from."""

from __future__ import annotations

import functools
import glob
import os

from coordinated_prep.contracts import DataSource
from coordinated_prep.errors import DatasetError
from coordinated_prep.pipeline.sources.imagefolder import ImageFolderSource
from coordinated_prep.pipeline.sources.remote import is_url
from coordinated_prep.pipeline.sources.remote_folder import is_remote_folder
from coordinated_prep.pipeline.sources.shapes import ensure_shapes
from coordinated_prep.pipeline.sources.shard_index import is_shard_index
from coordinated_prep.pipeline.sources.tar_shards import is_tar_dataset

BUILTIN_DATASETS = ("builtin:shapes", "builtin:shapes-large", "builtin:photos")
#: The Parquet dataset manifest's file name (``coordinated_prep.pipeline.sources.parquet.MANIFEST``). The
#: Parquet module is imported only for a Parquet dataset: pyarrow costs a process about 50 MB, and
#: coordinators, registries and caches open sources too.
PARQUET_MANIFEST = "coordprep-parquet.json"

__all__ = ["BUILTIN_DATASETS", "ImageFolderSource", "ParquetSource", "folder_root", "open_source", "open_source_async"]


@functools.lru_cache(maxsize=8)
def open_source(dataset: str) -> DataSource:
    """Open the data source a ``DataSpec.dataset`` names (cached per process).

    ``builtin:<name>`` is a generated ImageFolder; a directory holding ``coordprep-parquet.json``
    (written by ``coordprep convert``) is a :class:`ParquetSource`, and so is that manifest's URL
    (``s3://bucket/photos/coordprep-parquet.json``: the dataset is fetched once per node,
    :func:`~coordinated_prep.pipeline.sources.remote.fetched_parquet`); WebDataset tar shards (a brace
    pattern such as ``shards-{0000..0063}.tar``, a ``.tar`` file, or a directory of ``*.tar`` with no
    subdirectory) are a :class:`~coordinated_prep.pipeline.sources.tar_shards.TarShardSource`, and so
    is a shard index (a ``.json`` path or URL, WebDataset's ``wids`` format), whose shards are read as
    the epochs need them (:mod:`~coordinated_prep.pipeline.sources.shard_index`); a
    folder's URL is read as tar shards if ``*.tar`` lie at its top, else as an ImageFolder of raw files
    fetched once per node (:mod:`~coordinated_prep.pipeline.sources.remote_folder`); any other
    directory is read as an ImageFolder. In a process of a coordinated sweep, an ImageFolder's index comes from the
    sweep (walked once per node, :mod:`coordinated_prep.pipeline.sources.shared_index`).

    Raises:
        DatasetError: Unknown builtin name, missing directory, an unusable layout, or a Parquet
            dataset whose manifest or shards are missing or do not match.
    """
    if dataset.startswith("builtin:"):
        if dataset not in BUILTIN_DATASETS:
            raise DatasetError(f"dataset {dataset!r}: unknown builtin dataset; choose one of {list(BUILTIN_DATASETS)}")
        if dataset == "builtin:photos":
            from coordinated_prep.pipeline.sources.photos import ensure_photos

            return _image_folder(ensure_photos())
        return _image_folder(ensure_shapes(variant=dataset.removeprefix("builtin:")))
    if is_url(dataset) and dataset.endswith("/" + PARQUET_MANIFEST):  # fetched whole, once per node
        from coordinated_prep.pipeline.sources.parquet import ParquetSource
        from coordinated_prep.pipeline.sources.remote import fetched_parquet

        source: DataSource = ParquetSource(fetched_parquet(dataset), origin=dataset.rsplit("/", 1)[0])
    elif is_shard_index(dataset):  # tar shards, each read when an epoch first needs it
        from coordinated_prep.pipeline.sources.tar_shards import TarShardSource

        source = TarShardSource(dataset)
    elif is_remote_folder(dataset):  # tar shards or an ImageFolder, as its listing says
        from coordinated_prep.pipeline.sources.remote_folder import open_remote_folder

        source = open_remote_folder(dataset)
    elif os.path.isfile(os.path.join(dataset, PARQUET_MANIFEST)):
        from coordinated_prep.pipeline.sources.parquet import ParquetSource

        source = ParquetSource(dataset)
    elif is_tar_dataset(dataset):
        from coordinated_prep.pipeline.sources.tar_shards import TarShardSource

        source = TarShardSource(dataset)
    elif glob.glob(os.path.join(glob.escape(dataset), "*.parquet")):
        raise DatasetError(f"dataset {dataset!r} holds Parquet files but no {PARQUET_MANIFEST} manifest (an unfinished "
                           "conversion?); re-run `coordprep convert <imagefolder> <dir> --overwrite`")
    else:
        source = _image_folder(dataset)
    if len(source) == 0:
        raise DatasetError(f"dataset {dataset!r} holds no images")
    return source


def folder_root(dataset: str) -> str | None:
    """The ImageFolder directory (absolute) ``dataset`` is read from, or None if it is not one (Parquet).

    A ``builtin:`` dataset is generated here first if it is missing (as :func:`open_source` does).
    """
    if dataset.startswith("builtin:"):
        if dataset not in BUILTIN_DATASETS:
            return None  # open_source raises the error naming the choices
        if dataset == "builtin:photos":
            from coordinated_prep.pipeline.sources.photos import ensure_photos

            return os.path.abspath(ensure_photos())
        return os.path.abspath(ensure_shapes(variant=dataset.removeprefix("builtin:")))
    if os.path.isfile(os.path.join(dataset, PARQUET_MANIFEST)) or not os.path.isdir(dataset) or is_tar_dataset(dataset):
        return None
    return os.path.abspath(dataset)


async def open_source_async(dataset: str) -> DataSource:
    """:func:`open_source` for an async actor: the sweep's index is awaited, never fetched with a
    blocking ``ray.get`` (which would block the actor's event loop), and the files are opened in a
    thread."""
    import asyncio

    from coordinated_prep.pipeline.sources.shared_index import shared_index_async

    root = await asyncio.to_thread(folder_root, dataset)
    if root is None and is_remote_folder(dataset):
        root = dataset  # listed once for the sweep, too
    if root is not None:
        await shared_index_async(root)
    return await asyncio.to_thread(open_source, dataset)


def _image_folder(root: str) -> ImageFolderSource:
    """An ImageFolder from the sweep's index of it on this node (walked once per node), else walked here."""
    from coordinated_prep.pipeline.sources.shared_index import shared_index

    return ImageFolderSource(root, shared_index(os.path.abspath(root)))


def __getattr__(name: str) -> object:
    if name == "ParquetSource":  # imported on first use (pyarrow)
        from coordinated_prep.pipeline.sources.parquet import ParquetSource

        return ParquetSource
    raise AttributeError(f"module 'coordinated_prep.pipeline.sources' has no attribute {name!r}")
