"""``resources_per_trial: {gpu: auto}``: measure each configuration's peak on the GPU, then pack.

Tune needs one resource request for all the trials of a sweep, so every trial gets the share of
the most demanding configuration (:func:`~coordinated_prep.memory.packing.pack`). The peaks are
measured in a child process, so that the driver holds no CUDA context (and no GPU memory) while
the trials run. On a machine without a GPU, ``gpu: auto`` falls back to CPU trials (``gpu: 0``)
with a warning, so a sweep written for a GPU node also runs on a laptop.
"""

from __future__ import annotations

import logging
import warnings
from typing import Callable, Mapping

from coordinated_prep.memory_tool.configs import MemoryConfig
from coordinated_prep.memory.packing import Packing, pack
from coordinated_prep.sweep.config import SweepConfig

logger = logging.getLogger(__name__)

NO_GPU = ("resources_per_trial.gpu: auto, but this machine has no GPU (torch.cuda.is_available() is false): "
          "the trials run on the CPU (gpu: 0); set gpu: 0 to silence this, or run the sweep on a GPU node")


def gpu_bytes() -> int | None:
    """GPU 0's memory in bytes, or None without CUDA."""
    import torch

    if not torch.cuda.is_available():
        return None
    return int(torch.cuda.get_device_properties(0).total_memory)


def plan_gpu(cfg: SweepConfig, gpu: int | None,
             measure: Callable[[SweepConfig], Mapping[str, int]] | None = None) -> Packing | None:
    """The packing of ``cfg``'s trials on GPUs of ``gpu`` bytes, or None (with a warning) when ``gpu`` is None.

    Args:
        cfg: A sweep with ``gpu_auto`` set.
        gpu: One GPU's memory (:func:`gpu_bytes`), None on a machine without one.
        measure: Peak bytes per configuration label; default: one step of each on the GPU, in a child process.

    Raises:
        ConfigError: a configuration does not fit one GPU (naming it and the bytes).
    """
    if cfg.gpu_auto is None:
        raise ValueError("plan_gpu: the sweep does not say gpu: auto")
    if gpu is None:
        warnings.warn(NO_GPU, stacklevel=2)
        return None
    peaks = (measure or measure_peaks)(cfg)
    packing = pack(peaks, gpu, cfg.gpu_auto.margin)
    logger.info("gpu: auto: %d trial(s) per GPU at %.4f of a GPU each (largest: %s, %.2f GiB with margin)",
                packing.per_gpu, packing.fraction, packing.worst, packing.need_bytes / 2**30)
    return packing


def measure_peaks(cfg: SweepConfig) -> dict[str, int]:
    """Each configuration's measured CUDA peak over its first training step, in a child process."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    from coordinated_prep.memory_tool.run import sweep_configs
    from coordinated_prep.pipeline.sources import open_source

    configs = sweep_configs(cfg)
    classes = len(open_source(cfg.data.dataset).classes)
    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        return pool.submit(_peaks, configs, classes).result()


def _peaks(configs: list[MemoryConfig], num_classes: int) -> dict[str, int]:
    import torch

    from coordinated_prep.memory_tool.run import measure_config

    device = torch.device("cuda")
    # No warm-up: the measured step is a trial's first, which holds the most (the budget mode profiles
    # its plan then, and the allocator and cuDNN set up their workspaces).
    return {c.label: measure_config(c, num_classes, device, steps=1, warmup=0).peak_bytes for c in configs}
