"""The training loop the ready trainables share: :func:`trainables.common.fit` and
:func:`trainables.loop.fit_task` are :func:`train` with a :class:`Recipe` each.

:func:`train` runs the preamble (:func:`setup`: torch threads, seed, device, model, optimizer, which
the benchmark's trial uses too), resumes from the session's checkpoint, opens the recipe's loader,
and per epoch makes one timed pass over it (:func:`run_epoch`, with
:func:`coordinated_prep.trial.timing.timed`), evaluates and reports. The recipe says what differs: the
model, the loader, one step on a batch, the held-out metrics and the report.

Rules kept here:
- Schedule: one cycle over ``epochs x loader.fresh_batches_per_epoch`` steps, moved after every
  batch to the step the recipe counts (:meth:`Recipe.schedule_step`), never past its end, and at
  each epoch's end to that epoch's last step.
- Resume: a checkpoint of epoch e resumes at epoch e + 1 with its model, optimizer and schedule; a
  ``lr`` PBT changed scales the schedule to the new peak, a changed ``weight_decay`` applies from
  the next step. A checkpoint of the last epoch trains nothing.
- The held-out evaluation and the checkpoint use the core model, never its DDP wrapper (no collectives).
"""

from __future__ import annotations

import abc
import logging
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Mapping, TypeVar

import torch
from torch import nn

from coordinated_prep.trial.timing import Timing, timed
from trainables import distributed
from trainables.session import Session, TuneSession

logger = logging.getLogger(__name__)

T = TypeVar("T")


class Recipe(abc.ABC):
    """What one trainable's loop does its own way; :func:`train` does the rest."""

    @abc.abstractmethod
    def build(self, config: Mapping[str, Any], device: torch.device) -> nn.Module:
        """The model on ``device`` (after checking what of ``config`` it needs)."""

    @abc.abstractmethod
    def loader(self, config: Mapping[str, Any], batch_size: int, epochs: int) -> Any:
        """The trial's ``train_loader`` (a context manager) for the ``epochs`` left."""

    @abc.abstractmethod
    def step(self, model: nn.Module, optimizer: torch.optim.Optimizer, loss_fn: nn.Module, batch: Any,
             device: torch.device) -> tuple[float, int]:
        """One optimisation step on ``batch``; returns its mean loss and its number of samples."""

    @abc.abstractmethod
    def evaluate(self, core: nn.Module, config: Mapping[str, Any], device: torch.device,
                 loss_fn: nn.Module) -> dict[str, float]:
        """The held-out metrics of ``core``, ``loss`` first."""

    @abc.abstractmethod
    def metrics(self, epoch: int, train: dict[str, float], held_out: dict[str, float], loader: Any) -> dict[str, Any]:
        """What epoch ``epoch`` (from 1) reports, from :func:`run_epoch`'s ``train``, ``held_out`` and the loader."""

    def schedule_step(self, loader: Any, timing: Timing, batch_size: int) -> int:
        """Where the schedule stands within the epoch after a batch: its share of the epoch's batches in
        fresh batches, so echoed or extra-view batches neither stretch nor overrun it, and the ranks of a
        data-parallel trial, which take as many steps whatever rows each holds (pads, echoes), keep one
        schedule (each rank's own fresh rows would put them a step apart: DDP would then average
        gradients taken at different learning rates)."""
        try:
            batches = len(loader)
        except TypeError:  # echo="auto": its epoch's batches are not known ahead (never with ranks)
            return loader.epoch_counts.fresh // batch_size
        return timing.steps * loader.fresh_batches_per_epoch // max(batches, 1)


@dataclass(frozen=True)
class Setup:
    """What :func:`setup` made: the device, the model (``core``), the model to train (``core`` in
    DistributedDataParallel in a Ray Train worker of several, else ``core``) and its optimizer."""

    device: torch.device
    core: nn.Module
    model: nn.Module
    optimizer: torch.optim.Optimizer


def setup(config: Mapping[str, Any], build: Callable[[torch.device], nn.Module],
          device: torch.device | None = None) -> Setup:
    """The preamble of a training loop: torch threads (``torch_threads``, default 1), the seed
    (``model_seed``, 0) and then ``build(device)`` on ``device`` (default
    :func:`trainables.distributed.device`), wrapped for DDP where it trains with others, and its
    optimizer (:func:`make_optimizer` of ``config``)."""
    torch.set_num_threads(int(config.get("torch_threads", 1)))
    torch.manual_seed(int(config.get("model_seed", 0)))  # reproducible initialisation per trial
    device = distributed.device() if device is None else device
    core = build(device)
    model = distributed.prepare(core)  # DDP in a Ray Train worker of several; checkpoints hold the core's state
    return Setup(device, core, model, make_optimizer(model, config))


def on_workers(config: Mapping[str, Any], loop: Callable[[dict], None]) -> bool:
    """Whether ``config`` asks for several Ray Train workers and this process is the Tune trial; if so,
    ``loop(config)`` has run on them (:func:`trainables.distributed.launch`)."""
    if distributed.workers_of(config) > 1 and not distributed.in_worker():
        distributed.launch(config, loop)
        return True
    return False


#: What :func:`run_epoch` returns, reported by every recipe each epoch with ``epoch``.
EPOCH_KEYS = frozenset({"epoch", "train_loss", "samples", "steps", "data_wait_s", "compute_s", "stall_fraction"})

