"""Exceptions raised by coordinated_prep, each naming the thing at fault and the fix."""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping


class CoordinatedPrepError(Exception):
    """Base class of every error this library raises on purpose."""


class ConfigError(CoordinatedPrepError, ValueError):
    """A configuration value (Python or YAML) is missing, unknown, of the wrong type or impossible."""


class DatasetError(CoordinatedPrepError):
    """A dataset cannot be used: missing path, no classes, no images, unreadable files."""


class CacheError(CoordinatedPrepError):
    """The node cache cannot be used: it cannot start (its arena cannot be reserved), or a file that
    claims to be its arena is not the one it created."""


class SampleError(CoordinatedPrepError):
    """One sample could not be read or decoded; names the sample index and its file."""

    def __init__(self, index: int, path: str, reason: str) -> None:
        super().__init__(f"sample {index} ({path}): {reason}")
        self.index = index
        self.path = path
        self.reason = reason

    def __reduce__(self):  # keep the fields when Ray pickles the error across processes
        return (SampleError, (self.index, self.path, self.reason))


class StructureError(CoordinatedPrepError, ValueError):
    """A pipeline's samples do not share one structure (nesting, dtypes, shapes of stacked leaves),
    or hold a leaf no batch can; names the sample, the leaf and the fix."""


class PrepError(CoordinatedPrepError):
    """Shared preparation failed for a trial: re-raised in the trial that asked, naming it."""


def known_keys(cls: type, values: Mapping[str, Any], where: str) -> dict[str, Any]:
    """``values`` as keyword arguments of dataclass ``cls``; an unknown key is a ConfigError naming it
    and the allowed ones (what every ``from_mapping`` of a frozen configuration checks first)."""
    if not isinstance(values, Mapping):
        raise ConfigError(f"{where} must be a mapping, got {type(values).__name__}")
    allowed = [f.name for f in dataclasses.fields(cls) if f.init]
    unknown = sorted(set(values) - set(allowed), key=str)
    if unknown:
        raise ConfigError(f"{where}: unknown key(s) {unknown}; allowed keys are {allowed}")
    return dict(values)
