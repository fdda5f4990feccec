"""The group registry: one actor per sweep that owns the node prep pools and the groups' coordinators.

Ownership chain, top to bottom (each owner's death takes what it owns with it):
CoordinatedSearcher (driver) -> GroupRegistry -> NodePool per node (prep actors, staging budget)
                                              -> Coordinator per group and node -> pieces;
GroupRegistry -> EvalSet per evaluation pipeline -> resident evaluation pieces (until shutdown);
GroupRegistry -> RawCache per node (when the sweep has a cache) -> cached samples;
GroupRegistry -> the index of each ImageFolder per node (until shutdown; see sources/shared_index.py).

Membership (who keeps a group's coordinator alive) is kept per group key, apart from the coordinator
itself, and changes only under the key's lock, in one step per trial:

- ``group_for`` makes the trial a member *before* any await (the liveness check, the coordinator's
  start), so a completion in that window cannot empty the group under a starting trial; a failed
  start takes back only the membership it added.
- ``trial_done`` takes the same lock, so it waits for a start in progress, and destroys the
  coordinator only if no member is left. Members outlive a coordinator that died, so the completion
  of a dead member never destroys the replacement that its retried peers are building.
"""

from __future__ import annotations

import asyncio
import copy
import itertools
import logging
from dataclasses import dataclass
from typing import Any

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from coordinated_prep import metrics
from coordinated_prep.cache.layout import CacheLayout
from coordinated_prep.cache.spec import CacheSpec
from coordinated_prep.cache.start import start_caches
from coordinated_prep.coordinator import Coordinator
from coordinated_prep.errors import ConfigError, CoordinatedPrepError, DatasetError, PrepError
from coordinated_prep.eval_set import EvalSet, eval_key, eval_pieces, resident_prefix
from coordinated_prep.naming import NAMESPACE
from coordinated_prep.plan import piece_size
from coordinated_prep.pipeline.probe import PROBED
from coordinated_prep.pool.node import NodePool, node_table
from coordinated_prep.pool.spec import PoolSpec, split_budget
from coordinated_prep.pipeline.sources import folder_root
from coordinated_prep.pipeline.sources.fingerprint import Fingerprint, check_same_index
from coordinated_prep.pipeline.sources.shared_index import walk
from coordinated_prep.spec import DataSpec
from coordinated_prep.watch import Process, trial_of

logger = logging.getLogger(__name__)

_CALL_TIMEOUT_S = 30.0
#: A group's start on a node waits for the node's index of the dataset (a walk of an ImageFolder
#: tree, once per node) and then for the coordinator to fingerprint it, which stats every file: the
#: second bound grows with the files, ``_CALL_TIMEOUT_S`` plus this much per file (5 ms: an
#: ImageNet-sized tree, 1.28 M files, is allowed 1.8 h on a network filesystem answering slowly).
_STAT_S_PER_FILE = 0.005
_WALK_TIMEOUT_S = 3600.0  # the walk itself (readdir only), once per dataset and node
_LIVENESS_TIMEOUT_S = 10.0
_PLACE_TIMEOUT_S = 3 * _CALL_TIMEOUT_S  # placing a trial's ranks: a group's start and two calls to its coordinators
_KEPT_INCARNATIONS = 50  # per group, the most recent coordinators' own counters kept in reports
_SUMMED = ("samples_prepared", "samples_served", "pieces_prepared", "pieces_failed", "trials_joined",
           "fetch_s", "transform_s", "put_s", "prep_cpu_s", "evictions", "storage_reads", "cache_hits",
           "released_dead", "stall_s", "pieces_passed", "pieces_kept", "pieces_reused", "decodes", "tier_hits",
           "cohorts")


@dataclass
class _Group:
    spec: DataSpec
    node: str
    actor: Any


