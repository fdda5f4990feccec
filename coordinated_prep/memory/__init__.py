"""More trials per accelerator: memory modes for the trainables, their measurement, and trial packing.

Modules, one idea each: :mod:`.spec` (the ``memory:`` key, no torch), :mod:`.stages` (a model's
stages), :mod:`.modes` (checkpointing applied to a model), :mod:`.budget` (the budget plan),
:mod:`.norms` (batch-norm statistics kept through a recomputation, for both),
:mod:`.measure` (one step's memory and time), :mod:`.packing` (GPU shares, no torch). The
``coordprep memory`` tool and ``gpu: auto``, which import the sweep and the trainables, are in
:mod:`coordinated_prep.memory_tool`. Only the names below that need torch import it, on first use.
"""

from __future__ import annotations

import importlib
from typing import Any

from coordinated_prep.memory.packing import GpuAuto, Packing, cap_gpu_memory, gpu_fraction, pack
from coordinated_prep.memory.spec import MemoryMode, parse_memory

__all__ = ["GpuAuto", "MemoryMode", "Packing", "apply_memory", "cap_gpu_memory", "gpu_fraction", "measure_step",
           "pack", "parse_memory"]

_LAZY = {"apply_memory": "coordinated_prep.memory.modes", "measure_step": "coordinated_prep.memory.measure"}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
