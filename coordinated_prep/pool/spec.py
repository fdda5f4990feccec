"""Configuration of the node-level prep pool and staging budget, and how the budget is split."""

from __future__ import annotations

import math

from dataclasses import dataclass
from typing import Any, Mapping

from coordinated_prep.cache.spec import parse_bytes
from coordinated_prep.errors import ConfigError, known_keys


@dataclass(frozen=True)
class PoolSpec:
    """The prep resources of every node of a sweep, shared by all the data groups on that node.

    Each node runs one pool of prep actors for the whole sweep (started before the first trial, so
    the first batch does not wait for processes to import torch) and one staging budget in its
    object store, split evenly among the data groups that have trials there. Sweeping a DataSpec
    field over k values therefore costs no more prep processes or object-store bytes than one group.

    Args:
        actors: Prep actors per node (each is single-threaded), fixed; ``None`` sizes the pool by
            demand: it starts one actor and grows, up to one per CPU of the node, while the trials
            wait for prepared data (:mod:`coordinated_prep.pool.elastic`; a pool lent by a
            ``keep_warm`` driver keeps the size it was lent).
        cpus: Logical CPUs the pool reserves per node from Ray's scheduler at its most (each actor
            reserves ``cpus / most actors``), so that Tune does not place trials on them; ``None``:
            half the node's CPUs. A pool sized by demand reserves only its live actors' share, and
            gives it back to Tune while its preparation runs ahead (:mod:`~coordinated_prep.pool.elastic`). ``0``
            reserves none (the actors then compete with the trials, unseen by the scheduler).
        staging_fraction: The node's staging budget as a fraction of its object store.
        staging_bytes: The node's staging budget in bytes (an integer or e.g. ``"512MiB"``);
            overrides ``staging_fraction``.
        start_timeout_s: Longest wait for a node's pool to be placed (its CPUs held) before the
            sweep fails with an error naming the node; also the longest a growing pool waits for
            a new actor to start before it gives that one up.
        eval_fraction: Share of the node's staging budget that the sweep's evaluation sets (the
            held-out split, prepared once per evaluation pipeline) may keep resident for the whole
            sweep; what does not fit is prepared again at each evaluation and streamed in order.
            The data groups share what the resident pieces leave.
        decoded_fraction: The node's decoded tier (:mod:`coordinated_prep.tier`) as a fraction of its
            object store: prefix outputs (decoded, resized samples) kept for every data group and
            epoch, so that from the second epoch on only the groups' random tails run; what does not
            fit is decoded again. Its objects live in the object store, which every prep actor of
            the node reads zero-copy, so the store is the resource it competes for (with staging):
            a quarter keeps the sum with staging's quarter at half, leaving the rest to the trials
            and evaluation, and never makes the store spill. ``0`` turns the tier off.
        decoded_bytes: The decoded tier's budget in bytes (``"2GiB"``); overrides ``decoded_fraction``.
        keep_warm: Keep the prep actors running when the sweep is closed, for the next sweep of the
            same driver process (a notebook, a script of sweeps): a pool of the same shape (actors
            and CPUs per node) then starts on them, without importing torch again
            (:mod:`coordinated_prep.pool.warm`). They hold their CPUs until then; a sweep closed
            without ``keep_warm``, :func:`~coordinated_prep.pool.warm.release` or the driver's
            exit ends them.
    """

    actors: int | None = None
    cpus: float | None = None
    staging_fraction: float = 0.25
    staging_bytes: int | str | None = None
    start_timeout_s: float = 180.0
    eval_fraction: float = 0.5
    decoded_fraction: float = 0.25
    decoded_bytes: int | str | None = None
    keep_warm: bool = False

    def __post_init__(self) -> None:
        if self.actors is not None and (not isinstance(self.actors, int) or isinstance(self.actors, bool)
                                        or self.actors < 1):
            raise ConfigError(f"pool.actors={self.actors!r} must be an integer >= 1 (or unset: one per CPU)")
        if self.cpus is not None and (not isinstance(self.cpus, (int, float)) or isinstance(self.cpus, bool)
                                      or not 0 <= self.cpus < math.inf):
            raise ConfigError(f"pool.cpus={self.cpus!r} must be a number >= 0 (or unset: half the node's CPUs)")
        if (not isinstance(self.staging_fraction, (int, float)) or isinstance(self.staging_fraction, bool)
                or not 0.0 < self.staging_fraction <= 0.9):
            raise ConfigError(f"pool.staging_fraction={self.staging_fraction!r} must be in (0, 0.9]")
        if self.staging_bytes is not None:
            object.__setattr__(self, "staging_bytes", parse_bytes(self.staging_bytes, "pool.staging_bytes"))
        if (not isinstance(self.eval_fraction, (int, float)) or isinstance(self.eval_fraction, bool)
                or not 0.0 <= self.eval_fraction <= 0.9):
            raise ConfigError(f"pool.eval_fraction={self.eval_fraction!r} must be in [0, 0.9] (0: evaluation "
                              "pieces are never kept, each evaluation prepares them again)")
        if (not isinstance(self.decoded_fraction, (int, float)) or isinstance(self.decoded_fraction, bool)
                or not 0.0 <= self.decoded_fraction <= 0.6):
            raise ConfigError(f"pool.decoded_fraction={self.decoded_fraction!r} must be in [0, 0.6] (0: no decoded "
                              "tier; with staging's share it must leave the trials part of the object store)")
        if self.decoded_bytes is not None:
            object.__setattr__(self, "decoded_bytes", parse_bytes(self.decoded_bytes, "pool.decoded_bytes", minimum=0))
        elif self.staging_bytes is None and self.staging_fraction + self.decoded_fraction > 0.9:
            raise ConfigError(f"pool.staging_fraction={self.staging_fraction} and pool.decoded_fraction="
                              f"{self.decoded_fraction} add up to more than 0.9 of the object store, which would "
                              "leave the trials none and make it spill; lower one of them")
        if not isinstance(self.keep_warm, bool):
            raise ConfigError(f"pool.keep_warm={self.keep_warm!r} must be true or false")
        if (not isinstance(self.start_timeout_s, (int, float)) or isinstance(self.start_timeout_s, bool)
                or not 0 < self.start_timeout_s < math.inf):
            raise ConfigError(f"pool.start_timeout_s={self.start_timeout_s!r} must be a positive number of seconds")

    @property
    def grows(self) -> bool:
        """Whether a pool of this spec is sized by demand (``actors`` unset): it starts with one actor."""
        return self.actors is None

    def actors_for(self, node_cpus: float) -> int:
        """Prep actors on a node with ``node_cpus`` CPUs (the most, for a pool sized by demand)."""
        return self.actors or max(1, int(node_cpus))

    def cpus_for(self, node_cpus: float) -> float:
        """Logical CPUs the pool reserves on a node with ``node_cpus`` CPUs."""
        return node_cpus / 2 if self.cpus is None else float(self.cpus)

    def shape_for(self, node_cpus: float) -> tuple[int, float]:
        """(prep actors, logical CPUs each) on a node with ``node_cpus`` CPUs: a pool's shape."""
        n = self.actors_for(node_cpus)
        return n, min(self.cpus_for(node_cpus), node_cpus) / n

    def budget_for(self, store_bytes: float) -> int:
        """The node's staging budget, for an object store of ``store_bytes``."""
        return int(self.staging_bytes) if self.staging_bytes is not None else int(store_bytes * self.staging_fraction)

    def check_store(self, store_bytes: float, node: str) -> None:
        """Refuse a staging budget and decoded tier that together take more than 0.9 of ``node``'s
        object store (``store_bytes``): the fractions are checked when the spec is made, byte counts
        only here, once the store's size is known.

        Raises:
            ConfigError: Naming both budgets, the store and the fix.
        """
        staging, decoded = self.budget_for(store_bytes), self.decoded_for(store_bytes)
        if staging + decoded > 0.9 * store_bytes:
            raise ConfigError(f"node {node[:12]}: the staging budget ({staging} bytes: pool.staging_bytes or "
                              f"staging_fraction) and the decoded tier ({decoded} bytes: pool.decoded_bytes or "
                              f"decoded_fraction) add up to more than 0.9 of its {int(store_bytes)}-byte object store, "
                              "which would leave the trials none and make it spill; lower one of them")

    def decoded_for(self, store_bytes: float) -> int:
        """The node's decoded tier budget, for an object store of ``store_bytes`` (0: no tier)."""
        if self.decoded_bytes is not None:
            return int(self.decoded_bytes)
        return int(store_bytes * self.decoded_fraction)

    @classmethod
    def from_mapping(cls, values: Mapping[str, Any], where: str = "pool") -> "PoolSpec":
        """Build from a plain mapping (YAML), rejecting unknown keys by name."""
        return cls(**known_keys(cls, values, where))


def split_budget(total: int, caps: Mapping[str, int | None]) -> dict[str, int]:
    """Split a node's staging budget among its data groups: equal shares, water-filled.

    A group whose own cap (``DataSpec.staging_bytes``) is below its equal share gets its cap, and
    what it leaves is shared by the others. The shares never add up to more than ``total``.

    Args:
        total: The node's budget in bytes.
        caps: Per group key, its cap in bytes or None for none.

    Returns:
        Per group key, its budget in bytes (at least 1).
    """
    shares: dict[str, int] = {}
    left, open_groups = total, dict(caps)
    while open_groups:
        equal = left // len(open_groups)
        capped = {k: c for k, c in open_groups.items() if c is not None and c <= equal}
        if not capped:
            for k in open_groups:
                shares[k] = max(1, equal)
            break
        for k, c in capped.items():
            shares[k] = max(1, c)  # type: ignore[arg-type]
            left -= c  # type: ignore[operator]
            del open_groups[k]
    return shares
