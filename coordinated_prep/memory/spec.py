"""The ``memory:`` trial-config key, parsed into a frozen :class:`MemoryMode` (no torch here)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal, Mapping

from coordinated_prep.errors import ConfigError

#: What ``memory:`` may hold, for error messages.
ALLOWED = "none, checkpoint or {budget: f} with 0 < f <= 1"


@dataclass(frozen=True)
class MemoryMode:
    """How a trainable trades compute for activation memory.

    Attributes:
        kind: ``none`` (autograd saves what it needs), ``checkpoint`` (each stage keeps only its input
            and recomputes the rest in backward) or ``budget`` (each stage keeps its input plus the
            outputs with the most compute per byte, up to ``budget`` of the activation bytes of ``none``).
        budget: The fraction of ``none``'s activation bytes to keep; only with ``kind="budget"``.
    """

    kind: Literal["none", "checkpoint", "budget"] = "none"
    budget: float | None = None

    def __post_init__(self) -> None:
        if self.kind not in ("none", "checkpoint", "budget"):
            raise ConfigError(f"memory={self.kind!r} must be one of {ALLOWED}")
        if self.kind == "budget":
            b = self.budget
            if not isinstance(b, (int, float)) or isinstance(b, bool) or not 0.0 < b <= 1.0:
                raise ConfigError(f"memory.budget={b!r} must be a number in (0, 1]: the fraction of the "
                                  "activation bytes (of memory: none) to keep, e.g. {budget: 0.3}")
            object.__setattr__(self, "budget", float(b))
        elif self.budget is not None:
            raise ConfigError(f"memory={self.kind!r} takes no budget (got budget={self.budget!r}); "
                              "write memory: {budget: f} for a budget")

    @property
    def label(self) -> str:
        """A short name for tables and figures: ``none``, ``checkpoint``, ``budget=0.3``."""
        return f"budget={self.budget:g}" if self.kind == "budget" else self.kind

    def to_config(self) -> Any:
        """The value as a trial config holds it (the inverse of :func:`parse_memory`)."""
        return {"budget": self.budget} if self.kind == "budget" else self.kind


def parse_memory(value: Any, where: str = "memory") -> MemoryMode:
    """``none`` (or absent/null), ``checkpoint``, ``{budget: f}``, or a MemoryMode, as a MemoryMode.

    Raises:
        ConfigError: naming ``where``, the value and what is allowed.
    """
    if isinstance(value, MemoryMode):
        return value
    if value is None:
        return MemoryMode()
    if isinstance(value, str) and value in ("none", "checkpoint"):
        return MemoryMode(value)  # type: ignore[arg-type]
    if isinstance(value, Mapping) and set(value) == {"budget"}:
        try:
            return MemoryMode("budget", value["budget"])
        except ConfigError as e:
            raise ConfigError(f"{where}: {e}") from None
    raise ConfigError(f"{where}={value!r} must be {ALLOWED}")
