"""Trial packing: the GPU fraction a trial's measured peak needs, and how many trials share a GPU.

Pure arithmetic over byte counts, tested without a GPU. Ray's fractional GPUs are logical only:
the fraction tells Tune how many trials to place on one GPU, and each trial caps its own CUDA
allocator to the same fraction (:func:`cap_gpu_memory`), so a trial that outgrows its share fails
with an out-of-memory error of its own instead of starving its neighbours.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Mapping

from coordinated_prep.errors import ConfigError

#: Ray accounts fractional resources in units of 1/10000.
RESOLUTION = 10_000
DEFAULT_MARGIN = 0.1
#: GPU memory each trial process uses outside its allocator (the CUDA context), an estimate.
CONTEXT_BYTES = 512 * 2**20


@dataclass(frozen=True)
class Packing:
    """How the trials of a sweep share each GPU.

    Attributes:
        fraction: Each trial's GPU share (Tune's ``gpu`` resource).
        memory_fraction: The cap on each trial's CUDA allocator, as a fraction of the GPU: its share
            less the CUDA context, which the allocator does not count.
        per_gpu: Trials that fit on one GPU at that share.
        need_bytes: The largest measured peak over the sweep's configurations, margin and context included.
        gpu_bytes: One GPU's memory.
        worst: The configuration that needs ``need_bytes``.
    """

    fraction: float
    memory_fraction: float
    per_gpu: int
    need_bytes: int
    gpu_bytes: int
    worst: str


def need_bytes(peak_bytes: int, margin: float = DEFAULT_MARGIN, context_bytes: int = CONTEXT_BYTES) -> int:
    """GPU bytes one trial needs: its measured peak plus ``margin`` of it, plus its CUDA context."""
    return math.ceil(peak_bytes * (1.0 + margin)) + context_bytes


def gpu_fraction(peak_bytes: int, gpu_bytes: int, margin: float = DEFAULT_MARGIN, what: str = "the trial",
                 context_bytes: int = CONTEXT_BYTES) -> float:
    """The GPU share for a trial whose measured peak is ``peak_bytes``: ``1/k`` for the largest ``k``
    trials of :func:`need_bytes` that fit in ``gpu_bytes``, rounded down to Ray's resolution.

    Raises:
        ConfigError: the trial cannot fit one GPU (naming ``what``, the bytes needed and the GPU's), or
            an argument is out of range.
    """
    if gpu_bytes <= 0 or peak_bytes <= 0 or margin < 0 or context_bytes < 0:
        raise ConfigError(f"gpu_fraction(peak_bytes={peak_bytes}, gpu_bytes={gpu_bytes}, margin={margin}, "
                          f"context_bytes={context_bytes}): bytes must be positive and margin >= 0")
    need = need_bytes(peak_bytes, margin, context_bytes)
    per_gpu = min(gpu_bytes // need, RESOLUTION)  # Ray's smallest share is 1/RESOLUTION of a GPU
    if per_gpu < 1:
        raise ConfigError(f"{what} needs {need / 2**30:.2f} GiB ({peak_bytes} bytes measured + {margin:.0%} margin "
                          f"+ {context_bytes} bytes of CUDA context) "
                          f"but one GPU has {gpu_bytes / 2**30:.2f} GiB ({gpu_bytes} bytes); use memory: checkpoint "
                          "or a smaller budget, a smaller batch_size or crop size")
    return math.floor(RESOLUTION / per_gpu) / RESOLUTION


def pack(peaks: Mapping[str, int], gpu_bytes: int, margin: float = DEFAULT_MARGIN,
         context_bytes: int = CONTEXT_BYTES) -> Packing:
    """One GPU share for every trial of a sweep: the share the largest peak needs.

    Tune needs one resource request per trainable, so every configuration gets the share of the most
    demanding one (smaller ones leave part of their share unused).

    Args:
        peaks: Measured peak bytes per configuration label.
        gpu_bytes: One GPU's memory.
        margin: Head-room on top of each peak (0.1 = 10 %) for fragmentation and allocator slack.
        context_bytes: Each trial's memory outside the allocator (its CUDA context).

    Raises:
        ConfigError: ``peaks`` is empty, or the largest configuration cannot fit one GPU.
    """
    if not peaks:
        raise ConfigError("pack: no configurations measured")
    worst = max(peaks, key=peaks.__getitem__)
    fraction = gpu_fraction(peaks[worst], gpu_bytes, margin, worst, context_bytes)
    need = need_bytes(peaks[worst], margin, context_bytes)
    memory_fraction = math.floor(RESOLUTION * (fraction * gpu_bytes - context_bytes) / gpu_bytes) / RESOLUTION
    return Packing(fraction, memory_fraction, min(gpu_bytes // need, RESOLUTION), need, gpu_bytes, worst)


def cap_gpu_memory(fraction: float | None) -> bool:
    """Cap this process's CUDA allocator to ``fraction`` of GPU 0 (``Packing.memory_fraction``, which
    ``gpu: auto`` puts in the trial config as ``gpu_memory_fraction``).

    Returns whether a cap was set: nothing happens without a fraction or without CUDA.
    """
    if fraction is None:
        return False
    if not isinstance(fraction, (int, float)) or isinstance(fraction, bool) or not 0.0 < fraction <= 1.0:
        raise ConfigError(f"gpu_memory_fraction={fraction!r} must be a number in (0, 1]")
    import torch

    if not torch.cuda.is_available():
        return False
    torch.cuda.set_per_process_memory_fraction(float(fraction))
    return True


@dataclass(frozen=True)
class GpuAuto:
    """``resources_per_trial: {gpu: auto, gpu_margin: m}``: measure, then pack trials onto GPUs.

    Attributes:
        margin: Head-room on top of each measured peak (default 0.1).
    """

    margin: float = DEFAULT_MARGIN

    def __post_init__(self) -> None:
        m = self.margin
        if not isinstance(m, (int, float)) or isinstance(m, bool) or not 0.0 <= m <= 10.0:
            raise ConfigError(f"resources_per_trial.gpu_margin={m!r} must be a number in [0, 10] "
                              "(0.1 = 10 % head-room over the measured peak)")
