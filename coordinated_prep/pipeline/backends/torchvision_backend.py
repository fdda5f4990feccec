"""Preprocessing with torchvision's decoders and functional transforms, on the CPU."""

from __future__ import annotations

import warnings

import numpy as np
import torch
from torchvision.io import ImageReadMode, decode_image
from torchvision.transforms.v2 import functional as F

from coordinated_prep.pipeline.backends.augment import crop_params
from coordinated_prep.pipeline.backends.spec import PipelineSpec

# torchvision 0.29 warns on every decode that torchcodec will take over; once per sample would
# flood every prep actor's log, so this one message is silenced (the API still works as documented).
warnings.filterwarnings("ignore", message="The image decoding and encoding capabilities of TorchVision",
                        category=DeprecationWarning)


class TorchvisionPreprocessor:
    """Decode with ``torchvision.io`` and crop, resize and flip with ``transforms.v2.functional``.

    Args:
        pipeline: The declarative preprocessing spec.
    """

    def __init__(self, pipeline: PipelineSpec) -> None:
        self.pipeline = pipeline

    def train(self, data: bytes, seed: int, epoch: int, index: int) -> np.ndarray:
        """Decode and randomly augment one training sample into uint8 (3, size, size)."""
        return self._augment(_decode(data), seed, epoch, index, 0).numpy()

    def train_views(self, data: bytes, seed: int, epoch: int, index: int, views: int) -> np.ndarray:
        """Decode one sample once and augment it ``views`` times into uint8 (views, 3, size, size)."""
        return self.augment(_decode(data), seed, epoch, index, views)

    def decode(self, data: bytes) -> torch.Tensor:
        """The deterministic prefix: uint8 (3, H, W) of encoded ``data`` (what the decoded tier keeps)."""
        return _decode(data)

    def augment(self, image: torch.Tensor, seed: int, epoch: int, index: int, views: int) -> np.ndarray:
        """The random tail: ``views`` crops and flips of a decoded image, uint8 (views, 3, size, size)."""
        return torch.stack([self._augment(image, seed, epoch, index, v) for v in range(views)]).numpy()

    def _augment(self, image: torch.Tensor, seed: int, epoch: int, index: int, view: int) -> torch.Tensor:
        p = self.pipeline
        box = crop_params(seed, epoch, index, image.shape[1], image.shape[2], p.scale, p.ratio, p.hflip, view)
        out = F.resized_crop(image, box.top, box.left, box.height, box.width, [p.size, p.size], antialias=True)
        return out.flip(-1) if box.flip else out

    def eval(self, data: bytes) -> np.ndarray:
        """Decode, resize the shorter side and centre-crop one sample into uint8 (3, size, size)."""
        p = self.pipeline
        image = F.resize(_decode(data), [p.eval_resize], antialias=True)
        return F.center_crop(image, [p.size, p.size]).numpy()


def _decode(data: bytes) -> torch.Tensor:
    buffer = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    return decode_image(buffer, mode=ImageReadMode.RGB)