class GroupRegistry:
    """Starts a prep pool on every node, and a group's coordinator on a node when the group's first
    trial there joins; destroys the coordinator when the last one there leaves.

    A data group has one coordinator per node its trials run on, so a trial always reads from its
    own node; every coordinator of a node shares that node's prep pool and splits its staging
    budget evenly with the node's other groups. With a cache, the registry starts one cache actor
    on every node alive when the first group starts. :meth:`shutdown` destroys all of it.

    Plain Python: :data:`RegistryActor` runs it as the sweep's actor, and tests drive it on a plain
    asyncio loop with fake actor handles (``tests/test_registry.py``).

    Args:
        session: The searcher's session id, part of every actor name.
        cache: The sweep's node cache, or None for none.
        pool: The sweep's prep pool options.
    """

    def __init__(self, session: str, cache: CacheSpec | None = None, pool: PoolSpec | None = None) -> None:
        self.session = session
        self._cache_spec = cache
        self._pool_spec = pool or PoolSpec()
        self._layout: CacheLayout | None = None
        self._caches: dict[str, Any] = {}
        self._cache_start: asyncio.Future | None = None  # start_caches, once
        self._pools: dict[str, NodePool] = {}
        self._starting: dict[str, asyncio.Task] = {}
        self._groups: dict[str, _Group] = {}
        self._members: dict[str, set[str]] = {}  # group key -> its member trials (see the module docstring)
        self._trial_groups: dict[str, set[str]] = {}  # trial -> the keys of the groups it is a member of
        # (group, data-parallel trial) -> the rendezvous of its current worker group; bounded by the
        # trials, dropped when Tune reports the trial done
        self._rendezvous: dict[tuple[str, str], _Rendezvous] = {}
        self._finished: dict[str, dict[str, Any]] = {}
        self._incarnation = itertools.count()
        self._locks: dict[str, asyncio.Lock] = {}
        self._indexes: dict[str, tuple[str, Fingerprint]] = {}  # dataset -> (first node, its index's fingerprint)
        self._evals: dict[str, EvalSet] = {}  # eval_key -> the held-out split prepared for the sweep
        self._eval_turn = itertools.count()  # round robin of evaluation pieces over a pool's actors
        self._eval_watches: set[asyncio.Task] = set()  # strong references to _eval_settled tasks
        self._folder_indexes: dict[tuple[str, str], asyncio.Future] = {}  # (root, node) -> its index's reference

    async def start(self) -> dict[str, int]:
        """Start a prep pool on every live node with CPUs and wait until each is ready (warm start).

        Returns:
            Per node id, its number of prep actors.

        Raises:
            PrepError: A node's pool did not start (names the node and the fix).
        """
        nodes = [n for n, (cpus, _) in node_table().items() if cpus > 0]
        pools = await asyncio.gather(*(self._pool(n) for n in nodes))
        return {p.node: len(p.actors) for p in pools}

    async def group_for(self, spec: DataSpec, trial: str, node: str | None = None) -> Any:
        """The coordinator of ``spec``'s group on node ``node`` (default: the registry's), created if
        needed or if the one there died; ``trial`` becomes a member (a trial may be in several groups).

        Raises:
            PrepError, DatasetError: The group could not be started (the trial is then no member).
        """
        node = node or ray.get_runtime_context().get_node_id()
        key = f"{spec.group_key}@{node[:12]}"
        async with self._lock(key):  # one check-and-start per group at a time, and no completion inside it
            members = self._members.setdefault(key, set())
            added = trial not in members
            members.add(trial)  # before any await: see the module docstring
            self._trial_groups.setdefault(trial, set()).add(key)
            try:
                group = self._groups.get(key)
                if group is not None and not await _alive(group.actor):
                    logger.warning("data group %s: its coordinator died; starting a new one", key)
                    del self._groups[key]
                    _merge(self._finished, spec.group_key, {"coordinator_failures": 1}, spec)
                    group = None
                if group is None:
                    group = await self._start_group(key, spec, node)
            except BaseException:
                if added:
                    self._forget(trial, key)
                raise
            return group.actor

    async def meet(self, spec: DataSpec, trial: str, consumer: str, rank: int, world: int, node: str,
                   epochs: int | None, process: Any, timeout_s: float, workers: str | None = None) -> dict[str, Any]:
        """Rank ``rank`` of ``world`` of data-parallel ``trial`` arrives from ``node`` with its loader
        ``consumer`` (the trial id, or ``<trial>#<k>`` for its k-th loader); returns, once every rank
        of that loader has arrived, its coordinator and its place there.

        The ranks must read the same epochs, so they start on one piece, and each node's
        coordinator serves the ranks on its node:

        1. Another worker group (``workers``: Ray Train V2's id of the group, where it has one), a
           rank number that arrived already, or another world size is a new worker group (Ray
           Train restarted it after a failure): the old rendezvous is dropped. A rank that gives up
           waiting takes its arrival back, and the arrivals of ranks whose process ended on the
           registry's node are taken back at the next arrival (``_Rendezvous.drop_gone``), so a dead
           group's arrivals do not complete a new one (elsewhere, where Ray Train gives no group id,
           as V1: not before they time out).
        2. When all ``world`` ranks are there, each of their nodes' coordinators says the lowest
           join point it can serve from (what it still holds), the start is the highest, and each
           registers its own ranks there at once (``Coordinator.join_ranks``), keeping every piece
           from the start until each of them has fetched it.
        3. A node that no longer holds the start when asked to register (it released pieces in
           between) answers ``behind`` for its ranks, which then prepare their own pieces from the
           start: the same bytes, exactly once still.

        Raises:
            PrepError: The other ranks did not arrive, or were not placed, within ``timeout_s`` (named).
        """
        key = (spec.group_key, consumer)
        meeting = self._rendezvous.get(key)
        if meeting is not None and meeting.placing is None:
            meeting.drop_gone(ray.get_runtime_context().get_node_id())
        if (meeting is None or meeting.world != world or rank in meeting.arrivals
                or workers is not None and meeting.workers != workers):
            meeting = self._rendezvous[key] = _Rendezvous(world, workers)
        meeting.arrivals[rank] = (node, process, epochs)
        if len(meeting.arrivals) == world:
            meeting.placing = asyncio.ensure_future(self._place(spec, trial, consumer, meeting))
            async with meeting.arrived:
                meeting.arrived.notify_all()
        deadline = asyncio.get_running_loop().time() + timeout_s  # the bound for arriving and being placed
        try:
            async with meeting.arrived:
                await asyncio.wait_for(meeting.arrived.wait_for(lambda: meeting.placing is not None), timeout_s)
            # placing is quick and bounded itself; a rank that waited long for the last still sees it done
            left = max(_PLACE_TIMEOUT_S, deadline - asyncio.get_running_loop().time())
            placed = await asyncio.wait_for(asyncio.shield(meeting.placing), left)  # type: ignore[arg-type]
        except asyncio.TimeoutError:
            if meeting.placing is None:
                meeting.arrivals.pop(rank, None)  # gone: a later group must not count this rank as arrived
            missing = sorted(set(range(world)) - set(meeting.arrivals) - {rank})
            waited = f"for ranks {missing} to create their loaders" if missing else "for its ranks to be placed"
            raise PrepError(f"trial {trial}: rank {rank} of {world} waited {timeout_s}s {waited}; every rank must "
                            "call train_loader (raise data.fetch_timeout_s if the workers start slowly)") from None
        return placed[rank]

    async def _place(self, spec: DataSpec, trial: str, consumer: str,
                     meeting: "_Rendezvous") -> dict[int, dict[str, Any]]:
        """Register every rank of ``meeting`` on its node's coordinator at one start (see :meth:`meet`)."""
        by_node: dict[str, dict[int, Any]] = {}
        for rank, (node, process, _) in sorted(meeting.arrivals.items()):
            by_node.setdefault(node, {})[rank] = process
        epochs = meeting.arrivals[0][2]
        for attempt in (1, 2):  # a coordinator that died in between is replaced when asked again: once
            coordinators = {node: await self.group_for(spec, trial, node) for node in by_node}
            try:
                lows = await asyncio.wait_for(asyncio.gather(*(c.join_point.remote() for c in coordinators.values())),
                                              _CALL_TIMEOUT_S)
                break
            except ray.exceptions.RayActorError:
                if attempt == 2:
                    raise
                logger.warning("trial %s: a coordinator of group %s died as its ranks were placed; asking for a new one",
                               trial, spec.group_key)
        start = max(lows)
        answers = await asyncio.wait_for(
            asyncio.gather(*(coordinators[node].join_ranks.remote(consumer, ranks, meeting.world, start, epochs)
                             for node, ranks in by_node.items()), return_exceptions=True),
            _CALL_TIMEOUT_S)  # past it, ranks registered on a node are released by its watch when they fail
        failed = [a for a in answers if isinstance(a, BaseException)]
        if failed:  # no half-placed group: the ranks registered elsewhere leave again, and every rank fails
            for node, answer in zip(by_node, answers):
                if isinstance(answer, dict):
                    for rank, token in answer["tokens"].items():
                        coordinators[node].leave.remote(f"{consumer}@{rank}", token)
            raise failed[0]
        placed: dict[int, dict[str, Any]] = {}
        for node, answer in zip(by_node, answers):
            for rank in by_node[node]:
                placed[rank] = {"coordinator": coordinators[node], "start": start,
                                "info": None if answer is None else dict(answer["info"], token=answer["tokens"][rank],
                                                                          consumer=f"{consumer}@{rank}")}
        logger.info("trial %s: %d ranks on %d node(s) start at piece %d of group %s", trial, meeting.world,
                    len(by_node), start, spec.group_key)
        return placed

    async def folder_index(self, root: str, node: str) -> list[ray.ObjectRef]:
        """The index of ImageFolder ``root`` on ``node``, walked once per sweep and node (in a list:
        the caller gets the reference, not the index, and borrows the object).

        Raises:
            DatasetError: The walk found no usable ImageFolder.
        """
        key = (root, node)
        if key not in self._folder_indexes:  # concurrent first callers share one walk
            here = ray.get_runtime_context().get_node_id()
            self._folder_indexes[key] = asyncio.ensure_future(walk(root, node, here))
            logger.info("indexing dataset %s on node %s once for the sweep", root, node[:12])
        return [await asyncio.shield(self._folder_indexes[key])]

    async def trial_done(self, trial: str) -> None:
        """``trial`` ended for good: it leaves its groups, and a group left with no member is destroyed."""
        for key in [k for k in self._rendezvous if trial_of(k[1]) == trial]:
            del self._rendezvous[key]
        for key in sorted(self._trial_groups.get(trial, set())):
            async with self._lock(key):  # waits for a start in progress (see the module docstring)
                self._forget(trial, key)
                group = self._groups.get(key)
                if group is None:
                    continue
                if self._members.get(key):
                    try:
                        await asyncio.wait_for(group.actor.leave_trial.remote(trial), _CALL_TIMEOUT_S)
                    except (ray.exceptions.RayError, asyncio.TimeoutError) as e:
                        logger.warning("data group %s: trial %s could not leave cleanly: %r", key, trial, e)
                    continue
                del self._groups[key]
                await self._destroy(key, group)
            await self._split(group.node)

    async def eval_plan(self, spec: DataSpec, trial: str, node: str | None = None) -> dict[str, Any]:
        """One evaluation of ``trial`` with ``spec``'s pipeline: the resident pieces' references and
        the number of pieces (those past the resident ones come from :meth:`eval_piece`).

        The first call for a pipeline starts its preparation on ``node``'s pool (see
        :mod:`coordinated_prep.eval_set`); every later one, from any trial, prepares nothing.
        """
        node = node or ray.get_runtime_context().get_node_id()
        key = eval_key(spec)
        async with self._lock(key):  # one preparation per pipeline
            if key not in self._evals:
                self._evals[key] = await self._start_eval(key, spec, node)
        found = self._evals[key]
        for i in sorted(found.failed):  # a failed resident piece is not kept: prepared again for this one
            found.failed.discard(i)
            found.refs[i] = self._prepare_eval(found, i, resident=True)
            found.samples_prepared += len(found.pieces[i])
            metrics.inc("eval_samples_prepared", len(found.pieces[i]), pipeline=key)
        plan = found.plan()
        found.evaluations += 1
        found.samples_served += plan["samples"]
        metrics.inc("eval_samples_served", plan["samples"], pipeline=key)
        logger.debug("trial %s evaluates with %s", trial, key)
        return plan

    async def eval_piece(self, key: str, i: int) -> dict[str, Any]:
        """Evaluation piece ``i`` of ``key``, prepared now for one reader (it is past the resident ones)."""
        found = self._evals[key]
        indices = found.pieces[i]
        found.samples_prepared += len(indices)
        metrics.inc("eval_samples_prepared", len(indices), pipeline=key)
        return {"ref": self._prepare_eval(found, i, resident=False)}

    async def eval_reports(self) -> dict[str, dict[str, Any]]:
        """Per evaluation pipeline: held-out samples, resident pieces, prepared against served."""
        return {key: found.report() for key, found in self._evals.items()}

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

    async def pools(self) -> dict[str, dict[str, Any]]:
        """Per node: prep actors, reserved CPUs, staging budget, and each live group's share of it."""
        return {node: {"prep_actors": len(p.actors), "reserved_cpus": p.reserved_cpus, "budget_bytes": p.budget_bytes,
                       "eval_resident_bytes": self._eval_bytes(node),
                       "groups": {k: self._share(node, k, p) for k, g in self._groups.items() if g.node == node}}
                for node, p in self._pools.items()}

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

    async def shutdown(self) -> None:
        """Destroy every group, then the prep pools and the node caches."""
        for trial in list(self._trial_groups):
            await self.trial_done(trial)
        for key, group in list(self._groups.items()):  # groups whose coordinators were replaced
            del self._groups[key]
            await self._destroy(key, group)
        self._evals.clear()  # the resident evaluation pieces are freed with their references
        self._folder_indexes.clear()
        for pool in self._pools.values():
            pool.kill()
        self._pools.clear()
        for node, actor in self._caches.items():
            try:
                await asyncio.wait_for(actor.clear.remote(), _CALL_TIMEOUT_S)
            except (ray.exceptions.RayError, asyncio.TimeoutError):
                pass  # gone with its node already
            ray.kill(actor)
        self._caches.clear()

    # -- internals ---------------------------------------------------------------------------
    def _lock(self, key: str) -> asyncio.Lock:
        return self._locks.setdefault(key, asyncio.Lock())

    def _forget(self, trial: str, key: str) -> None:
        """``trial`` is no longer a member of group ``key`` (no await: one step)."""
        members = self._members.get(key)
        if members is not None:
            members.discard(trial)
            if not members:
                del self._members[key]
        keys = self._trial_groups.get(trial)
        if keys is not None:
            keys.discard(key)
            if not keys:
                del self._trial_groups[trial]

    async def _start_group(self, key: str, spec: DataSpec, node: str) -> _Group:
        pool = await self._pool(node)
        index, files = await self._coordinator_index(spec.dataset, node)
        start = await self._probe(spec, pool, "train")
        name = f"coordprep-{self.session}-{spec.group_key}-{node[:8]}-{next(self._incarnation)}"
        group = self._groups[key] = _Group(spec, node, None)
        budget = self._share(node, key, pool)
        piece_bytes = piece_size(spec.chunk_size, start[0]) * start[1].sample_bytes
        if piece_bytes > budget:
            del self._groups[key]
            raise ConfigError(
                f"data group {spec.group_key} ({spec.dataset_name}): one piece of {piece_size(spec.chunk_size, start[0])} "
                f"samples takes {piece_bytes} bytes ({start[1].sample_bytes} per sample, all views), more than the "
                f"group's staging budget on node {node} ({budget} bytes); lower data.chunk_size, raise "
                "pool.staging_fraction (or data.staging_bytes), or make the samples smaller (crop, a smaller dtype)")
        group.actor = Coordinator.options(
            name=name, namespace=NAMESPACE,
            scheduling_strategy=NodeAffinitySchedulingStrategy(node_id=node, soft=False),
        ).remote(spec, name, pool.actors, budget, index, start)  # Ray resolves the index first
        try:
            await self._check_index(spec.dataset, node, group.actor, files)
        except Exception:
            del self._groups[key]
            ray.kill(group.actor)
            raise
        logger.info("data group %s: started %s on node %s", spec.group_key, name, node)
        await self._split(node, except_key=key)
        return group

    async def _probe(self, spec: DataSpec, pool: NodePool, mode: str) -> Any:
        """A prep actor's probe of ``spec`` (:mod:`coordinated_prep.pipeline.probe`): (samples, Probe).

        Raises:
            ConfigError: A transform that cannot be seeded, a sample too big, the probe timed out.
            StructureError: Samples of different structures.
            SampleError: None of the first samples can be prepared.
        """
        try:
            return await asyncio.wait_for(pool.actors[0].probe.remote(spec, mode), spec.fetch_timeout_s)
        except asyncio.TimeoutError:
            raise ConfigError(f"data group {spec.group_key} ({spec.dataset_name}): preparing its first {PROBED} samples "
                              f"took longer than fetch_timeout_s={spec.fetch_timeout_s}s") from None
        except ray.exceptions.RayTaskError as e:
            raise (e.cause if isinstance(e.cause, CoordinatedPrepError) else e) from None

    async def _check_index(self, dataset: Any, node: str, coordinator: Any, files: int = 0) -> None:
        """Refuse a node whose copy of ``dataset`` indexes other samples than the first node's.

        The coordinator's start and its fingerprint (a ``stat`` of each of the ``files`` files) are
        allowed :func:`start_bound_s` seconds.

        Raises:
            DatasetError: Naming the dataset, both nodes and what differs (caches and coordinators of
                different nodes exchange samples by index); or naming the dataset, the node and the
                fix when the start ran past its bound.
        """
        if not isinstance(dataset, str):
            return  # a dataset object or factory: nothing on disk to compare between nodes
        timeout = start_bound_s(files)
        try:
            found = await asyncio.wait_for(coordinator.fingerprint.remote(), timeout)
        except asyncio.TimeoutError:
            raise DatasetError(
                f"dataset {dataset!r}: the data group's coordinator on node {node} did not open the dataset and stat "
                f"its {files} files within {timeout:.0f}s ({_STAT_S_PER_FILE * 1e3:.0f} ms per file allowed): its "
                "filesystem answers slower than that. Copy the dataset to a local disk, or convert it to Parquet "
                f"records (`coordprep convert {dataset} <dir>`, then use <dir>: a start then stats one file per "
                "shard)") from None
        first_node, first = self._indexes.setdefault(dataset, (node, found))
        check_same_index(dataset, first_node, first, node, found)

    async def _coordinator_index(self, dataset: str, node: str) -> tuple[Any, int]:
        """``node``'s index of ``dataset`` if it is an ImageFolder, as a reference to pass to its new
        coordinator (Ray resolves it before the coordinator starts, so the coordinator, an async
        actor, makes no blocking ``ray.get``), and the number of files (0 where unknown).

        (None, 0) for a Parquet dataset (no walk). A ``builtin:`` dataset on another node is found
        (generated if missing) by a zero-CPU task there: each node has its own copy.

        Raises:
            DatasetError: The walk found no usable ImageFolder, or took longer than its bound.
        """
        if not isinstance(dataset, str):
            return None, 0  # a dataset object or factory: no folder to walk
        try:
            if dataset.startswith("builtin:") and node != ray.get_runtime_context().get_node_id():
                affinity = NodeAffinitySchedulingStrategy(node_id=node, soft=False)
                root = await asyncio.wait_for(ray.remote(num_cpus=0, max_retries=0)(folder_root).options(
                    scheduling_strategy=affinity).remote(dataset), _WALK_TIMEOUT_S)
            else:
                root = await asyncio.to_thread(folder_root, dataset)
        except asyncio.TimeoutError:
            raise DatasetError(f"dataset {dataset!r}: node {node} did not generate it within {_WALK_TIMEOUT_S:.0f}s; "
                               "check that node's disk (COORDPREP_CACHE)") from None
        if root is None:
            return None, 0
        try:
            [ref] = await asyncio.wait_for(self.folder_index(root, node), _WALK_TIMEOUT_S)
            index = await asyncio.wait_for(ref, _WALK_TIMEOUT_S)
        except asyncio.TimeoutError:
            raise DatasetError(
                f"dataset {dataset!r}: walking its folders on node {node} took longer than {_WALK_TIMEOUT_S:.0f}s; "
                f"copy it to a local disk, or convert it to Parquet records (`coordprep convert {dataset} <dir>`)"
            ) from None
        except ray.exceptions.RayTaskError as e:
            raise (e.cause if isinstance(e.cause, DatasetError) else e) from None
        return ref, len(index)

    async def _pool(self, node: str) -> NodePool:
        """The node's prep pool, started (once, concurrent callers share the start) and ready."""
        if node in self._pools:
            return self._pools[node]
        if node not in self._starting:
            self._starting[node] = asyncio.get_running_loop().create_task(self._start_pool(node))
        try:
            return await asyncio.shield(self._starting[node])
        finally:
            if self._starting.get(node) is not None and self._starting[node].done():
                del self._starting[node]

    async def _start_pool(self, node: str) -> NodePool:
        cpus, store = node_table().get(node, (1.0, float(2**30)))
        pool = NodePool(node, cpus, store, self._pool_spec, await self._ensure_caches())
        try:
            await pool.ready()
        except PrepError:
            pool.kill()
            raise
        self._pools[node] = pool
        return pool

    def _share(self, node: str, key: str, pool: NodePool) -> int:
        """Group ``key``'s share of ``node``'s staging budget (less its resident evaluation pieces),
        the group counted in."""
        caps = {k: g.spec.staging_bytes for k, g in self._groups.items() if g.node == node}
        caps.setdefault(key, self._groups[key].spec.staging_bytes if key in self._groups else None)
        return max(split_budget(pool.budget_bytes - self._eval_bytes(node), caps)[key], 1)

    def _eval_bytes(self, node: str) -> int:
        """Bytes the resident evaluation pieces hold in ``node``'s object store."""
        return sum(e.resident_bytes for e in self._evals.values() if e.node == node)

    async def _start_eval(self, key: str, spec: DataSpec, node: str) -> EvalSet:
        """Cut the held-out split into pieces and start preparing the resident ones on ``node``."""
        pool = await self._pool(node)
        try:
            held, start = await asyncio.wait_for(pool.actors[0].held_out.remote(spec), spec.fetch_timeout_s)
        except ray.exceptions.RayTaskError as e:
            raise (e.cause if isinstance(e.cause, CoordinatedPrepError) else e) from None
        found = EvalSet(key, spec, node, eval_pieces(held, piece_size(spec.chunk_size, len(held))),
                        layout=start.layout, sample_bytes=start.sample_bytes, spec_box=[ray.put(spec)])
        allowance = int(pool.budget_bytes * self._pool_spec.eval_fraction) - self._eval_bytes(node)
        per_sample = found.sample_bytes
        resident = resident_prefix([len(p) * per_sample for p in found.pieces], max(allowance, 0))
        found.refs = [self._prepare_eval(found, i, resident=True) for i in range(resident)]
        prepared = sum(len(p) for p in found.pieces[:resident])
        found.samples_prepared += prepared
        metrics.inc("eval_samples_prepared", prepared, pipeline=key)
        logger.info("evaluation set %s: %d held-out samples in %d pieces on node %s, %d resident (%d bytes)",
                    key, len(held), len(found.pieces), node, resident, found.resident_bytes)
        if resident:
            await self._split(node)  # the node's groups share what the resident pieces leave
        return found

    def _prepare_eval(self, found: EvalSet, i: int, resident: bool) -> ray.ObjectRef:
        """Submit evaluation piece ``i`` to its node's pool; the registry owns the result. Its skipped
        samples are counted and logged, and a failed ``resident`` piece is marked to prepare again,
        when the task ends (:meth:`_eval_settled`)."""
        actors = self._pools[found.node].actors
        actor = actors[next(self._eval_turn) % len(actors)]
        skipped, piece = actor.prepare_eval.options(num_returns=2).remote(found.key, found.spec_box, found.pieces[i],
                                                                          found.layout)
        task = asyncio.get_running_loop().create_task(self._eval_settled(found, i, skipped, resident))
        self._eval_watches.add(task)
        task.add_done_callback(self._eval_watches.discard)
        return piece

    async def _eval_settled(self, found: EvalSet, i: int, skipped_ref: ray.ObjectRef, resident: bool) -> None:
        """Count and log (once per sample) what piece ``i`` skipped; mark a failed resident piece."""
        try:
            skipped = await skipped_ref
        except Exception as e:  # the reading trials get the error itself, naming the file
            if resident and self._evals.get(found.key) is found:
                found.failed.add(i)
            metrics.inc("errors", 1, group=found.key, kind="failed_piece")
            logger.warning("evaluation set %s: piece %d failed%s: %s", found.key, i,
                           " (it is prepared again at the next evaluation)" if resident else "", e)
            return
        for index, path, reason in skipped:
            if index not in found.skipped:
                found.skipped[index] = path
                metrics.inc("errors", 1, group=found.key, kind="skipped_sample")
                logger.warning("evaluation set %s: skipping held-out sample %d (%s): %s", found.key, index, path,
                               reason)

    async def _split(self, node: str, except_key: str | None = None) -> None:
        """Tell every coordinator of ``node`` its share of the node's budget (after a group came or went)."""
        pool = self._pools.get(node)
        if pool is None:
            return
        calls = [g.actor.set_budget.remote(self._share(node, k, pool))
                 for k, g in self._groups.items() if g.node == node and k != except_key]
        results = await asyncio.gather(*calls, return_exceptions=True)
        for r in results:
            if isinstance(r, Exception):
                logger.warning("node %s: a coordinator did not take its new budget share: %r", node, r)

    async def _destroy(self, key: str, group: _Group) -> None:
        try:
            _merge(self._finished, group.spec.group_key,
                   await asyncio.wait_for(group.actor.report.remote(), _CALL_TIMEOUT_S), group.spec)
            await asyncio.wait_for(group.actor.close.remote(), _CALL_TIMEOUT_S)
        except (ray.exceptions.RayError, asyncio.TimeoutError) as e:
            logger.warning("data group %s: coordinator did not close cleanly: %r", key, e)
        ray.kill(group.actor)
        logger.info("data group %s: last trial left; coordinator destroyed", key)

    async def _ensure_caches(self) -> tuple[CacheLayout, CacheSpec] | None:
        """Start a cache on every live node (once, when the first pool starts) and wait until each has
        reserved its memory; the layout. Raises CacheError (at sweep start, in the driver) if one cannot."""
        if self._cache_spec is None:
            return None
        if self._cache_start is None:  # concurrent first joins all wait for this one start
            nodes = tuple(sorted(node_table()))
            self._layout = CacheLayout(self.session, nodes, self._cache_spec.seed, self._cache_spec.partitioned)
            self._cache_start = asyncio.ensure_future(start_caches(self._cache_spec, self._layout))
        self._caches = await asyncio.shield(self._cache_start)
        return self._layout, self._cache_spec


