"""Data sources: where encoded samples come from."""

from __future__ import annotations

import functools

from coordinated_prep.contracts import DataSource
from coordinated_prep.errors import DatasetError
from coordinated_prep.sources.imagefolder import ImageFolderSource
from coordinated_prep.sources.shapes import ensure_shapes

BUILTIN_DATASETS = ("builtin:shapes", "builtin:shapes-large")

__all__ = ["BUILTIN_DATASETS", "ImageFolderSource", "open_source"]


@functools.lru_cache(maxsize=8)
def open_source(dataset: str) -> DataSource:
    """Open the data source a ``DataSpec.dataset`` names (cached per process).

    Raises:
        DatasetError: Unknown builtin name, missing directory, or an unusable layout.
    """
    if dataset.startswith("builtin:"):
        if dataset not in BUILTIN_DATASETS:
            raise DatasetError(f"dataset {dataset!r}: unknown builtin dataset; choose one of {list(BUILTIN_DATASETS)}")
        return ImageFolderSource(ensure_shapes(variant=dataset.removeprefix("builtin:")))
    source = ImageFolderSource(dataset)
    if len(source) == 0:
        raise DatasetError(f"dataset {dataset!r} holds no images")
    return source
