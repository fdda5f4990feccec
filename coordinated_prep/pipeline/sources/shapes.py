"""The embedded datasets: JPEG images of ten shape classes, generated on first use.

``builtin:shapes`` (the default: 10 x 300 images of 160 x 160 px) and ``builtin:shapes-large``
(10 x 60 images of 500 x 375 px, the size of an average ImageNet photo, for ``coordprep bench``).
"""

from __future__ import annotations

import logging
import math
import os
import shutil
import tempfile
from typing import Callable

import numpy as np
from PIL import Image, ImageDraw, ImageFilter

logger = logging.getLogger(__name__)

CLASSES: tuple[str, ...] = (
    "circle", "square", "triangle", "diamond", "pentagon",
    "hexagon", "star", "cross", "ring", "crescent",
)
IMAGES_PER_CLASS = 300
IMAGE_SIZE = 160
_VERSION = 1

#: name -> (width, height, images per class)
VARIANTS: dict[str, tuple[int, int, int]] = {"shapes": (IMAGE_SIZE, IMAGE_SIZE, IMAGES_PER_CLASS),
                                             "shapes-large": (500, 375, 60)}


def cache_dir() -> str:
    """Where generated datasets live: ``$COORDPREP_CACHE`` or ``~/.cache/coordinated_prep``."""
    return os.environ.get("COORDPREP_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "coordinated_prep")


def ensure_shapes(root: str | None = None, variant: str = "shapes") -> str:
    """Return the directory of ``builtin:<variant>``, generating it once if it is missing."""
    width, height, per_class = VARIANTS[variant]
    root = root or os.path.join(cache_dir(), f"{variant}-v{_VERSION}")
    return generate_into(root, lambda out: _generate(out, width, height, per_class),
                         f"builtin:{variant} ({len(CLASSES) * per_class} JPEGs of {width} x {height} px)")


def generate_into(root: str, generate: Callable[[str], None], what: str) -> str:
    """Return ``root``, first running ``generate(tmp)`` and renaming ``tmp`` to ``root`` if it is missing.

    Generation writes into a temporary sibling and renames it into place, so concurrent callers
    never see a half-written dataset; a caller that loses the race discards its copy.
    """
    if os.path.isdir(root):
        return root
    parent = os.path.dirname(root)
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=".generating-", dir=parent)
    logger.info("generating %s into %s", what, root)
    try:
        generate(tmp)
        os.rename(tmp, root)
    except OSError:
        if not os.path.isdir(root):
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return root


def _generate(out: str, width: int, height: int, per_class: int) -> None:
    rng = np.random.default_rng(20211)
    for name in CLASSES:
        folder = os.path.join(out, name)
        os.makedirs(folder)
        for i in range(per_class):
            image = _draw(name, rng, width, height)
            image.save(os.path.join(folder, f"{name}_{i:04d}.jpg"), quality=90)


def _draw(shape: str, rng: np.random.Generator, width: int, height: int) -> Image.Image:
    s = min(width, height)
    extent = np.array([width, height])
    base = rng.integers(0, 256, 3)
    noise = rng.normal(0, 24, (height, width, 3)) + base
    image = Image.fromarray(np.clip(noise, 0, 255).astype(np.uint8)).filter(ImageFilter.GaussianBlur(1.5))
    draw = ImageDraw.Draw(image)
    for _ in range(3):  # distractor strokes, so that colour alone does not give the class away
        xy = [tuple(int(v) for v in rng.integers(0, s, 2) * extent // s) for _ in range(2)]
        draw.line(xy, fill=tuple(int(v) for v in rng.integers(0, 256, 3)), width=int(rng.integers(1, 4)))
    colour = tuple(int(v) for v in (base + rng.integers(90, 166, 3)) % 256)
    radius = rng.uniform(0.18, 0.36) * s
    cx, cy = rng.uniform(radius + 4, extent - radius - 4)
    angle = rng.uniform(0, 2 * math.pi)
    _SHAPES[shape](draw, cx, cy, radius, angle, colour, base)
    return image


def _polygon(cx: float, cy: float, r: float, angle: float, n: int, inner: float = 1.0) -> list[tuple[float, float]]:
    points = []
    for k in range(n * (2 if inner != 1.0 else 1)):
        rr = r if k % 2 == 0 or inner == 1.0 else r * inner
        a = angle + k * math.pi * 2 / (n * (2 if inner != 1.0 else 1))
        points.append((cx + rr * math.cos(a), cy + rr * math.sin(a)))
    return points


def _cross(cx: float, cy: float, r: float, angle: float) -> list[tuple[float, float]]:
    w = r * 0.35
    arm = [(w, w), (w, r), (-w, r), (-w, w), (-r, w), (-r, -w), (-w, -w), (-w, -r), (w, -r), (w, -w), (r, -w), (r, w)]
    c, s = math.cos(angle), math.sin(angle)
    return [(cx + x * c - y * s, cy + x * s + y * c) for x, y in arm]


def _background(base: np.ndarray) -> tuple[int, ...]:
    return tuple(int(v) for v in base)


_SHAPES = {
    "circle": lambda d, x, y, r, a, c, b: d.ellipse([x - r, y - r, x + r, y + r], fill=c),
    "square": lambda d, x, y, r, a, c, b: d.polygon(_polygon(x, y, r, a, 4), fill=c),
    "triangle": lambda d, x, y, r, a, c, b: d.polygon(_polygon(x, y, r, a, 3), fill=c),
    "diamond": lambda d, x, y, r, a, c, b: d.polygon(
        [(x, y - r), (x + r * 0.55, y), (x, y + r), (x - r * 0.55, y)], fill=c),
    "pentagon": lambda d, x, y, r, a, c, b: d.polygon(_polygon(x, y, r, a, 5), fill=c),
    "hexagon": lambda d, x, y, r, a, c, b: d.polygon(_polygon(x, y, r, a, 6), fill=c),
    "star": lambda d, x, y, r, a, c, b: d.polygon(_polygon(x, y, r, a, 5, inner=0.42), fill=c),
    "cross": lambda d, x, y, r, a, c, b: d.polygon(_cross(x, y, r, a), fill=c),
    "ring": lambda d, x, y, r, a, c, b: d.ellipse([x - r, y - r, x + r, y + r], outline=c, width=max(3, int(r * 0.3))),
    "crescent": lambda d, x, y, r, a, c, b: (
        d.ellipse([x - r, y - r, x + r, y + r], fill=c),
        d.ellipse([x - r + r * 0.6 * math.cos(a), y - r + r * 0.6 * math.sin(a),
                   x + r + r * 0.6 * math.cos(a), y + r + r * 0.6 * math.sin(a)], fill=_background(b)),
    ),
}
