"""The ready image trainables' loop (:func:`fit`): the built-in pipeline's uint8 images, normalised on the
device, through the shared training loop of :mod:`trainables.training`.

Its old neighbours keep their import path here: the sessions and checkpoint files
(:mod:`trainables.session`) and :func:`~trainables.training.make_optimizer`.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Mapping

import torch
from torch import nn

from coordinated_prep import eval_loader, train_loader
from coordinated_prep.errors import ConfigError
from coordinated_prep.trial.loader import resolve_spec
from coordinated_prep.memory.modes import apply_memory
from coordinated_prep.memory.packing import cap_gpu_memory
from coordinated_prep.pipeline.sources import open_source
from trainables.session import STATE_FILE, Session, TuneSession, load_state, save_state  # noqa: F401  (their old home)
from trainables.training import EPOCH_KEYS, TOTALS, Recipe, on_workers, train
from trainables.training import make_optimizer  # noqa: F401  (its old home)

MEAN, STD = 0.5, 0.25


def normalize(images: torch.Tensor, device: torch.device) -> torch.Tensor:
    """uint8 (N, 3, H, W) -> float on ``device``, normalised there (shared memory stays uint8)."""
    return images.to(device, non_blocking=True).float().div_(255.0).sub_(MEAN).div_(STD)


def fit(config: Mapping[str, Any], build: Callable[[int, Mapping[str, Any]], nn.Module],
        session: Session | None = None) -> None:
    """Train ``build(num_classes, config)`` for ``config["epochs"]`` epochs and report each epoch.

    Config keys: ``data`` (a DataSpec), ``lr``, ``batch_size``, ``epochs``; optional ``momentum``
    (0.9), ``weight_decay`` (5e-4), ``torch_threads`` (1), ``eval_batch_size`` (256), ``model_seed`` (0),
    ``memory`` (``none``, ``checkpoint`` or ``{budget: f}``: see :mod:`coordinated_prep.memory.modes`),
    ``gpu_memory_fraction`` (the CUDA allocator cap that ``gpu: auto`` sets) and ``echo`` (data
    echoing: ``1``, ``2``, ``"batch:2"``, ``"auto"``...: see :mod:`coordinated_prep.trial.echo`).
    Reports ``epoch``, ``loss`` and ``accuracy`` on the held-out split, ``train_loss``,
    ``data_wait_s``, ``compute_s``, ``stall_fraction`` (share of the epoch spent waiting for data) and
    ``private_samples`` (samples the trial prepared itself so far), ``copied_fraction`` (share of its
    batches so far that straddled two pieces and were copied; the rest were views of shared
    memory) and ``loader_cpu_ms_per_batch`` (CPU its loader spent per batch), ``fresh_samples`` and
    ``echoed_samples`` (this epoch's fresh samples and repeats; ``..._total`` for all epochs) and
    ``steps`` (this epoch's optimiser steps), with a checkpoint of the model, optimizer,
    learning-rate schedule and epoch.

    The learning-rate schedule (one cycle) runs over fresh samples: it moves one step per batch's
    worth of fresh samples, so echoed steps train at the rate of the epoch's progress and neither
    stretch nor overrun the schedule (whose length ``echo="auto"`` cannot know ahead). Without
    echo this is one schedule step per batch, as usual.

    A trial that finds a checkpoint (Tune retried it, restored the sweep, or PBT copied another
    trial's state into it) resumes after the checkpoint's epoch: its loader declares only the epochs
    left, and the schedule goes on from its step. When PBT changed ``lr``, the schedule keeps its
    shape scaled to the new peak; a changed ``weight_decay`` applies from the next step.

    With ``workers: k`` above 1 the trial trains on k Ray Train workers, the model in
    DistributedDataParallel and each rank reading its share of every epoch (``batch_size`` per
    rank): :mod:`trainables.distributed`.

    Args:
        config: The trial's config.
        build: Builds the model.
        session: Where epochs are reported and checkpoints kept; default :class:`TuneSession`
            (:class:`~trainables.distributed.TrainSession` in a Ray Train worker).
    """
    if on_workers(config, functools.partial(fit, build=build)):
        return
    train(config, _Images(build), session)


#: What the image trainables (small_cnn, resnet18) report each epoch (:meth:`_Images.metrics`).
REPORTS = EPOCH_KEYS | TOTALS | {"loss", "accuracy", "private_samples", "copied_fraction", "loader_cpu_ms_per_batch",
                                 "fresh_samples", "echoed_samples"}


class _Images(Recipe):
    """:func:`fit`'s recipe: the built-in image pipeline's uint8 batches, normalised on the device."""

    def __init__(self, build: Callable[[int, Mapping[str, Any]], nn.Module]) -> None:
        self._build = build

    def build(self, config: Mapping[str, Any], device: torch.device) -> nn.Module:
        spec = resolve_spec(config)
        if spec.user_transforms:
            raise ConfigError(f"trainable {getattr(self._build, '__module__', 'fit')}: trains the built-in image "
                              "pipeline (uint8 images of a builtin or directory dataset, normalised here); with your "
                              "own dataset or transforms use trainables.loop.fit_task, as cifar_cnn, seg_unet and "
                              "audio_cnn do")
        cap_gpu_memory(config.get("gpu_memory_fraction"))  # gpu: auto's share: an overrun fails here, not next door
        model = self._build(len(open_source(spec.dataset).classes), config).to(device)
        return apply_memory(model, config.get("memory"))

    def loader(self, config: Mapping[str, Any], batch_size: int, epochs: int) -> Any:
        return train_loader(config, batch_size=batch_size, epochs=epochs, echo=config.get("echo"))

    def step(self, model: nn.Module, optimizer: torch.optim.Optimizer, loss_fn: nn.Module, batch: Any,
             device: torch.device) -> tuple[float, int]:
        return train_step(model, optimizer, loss_fn, batch.images, batch.labels, device), len(batch)

    def evaluate(self, core: nn.Module, config: Mapping[str, Any], device: torch.device,
                 loss_fn: nn.Module) -> dict[str, float]:
        loss, accuracy = evaluate(core, config, device, loss_fn)
        return {"loss": loss, "accuracy": accuracy}

    def metrics(self, epoch: int, train: dict[str, float], held_out: dict[str, float], loader: Any) -> dict[str, Any]:
        return {"epoch": epoch, **held_out, "train_loss": train["train_loss"], "samples": train["samples"],
                "private_samples": loader.private_samples, "data_wait_s": train["data_wait_s"],
                "compute_s": train["compute_s"], "stall_fraction": train["stall_fraction"],
                "copied_fraction": loader.stats.copied_fraction,
                "loader_cpu_ms_per_batch": loader.stats.cpu_ms_per_batch, "steps": train["steps"],
                "fresh_samples": loader.epoch_counts.fresh, "echoed_samples": loader.epoch_counts.echoed,
                "fresh_samples_total": loader.echo_counts.fresh, "echoed_samples_total": loader.echo_counts.echoed}


def train_step(model: nn.Module, optimizer: torch.optim.Optimizer, loss_fn: nn.Module, images: torch.Tensor,
               labels: torch.Tensor, device: torch.device) -> float:
    """One optimisation step on a uint8 batch; returns its mean loss."""
    logits = model(normalize(images, device))
    loss = loss_fn(logits, labels.to(device))
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    optimizer.step()
    return loss.item()


@torch.no_grad()
def evaluate(model: nn.Module, config: Mapping[str, Any], device: torch.device, loss_fn: nn.Module) -> tuple[float, float]:
    """Mean loss and accuracy on the held-out split."""
    model.eval()
    total = correct = 0
    loss_sum = 0.0
    for batch in eval_loader(config, int(config.get("eval_batch_size", 256))):
        logits = model(normalize(batch.images, device))
        labels = batch.labels.to(device)
        loss_sum += loss_fn(logits, labels).item() * len(batch)
        correct += int((logits.argmax(1) == labels).sum())
        total += len(batch)
    return loss_sum / max(total, 1), correct / max(total, 1)

