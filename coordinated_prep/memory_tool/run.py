"""``coordprep memory``: one training step per configuration of a sweep, measured."""

from __future__ import annotations

import logging
import os
import platform
from dataclasses import asdict
from typing import Any

import torch

from coordinated_prep.errors import ConfigError
from coordinated_prep.memory_tool.configs import MemoryConfig, memory_configs
from coordinated_prep.memory.measure import StepBench, StepMemory
from coordinated_prep.memory.modes import apply_memory
from coordinated_prep.sweep.config import SweepConfig

logger = logging.getLogger(__name__)


def sweep_configs(cfg: SweepConfig) -> list[MemoryConfig]:
    """The distinct configurations of ``cfg`` (see :mod:`coordinated_prep.memory_tool.configs`)."""
    from trainables import MODELS

    if cfg.trainable not in MODELS:
        raise ConfigError(f"trainable={cfg.trainable!r}: coordprep memory measures the registered trainables' "
                          f"models only ({sorted(MODELS)})")
    if cfg.data.user_transforms:
        raise ConfigError(f"memory: {cfg.path} brings its own dataset or transforms, whose input shape the measured "
                          "models (small_cnn, resnet18: 3 x size x size images) do not know; measure a sweep of those")
    return memory_configs(cfg.trainable, dict(cfg.search_space), cfg.data.pipeline.size)  # type: ignore[union-attr]


def prepare(config: MemoryConfig, num_classes: int, device: torch.device, seed: int = 0) -> StepBench:
    """The trainable's model in ``config``'s memory mode, its optimizer and a random batch (normalised
    values, as the trainables feed their models), ready to step."""
    from trainables import MODELS
    from trainables.common import make_optimizer

    torch.manual_seed(seed)
    trial = {**config.trial_config(), "lr": 0.01}
    model = apply_memory(MODELS[config.trainable](num_classes, trial).to(device), config.memory)
    model.train()
    images = torch.randn(config.batch_size, 3, config.size, config.size, device=device)
    labels = torch.randint(0, num_classes, (config.batch_size,), device=device)
    return StepBench(model, make_optimizer(model, trial), images, labels)


def measure_config(config: MemoryConfig, num_classes: int, device: torch.device, steps: int = 3,
                   warmup: int = 1) -> StepMemory:
    """Measure one configuration alone (on CUDA, its peak is its own)."""
    bench = prepare(config, num_classes, device)
    try:
        bench.warm_up(warmup)
        for _ in range(steps):
            bench.timed_step()
        return bench.result()
    finally:
        del bench
        if device.type == "cuda":
            torch.cuda.empty_cache()


def run_memory(cfg: SweepConfig, steps: int = 3, warmup: int = 1, threads: int | None = None) -> dict[str, Any]:
    """Measure every configuration of ``cfg``; returns the report :mod:`~coordinated_prep.memory_tool.report` renders.

    On a CPU the configurations are stepped in rounds (one step of each per round), so that load from
    other processes falls on all of them alike; on CUDA one after the other, so each peak is its own.
    """
    from coordinated_prep.pipeline.sources import open_source

    if steps < 1 or warmup < 0:
        raise ConfigError(f"memory: --steps={steps} must be >= 1 and --warmup={warmup} >= 0")
    if threads is not None:
        if threads < 1:
            raise ConfigError(f"memory: --threads={threads} must be >= 1")
        torch.set_num_threads(threads)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    num_classes = len(open_source(cfg.data.dataset).classes)
    configs = sweep_configs(cfg)
    logger.info("measuring %d configurations (%d warm-up + %d timed steps each, on %s)", len(configs), warmup,
                steps, device)
    if device.type == "cuda":
        results = [measure_config(c, num_classes, device, steps, warmup) for c in configs]
    else:
        benches = [prepare(c, num_classes, device) for c in configs]
        for bench in benches:
            bench.warm_up(warmup)
        for _ in range(steps):
            for bench in benches:
                bench.timed_step()
        results = [b.result() for b in benches]
    rows = [{"config": c.label, "trainable": c.trainable, "batch_size": c.batch_size, "size": c.size,
             "width": c.width, "memory": c.memory.label, **asdict(m)} for c, m in zip(configs, results)]
    return {"experiment": cfg.path, "device": _device_name(device), "threads": torch.get_num_threads(),
            "steps": steps, "warmup": warmup, "torch": torch.__version__, "rows": rows}


def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"CPU: {platform.processor() or platform.machine()}, {os.cpu_count()} cores ({platform.node()})"
