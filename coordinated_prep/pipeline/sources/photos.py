"""``builtin:photos``: 4,096 JPEGs of 500 x 375 px cut from a real photograph, generated on first use.

The photograph is the portrait of Grace Hopper that matplotlib ships (``mpl-data/sample_data``), so
nothing is downloaded. Each image is a random crop of it (scale, aspect, position and a brightness
and colour shift drawn from a seeded generator), resized to 500 x 375: the size of an average
ImageNet photo, with a real photo's texture, so decoding costs what a photograph costs (unlike the
noise of ``builtin:shapes``). Two classes: ``upright`` and ``upside-down`` (the crop turned by 180
degrees), learnable under the random crops and horizontal flips of the default pipeline.
"""

from __future__ import annotations

import logging
import os

import numpy as np
from PIL import Image, ImageEnhance

from coordinated_prep.pipeline.sources.shapes import cache_dir, generate_into

logger = logging.getLogger(__name__)

CLASSES: tuple[str, ...] = ("upright", "upside-down")
IMAGES_PER_CLASS = 2048
WIDTH, HEIGHT = 500, 375
_VERSION = 1


def _photograph() -> Image.Image:
    import matplotlib

    path = os.path.join(matplotlib.get_data_path(), "sample_data", "grace_hopper.jpg")
    return Image.open(path).convert("RGB")


def ensure_photos(root: str | None = None) -> str:
    """Return the directory of ``builtin:photos``, generating it once if it is missing (about 20 s)."""
    root = root or os.path.join(cache_dir(), f"photos-v{_VERSION}")
    return generate_into(root, _generate, f"builtin:photos ({len(CLASSES) * IMAGES_PER_CLASS} JPEGs of "
                                          f"{WIDTH} x {HEIGHT} px cut from a photograph)")


def _generate(out: str) -> None:
    photo = _photograph()
    rng = np.random.default_rng(20210)
    for label, name in enumerate(CLASSES):
        folder = os.path.join(out, name)
        os.makedirs(folder)
        for i in range(IMAGES_PER_CLASS):
            image = _crop(photo, rng)
            if label == 1:
                image = image.rotate(180)
            image.save(os.path.join(folder, f"{name}_{i:04d}.jpg"), quality=90)


def _crop(photo: Image.Image, rng: np.random.Generator) -> Image.Image:
    """A random 4:3-ish crop covering 35-100% of the photograph's width, resized, with a colour shift."""
    w, h = photo.size
    cw = int(w * rng.uniform(0.35, 1.0))
    ch = min(h, int(cw * rng.uniform(0.6, 0.9)))
    x, y = int(rng.integers(0, w - cw + 1)), int(rng.integers(0, h - ch + 1))
    image = photo.crop((x, y, x + cw, y + ch)).resize((WIDTH, HEIGHT), Image.BILINEAR)
    image = ImageEnhance.Brightness(image).enhance(rng.uniform(0.7, 1.3))
    return ImageEnhance.Color(image).enhance(rng.uniform(0.5, 1.5))
