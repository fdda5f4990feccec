"""Semantic segmentation with a joint transform: a tiny U-Net on image/mask pairs
(:mod:`trainables.data.segmentation`), reporting mean IoU and pixel accuracy."""

from __future__ import annotations

from typing import Any, Mapping

import torch
from torch import nn

from trainables.data.segmentation import CLASSES
from trainables.loop import Task, fit_task, reports
from trainables.scores import SegmentationScores


def _double_conv(cin: int, cout: int) -> nn.Sequential:
    """Two 3 x 3 conv-BN-ReLU layers at one resolution."""
    return nn.Sequential(nn.Conv2d(cin, cout, 3, padding=1, bias=False), nn.BatchNorm2d(cout), nn.ReLU(inplace=True),
                         nn.Conv2d(cout, cout, 3, padding=1, bias=False), nn.BatchNorm2d(cout), nn.ReLU(inplace=True))


class TinyUNet(nn.Module):
    """A U-Net of ``depth`` halvings: widths w, 2w, 4w... down, the same back up with skip connections,
    and a 1 x 1 head to per-pixel logits. Input sides must be divisible by ``2 ** depth``.

    Args:
        num_classes: Classes per pixel.
        width: Channels of the first level.
        depth: Down-sampling steps.
    """

    def __init__(self, num_classes: int, width: int = 8, depth: int = 3) -> None:
        super().__init__()
        widths = [width * 2**i for i in range(depth + 1)]
        self.down = nn.ModuleList([_double_conv(3, widths[0])] +
                                  [_double_conv(a, b) for a, b in zip(widths, widths[1:])])
        self.up = nn.ModuleList([nn.ConvTranspose2d(b, a, 2, stride=2) for a, b in zip(widths, widths[1:])])
        self.merge = nn.ModuleList([_double_conv(2 * a, a) for a in widths[:-1]])
        self.head = nn.Conv2d(widths[0], num_classes, 1)
        self.pool = nn.MaxPool2d(2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(N, 3, H, W) -> (N, num_classes, H, W) logits."""
        skips = []
        for i, block in enumerate(self.down):
            x = block(x if i == 0 else self.pool(x))
            skips.append(x)
        x = skips.pop()
        for up, merge in zip(reversed(self.up), reversed(self.merge)):
            x = merge(torch.cat([skips.pop(), up(x)], dim=1))
        return self.head(x)


def build(num_classes: int, config: Mapping[str, Any]) -> nn.Module:
    """The tiny U-Net at ``config["width"]`` (default 8) and ``config["depth"]`` (default 3)."""
    return TinyUNet(num_classes, int(config.get("width", 8)), int(config.get("depth", 3)))


#: The tiny U-Net; ``miou`` and ``pixel_accuracy`` held out.
TASK = Task(build=build, num_classes=len(CLASSES), scores=SegmentationScores)
REPORTS = reports(TASK)  # what it reports each epoch (a YAML sweep's metric is one of them)


def train(config: dict) -> None:
    """Tune trainable: the tiny U-Net on ``config["data"]``'s (float image, int64 mask) pairs;
    see :func:`trainables.loop.fit_task`."""
    fit_task(config, TASK)
