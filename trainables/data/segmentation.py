"""Segmentation data in memory: 64 x 64 images of discs, squares and triangles with per-pixel class masks.

Samples are ``(tv_tensors.Image uint8 (3, H, W), tv_tensors.Mask int64 (H, W))``, so one joint v2
transform crops, flips and rotates the image and its mask alike. Each class has its own colour
(jittered per shape unless ``jitter=0``), so with ``jitter=0, noise=0`` the mask can be recomputed
from the image's pixels: the tests check alignment after the random transform that way.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import torch
from torchvision import tv_tensors
from torchvision.transforms import v2

SIZE = 64
CLASSES = ("background", "disc", "square", "triangle")
#: Each class's colour (RGB) before jitter; the background's is the canvas.
PALETTE = np.array([[40, 40, 40], [220, 60, 60], [60, 200, 70], [70, 90, 230]], dtype=np.float32)
MEAN = (0.228, 0.215, 0.205)  # measured on make(800, 0)
STD = (0.204, 0.170, 0.164)


class ShapeMasks:
    """A map-style dataset of images and their masks held in memory.

    Args:
        images: uint8 of shape (N, 3, H, W).
        masks: Class indices (uint8 to save memory) of shape (N, H, W); samples give them as int64.
        classes: Class names, indexed by mask value.
    """

    def __init__(self, images: np.ndarray, masks: np.ndarray, classes: Sequence[str] = CLASSES) -> None:
        if images.dtype != np.uint8 or images.ndim != 4 or images.shape[1] != 3:
            raise ValueError(f"images: dtype={images.dtype} shape={images.shape}; expected uint8 (N, 3, H, W)")
        if masks.shape != (images.shape[0], *images.shape[2:]):
            raise ValueError(f"masks: shape={masks.shape}; expected {(images.shape[0], *images.shape[2:])}")
        self.images, self.masks, self.classes = images, masks, list(classes)

    def __len__(self) -> int:
        return len(self.images)

    def __getitem__(self, index: int) -> tuple[tv_tensors.Image, tv_tensors.Mask]:
        return (tv_tensors.Image(torch.from_numpy(self.images[index])),
                tv_tensors.Mask(torch.from_numpy(self.masks[index]).long()))


def make(n: int = 800, seed: int = 0, jitter: float = 40.0, noise: float = 10.0, max_shapes: int = 4) -> ShapeMasks:
    """``n`` images of 1 to ``max_shapes`` shapes, each drawn from ``seed`` (800 take about 0.2 s).

    Args:
        n: Samples.
        seed: Seed of every draw.
        jitter: Largest change of a shape's colour channels from its class colour (0: exact colours).
        noise: Standard deviation of the Gaussian pixel noise (0: none).
        max_shapes: Most shapes per image; later shapes cover earlier ones, in the mask too.
    """
    if not isinstance(n, int) or n < 1:
        raise ValueError(f"make(n={n!r}): n must be a positive integer")
    rng = np.random.default_rng(seed)
    yy, xx = np.mgrid[0:SIZE, 0:SIZE].astype(np.float32)
    masks = np.zeros((n, SIZE, SIZE), dtype=np.uint8)
    images = np.broadcast_to(PALETTE[0], (n, SIZE, SIZE, 3)).copy()
    for i in range(n):
        for _ in range(int(rng.integers(1, max_shapes + 1))):
            label = int(rng.integers(1, len(CLASSES)))
            cy, cx = rng.uniform(8, SIZE - 8, size=2)
            inside = _shape(label, yy - cy, xx - cx, float(rng.uniform(7, 16)))
            masks[i][inside] = label
            images[i][inside] = PALETTE[label] + rng.uniform(-jitter, jitter, size=3)
    if noise:
        images += rng.normal(0, noise, size=images.shape).astype(np.float32)
    images = np.clip(np.rint(images), 0, 255).astype(np.uint8).transpose(0, 3, 1, 2)
    return ShapeMasks(np.ascontiguousarray(images), masks)


def _shape(label: int, dy: np.ndarray, dx: np.ndarray, r: float) -> np.ndarray:
    """The pixels of a disc (1), square (2) or triangle (3) of size ``r`` at offsets (dy, dx)."""
    if label == 1:
        return np.hypot(dy, dx) < r
    if label == 2:
        return np.maximum(np.abs(dy), np.abs(dx)) < r * 0.85
    return (dy < r * 0.7) & (dy > -r) & (np.abs(dx) < (dy + r) * 0.6)


def train_transforms(size: int = SIZE, scale: Sequence[float] = (0.5, 1.0), degrees: float = 15.0) -> v2.Compose:
    """Joint training augmentation: one crop, flip and rotation drawn per call move image and mask alike.

    The image is resampled bilinearly and the mask by nearest neighbour (v2 picks per tv_tensor);
    rotation fills the corners with class 0 (background) and black. Only the image becomes float.

    Args:
        size: Side of the output.
        scale: RandomResizedCrop's range of area fractions.
        degrees: Largest rotation either way.
    """
    return v2.Compose([
        v2.RandomResizedCrop(size, scale=tuple(scale), antialias=True),
        v2.RandomHorizontalFlip(),
        v2.RandomRotation(degrees),
        v2.ToDtype({tv_tensors.Image: torch.float32, "others": None}, scale=True),
        v2.Normalize(MEAN, STD),
    ])


def eval_transforms(size: int = SIZE) -> v2.Compose:
    """Joint evaluation transform: resize both to ``size`` (a no-op at 64), image to normalised float."""
    return v2.Compose([
        v2.Resize(size, antialias=True),
        v2.ToDtype({tv_tensors.Image: torch.float32, "others": None}, scale=True),
        v2.Normalize(MEAN, STD),
    ])
