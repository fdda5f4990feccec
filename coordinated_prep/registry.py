"""The group registry: one actor per sweep that owns the data groups' coordinators.

Ownership chain, top to bottom (each owner's death takes what it owns with it):
CoordinatedSearcher (driver) -> GroupRegistry -> Coordinator per group and node -> prep actors and pieces;
GroupRegistry -> RawCache per node (when the sweep has a cache) -> cached samples.
"""

from __future__ import annotations

import asyncio
import copy
import itertools
import logging
from dataclasses import dataclass, field
from typing import Any

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from coordinated_prep.cache.layout import CacheLayout
from coordinated_prep.cache.spec import CacheSpec
from coordinated_prep.cache.start import start_caches
from coordinated_prep.coordinator import Coordinator, node_resources
from coordinated_prep.naming import NAMESPACE
from coordinated_prep.spec import DataSpec

logger = logging.getLogger(__name__)

_CALL_TIMEOUT_S = 30.0
_KEPT_INCARNATIONS = 50  # per group, the most recent coordinators' own counters kept in reports
_SUMMED = ("samples_prepared", "samples_served", "pieces_prepared", "pieces_failed", "trials_joined",
           "fetch_s", "transform_s", "put_s", "prep_cpu_s", "evictions", "storage_reads", "cache_hits")


@dataclass
class _Group:
    spec: DataSpec
    actor: Any
    trials: set[str] = field(default_factory=set)


@ray.remote(num_cpus=0, max_concurrency=1000)
class GroupRegistry:
    """Creates a group's coordinator on a node when the group's first trial there joins, and
    destroys it when the last one there leaves.

    A data group has one coordinator per node its trials run on, each with its own prep actors,
    so a trial always reads from its own node. With a cache, the registry starts one cache actor
    on every node alive when the first group starts, and destroys them in :meth:`shutdown`.

    Args:
        session: The searcher's session id, part of every actor name.
        cache: The sweep's node cache, or None for none.
    """

    def __init__(self, session: str, cache: CacheSpec | None = None) -> None:
        self.session = session
        self._cache_spec = cache
        self._layout: CacheLayout | None = None
        self._caches: dict[str, Any] = {}
        self._cache_start: asyncio.Future | None = None  # start_caches, once
        self._groups: dict[str, _Group] = {}
        self._trial_group: dict[str, str] = {}
        self._finished: dict[str, dict[str, Any]] = {}
        self._incarnation = itertools.count()

    async def group_for(self, spec: DataSpec, trial: str, node: str | None = None) -> Any:
        """The coordinator of ``spec``'s group on node ``node`` (default: the registry's), created if
        needed; ``trial`` becomes a member."""
        node = node or node_resources()[0]
        key = f"{spec.group_key}@{node[:12]}"
        if self._trial_group.get(trial, key) != key:  # the trial changed its data spec (e.g. PBT) or node
            await self.trial_done(trial)
        caches = await self._ensure_caches()  # awaited before the lookup: none between it and the insert
        group = self._groups.get(key)
        if group is None:
            name = f"coordprep-{self.session}-{spec.group_key}-{node[:8]}-{next(self._incarnation)}"
            actor = Coordinator.options(
                name=name, namespace=NAMESPACE,
                scheduling_strategy=NodeAffinitySchedulingStrategy(node_id=node, soft=False),
            ).remote(spec, name, caches)
            group = self._groups[key] = _Group(spec, actor)
            logger.info("data group %s: started %s on node %s", spec.group_key, name, node)
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
            _merge(self._finished, group.spec.group_key,
                   await asyncio.wait_for(group.actor.report.remote(), _CALL_TIMEOUT_S), group.spec)
            await asyncio.wait_for(group.actor.close.remote(), _CALL_TIMEOUT_S)
        except (ray.exceptions.RayError, asyncio.TimeoutError) as e:
            logger.warning("data group %s: coordinator did not close cleanly: %r", key, e)
        ray.kill(group.actor)
        logger.info("data group %s: last trial left; coordinator destroyed", key)

    async def reports(self) -> dict[str, dict[str, Any]]:
        """Per group: counters summed over its coordinators so far, live ones included."""
        out = copy.deepcopy(self._finished)  # live coordinators are merged into a copy, not the totals
        for key, group in list(self._groups.items()):
            try:
                _merge(out, group.spec.group_key, await asyncio.wait_for(group.actor.report.remote(), _CALL_TIMEOUT_S),
                       group.spec)
            except (ray.exceptions.RayError, asyncio.TimeoutError) as e:
                logger.warning("data group %s: no report: %s", key, e)
        return out

    async def cache_reports(self) -> dict[str, dict[str, Any]]:
        """Per node: the cache's counters (hits local and remote, misses, storage reads, bytes held),
        or ``{"lost": True}`` for a cache that no longer answers (its node left)."""
        out: dict[str, dict[str, Any]] = {}
        for node, actor in self._caches.items():
            try:
                out[node] = await asyncio.wait_for(actor.report.remote(), _CALL_TIMEOUT_S)
            except (ray.exceptions.RayError, asyncio.TimeoutError) as e:
                logger.warning("cache on node %s: no report: %r", node, e)
                out[node] = {"node": node, "lost": True}
        return out

    async def shutdown(self) -> None:
        """Destroy every group, then the node caches."""
        for trial in list(self._trial_group):
            await self.trial_done(trial)
        for node, actor in self._caches.items():
            try:
                await asyncio.wait_for(actor.clear.remote(), _CALL_TIMEOUT_S)
            except (ray.exceptions.RayError, asyncio.TimeoutError):
                pass  # gone with its node already
            ray.kill(actor)
        self._caches.clear()

    async def _ensure_caches(self) -> tuple[CacheLayout, CacheSpec] | None:
        """Start a cache on every live node (once, when the first group starts) and wait until each has
        reserved its memory; the layout. Raises CacheError (to every joining trial) if one cannot."""
        if self._cache_spec is None:
            return None
        if self._cache_start is None:  # concurrent first joins all wait for this one start
            nodes = tuple(sorted(n["NodeID"] for n in ray.nodes() if n["Alive"]))
            self._layout = CacheLayout(self.session, nodes, self._cache_spec.seed, self._cache_spec.partitioned)
            self._cache_start = asyncio.ensure_future(start_caches(self._cache_spec, self._layout))
        self._caches = await asyncio.shield(self._cache_start)
        return self._layout, self._cache_spec


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
    nodes = acc.setdefault("nodes", [])
    if live.get("node") and live["node"] not in nodes:
        nodes.append(live["node"])
    for k in ("budget_bytes", "prep_actors", "samples_per_epoch"):
        acc[k] = live.get(k)
