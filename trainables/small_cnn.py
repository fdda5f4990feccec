"""A small CNN trainable: four conv blocks and a linear head."""

from __future__ import annotations

from typing import Any, Mapping

from torch import nn

from trainables.common import fit


def build(num_classes: int, config: Mapping[str, Any]) -> nn.Module:
    """Conv-BN-ReLU blocks of ``width``, 2w, 4w, 4w channels, each halving the resolution."""
    w = int(config.get("width", 16))
    chans = [3, w, 2 * w, 4 * w, 4 * w]
    layers: list[nn.Module] = []
    for cin, cout in zip(chans, chans[1:]):
        layers += [nn.Conv2d(cin, cout, 3, padding=1, bias=False), nn.BatchNorm2d(cout), nn.ReLU(inplace=True),
                   nn.MaxPool2d(2)]
    return nn.Sequential(*layers, nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(chans[-1], num_classes))


def train(config: dict) -> None:
    """Tune trainable: the small CNN on ``config["data"]``; see :func:`trainables.common.fit`."""
    fit(config, build)
