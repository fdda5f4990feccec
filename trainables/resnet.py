"""torchvision's ResNet-18 with a configurable width, as a Tune trainable."""

from __future__ import annotations

from typing import Any, Mapping

from torch import nn
from torchvision.models.resnet import BasicBlock, ResNet

from trainables.common import fit


class _WideResNet18(ResNet):
    """ResNet-18 whose stage widths are ``width``, 2w, 4w, 8w instead of 64, 128, 256, 512."""

    def __init__(self, num_classes: int, width: int) -> None:
        self._width = width
        super().__init__(BasicBlock, [2, 2, 2, 2], num_classes=num_classes)
        self.conv1 = nn.Conv2d(3, width, kernel_size=7, stride=2, padding=3, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.fc = nn.Linear(8 * width, num_classes)

    def _make_layer(self, block, planes, blocks, stride=1, dilate=False):  # noqa: ANN001 - torchvision's signature
        if planes == 64:  # the first stage: torchvision starts from 64 input planes
            self.inplanes = self._width
        return super()._make_layer(block, planes * self._width // 64, blocks, stride, dilate)


def build(num_classes: int, config: Mapping[str, Any]) -> nn.Module:
    """ResNet-18 (torchvision's blocks and layout) with base width ``config["width"]`` (default 64)."""
    width = int(config.get("width", 64))
    if width == 64:
        from torchvision.models import resnet18

        return resnet18(num_classes=num_classes)
    return _WideResNet18(num_classes, width)


def train(config: dict) -> None:
    """Tune trainable: ResNet-18 on ``config["data"]``; see :func:`trainables.common.fit`."""
    fit(config, build)
