"""Preprocessing with torchvision's decoders and functional transforms, on the CPU."""

from __future__ import annotations

import warnings

import numpy as np
import torch
from torchvision.io import ImageReadMode, decode_image
from torchvision.transforms.v2 import functional as F

from coordinated_prep.backends.augment import crop_params
from coordinated_prep.spec import PipelineSpec

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
        p = self.pipeline
        image = _decode(data)
        box = crop_params(seed, epoch, index, image.shape[1], image.shape[2], p.scale, p.ratio, p.hflip)
        out = F.resized_crop(image, box.top, box.left, box.height, box.width, [p.size, p.size], antialias=True)
        if box.flip:
            out = out.flip(-1)
        return out.numpy()

    def eval(self, data: bytes) -> np.ndarray:
        """Decode, resize the shorter side and centre-crop one sample into uint8 (3, size, size)."""
        p = self.pipeline
        image = F.resize(_decode(data), [p.eval_resize], antialias=True)
        return F.center_crop(image, [p.size, p.size]).numpy()


def _decode(data: bytes) -> torch.Tensor:
    buffer = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    return decode_image(buffer, mode=ImageReadMode.RGB)
