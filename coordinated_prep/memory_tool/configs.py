"""The distinct (model, width, batch size, crop size, memory mode) of a sweep, for ``coordprep memory``.

Pure Python over a validated SweepConfig (no torch): ``choice`` and ``grid`` keys contribute every
value; a continuous distribution (``uniform``, ``loguniform``, ``randint``) contributes the middle
of its range, as ``coordprep analyze`` does; a constant contributes itself. The crop size is the
sweep's ``data.pipeline.size``, or the values of the search-space key ``data.pipeline.size`` when it has one.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from typing import Any

from coordinated_prep.memory.spec import MemoryMode, parse_memory
from coordinated_prep.sweep.syntax import Dimension


@dataclass(frozen=True)
class MemoryConfig:
    """One configuration whose training step ``coordprep memory`` measures."""

    trainable: str
    batch_size: int
    size: int
    width: int | None
    memory: MemoryMode

    @property
    def label(self) -> str:
        """E.g. ``resnet18 b64 224px checkpoint`` (``w16`` after the name when a width is set)."""
        width = f" w{self.width}" if self.width is not None else ""
        return f"{self.trainable}{width} b{self.batch_size} {self.size}px {self.memory.label}"

    def trial_config(self) -> dict[str, Any]:
        """The trial-config keys the model builder reads."""
        config: dict[str, Any] = {"batch_size": self.batch_size, "memory": self.memory.to_config()}
        if self.width is not None:
            config["width"] = self.width
        return config


def values(value: Any) -> list[Any]:
    """The values ``coordprep memory`` measures for one search-space entry (see the module docstring)."""
    if not isinstance(value, Dimension):
        return [value]
    if value.kind in ("choice", "grid"):
        out: list[Any] = []
        for v in value.args:
            if v not in out:
                out.append(v)
        return out
    low, high = value.args
    if value.kind == "loguniform":
        return [math.sqrt(low * high)]
    if value.kind == "uniform":
        return [(low + high) / 2]
    return [(low + high - 1) // 2]  # randint: [low, high)


def memory_configs(trainable: str, space: dict[str, Any], size: int) -> list[MemoryConfig]:
    """Every distinct configuration of ``space`` that changes a training step's memory.

    Args:
        trainable: The registered trainable's name.
        space: The sweep's search space (constants and Dimensions).
        size: The crop size (``data.pipeline.size``), unless the space searches ``data.pipeline.size``.
    """
    batches = [int(b) for b in values(space["batch_size"])]
    sizes = [int(s) for s in values(space.get("data.pipeline.size", size))]
    widths = [int(w) for w in values(space["width"])] if "width" in space else [None]
    modes = [parse_memory(m, "search_space.memory") for m in values(space.get("memory", "none"))]
    unique: list[MemoryConfig] = []
    for b, s, w, m in itertools.product(batches, sizes, widths, modes):
        config = MemoryConfig(trainable, b, s, w, m)
        if config not in unique:
            unique.append(config)
    return unique
