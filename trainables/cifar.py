"""CIFAR-style classification with your own dataset and transforms: the small CNN on 32 x 32 arrays
(:mod:`trainables.data.cifar`: a generated dataset, a v2 RandAugment pipeline)."""

from __future__ import annotations

from trainables import small_cnn
from trainables.data.cifar import CLASSES
from trainables.loop import Task, fit_task, reports
from trainables.scores import Accuracy

#: The small CNN (four conv blocks; 32 x 32 in, 2 x 2 before the head); ``accuracy`` held out.
TASK = Task(build=small_cnn.build, num_classes=len(CLASSES), scores=Accuracy)
REPORTS = reports(TASK)  # what it reports each epoch (a YAML sweep's metric is one of them)


def train(config: dict) -> None:
    """Tune trainable: the small CNN on ``config["data"]``'s float (3, 32, 32) inputs and int labels;
    see :func:`trainables.loop.fit_task`."""
    fit_task(config, TASK)
