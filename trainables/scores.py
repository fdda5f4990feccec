"""Held-out metrics the example trainables report, accumulated batch by batch."""

from __future__ import annotations

from typing import Protocol

import torch


class Scores(Protocol):
    """Accumulates a model's outputs against the targets over an evaluation; one per evaluation.
    ``KEYS``: the names :meth:`result` returns (a YAML sweep's ``metric`` is checked against them)."""

    KEYS: tuple[str, ...]

    def update(self, outputs: torch.Tensor, targets: torch.Tensor) -> None:
        """Add one batch: the model's logits and the targets, on the same device."""

    def result(self) -> dict[str, float]:
        """The metrics over every batch added so far."""


class Accuracy:
    """Classification: ``accuracy``, the share of samples whose arg-max logit is the label.

    Args:
        num_classes: Not needed here; taken so that every :class:`Scores` is built the same way.
    """

    KEYS = ("accuracy",)

    def __init__(self, num_classes: int) -> None:
        self.correct = self.total = 0

    def update(self, outputs: torch.Tensor, targets: torch.Tensor) -> None:
        """Count the batch's (N, C) logits against its (N,) labels."""
        self.correct += int((outputs.argmax(1) == targets).sum())
        self.total += int(targets.numel())

    def result(self) -> dict[str, float]:
        """``{"accuracy": ...}`` (0.0 before any batch)."""
        return {"accuracy": self.correct / max(self.total, 1)}


class SegmentationScores:
    """Segmentation, from one confusion matrix over every pixel: ``pixel_accuracy`` and ``miou``, the mean
    over classes of intersection over union (classes absent from targets and predictions alike left out)."""

    KEYS = ("miou", "pixel_accuracy")

    def __init__(self, num_classes: int) -> None:
        self.num_classes = num_classes
        self.confusion = torch.zeros(num_classes, num_classes, dtype=torch.int64)

    def update(self, outputs: torch.Tensor, targets: torch.Tensor) -> None:
        """Count the batch's (N, C, H, W) logits against its (N, H, W) class masks."""
        k = self.num_classes
        pairs = targets.reshape(-1).long() * k + outputs.argmax(1).reshape(-1)
        self.confusion += torch.bincount(pairs.cpu(), minlength=k * k).reshape(k, k)

    def result(self) -> dict[str, float]:
        """``{"miou": ..., "pixel_accuracy": ...}`` (0.0 before any batch)."""
        hits = self.confusion.diag().double()
        union = self.confusion.sum(0) + self.confusion.sum(1) - self.confusion.diag()
        present = union > 0
        miou = float((hits[present] / union[present]).mean()) if present.any() else 0.0
        return {"miou": miou, "pixel_accuracy": float(hits.sum() / max(int(self.confusion.sum()), 1))}
