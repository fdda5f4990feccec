"""Is the photograph upright? The small CNN on ``builtin:photos`` through a transform of the user's
(:mod:`trainables.data.photos`), as ``experiments/augment.yaml`` sweeps its crop scale."""

from __future__ import annotations

from trainables import small_cnn
from trainables.loop import Task, fit_task
from trainables.scores import Accuracy

#: The small CNN; two classes (``upright``, ``upside-down``); ``accuracy`` held out.
TASK = Task(build=small_cnn.build, num_classes=2, scores=Accuracy)


def train(config: dict) -> None:
    """Tune trainable: the small CNN on ``config["data"]``'s float (3, S, S) photos and int labels;
    see :func:`trainables.loop.fit_task`."""
    fit_task(config, TASK)
