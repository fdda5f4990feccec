"""The training loop of the examples that bring their own dataset and transforms: batches are whatever
``default_collate`` makes of ``(input, target)`` samples, the loss is cross-entropy, the metrics the task's."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Mapping

import torch
from torch import nn

from coordinated_prep import eval_loader, train_loader
from trainables.scores import Scores
from trainables.session import Session, TuneSession  # noqa: F401  (TuneSession, make_optimizer: importable here, as before)
from trainables.training import EPOCH_KEYS, Recipe, _advance, make_optimizer, on_workers, run_epoch, train  # noqa: F401


@dataclass(frozen=True)
class Task:
    """What an example trains: its model, its number of classes and its held-out metrics.

    Args:
        build: ``build(num_classes, config)`` -> the model, taking a batch of inputs to logits
            (N, C) or, for segmentation, (N, C, H, W).
        num_classes: Classes of the dataset, unless the config sets ``num_classes``.
        scores: ``scores(num_classes)`` -> a fresh accumulator of held-out metrics.
    """

    build: Callable[[int, Mapping[str, Any]], nn.Module]
    num_classes: int
    scores: Callable[[int], Scores]


def fit_task(config: Mapping[str, Any], task: Task, session: Session | None = None) -> None:
    """Train ``task``'s model on ``config["data"]`` for ``config["epochs"]`` epochs and report each epoch.

    Config keys as :func:`trainables.common.fit` (``data``, ``lr``, ``batch_size``, ``epochs``; optional
    ``momentum``, ``weight_decay``, ``torch_threads``, ``eval_batch_size``, ``model_seed``, ``width``) and
    ``num_classes``; ``memory`` and ``echo`` are not read. Inputs must arrive as the model takes them
    (the transforms make them float): they are moved to the device, never written to. Reports ``epoch``,
    ``loss`` (held-out), the task's scores, ``train_loss``, ``samples``, ``steps``, ``data_wait_s``,
    ``compute_s``, ``stall_fraction``, ``private_samples``, ``copied_fraction`` and
    ``loader_cpu_ms_per_batch``, with a checkpoint that a retried or PBT-exploited trial resumes from
    (one-cycle schedule, one step per batch). With ``workers: k`` above 1 it trains on k Ray Train
    workers (DDP), as :func:`trainables.common.fit` does.
    """
    if on_workers(config, functools.partial(fit_task, task=task)):
        return
    train(config, _TaskRecipe(task), session)


def reports(task: Task) -> frozenset[str] | None:
    """What a trainable of ``task`` reports each epoch (:meth:`_TaskRecipe.metrics`): the loop's, the
    held-out loss and the task's scores; None if its scores do not declare their ``KEYS``."""
    keys = getattr(task.scores, "KEYS", None)
    if keys is None:
        return None
    return EPOCH_KEYS | {"loss", "private_samples", "copied_fraction", "loader_cpu_ms_per_batch", *keys}


class _TaskRecipe(Recipe):
    """:func:`fit_task`'s recipe: ``(inputs, targets)`` batches as the transforms made them, the task's scores."""

    def __init__(self, task: Task) -> None:
        self._task = task

    def _num_classes(self, config: Mapping[str, Any]) -> int:
        return int(config.get("num_classes", self._task.num_classes))

    def build(self, config: Mapping[str, Any], device: torch.device) -> nn.Module:
        return self._task.build(self._num_classes(config), config).to(device)

    def loader(self, config: Mapping[str, Any], batch_size: int, epochs: int) -> Any:
        return train_loader(config, batch_size=batch_size, epochs=epochs)

    def step(self, model: nn.Module, optimizer: torch.optim.Optimizer, loss_fn: nn.Module, batch: Any,
             device: torch.device) -> tuple[float, int]:
        return _pair_step(model, optimizer, loss_fn, batch, device)

    def evaluate(self, core: nn.Module, config: Mapping[str, Any], device: torch.device,
                 loss_fn: nn.Module) -> dict[str, float]:
        loss, scores = evaluate(core, config, device, loss_fn, self._task.scores(self._num_classes(config)))
        return {"loss": loss, **scores}

    def metrics(self, epoch: int, train: dict[str, float], held_out: dict[str, float], loader: Any) -> dict[str, Any]:
        return {**train, "epoch": epoch, **held_out, "private_samples": loader.private_samples,
                "copied_fraction": loader.stats.copied_fraction,
                "loader_cpu_ms_per_batch": loader.stats.cpu_ms_per_batch}


def train_epoch(model: nn.Module, optimizer: torch.optim.Optimizer, scheduler: torch.optim.lr_scheduler.LRScheduler,
                loss_fn: nn.Module, batches: Iterable[Any], device: torch.device, first_step: int) -> dict[str, float]:
    """One epoch of ``for inputs, targets in batches``; the schedule moves a step per batch from
    ``first_step``. Returns ``train_loss``, ``samples``, ``steps``, ``data_wait_s``, ``compute_s`` and
    ``stall_fraction`` (the share of the epoch spent waiting for batches)."""
    return run_epoch(model, batches, lambda batch: _pair_step(model, optimizer, loss_fn, batch, device),
                     lambda timing: _advance(scheduler, first_step + timing.steps))


def _pair_step(model: nn.Module, optimizer: torch.optim.Optimizer, loss_fn: nn.Module, batch: Any,
               device: torch.device) -> tuple[float, int]:
    """:func:`train_step` on an ``(inputs, targets)`` batch; returns its mean loss and its samples."""
    inputs, targets = batch
    return train_step(model, optimizer, loss_fn, inputs, targets, device), len(targets)


def train_step(model: nn.Module, optimizer: torch.optim.Optimizer, loss_fn: nn.Module, inputs: torch.Tensor,
               targets: torch.Tensor, device: torch.device) -> float:
    """One optimisation step; returns its mean loss. ``inputs`` may be shared memory (writable,
    copy-on-write): ``.to`` copies it only to another device."""
    outputs = model(inputs.to(device, non_blocking=True))
    loss = loss_fn(outputs, targets.to(device, non_blocking=True))
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    optimizer.step()
    return loss.item()


@torch.no_grad()
def evaluate(model: nn.Module, config: Mapping[str, Any], device: torch.device, loss_fn: nn.Module,
             scores: Scores) -> tuple[float, dict[str, float]]:
    """Mean loss and ``scores``' metrics on the held-out split (``eval_loader``)."""
    model.eval()
    total, loss_sum = 0, 0.0
    for inputs, targets in eval_loader(config, int(config.get("eval_batch_size", 256))):
        outputs = model(inputs.to(device, non_blocking=True))
        targets = targets.to(device, non_blocking=True)
        loss_sum += loss_fn(outputs, targets).item() * len(targets)
        scores.update(outputs, targets)
        total += len(targets)
    return loss_sum / max(total, 1), scores.result()
