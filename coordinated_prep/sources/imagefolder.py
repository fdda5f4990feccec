"""A directory in torchvision's ImageFolder layout: one subfolder per class."""

from __future__ import annotations

import logging
import os

import numpy as np

from coordinated_prep.errors import DatasetError, SampleError

logger = logging.getLogger(__name__)

#: Extensions read as images (lower case); the same matching rule as torchvision's.
IMAGE_EXTENSIONS: tuple[str, ...] = (".jpg", ".jpeg", ".png")


class ImageFolderSource:
    """Samples of ``root/<class>/**/<file>``, indexed like ``torchvision.datasets.ImageFolder``.

    Classes are the sorted subfolder names; samples are walked class by class, in sorted order,
    following symlinks, so index ``i`` names the same file as ImageFolder's ``samples[i]``.

    Args:
        root: The dataset directory.

    Raises:
        DatasetError: If ``root`` is missing, has no class folders, or a class has no images.
    """

    def __init__(self, root: str) -> None:
        self.root = os.path.abspath(os.path.expanduser(root))
        if not os.path.isdir(self.root):
            raise DatasetError(f"dataset {root!r}: no such directory; give an ImageFolder root, a Parquet dataset "
                               "directory written by `coordprep convert`, or 'builtin:shapes'")
        classes = sorted(e.name for e in os.scandir(self.root) if e.is_dir())
        if not classes:
            raise DatasetError(
                f"dataset {self.root!r}: no class subfolders; expected the ImageFolder layout root/<class>/<image>"
            )
        paths: list[str] = []
        labels: list[int] = []
        ignored: list[str] = []
        for label, name in enumerate(classes):
            found = _images_under(os.path.join(self.root, name), ignored)
            if not found:
                raise DatasetError(
                    f"dataset {self.root!r}: class folder {name!r} holds no images with extensions "
                    f"{list(IMAGE_EXTENSIONS)}; add images or remove the folder"
                )
            paths.extend(found)
            labels.extend([label] * len(found))
        if ignored:  # as torchvision's ImageFolder does, but said out loud
            logger.warning("dataset %s: ignoring %d file(s) without an image extension %s, e.g. %s",
                           self.root, len(ignored), list(IMAGE_EXTENSIONS), ignored[0])
        self.classes: tuple[str, ...] = tuple(classes)
        self.paths: tuple[str, ...] = tuple(paths)
        self.labels = np.asarray(labels, dtype=np.int64)

    def __len__(self) -> int:
        return len(self.paths)

    def read(self, index: int) -> bytes:
        """Bytes of the file of sample ``index``."""
        path = self.paths[index]
        try:
            with open(path, "rb") as f:
                return f.read()
        except OSError as e:
            raise SampleError(index, path, f"cannot read the file: {e.strerror or e}") from e

    def describe(self, index: int) -> str:
        """The file path of sample ``index``."""
        return self.paths[index]


def _images_under(folder: str, ignored: list[str]) -> list[str]:
    found: list[str] = []
    for dirpath, _, filenames in sorted(os.walk(folder, followlinks=True)):
        for name in sorted(filenames):
            path = os.path.join(dirpath, name)
            (found if name.lower().endswith(IMAGE_EXTENSIONS) else ignored).append(path)
    return found
