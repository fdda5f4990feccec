"""The group registry: one actor per sweep that owns the data groups' coordinators.

Ownership chain, top to bottom (each owner's death takes what it owns with it):
CoordinatedSearcher (driver) -> GroupRegistry -> Coordinator per group -> prep actors and pieces.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from dataclasses import dataclass, field
from typing import Any

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from coordinated_prep.coordinator import Coordinator, node_resources
from coordinated_prep.naming import NAMESPACE
from coordinated_prep.spec import DataSpec

logger = logging.getLogger(__name__)

_CALL_TIMEOUT_S = 30.0
_KEPT_INCARNATIONS = 50  # per group, the most recent coordinators' own counters kept in reports
_SUMMED = ("samples_prepared", "samples_served", "pieces_prepared", "pieces_failed", "trials_joined",
           "fetch_s", "transform_s", "put_s", "prep_cpu_s", "evictions")


@dataclass
class _Group:
    spec: DataSpec
    actor: Any
    trials: set[str] = field(default_factory=set)


@ray.remote(num_cpus=0, max_concurrency=1000)
class GroupRegistry:
    """Creates a group's coordinator when its first trial joins and destroys it when the last leaves.

    Args:
        session: The searcher's session id, part of every actor name.
    """

    def __init__(self, session: str) -> None:
        self.session = session
        self._groups: dict[str, _Group] = {}
        self._trial_group: dict[str, str] = {}
        self._finished: dict[str, dict[str, Any]] = {}
        self._incarnation = itertools.count()

    async def group_for(self, spec: DataSpec, trial: str) -> Any:
        """The coordinator of ``spec``'s group on this node, created if needed; ``trial`` becomes a member."""
        key = spec.group_key
        if self._trial_group.get(trial, key) != key:  # the trial changed its data spec (e.g. PBT)
            await self.trial_done(trial)
        group = self._groups.get(key)
        if group is None:
            name = f"coordprep-{self.session}-{key}-{next(self._incarnation)}"
            node_id, _, _ = node_resources()
            actor = Coordinator.options(
                name=name, namespace=NAMESPACE,
                scheduling_strategy=NodeAffinitySchedulingStrategy(node_id=node_id, soft=False),
            ).remote(spec, name)
            group = self._groups[key] = _Group(spec, actor)
            logger.info("data group %s: started %s", key, name)
        group.trials.add(trial)
        self._trial_group[trial] = key
        return group.actor

    async def trial_done(self, trial: str) -> None:
        """``trial`` ended for good: it leaves its group, and an empty group is destroyed."""
        key = self._trial_group.pop(trial, None)
        if key is None:
            return
        group = self._groups[key]
        group.trials.discard(trial)
        if group.trials:
            try:
                await asyncio.wait_for(group.actor.leave.remote(trial), _CALL_TIMEOUT_S)
            except (ray.exceptions.RayError, asyncio.TimeoutError) as e:
                logger.warning("data group %s: trial %s could not leave cleanly: %r", key, trial, e)
            return
        del self._groups[key]  # before any await, so a concurrent join starts a fresh group
        try:
            _merge(self._finished, key, await asyncio.wait_for(group.actor.report.remote(), _CALL_TIMEOUT_S),
                   group.spec)
            await asyncio.wait_for(group.actor.close.remote(), _CALL_TIMEOUT_S)
        except (ray.exceptions.RayError, asyncio.TimeoutError) as e:
            logger.warning("data group %s: coordinator did not close cleanly: %r", key, e)
        ray.kill(group.actor)
        logger.info("data group %s: last trial left; coordinator destroyed", key)

    async def reports(self) -> dict[str, dict[str, Any]]:
        """Per group: counters summed over its coordinators so far, live ones included."""
        out = {k: dict(v) for k, v in self._finished.items()}
        for key, group in list(self._groups.items()):
            try:
                _merge(out, key, await asyncio.wait_for(group.actor.report.remote(), _CALL_TIMEOUT_S), group.spec)
            except (ray.exceptions.RayError, asyncio.TimeoutError) as e:
                logger.warning("data group %s: no report: %s", key, e)
        return out

    async def shutdown(self) -> None:
        """Destroy every group."""
        for trial in list(self._trial_group):
            await self.trial_done(trial)


def _merge(reports: dict[str, dict[str, Any]], key: str, live: dict[str, Any], spec: DataSpec) -> None:
    acc = reports.setdefault(key, {"dataset": spec.dataset, "seed": spec.seed, "coordinators": 0,
                                   "peak_staged_bytes": 0, **{k: 0 for k in _SUMMED}})
    acc["coordinators"] += 1
    kept = acc.setdefault("per_coordinator", [])
    kept.append({k: live.get(k) for k in ("coordinator", "samples_prepared", "samples_served", "pieces_prepared")})
    del kept[:-_KEPT_INCARNATIONS]
    for k in _SUMMED:
        acc[k] += live.get(k, 0)
    acc["peak_staged_bytes"] = max(acc["peak_staged_bytes"], live.get("peak_staged_bytes", 0))
    acc["samples_skipped"] = max(acc.get("samples_skipped", 0), live.get("samples_skipped", 0))
    for k in ("budget_bytes", "prep_actors", "samples_per_epoch"):
        acc[k] = live.get(k)
