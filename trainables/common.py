"""The training loop the ready trainables share: train with the loader, evaluate, report to Tune."""

from __future__ import annotations

import functools
import logging
import os
import tempfile
import time
from typing import Any, Callable, Mapping, Protocol

import torch
from torch import nn

from coordinated_prep import eval_loader, train_loader
from coordinated_prep.errors import ConfigError
from coordinated_prep.memory.modes import apply_memory
from coordinated_prep.memory.packing import cap_gpu_memory
from coordinated_prep.pipeline.sources import open_source
from coordinated_prep.loader import resolve_spec
from trainables import distributed

logger = logging.getLogger(__name__)

MEAN, STD = 0.5, 0.25
#: The file a checkpoint of :func:`fit` holds: ``torch.save`` of plain state dicts (loaded weights-only).
STATE_FILE = "state.pt"


def normalize(images: torch.Tensor, device: torch.device) -> torch.Tensor:
    """uint8 (N, 3, H, W) -> float on ``device``, normalised there (shared memory stays uint8)."""
    return images.to(device, non_blocking=True).float().div_(255.0).sub_(MEAN).div_(STD)


class Session(Protocol):
    """Where a trainable reports each epoch and finds the state it resumes from."""

    def restore(self) -> dict[str, Any] | None:
        """The state saved with the latest checkpoint (model, optimizer, schedule, epoch), or None."""

    def report(self, metrics: dict[str, Any], state: dict[str, Any]) -> None:
        """Report one epoch's metrics with the state to resume from after it."""


class TuneSession:
    """Ray Tune's: each epoch's state is a checkpoint (``tune.report(..., checkpoint=...)``), and a
    retried, restored or PBT-exploited trial resumes from ``tune.get_checkpoint()``."""

    def restore(self) -> dict[str, Any] | None:
        from ray import tune

        checkpoint = tune.get_checkpoint()
        return None if checkpoint is None else load_state(checkpoint)

    def report(self, metrics: dict[str, Any], state: dict[str, Any]) -> None:
        from ray import tune

        with tempfile.TemporaryDirectory(prefix="coordprep-ckpt-") as d:
            save_state(d, state)
            tune.report(metrics, checkpoint=tune.Checkpoint.from_directory(d))  # Tune copies it to storage


def save_state(directory: str, state: dict[str, Any]) -> None:
    """Write ``state`` into a checkpoint directory (weights-only ``torch.save``)."""
    torch.save(state, os.path.join(directory, STATE_FILE))


def load_state(checkpoint: Any) -> dict[str, Any]:
    """The state a Tune or Ray Train checkpoint written by :func:`save_state` holds.

    Raises:
        ConfigError: The checkpoint has no state file (it was written by something else).
    """
    with checkpoint.as_directory() as d:
        path = os.path.join(d, STATE_FILE)
        if not os.path.exists(path):
            raise ConfigError(f"checkpoint {checkpoint.path}: no {STATE_FILE}; it was not written by "
                              "trainables.common.fit, so this trial cannot resume from it")
        return torch.load(path, map_location="cpu", weights_only=True)


