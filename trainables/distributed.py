"""Data-parallel trials: a ready trainable with ``workers: k`` trains on k Ray Train workers (DDP).

The Tune trial runs a ``TorchTrainer`` (Train V2) of ``workers`` workers, each running the same
training loop: the model is wrapped in ``DistributedDataParallel`` (gloo on CPUs, NCCL on GPUs),
each rank's :func:`~coordinated_prep.train_loader` reads its share of the trial's epochs from the
group's shared stream (``batch_size`` is per rank), rank 0's metrics reach Tune
(``TuneReportCallback``) and rank 0 writes the checkpoints. A worker that dies makes Ray Train
restart the whole worker group (``worker_failures`` times, default 0), which resumes from the last
checkpoint with exact epochs. The checkpoints (the newest two) stay with the Ray Train run, on this
node under the temp directory per experiment and trial; Tune never receives them, so a sweep refuses
PBT and PB2, which copy Tune checkpoints between trials, for ``workers`` > 1.

Config keys read here: ``workers`` (1: train in the trial's own process), ``cpu_per_worker``
(0.25), ``gpu_per_worker`` (0; above 0 the workers use CUDA and NCCL), ``worker_failures`` (0).
"""

from __future__ import annotations

import os
import tempfile
from typing import Any, Callable, Mapping

import torch
from torch import nn

from coordinated_prep.context import whereabouts
from coordinated_prep.errors import ConfigError
from trainables.session import load_state, save_state


def workers_of(config: Mapping[str, Any]) -> int:
    """``config["workers"]``, checked: the Ray Train workers a trial trains on (1: none)."""
    k = config.get("workers", 1)
    if not isinstance(k, int) or isinstance(k, bool) or k < 1:
        raise ConfigError(f"config workers={k!r} must be an integer >= 1 (the Ray Train workers of each trial)")
    return k


def in_worker() -> bool:
    """Whether this process is a Ray Train worker."""
    return whereabouts().train


def launch(config: Mapping[str, Any], loop: Callable[[dict], None]) -> None:
    """Run ``loop(config)`` on ``config["workers"]`` Ray Train workers of this Tune trial; returns when they end.

    Raises:
        ConfigError: A bad ``workers``, ``cpu_per_worker``, ``gpu_per_worker`` or ``worker_failures``.
    """
    from ray import tune
    from ray.train import CheckpointConfig, FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer
    from ray.tune.integration.ray_train import TuneReportCallback

    k = workers_of(config)
    cpus, gpus = config.get("cpu_per_worker", 0.25), config.get("gpu_per_worker", 0)
    failures = config.get("worker_failures", 0)
    for name, value in (("cpu_per_worker", cpus), ("gpu_per_worker", gpus), ("worker_failures", failures)):
        if not isinstance(value, (int, float)) or isinstance(value, bool) or value < 0:
            raise ConfigError(f"config {name}={value!r} must be a number >= 0")
    context = tune.get_context()
    trial = context.get_trial_id() or "trial"
    resources = {"CPU": float(cpus), **({"GPU": float(gpus)} if gpus else {})}
    storage = os.path.join(tempfile.gettempdir(), "coordprep-train", context.get_experiment_name() or "sweep")
    trainer = TorchTrainer(
        loop, train_loop_config=dict(config),
        scaling_config=ScalingConfig(num_workers=k, use_gpu=bool(gpus), resources_per_worker=resources),
        run_config=RunConfig(name=trial, storage_path=storage, failure_config=FailureConfig(max_failures=int(failures)),
                             checkpoint_config=CheckpointConfig(num_to_keep=2),  # bounded: a restart resumes from the newest
                             callbacks=[TuneReportCallback()]))
    trainer.fit()


def device() -> torch.device:
    """Where this process trains: its own GPU in a Ray Train worker (``ray.train.torch.get_device``),
    else the first GPU if any, else the CPU."""
    if in_worker():
        from ray.train.torch import get_device

        return get_device()
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def prepare(model: nn.Module) -> nn.Module:
    """``model`` wrapped for data-parallel training in a Ray Train worker of several (DDP); as it is elsewhere."""
    if whereabouts().world == 1:
        return model
    from ray.train.torch import prepare_model

    return prepare_model(model)


class TrainSession:
    """Ray Train's side of :class:`trainables.session.Session`: every rank reports its metrics (Tune
    sees rank 0's), rank 0 writes the checkpoint, and a restarted worker group resumes from it."""

    def restore(self) -> dict[str, Any] | None:
        import ray.train

        checkpoint = ray.train.get_checkpoint()
        return None if checkpoint is None else load_state(checkpoint)

    def report(self, metrics: dict[str, Any], state: dict[str, Any]) -> None:
        import ray.train

        if ray.train.get_context().get_world_rank() != 0:
            ray.train.report(metrics)
            return
        with tempfile.TemporaryDirectory(prefix="coordprep-ckpt-") as d:
            save_state(d, state)
            ray.train.report(metrics, checkpoint=ray.train.Checkpoint.from_directory(d))
