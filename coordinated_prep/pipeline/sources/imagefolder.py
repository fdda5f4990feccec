"""A directory in torchvision's ImageFolder layout: one subfolder per class."""

from __future__ import annotations

import logging

from coordinated_prep.errors import SampleError
from coordinated_prep.pipeline.sources.folder_index import IMAGE_EXTENSIONS, FolderIndex, PathList, scan

logger = logging.getLogger(__name__)


class ImageFolderSource:
    """Samples of ``root/<class>/**/<file>``, indexed like ``torchvision.datasets.ImageFolder``.

    Classes are the sorted subfolder names; samples are walked class by class, in sorted order,
    following symlinks, so index ``i`` names the same file as ImageFolder's ``samples[i]``.

    Args:
        root: The dataset directory.
        index: Its index, walked already (shared in a sweep); None walks ``root`` now.

    Raises:
        DatasetError: If ``root`` is missing, has no class folders, or a class has no images.
    """

    def __init__(self, root: str, index: FolderIndex | None = None) -> None:
        index = index if index is not None else scan(root)
        count, first = index.ignored
        if count:  # as torchvision's ImageFolder does, but said out loud
            logger.warning("dataset %s: ignoring %d file(s) without an image extension %s, e.g. %s",
                           index.root, count, list(IMAGE_EXTENSIONS), first)
        self.root = index.root
        self.index = index
        self.classes: tuple[str, ...] = index.classes
        self.paths = PathList(index)
        self.labels = index.labels

    def __len__(self) -> int:
        return len(self.labels)

    def read(self, index: int) -> bytes:
        """Bytes of the file of sample ``index``."""
        path = self.index.path(index)
        try:
            with open(path, "rb") as f:
                return f.read()
        except OSError as e:
            raise SampleError(index, path, f"cannot read the file: {e.strerror or e}") from e

    def describe(self, index: int) -> str:
        """The file path of sample ``index``."""
        return self.index.path(index)
