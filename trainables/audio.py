"""Audio classification: a small CNN over log-mel spectrograms (:mod:`trainables.data.audio`: generated
clips, crop, time shift and log-mel as transforms)."""

from __future__ import annotations

from typing import Any, Mapping

from torch import nn

from trainables.data.audio import CLASSES
from trainables.loop import Task, fit_task, reports
from trainables.scores import Accuracy


def build(num_classes: int, config: Mapping[str, Any]) -> nn.Module:
    """(N, 1, mels, frames) log-mel -> logits: batch norm of the input (log-mel levels are far from
    zero mean), three conv-BN-ReLU blocks of ``width``, 2w, 4w channels each halving both axes, global
    average pooling and a linear head."""
    w = int(config.get("width", 16))
    chans = [1, w, 2 * w, 4 * w]
    layers: list[nn.Module] = [nn.BatchNorm2d(1)]
    for cin, cout in zip(chans, chans[1:]):
        layers += [nn.Conv2d(cin, cout, 3, padding=1, bias=False), nn.BatchNorm2d(cout), nn.ReLU(inplace=True),
                   nn.MaxPool2d(2)]
    return nn.Sequential(*layers, nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(chans[-1], num_classes))


#: The spectrogram CNN; ``accuracy`` held out.
TASK = Task(build=build, num_classes=len(CLASSES), scores=Accuracy)
REPORTS = reports(TASK)  # what it reports each epoch (a YAML sweep's metric is one of them)


def train(config: dict) -> None:
    """Tune trainable: the spectrogram CNN on ``config["data"]``'s (1, mels, frames) inputs and int labels;
    see :func:`trainables.loop.fit_task`."""
    fit_task(config, TASK)
