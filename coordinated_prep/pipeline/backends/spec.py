"""The built-in backends' configuration: ``PipelineSpec``, frozen and validated at construction."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Literal, Mapping

from coordinated_prep.errors import ConfigError, known_keys

Backend = Literal["torchvision", "dali"]
BACKENDS: tuple[str, ...] = ("torchvision", "dali")


def _pair(name: str, value: Any) -> tuple[float, float]:
    try:
        if isinstance(value, (str, bytes)) or any(isinstance(v, (bool, str)) for v in value):
            raise TypeError("not numbers")  # YAML's true would read as 1.0, a string's characters as digits
        low, high = (float(v) for v in value)
    except (TypeError, ValueError):
        raise ConfigError(f"{name}={value!r} must be a pair of numbers [low, high]") from None
    if not (0 < low <= high):
        raise ConfigError(f"{name}={value!r} must satisfy 0 < low <= high")
    return low, high


@dataclass(frozen=True)
class PipelineSpec:
    """Declarative preprocessing: decode, then augment for training or resize for evaluation.

    Training: decode -> random resized crop to ``size`` -> horizontal flip with probability
    ``hflip``. Evaluation: decode -> resize the shorter side to ``eval_resize`` -> centre crop
    to ``size``. Outputs are ``uint8`` arrays of shape ``(3, size, size)``; normalisation to
    float is the trial's job, on its own device.

    Args:
        size: Side of the square output, in pixels.
        scale: Range of the crop's area as a fraction of the source image's area.
        ratio: Range of the crop's aspect ratio (width / height).
        hflip: Probability of a horizontal flip.
        eval_resize: Shorter side before the evaluation centre crop; defaults to ``size * 8 / 7``.
        backend: Library that decodes and transforms.
    """

    size: int = 112
    scale: tuple[float, float] = (0.25, 1.0)
    ratio: tuple[float, float] = (3 / 4, 4 / 3)
    hflip: float = 0.5
    eval_resize: int | None = None
    backend: Backend = "torchvision"

    def __post_init__(self) -> None:
        if not isinstance(self.size, int) or isinstance(self.size, bool) or not 8 <= self.size <= 4096:
            raise ConfigError(f"data.pipeline.size={self.size!r} must be an integer in [8, 4096]")
        scale = _pair("data.pipeline.scale", self.scale)
        if scale[1] > 1.0:
            raise ConfigError(f"data.pipeline.scale={self.scale!r}: the upper bound must be at most 1.0")
        object.__setattr__(self, "scale", scale)
        object.__setattr__(self, "ratio", _pair("data.pipeline.ratio", self.ratio))
        if not isinstance(self.hflip, (int, float)) or isinstance(self.hflip, bool) or not 0.0 <= self.hflip <= 1.0:
            raise ConfigError(f"data.pipeline.hflip={self.hflip!r} must be a probability in [0, 1]")
        object.__setattr__(self, "hflip", float(self.hflip))
        if self.eval_resize is None:
            object.__setattr__(self, "eval_resize", math.ceil(self.size * 8 / 7))
        elif not isinstance(self.eval_resize, int) or self.eval_resize < self.size:
            raise ConfigError(
                f"data.pipeline.eval_resize={self.eval_resize!r} must be an integer >= size={self.size} "
                "(the centre crop must fit inside the resized image)"
            )
        if self.backend not in BACKENDS:
            raise ConfigError(f"data.pipeline.backend={self.backend!r} is not one of {list(BACKENDS)}")

    @property
    def sample_bytes(self) -> int:
        """Bytes of one prepared sample (uint8, 3 x size x size)."""
        return 3 * self.size * self.size

    @classmethod
    def from_mapping(cls, values: Mapping[str, Any], where: str = "pipeline") -> "PipelineSpec":
        """Build from a plain mapping (YAML or a Python dict), rejecting unknown keys by name."""
        return cls(**known_keys(cls, values, where))