RegistryActor = ray.remote(num_cpus=0, max_concurrency=1000)(GroupRegistry)
"""The registry as the sweep's Ray actor (created by the searcher; one per sweep)."""


def start_bound_s(files: int) -> float:
    """Seconds a group's coordinator may take to start on a node and fingerprint ``files`` files."""
    return _CALL_TIMEOUT_S + files * _STAT_S_PER_FILE


async def _alive(actor: Any) -> bool:
    """Whether ``actor`` answers (a dead one fails at once; a busy asyncio actor still answers)."""
    try:
        await asyncio.wait_for(actor.__ray_ready__.remote(), _LIVENESS_TIMEOUT_S)
        return True
    except ray.exceptions.RayActorError:
        return False
    except asyncio.TimeoutError:
        return True  # slow, not dead: the trial's own timeouts apply


class _Rendezvous:
    """The ranks of one worker group of a data-parallel trial, as they arrive (see ``meet``)."""

    def __init__(self, world: int, workers: str | None = None) -> None:
        self.world = world
        self.workers = workers  # the worker group's id, where Ray Train gives one
        self.arrivals: dict[int, tuple[str, Any, int | None]] = {}  # rank -> (node, process, epochs)
        self.arrived = asyncio.Condition()
        self.placing: asyncio.Future | None = None  # once every rank is there

    def drop_gone(self, here: str) -> None:
        """Take back the arrivals of ranks whose process on node ``here`` (the registry's) has ended:
        a worker group that died before all its ranks arrived must not complete a new group's
        meeting (where Ray Train gives no group id, as V1). Other nodes' ranks time out instead."""
        for rank, (node, process, _) in list(self.arrivals.items()):
            if node == here and Process(*process).ended():
                del self.arrivals[rank]


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
