"""``coordprep memory``: one training step per configuration of a sweep, measured."""

from __future__ import annotations

import logging
import os
import platform
from dataclasses import asdict
from typing import Any, Callable

import torch

from coordinated_prep.errors import ConfigError
from coordinated_prep.memory.configs import MemoryConfig, memory_configs
from coordinated_prep.memory.measure import StepMemory, measure_step
from coordinated_prep.memory.modes import apply_memory
from coordinated_prep.sweep.config import SweepConfig

logger = logging.getLogger(__name__)


def sweep_configs(cfg: SweepConfig) -> list[MemoryConfig]:
    """The distinct configurations of ``cfg`` (see :mod:`coordinated_prep.memory.configs`)."""
    from trainables import MODELS

    if cfg.trainable not in MODELS:
        raise ConfigError(f"trainable={cfg.trainable!r}: coordprep memory measures the registered trainables' "
                          f"models only ({sorted(MODELS)})")
    return memory_configs(cfg.trainable, dict(cfg.search_space), cfg.data.pipeline.size)  # type: ignore[union-attr]


def measure_config(config: MemoryConfig, num_classes: int, device: torch.device, steps: int = 3,
                   warmup: int = 1, seed: int = 0) -> StepMemory:
    """Build the trainable's model in ``config``'s memory mode and measure its training step on a
    random batch (normalised values, as the trainables feed their models)."""
    from trainables import MODELS
    from trainables.common import make_optimizer

    torch.manual_seed(seed)
    trial = {**config.trial_config(), "lr": 0.01}
    model = apply_memory(MODELS[config.trainable](num_classes, trial).to(device), config.memory)
    model.train()
    images = torch.randn(config.batch_size, 3, config.size, config.size, device=device)
    labels = torch.randint(0, num_classes, (config.batch_size,), device=device)
    try:
        return measure_step(model, make_optimizer(model, trial), images, labels, steps=steps, warmup=warmup)
    finally:
        del model, images
        if device.type == "cuda":
            torch.cuda.empty_cache()


def run_memory(cfg: SweepConfig, steps: int = 3, warmup: int = 1, threads: int | None = None,
               progress: Callable[[dict[str, Any]], None] | None = None) -> dict[str, Any]:
    """Measure every configuration of ``cfg``; returns the report :mod:`~coordinated_prep.memory.report` renders."""
    from coordinated_prep.sources import open_source

    if steps < 1 or warmup < 0:
        raise ConfigError(f"memory: --steps={steps} must be >= 1 and --warmup={warmup} >= 0")
    if threads is not None:
        if threads < 1:
            raise ConfigError(f"memory: --threads={threads} must be >= 1")
        torch.set_num_threads(threads)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    num_classes = len(open_source(cfg.data.dataset).classes)
    rows = []
    for config in sweep_configs(cfg):
        logger.info("measuring %s (%d warm-up + %d timed steps on %s)", config.label, warmup, steps, device)
        m = measure_config(config, num_classes, device, steps, warmup)
        row = {"config": config.label, "trainable": config.trainable, "batch_size": config.batch_size,
               "size": config.size, "width": config.width, "memory": config.memory.label, **asdict(m)}
        rows.append(row)
        if progress is not None:
            progress(row)
    return {"experiment": cfg.path, "device": _device_name(device), "threads": torch.get_num_threads(),
            "steps": steps, "warmup": warmup, "torch": torch.__version__, "rows": rows}


def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"CPU: {platform.processor() or platform.machine()}, {os.cpu_count()} cores ({platform.node()})"