#: Reported counts over the whole trial: a trial resumed from a checkpoint goes on from the checkpoint's.
TOTALS = frozenset({"fresh_samples_total", "echoed_samples_total"})


def train(config: Mapping[str, Any], recipe: Recipe, session: Session | None = None) -> None:
    """Train as ``recipe`` says for ``config["epochs"]`` epochs (``lr``, ``batch_size``; optional
    ``momentum``, ``weight_decay``, ``torch_threads``, ``model_seed``) and report each epoch with
    its checkpoint to ``session`` (default: Ray Train's in a Ray Train worker, else Tune's)."""
    session = session or (distributed.TrainSession() if distributed.in_worker() else TuneSession())
    s = setup(config, lambda device: recipe.build(config, device))
    epochs, batch_size = int(config["epochs"]), int(config["batch_size"])
    state = session.restore()
    done = int(state["epoch"]) if state else 0
    totals = {**dict.fromkeys(TOTALS, 0), **(state or {}).get("totals", {})}  # a resumed trial's go on
    if done >= epochs:
        logger.info("the checkpoint is of epoch %d of %d: nothing left to train", done, epochs)
        return
    loss_fn = nn.CrossEntropyLoss()
    with recipe.loader(config, batch_size, epochs - done) as loader:
        per_epoch = loader.fresh_batches_per_epoch  # schedule steps per epoch: fresh batches, echoes aside
        scheduler = one_cycle(s.optimizer, config, epochs * per_epoch)
        if state:
            _load(state, s.core, s.optimizer, scheduler, config)
        for epoch in range(done, epochs):
            first = epoch * per_epoch
            metrics = run_epoch(
                s.model, loader, lambda batch: recipe.step(s.model, s.optimizer, loss_fn, batch, s.device),
                lambda timing: _advance(scheduler, first + recipe.schedule_step(loader, timing, batch_size)))
            _advance(scheduler, first + per_epoch)  # the epoch's last, partial batch of fresh samples
            held_out = recipe.evaluate(s.core, config, s.device, loss_fn)  # the core: no collectives
            report = recipe.metrics(epoch + 1, metrics, held_out, loader)
            for key in TOTALS & report.keys():  # the loader counts this run's samples only
                report[key] += totals[key]
            session.report(report, {"epoch": epoch + 1, "lr": float(config["lr"]), "model": s.core.state_dict(),
                                    "optimizer": s.optimizer.state_dict(), "scheduler": scheduler.state_dict(),
                                    "totals": {key: report[key] for key in TOTALS & report.keys()}})


def run_epoch(model: nn.Module, batches: Iterable[T], step: Callable[[T], tuple[float, int]],
              after_step: Callable[[Timing], None]) -> dict[str, float]:
    """One timed training pass over ``batches``: ``step(batch)`` -> (mean loss, samples), then
    ``after_step(timing)`` (the schedule). Returns ``train_loss``, ``samples``, ``steps``,
    ``data_wait_s``, ``compute_s`` and ``stall_fraction`` (the share of the pass spent waiting for batches)."""
    model.train()
    timing, loss_sum, seen = Timing(), 0.0, 0
    for batch in timed(batches, timing):
        loss, n = step(batch)
        after_step(timing)
        loss_sum += loss * n
        seen += n
    return {"train_loss": loss_sum / max(seen, 1), "samples": seen, "steps": timing.steps, "data_wait_s": timing.wait,
            "compute_s": timing.compute, "stall_fraction": timing.stall_fraction}


def make_optimizer(model: nn.Module, config: Mapping[str, Any]) -> torch.optim.Optimizer:
    """SGD with Nesterov momentum from the config's ``lr``, ``momentum`` and ``weight_decay``."""
    return torch.optim.SGD(model.parameters(), lr=float(config["lr"]), momentum=float(config.get("momentum", 0.9)),
                           weight_decay=float(config.get("weight_decay", 5e-4)), nesterov=True)


def one_cycle(optimizer: torch.optim.Optimizer, config: Mapping[str, Any], total_steps: int) -> Any:
    """The one-cycle schedule to ``lr`` over ``total_steps``; its momentum cycles below the config's
    ``momentum`` where it is given (OneCycleLR's own 0.85 to 0.95 would overwrite it)."""
    momentum = {}
    if "momentum" in config:
        m = float(config["momentum"])
        momentum = {"max_momentum": m, "base_momentum": min(0.85, m)}
    # a warm-up of exactly one step is a division by zero in OneCycleLR (4 steps at 0.25)
    pct_start = 0.25 if total_steps * 0.25 != 1 else 0.3
    return torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=float(config["lr"]), total_steps=total_steps,
                                               pct_start=pct_start, **momentum)


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
        if "momentum" in config and "max_momentum" in group:  # PBT may have changed it too
            group["max_momentum"], group["base_momentum"] = float(config["momentum"]), min(0.85, float(config["momentum"]))
    scheduler.base_lrs = [lr * scale for lr in scheduler.base_lrs]
    scheduler._last_lr = [group["lr"] for group in optimizer.param_groups]  # what get_last_lr() reports


__all__ = ["Recipe", "Setup", "make_optimizer", "on_workers", "one_cycle", "run_epoch", "setup", "train"]
