"""The training loop of the examples that bring their own dataset and transforms: batches are whatever
``default_collate`` makes of ``(input, target)`` samples, the loss is cross-entropy, the metrics the task's."""

from __future__ import annotations

import functools
import logging
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Mapping

import torch
from torch import nn

from coordinated_prep import eval_loader, train_loader
from trainables import distributed
from trainables.common import Session, TuneSession, make_optimizer
from trainables.common import _advance, _load  # the schedule and resume rules of fit, kept in one place
from trainables.scores import Scores

logger = logging.getLogger(__name__)


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
    if distributed.workers_of(config) > 1 and not distributed.in_worker():
        distributed.launch(config, functools.partial(fit_task, task=task))
        return
    session = session or (distributed.TrainSession() if distributed.in_worker() else TuneSession())
    torch.set_num_threads(int(config.get("torch_threads", 1)))
    torch.manual_seed(int(config.get("model_seed", 0)))  # reproducible initialisation per trial
    device = distributed.device()
    num_classes = int(config.get("num_classes", task.num_classes))
    core = task.build(num_classes, config).to(device)
    model = distributed.prepare(core)  # DDP in a Ray Train worker of several; checkpoints hold the core's state
    optimizer = make_optimizer(model, config)
    epochs, batch_size = int(config["epochs"]), int(config["batch_size"])
    state = session.restore()
    done = int(state["epoch"]) if state else 0
    if done >= epochs:
        logger.info("the checkpoint is of epoch %d of %d: nothing left to train", done, epochs)
        return
    loss_fn = nn.CrossEntropyLoss()
    with train_loader(config, batch_size=batch_size, epochs=epochs - done) as loader:
        per_epoch = loader.fresh_batches_per_epoch
        scheduler = torch.optim.lr_scheduler.OneCycleLR(
            optimizer, max_lr=float(config["lr"]), total_steps=epochs * per_epoch, pct_start=0.25)
        if state:
            _load(state, core, optimizer, scheduler, config)
        for epoch in range(done, epochs):
            metrics = train_epoch(model, optimizer, scheduler, loss_fn, loader, device, epoch * per_epoch)
            _advance(scheduler, (epoch + 1) * per_epoch)
            eval_loss, scores = evaluate(core, config, device, loss_fn, task.scores(num_classes))  # no collectives
            metrics.update({"epoch": epoch + 1, "loss": eval_loss, **scores,
                            "private_samples": loader.private_samples,
                            "copied_fraction": loader.stats.copied_fraction,
                            "loader_cpu_ms_per_batch": loader.stats.cpu_ms_per_batch})
            session.report(metrics, {"epoch": epoch + 1, "lr": float(config["lr"]), "model": core.state_dict(),
                                     "optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict()})


def train_epoch(model: nn.Module, optimizer: torch.optim.Optimizer, scheduler: torch.optim.lr_scheduler.LRScheduler,
                loss_fn: nn.Module, batches: Iterable[Any], device: torch.device, first_step: int) -> dict[str, float]:
    """One epoch of ``for inputs, targets in batches``; the schedule moves a step per batch from
    ``first_step``. Returns ``train_loss``, ``samples``, ``steps``, ``data_wait_s``, ``compute_s`` and
    ``stall_fraction`` (the share of the epoch spent waiting for batches)."""
    model.train()
    wait = compute = loss_sum = 0.0
    seen = steps = 0
    t0 = time.perf_counter()
    for inputs, targets in batches:
        t1 = time.perf_counter()
        wait += t1 - t0
        loss = train_step(model, optimizer, loss_fn, inputs, targets, device)
        steps += 1
        _advance(scheduler, first_step + steps)
        loss_sum += loss * len(targets)
        seen += len(targets)
        t0 = time.perf_counter()
        compute += t0 - t1
    wait += time.perf_counter() - t0  # waiting for the end of the epoch is waiting too
    return {"train_loss": loss_sum / max(seen, 1), "samples": seen, "steps": steps, "data_wait_s": wait,
            "compute_s": compute, "stall_fraction": wait / max(wait + compute, 1e-9)}


def train_step(model: nn.Module, optimizer: torch.optim.Optimizer, loss_fn: nn.Module, inputs: torch.Tensor,
               targets: torch.Tensor, device: torch.device) -> float:
    """One optimisation step; returns its mean loss. ``inputs`` may be read-only shared memory:
    ``.to`` copies it only to another device, and nothing here writes into it."""
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
