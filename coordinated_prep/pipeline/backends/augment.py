"""Random augmentation parameters as a pure function of (seed, epoch, sample index, view)."""

from __future__ import annotations

import math
from typing import NamedTuple

import numpy as np

_AUGMENT_STREAM = 0xA11C  # separates augmentation draws from the sample-order draws of the plan


class CropParams(NamedTuple):
    """A crop box in source pixels and whether to flip horizontally."""

    top: int
    left: int
    height: int
    width: int
    flip: bool


def crop_params(
    seed: int, epoch: int, index: int, height: int, width: int,
    scale: tuple[float, float], ratio: tuple[float, float], hflip: float, view: int = 0,
) -> CropParams:
    """Draw a random resized crop and flip, the same for the same arguments in any process.

    The box follows torchvision's ``RandomResizedCrop.get_params`` (ten tries at a random area and
    log-uniform aspect ratio, then a centre crop clamped to ``ratio``); the randomness comes from a
    NumPy generator seeded by ``(seed, epoch, index)`` instead of torch's global generator. View
    ``v`` > 0 of a sample (echoing before augmentation) draws from ``(seed, epoch, index, v)``, so
    view 0 is the draw every group without views makes.
    """
    key = (_AUGMENT_STREAM, seed, epoch, index) if view == 0 else (_AUGMENT_STREAM, seed, epoch, index, view)
    rng = np.random.default_rng(key)
    area = height * width
    log_ratio = (math.log(ratio[0]), math.log(ratio[1]))
    draws = rng.random((10, 2))
    box = None
    for u_area, u_ratio in draws:
        target = area * (scale[0] + (scale[1] - scale[0]) * u_area)
        aspect = math.exp(log_ratio[0] + (log_ratio[1] - log_ratio[0]) * u_ratio)
        w = int(round(math.sqrt(target * aspect)))
        h = int(round(math.sqrt(target / aspect)))
        if 0 < w <= width and 0 < h <= height:
            box = (h, w)
            break
    offsets = rng.random(3)
    if box is None:  # fall back to the largest centred crop within the ratio range
        in_ratio = width / height
        if in_ratio < ratio[0]:
            box = (int(round(width / ratio[0])), width)
        elif in_ratio > ratio[1]:
            box = (height, int(round(height * ratio[1])))
        else:
            box = (height, width)
        top, left = (height - box[0]) // 2, (width - box[1]) // 2
    else:
        top = int(offsets[0] * (height - box[0] + 1))
        left = int(offsets[1] * (width - box[1] + 1))
    return CropParams(top, left, box[0], box[1], bool(offsets[2] < hflip))
