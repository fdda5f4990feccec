"""The registry's reports: per data group, node pool, node cache and decoded tier, summed over coordinators."""

from __future__ import annotations

import asyncio
import copy
import logging
from typing import Any

import ray

from coordinated_prep.naming import CALL_TIMEOUT_S
from coordinated_prep.spec import DataSpec

logger = logging.getLogger(__name__)
_KEPT_INCARNATIONS = 50  # per group, the most recent coordinators' own counters kept in reports
_SUMMED = ("samples_prepared", "samples_served", "pieces_prepared", "pieces_failed", "trials_joined",
           "fetch_s", "transform_s", "put_s", "prep_cpu_s", "evictions", "storage_reads", "cache_hits",
           "released_dead", "stall_s", "pieces_passed", "pieces_kept", "pieces_reused", "decodes", "tier_hits",
           "cohorts")


class Reports:
    """The registry's reports (:class:`~coordinated_prep.stream.registry.GroupRegistry` inherits them).

    They read the registry's groups, pools and caches, and ``_finished`` (the counters of coordinators
    that ended, summed per group); they own nothing.
    """

    async def reports(self) -> dict[str, dict[str, Any]]:
        """Per group: counters summed over its coordinators so far, live ones included."""
        out = copy.deepcopy(self._finished)  # live coordinators are merged into a copy, not the totals
        for key, group in list(self._groups.items()):
            try:
                _merge(out, group.spec.group_key, await asyncio.wait_for(group.actor.report.remote(), CALL_TIMEOUT_S),
                       group.spec)
            except (ray.exceptions.RayError, asyncio.TimeoutError) as e:
                logger.warning("data group %s: no report: %s", key, e)
        return out

    async def loader_stats(self, trial: str, loader: int, stats: dict[str, Any]) -> None:
        """What a trial's loader measured so far (epochs read, data wait, stall), sent at the end of each
        epoch (:class:`~coordinated_prep.trial.loader.TrainLoader`). Per trial the loader that has read
        the most epochs is kept (a retry's new loader once it catches up; one loader of several
        datasets), so a loader made anew for every epoch reports one. Bounded by the trials of the sweep."""
        kept = self._loaders.get(trial)
        if kept is None or kept[0] == loader or stats.get("epochs", 0) >= kept[1].get("epochs", 0):
            self._loaders[trial] = (loader, dict(stats))

    async def loader_reports(self) -> dict[str, dict[str, Any]]:
        """Per trial (``<trial>@<rank>`` for a data-parallel rank): what its loader measured."""
        return {trial: stats for trial, (_, stats) in self._loaders.items()}

    async def pools(self) -> dict[str, dict[str, Any]]:
        """Per node: prep actors (and, for a pool sized by demand, its growth: most actors, decisions),
        reserved CPUs, staging budget, and each live group's share of it."""
        return {node: {"prep_actors": len(p.actors), "reserved_cpus": p.reserved_cpus, "budget_bytes": p.budget_bytes,
                       "growth": p.growth.report() if p.growth is not None else None,
                       "eval_resident_bytes": self._eval_bytes(node),
                       "groups": {k: self._share(node, k, p) for k, g in self._groups.items() if g.node == node}}
                for node, p in self._pools.items()}

    async def cache_reports(self) -> dict[str, dict[str, Any]]:
        """Per node: the cache's counters (hits local and remote, misses, storage reads, bytes held),
        or ``{"lost": True}`` for a cache that no longer answers (its node left)."""
        out: dict[str, dict[str, Any]] = {}
        for node, actor in self._caches.items():
            try:
                out[node] = await asyncio.wait_for(actor.report.remote(), CALL_TIMEOUT_S)
            except (ray.exceptions.RayError, asyncio.TimeoutError) as e:
                logger.warning("cache on node %s: no report: %r", node, e)
                out[node] = {"node": node, "lost": True}
        return out

    async def decoded_reports(self) -> dict[str, dict[str, Any]]:
        """Per node with a decoded tier: its counters, bytes and samples kept (:meth:`DecodedTier.report`)."""
        out: dict[str, dict[str, Any]] = {}
        for node, pool in self._pools.items():
            try:
                report = await pool.tier_report()
            except (ray.exceptions.RayError, asyncio.TimeoutError) as e:
                logger.warning("decoded tier on node %s: no report: %r", node, e)
                report = {"node": node, "lost": True}
            if report is not None:
                out[node] = report
        return out


def _merge(reports: dict[str, dict[str, Any]], key: str, live: dict[str, Any], spec: DataSpec) -> None:
    acc = reports.setdefault(key, {"dataset": spec.dataset if isinstance(spec.dataset, str) else spec.dataset_name, "seed": spec.seed, "coordinators": 0,
                                   "coordinator_failures": 0, "peak_staged_bytes": 0, **{k: 0 for k in _SUMMED}})
    if live.get("coordinator_failures"):
        acc["coordinator_failures"] += live["coordinator_failures"]
        return
    acc["coordinators"] += 1
    kept = acc.setdefault("per_coordinator", [])
    kept.append({k: live.get(k) for k in ("coordinator", "samples_prepared", "samples_served", "pieces_prepared")})
    del kept[:-_KEPT_INCARNATIONS]
    for k in _SUMMED:
        acc[k] += live.get(k, 0)
    acc["peak_staged_bytes"] = max(acc["peak_staged_bytes"], live.get("peak_staged_bytes", 0))
    acc["samples_skipped"] = max(acc.get("samples_skipped", 0), live.get("samples_skipped", 0))
    by_epoch = acc.setdefault("decodes_by_epoch", {})
    for epoch, n in (live.get("decodes_by_epoch") or {}).items():
        by_epoch[epoch] = by_epoch.get(epoch, 0) + n
    acc.setdefault("ranks", {}).update(live.get("ranks") or {})  # data-parallel trial -> its workers
    acc.setdefault("starts", {}).update(live.get("starts") or {})  # trial -> the piece it joined at (last incarnation)
    nodes = acc.setdefault("nodes", [])
    if live.get("node") and live["node"] not in nodes:
        nodes.append(live["node"])
    for k in ("budget_bytes", "prep_actors", "samples_per_epoch"):
        acc[k] = live.get(k)
