"""Fakes and small datasets shared by the tests."""

from __future__ import annotations

import os

import numpy as np
from PIL import Image


def make_imagefolder(root: str, classes: int = 3, per_class: int = 10, size: tuple[int, int] = (48, 40),
                     png_every: int = 4, seed: int = 0) -> str:
    """Write a small ImageFolder of random JPEGs (and some PNGs, some in subfolders) under ``root``."""
    rng = np.random.default_rng(seed)
    for c in range(classes):
        folder = os.path.join(root, f"class_{c}")
        os.makedirs(os.path.join(folder, "nested"), exist_ok=True)
        for i in range(per_class):
            pixels = rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)
            pixels[:, :, c % 3] = 40 * c  # a learnable hint, not needed by these tests
            sub = "nested" if i % 5 == 4 else ""
            ext = "png" if i % png_every == 0 else "jpg"
            Image.fromarray(pixels).save(os.path.join(folder, sub, f"img_{i:03d}.{ext}"))
    with open(os.path.join(root, "class_0", "notes.txt"), "w") as f:
        f.write("not an image: must be ignored\n")
    return root
