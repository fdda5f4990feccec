"""Configuration of the node-wide raw-data cache."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Mapping

from coordinated_prep.errors import ConfigError

_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "kib": 2**10, "mib": 2**20, "gib": 2**30}


def parse_bytes(value: Any, name: str, minimum: int = 1) -> int:
    """A byte count from an integer or a string such as ``"512MiB"`` or ``"2GB"``.

    Raises:
        ConfigError: Naming ``name`` and the value, if it is not a size of at least ``minimum``.
    """
    if isinstance(value, bool):
        raise ConfigError(f"{name}={value!r} must be a byte count such as 536870912 or '512MiB'")
    if isinstance(value, int):
        n = value
    else:
        match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kmg]i?b|b)?\s*", str(value), re.IGNORECASE)
        if not match:
            raise ConfigError(f"{name}={value!r} must be a byte count such as 536870912 or '512MiB' "
                              f"(units {sorted(u for u in _UNITS if u)})")
        n = int(float(match.group(1)) * _UNITS[(match.group(2) or "").lower()])
    if n < minimum:
        raise ConfigError(f"{name}={value!r} must be at least {minimum} byte{'s' if minimum != 1 else ''}")
    return n


@dataclass(frozen=True)
class CacheSpec:
    """A raw-data cache on every node, shared by every data group of the sweep on that node.

    It holds encoded samples (a JPEG stays a JPEG) in shared memory on the node with CoorDL's MinIO
    policy: the first samples read are kept until ``capacity_bytes`` is full and are never evicted,
    so from the second epoch on the hit rate equals the cached fraction, whatever the order.

    Args:
        capacity_bytes: Bytes cached per node (an integer, or a string such as ``"512MiB"``),
            reserved in the node's memory (``/dev/shm``, beside Ray's object store) when the
            cache starts.
        partitioned: With several nodes, each caches a disjoint part of the dataset (derived from
            ``seed``) and a miss on one node is read from the node caching it, through Ray, not
            from storage. ``False``: every node caches what its own prep actors read first.
        seed: Seed of the assignment of samples to nodes.
        timeout_s: Longest wait for a cache (local or remote) before reading from storage instead.
        read_threads: Storage reads a cache runs at once.
    """

    capacity_bytes: int | str
    partitioned: bool = True
    seed: int = 0
    timeout_s: float = 60.0
    read_threads: int = 4

    def __post_init__(self) -> None:
        object.__setattr__(self, "capacity_bytes", parse_bytes(self.capacity_bytes, "cache.capacity_bytes"))
        if not isinstance(self.partitioned, bool):
            raise ConfigError(f"cache.partitioned={self.partitioned!r} must be true or false")
        if not isinstance(self.seed, int) or isinstance(self.seed, bool) or self.seed < 0:
            raise ConfigError(f"cache.seed={self.seed!r} must be an integer >= 0")
        if not isinstance(self.timeout_s, (int, float)) or isinstance(self.timeout_s, bool) or self.timeout_s <= 0:
            raise ConfigError(f"cache.timeout_s={self.timeout_s!r} must be a positive number of seconds")
        if not isinstance(self.read_threads, int) or isinstance(self.read_threads, bool) or not 1 <= self.read_threads <= 64:
            raise ConfigError(f"cache.read_threads={self.read_threads!r} must be an integer in [1, 64]")

    @classmethod
    def from_mapping(cls, values: Mapping[str, Any], where: str = "cache") -> "CacheSpec":
        """Build from a plain mapping (YAML), rejecting unknown keys by name."""
        if not isinstance(values, Mapping):
            raise ConfigError(f"{where} must be a mapping such as {{capacity_bytes: 512MiB}}, got {values!r}")
        allowed = ["capacity_bytes", "partitioned", "seed", "timeout_s", "read_threads"]
        unknown = sorted(set(values) - set(allowed))
        if unknown:
            raise ConfigError(f"{where}: unknown key(s) {unknown}; allowed keys are {allowed}")
        if "capacity_bytes" not in values:
            raise ConfigError(f"{where}: capacity_bytes is required, e.g. {{capacity_bytes: 512MiB}}")
        return cls(**values)
