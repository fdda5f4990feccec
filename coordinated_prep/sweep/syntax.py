"""The sweep file's building blocks: search-space dimensions and the check of a mapping's keys."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal, Mapping

from coordinated_prep.errors import ConfigError

DISTRIBUTIONS = ("choice", "grid", "uniform", "loguniform", "randint")
#: Single keys that make a mapping a constant, not a distribution: ``memory: {budget: 0.3}``.
CONSTANT_MAPPINGS = ("budget",)
#: Keys of a constant mapping of several keys: an echo setting ({mode: batch, factor: 2, buffer: 128}).
ECHO_KEYS = ("mode", "factor", "buffer")


@dataclass(frozen=True)
class Dimension:
    """One search-space entry: a Tune distribution over ``args``."""

    kind: Literal["choice", "grid", "uniform", "loguniform", "randint"]
    args: tuple[Any, ...]

    def to_tune(self) -> Any:
        """The Tune search-space object."""
        from ray import tune

        if self.kind == "choice":
            return tune.choice(list(self.args))
        if self.kind == "grid":
            return tune.grid_search(list(self.args))
        return getattr(tune, self.kind)(*self.args)


def parse_dimension(where: str, value: Any) -> Any:
    """A constant as it is, or ``{distribution: arguments}`` as a :class:`Dimension`; errors name ``where``.

    A mapping whose one key is in :data:`CONSTANT_MAPPINGS` is a constant (``{budget: 0.3}``): no
    distribution has that name, and any other unknown key is still an error (a misspelt ``choice``).
    """
    if isinstance(value, Mapping) and len(value) == 1 and next(iter(value)) in CONSTANT_MAPPINGS:
        return dict(value)
    if isinstance(value, Mapping) and "mode" in value and set(value) <= set(ECHO_KEYS):
        return dict(value)  # an echo setting, checked where the key is (sweep.config)
    if not isinstance(value, Mapping):
        if isinstance(value, (int, float, str, bool, list)) or value is None:
            return value  # a constant
        raise ConfigError(f"{where}={value!r} must be a constant or a mapping {{distribution: arguments}}")
    if len(value) != 1 or next(iter(value)) not in DISTRIBUTIONS:
        raise ConfigError(f"{where}: {dict(value)!r} must have exactly one key out of {list(DISTRIBUTIONS)} "
                          f"(a distribution), or be a constant {{budget: f}} or {{mode: m, factor: e}}")
    kind, args = next(iter(value.items()))
    if not isinstance(args, list) or not args:
        raise ConfigError(f"{where}.{kind} must be a non-empty list")
    if kind in ("uniform", "loguniform", "randint"):
        if len(args) != 2 or not all(is_number(a) for a in args):
            raise ConfigError(f"{where}.{kind}={args!r} must be [low, high] numbers")
        if not args[0] < args[1] or (kind == "loguniform" and args[0] <= 0):
            raise ConfigError(f"{where}.{kind}={args!r} needs low < high" + (" and low > 0" if kind == "loguniform" else ""))
        if kind == "randint" and not all(isinstance(a, int) for a in args):
            raise ConfigError(f"{where}.randint={args!r} must be integers")
    return Dimension(kind, tuple(args))


def check_keys(value: Any, allowed: tuple[str, ...], where: str) -> None:
    """Reject a non-mapping, or a mapping with keys outside ``allowed``, naming them and the allowed ones."""
    if not isinstance(value, Mapping):
        raise ConfigError(f"{where} must be a mapping")
    unknown = sorted(set(value) - set(allowed), key=str)
    if unknown:
        raise ConfigError(f"{where}: unknown key(s) {unknown}; allowed: {list(allowed)}")


def is_number(value: Any) -> bool:
    """An int or float, not a bool (YAML's ``true`` is not a number here)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def is_int(value: Any) -> bool:
    """An int, not a bool."""
    return isinstance(value, int) and not isinstance(value, bool)
