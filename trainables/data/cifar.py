"""CIFAR-style data in memory: 32 x 32 RGB uint8 arrays of ten pattern classes, and their v2 transforms.

The class of an image is its pattern (stripes, a disc, a ring, a cross...), never its colours, so
colour jitter and RandAugment keep the label; every class is symmetric under a horizontal flip.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import torch
from torchvision.transforms import v2

SIZE = 32
CLASSES = ("horizontal-stripes", "vertical-stripes", "checkerboard", "disc", "ring", "square", "square-outline",
           "plus", "cross", "triangle")
#: Per-channel mean and standard deviation of the generated images (measured on make(3000, 0)), in [0, 1].
MEAN = (0.496, 0.499, 0.493)
STD = (0.288, 0.291, 0.290)


class PatternArrays:
    """A map-style dataset over arrays held in memory: sample ``i`` is ``(images[i], int(labels[i]))``.

    Args:
        images: uint8 of shape (N, 32, 32, 3), HWC as CIFAR-10's arrays are (``v2.ToImage`` makes them CHW).
        labels: Class indices, shape (N,).
        classes: Class names, indexed by label.
    """

    def __init__(self, images: np.ndarray, labels: np.ndarray, classes: Sequence[str] = CLASSES) -> None:
        if images.dtype != np.uint8 or images.ndim != 4 or images.shape[-1] != 3:
            raise ValueError(f"images: dtype={images.dtype} shape={images.shape}; expected uint8 (N, H, W, 3)")
        if labels.shape != (len(images),):
            raise ValueError(f"labels: shape={labels.shape}; expected ({len(images)},), one label per image")
        self.images, self.labels, self.classes = images, labels.astype(np.int64), list(classes)

    def __len__(self) -> int:
        return len(self.images)

    def __getitem__(self, index: int) -> tuple[np.ndarray, int]:
        return self.images[index], int(self.labels[index])


def make(n: int = 3000, seed: int = 0) -> PatternArrays:
    """``n`` images, classes in turn (``i % 10``), each drawn from ``seed`` and its index alone.

    Each image is a pattern at a random position, size and phase in a random foreground colour over
    a random background colour, with Gaussian pixel noise. 3,000 images take about 0.3 s.
    """
    if not isinstance(n, int) or n < len(CLASSES):
        raise ValueError(f"make(n={n!r}): n must be an integer >= {len(CLASSES)} (one sample per class at least)")
    rng = np.random.default_rng(seed)
    labels = np.arange(n) % len(CLASSES)
    yy, xx = np.mgrid[0:SIZE, 0:SIZE].astype(np.float32)
    centre = rng.uniform(10, 22, size=(n, 2)).astype(np.float32)
    radius = rng.uniform(6, 11, size=n).astype(np.float32)
    period = rng.uniform(4, 9, size=n).astype(np.float32)
    phase = rng.uniform(0, 2 * np.pi, size=n).astype(np.float32)
    masks = np.stack([_pattern(int(c), yy - cy, xx - cx, r, p, ph)
                      for c, (cy, cx), r, p, ph in zip(labels, centre, radius, period, phase)])
    fg, bg = _colours(rng, n)
    images = np.where(masks[..., None], fg[:, None, None, :], bg[:, None, None, :])
    images = images + rng.normal(0, 12, size=images.shape).astype(np.float32)
    return PatternArrays(np.clip(images, 0, 255).astype(np.uint8), labels)


def _pattern(label: int, dy: np.ndarray, dx: np.ndarray, r: float, period: float, phase: float) -> np.ndarray:
    """The boolean foreground of class ``label`` on offsets (dy, dx) from its centre."""
    d = np.hypot(dy, dx)
    w = max(1.5, r / 3.5)  # stroke width
    if label == 0:
        return np.sin(2 * np.pi * dy / period + phase) > 0
    if label == 1:
        return np.sin(2 * np.pi * dx / period + phase) > 0
    if label == 2:
        return (np.sin(2 * np.pi * dy / period + phase) > 0) ^ (np.sin(2 * np.pi * dx / period + phase) > 0)
    if label == 3:
        return d < r
    if label == 4:
        return np.abs(d - r) < w / 1.5
    if label == 5:
        return np.maximum(np.abs(dy), np.abs(dx)) < r * 0.85
    if label == 6:
        return np.abs(np.maximum(np.abs(dy), np.abs(dx)) - r * 0.85) < w / 1.5
    if label == 7:
        return ((np.abs(dy) < w) | (np.abs(dx) < w)) & (np.maximum(np.abs(dy), np.abs(dx)) < r)
    if label == 8:
        return ((np.abs(dy - dx) < w * 1.2) | (np.abs(dy + dx) < w * 1.2)) & (d < r * 1.1)
    return (dy < r * 0.7) & (dy > -r) & (np.abs(dx) < (dy + r) * 0.6)  # a triangle pointing up


def _colours(rng: np.random.Generator, n: int) -> tuple[np.ndarray, np.ndarray]:
    """Foreground and background RGB colours, at least 120 grey levels apart in the sum of channels."""
    fg = rng.uniform(0, 255, size=(n, 3)).astype(np.float32)
    bg = rng.uniform(0, 255, size=(n, 3)).astype(np.float32)
    close = np.abs(fg - bg).sum(1) < 120
    bg[close] = 255 - fg[close]  # the complement: far from the foreground in every channel but the middle
    return fg, bg


def train_transform(scale: Sequence[float] = (0.6, 1.0), jitter: float = 0.3, num_ops: int = 2,
                    magnitude: int = 9) -> v2.Compose:
    """CIFAR-style training augmentation, HWC uint8 array in, normalised float (3, 32, 32) out.

    Args:
        scale: RandomResizedCrop's range of area fractions.
        jitter: ColorJitter's brightness, contrast and saturation strength (hue: a third of it).
        num_ops: RandAugment's operations per image.
        magnitude: RandAugment's magnitude (0-30).
    """
    return v2.Compose([
        v2.ToImage(),
        v2.RandomResizedCrop(SIZE, scale=tuple(scale), antialias=True),
        v2.RandomHorizontalFlip(),
        v2.ColorJitter(brightness=jitter, contrast=jitter, saturation=jitter, hue=min(jitter / 3, 0.5)),
        v2.RandAugment(num_ops=num_ops, magnitude=magnitude),
        v2.ToDtype(torch.float32, scale=True),
        v2.Normalize(MEAN, STD),
    ])


def eval_transform() -> v2.Compose:
    """Evaluation: HWC uint8 array in, normalised float (3, 32, 32) out; nothing random."""
    return v2.Compose([v2.ToImage(), v2.ToDtype(torch.float32, scale=True), v2.Normalize(MEAN, STD)])
