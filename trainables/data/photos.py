"""A team's ImageNet-style torchvision v2 training pipeline for ``builtin:photos``, as ``coordprep bench`` runs it.

The built-in or directory dataset gives each sample as ``(tv_tensors.Image uint8 (3, H, W), label)``;
this transform takes the image and returns the tensor a model would be fed.
"""

from __future__ import annotations

import torch
from torchvision.transforms import v2

#: ImageNet's per-channel mean and standard deviation, in [0, 1]: what a pretrained backbone expects.
MEAN = (0.485, 0.456, 0.406)
STD = (0.229, 0.224, 0.225)


def train_transform(size: int = 224, jitter: float = 0.4, normalize: bool = True, resize: int | None = None,
                    scale: tuple[float, float] = (0.08, 1.0)) -> v2.Compose:
    """Random resized crop, flip and colour jitter, then (``normalize``) float32 normalised by ImageNet's statistics.

    Args:
        size: Output side in pixels.
        resize: First resize the shorter side to this working size (deterministic: the prefix that
            the decoded tier keeps for every crop scale, :mod:`coordinated_prep.pipeline.split`).
        scale: The random crop's area range, as a fraction of the (resized) image.
        jitter: ColorJitter's brightness, contrast and saturation strength (0: no ColorJitter).
        normalize: End with ``ToDtype(float32, scale=True)`` and ``Normalize`` (4 bytes per value, as a
            training loop would feed the model); False ends with uint8 (a quarter of the bytes to stage
            and move, normalised by the trial instead).
    """
    steps: list[v2.Transform] = [v2.Resize(resize, antialias=True)] if resize else []
    steps += [
        v2.RandomResizedCrop(size, scale=tuple(scale), antialias=True),
        v2.RandomHorizontalFlip(),
    ]
    if jitter:
        steps.append(v2.ColorJitter(brightness=jitter, contrast=jitter, saturation=jitter))
    if normalize:
        steps += [v2.ToDtype(torch.float32, scale=True), v2.Normalize(MEAN, STD)]
    return v2.Compose(steps)


def eval_transform(size: int = 224, resize: int | None = None, normalize: bool = True) -> v2.Compose:
    """Resize the shorter side to ``resize`` (default ``size * 8 / 7``) and take the centre ``size`` crop,
    then (``normalize``) float32 normalised as in training."""
    steps: list[v2.Transform] = [v2.Resize(resize or -(-size * 8 // 7), antialias=True), v2.CenterCrop(size)]
    if normalize:
        steps += [v2.ToDtype(torch.float32, scale=True), v2.Normalize(MEAN, STD)]
    return v2.Compose(steps)