def fit(config: Mapping[str, Any], build: Callable[[int, Mapping[str, Any]], nn.Module],
        session: Session | None = None) -> None:
    """Train ``build(num_classes, config)`` for ``config["epochs"]`` epochs and report each epoch.

    Config keys: ``data`` (a DataSpec), ``lr``, ``batch_size``, ``epochs``; optional ``momentum``
    (0.9), ``weight_decay`` (5e-4), ``torch_threads`` (1), ``eval_batch_size`` (256), ``model_seed`` (0),
    ``memory`` (``none``, ``checkpoint`` or ``{budget: f}``: see :mod:`coordinated_prep.memory.modes`),
    ``gpu_memory_fraction`` (the CUDA allocator cap that ``gpu: auto`` sets) and ``echo`` (data
    echoing: ``1``, ``2``, ``"batch:2"``, ``"auto"``...: see :mod:`coordinated_prep.echo`).
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
    if distributed.workers_of(config) > 1 and not distributed.in_worker():
        distributed.launch(config, functools.partial(fit, build=build))
        return
    session = session or (distributed.TrainSession() if distributed.in_worker() else TuneSession())
    torch.set_num_threads(int(config.get("torch_threads", 1)))
    torch.manual_seed(int(config.get("model_seed", 0)))  # reproducible initialisation per trial
    device = distributed.device()
    spec = resolve_spec(config)
    if spec.user_transforms:
        raise ConfigError(f"trainable {getattr(build, '__module__', 'fit')}: trains the built-in image pipeline (uint8 "
                          "images of a builtin or directory dataset, normalised here); with your own dataset or "
                          "transforms use trainables.loop.fit_task, as cifar_cnn, seg_unet and audio_cnn do")
    cap_gpu_memory(config.get("gpu_memory_fraction"))  # gpu: auto's share: an overrun fails here, not next door
    core = apply_memory(build(len(open_source(spec.dataset).classes), config).to(device), config.get("memory"))
    model = distributed.prepare(core)  # DDP in a Ray Train worker of several; checkpoints hold the core's state
    optimizer = make_optimizer(model, config)
    epochs = int(config["epochs"])
    state = session.restore()
    done = int(state["epoch"]) if state else 0
    if done >= epochs:
        logger.info("the checkpoint is of epoch %d of %d: nothing left to train", done, epochs)
        return
    loss_fn = nn.CrossEntropyLoss()
    batch_size = int(config["batch_size"])
    with train_loader(config, batch_size=batch_size, epochs=epochs - done, echo=config.get("echo")) as loader:
        per_epoch = loader.fresh_batches_per_epoch  # schedule steps per epoch: fresh batches, echoes aside
        scheduler = torch.optim.lr_scheduler.OneCycleLR(
            optimizer, max_lr=float(config["lr"]), total_steps=epochs * per_epoch, pct_start=0.25
        )
        if state:
            _load(state, core, optimizer, scheduler, config)
        for epoch in range(done, epochs):
            model.train()
            wait = compute = train_loss = 0.0
            seen = steps = 0
            batches = iter(loader)
            while True:
                t0 = time.perf_counter()
                batch = next(batches, None)
                t1 = time.perf_counter()
                wait += t1 - t0
                if batch is None:
                    break
                loss = train_step(model, optimizer, loss_fn, batch.images, batch.labels, device)
                _advance(scheduler, epoch * per_epoch + loader.epoch_counts.fresh // batch_size)
                train_loss += loss * len(batch)
                seen += len(batch)
                steps += 1
                compute += time.perf_counter() - t1
            _advance(scheduler, (epoch + 1) * per_epoch)  # the epoch's last, partial batch of fresh samples
            eval_loss, accuracy = evaluate(core, config, device, loss_fn)  # the core: no collectives
            metrics = {"epoch": epoch + 1, "loss": eval_loss, "accuracy": accuracy,
                       "train_loss": train_loss / max(seen, 1), "samples": seen,
                       "private_samples": loader.private_samples, "data_wait_s": wait, "compute_s": compute,
                       "stall_fraction": wait / max(wait + compute, 1e-9),
                       "copied_fraction": loader.stats.copied_fraction,
                       "loader_cpu_ms_per_batch": loader.stats.cpu_ms_per_batch, "steps": steps,
                       "fresh_samples": loader.epoch_counts.fresh, "echoed_samples": loader.epoch_counts.echoed,
                       "fresh_samples_total": loader.echo_counts.fresh,
                       "echoed_samples_total": loader.echo_counts.echoed}
            session.report(metrics, {"epoch": epoch + 1, "lr": float(config["lr"]), "model": core.state_dict(),
                                     "optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict()})


def _advance(scheduler: torch.optim.lr_scheduler.LRScheduler, step: int) -> None:
    """Step ``scheduler`` up to schedule step ``step`` (no further than its end)."""
    while scheduler.last_epoch < min(step, scheduler.total_steps):  # type: ignore[attr-defined]
        scheduler.step()


def _load(state: Mapping[str, Any], model: nn.Module, optimizer: torch.optim.Optimizer,
          scheduler: torch.optim.lr_scheduler.LRScheduler, config: Mapping[str, Any]) -> None:
    """Resume from ``state``, keeping this trial's hyperparameters where PBT changed them."""
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    scheduler.load_state_dict(state["scheduler"])
    scale = float(config["lr"]) / float(state["lr"])  # 1.0 unless PBT perturbed lr
    for group in optimizer.param_groups:
        for key in ("lr", "initial_lr", "max_lr", "min_lr"):
            group[key] *= scale
        group["weight_decay"] = float(config.get("weight_decay", 5e-4))
    scheduler.base_lrs = [lr * scale for lr in scheduler.base_lrs]
    scheduler._last_lr = [group["lr"] for group in optimizer.param_groups]  # what get_last_lr() reports


def train_step(model: nn.Module, optimizer: torch.optim.Optimizer, loss_fn: nn.Module, images: torch.Tensor,
               labels: torch.Tensor, device: torch.device) -> float:
    """One optimisation step on a uint8 batch; returns its mean loss."""
    logits = model(normalize(images, device))
    loss = loss_fn(logits, labels.to(device))
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    optimizer.step()
    return loss.item()


def make_optimizer(model: nn.Module, config: Mapping[str, Any]) -> torch.optim.Optimizer:
    """SGD with Nesterov momentum from the config's ``lr``, ``momentum`` and ``weight_decay``."""
    return torch.optim.SGD(model.parameters(), lr=float(config["lr"]), momentum=float(config.get("momentum", 0.9)),
                           weight_decay=float(config.get("weight_decay", 5e-4)), nesterov=True)


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
