"""The group registry: one actor per sweep that owns the node prep pools and the groups' coordinators.

Ownership chain, top to bottom (each owner's death takes what it owns with it):
CoordinatedSearcher (driver) -> GroupRegistry -> NodePool per node (prep actors, staging budget)
                                              -> Coordinator per group and node -> pieces;
GroupRegistry -> EvalSet per evaluation pipeline -> resident evaluation pieces (until shutdown);
GroupRegistry -> RawCache per node (when the sweep has a cache) -> cached samples;
GroupRegistry -> the index of each ImageFolder per node, and the listing of each folder URL (until
                 shutdown; see sources/shared_index.py).

Membership (who keeps a group's coordinator alive) is kept per group key, apart from the coordinator
itself, and changes only under the key's lock, in one step per trial:

- ``group_for`` makes the trial a member *before* any await under the lock (the liveness check,
  the coordinator's start), so a completion in that window cannot empty the group under a starting
  trial; a failed start takes back only the membership it added. (Before it takes the lock, a start
  may first drop ended runs of the node: the trial is no member yet then.)
- ``trial_done`` takes the same lock, so it waits for a start in progress, and destroys the
  coordinator only if no member is left. Members outlive a coordinator that died, so the completion
  of a dead member never destroys the replacement that its retried peers are building.
- A trial reported done never becomes a member again: ``trial_done`` records it (one string per
  trial, kept for the registry's life) before any await, and ``group_for`` and ``meet`` refuse it
  under the same lock. A placement of its ranks still running (``_place`` joins one node at a time,
  and a coordinator's start takes minutes) therefore fails at its next node, and ranks it registered
  after the completion leave again: nothing placed for a done trial survives it.
- A run of Ray Train without Tune (``train:<name>:<run>``, :mod:`coordinated_prep.context`) has no
  completion report: it leaves a group when every process it joined that group's node with has
  ended. The registry keeps those processes per (group, run), asks the group's coordinator (on their
  node) whether they ended, every ``_REAP_S`` while a run is a member and before a new group starts
  on the node (it needs its budget share), and then makes the run leave as ``trial_done`` would. A
  Tune trial is never dropped this way: a paused trial's process ends, and its group, with the pieces
  kept for it, must outlive the pause.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from dataclasses import dataclass
from typing import Any, Collection

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from coordinated_prep.cache.layout import CacheLayout
from coordinated_prep.cache.spec import CacheSpec
from coordinated_prep.cache.start import start_caches
from coordinated_prep.stream.coordinator import Coordinator
from coordinated_prep.errors import (
    ConfigError,
    CoordinatedPrepError,
    PrepError,
)
from coordinated_prep.stream.eval_set import EvalSet
from coordinated_prep.stream.evals import Evals
from coordinated_prep.stream.group_reports import Reports, _merge
from coordinated_prep.stream.growth import PoolGrowth
from coordinated_prep.stream.indexes import Indexes
from coordinated_prep.stream.linger import Kept, Lingering
from coordinated_prep.naming import CALL_TIMEOUT_S, LIVENESS_TIMEOUT_S, NAMESPACE
from coordinated_prep.pipeline.probe import PROBED
from coordinated_prep.pipeline.streamed import StreamedShards
from coordinated_prep.pipeline.sources.fingerprint import Fingerprint
from coordinated_prep.plan import holdout_split, piece_size
from coordinated_prep.pool.node import NodePool, node_table
from coordinated_prep.pool.spec import PoolSpec, split_budget
from coordinated_prep.stream.ranks import Ranks, _Rendezvous
from coordinated_prep.stream.runs import Runs
from coordinated_prep.spec import DataSpec
from coordinated_prep.stream.watch import Process, trial_of

logger = logging.getLogger(__name__)

_RUN = "train:"  # the trial ids of runs of Ray Train alone (context._run_name): no Tune reports their end


@dataclass
class _Group:
    spec: DataSpec
    node: str
    actor: Any


class GroupRegistry(Ranks, Runs, Evals, Indexes, Reports, PoolGrowth, Kept):
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
        lent: Per node, prep actors the driver lends for that node's pool (kept warm,
            :mod:`coordinated_prep.pool.warm`); the driver owns them, the pool never kills them.
    """

    def __init__(self, session: str, cache: CacheSpec | None = None, pool: PoolSpec | None = None,
                 lent: dict[str, list[Any]] | None = None) -> None:
        self.session = session
        self._cache_spec = cache
        self._pool_spec = pool or PoolSpec()
        self._lent = dict(lent or {})  # taken by each node's first pool: a pool that fails gives them up
        self._layout: CacheLayout | None = None
        self._caches: dict[str, Any] = {}
        self._cache_start: asyncio.Future | None = None  # start_caches, once
        self._pools: dict[str, NodePool] = {}
        self._starting: dict[str, asyncio.Task] = {}
        self._growers: dict[str, asyncio.Task] = {}  # node -> its pool's growth tick, until shutdown
        self._groups: dict[str, _Group] = {}
        self._members: dict[str, set[str]] = {}  # group key -> its member trials (see the module docstring)
        self._trial_groups: dict[str, set[str]] = {}  # trial -> the keys of the groups it is a member of
        # (group, data-parallel trial) -> the rendezvous of its current worker group; bounded by the
        # trials, dropped when Tune reports the trial done, when a run without Tune leaves its last
        # group (once placed), or when its last waiting rank gives up
        self._rendezvous: dict[tuple[str, str], _Rendezvous] = {}
        # Trials Tune reported done: never members again (see the module docstring); one id per trial
        self._done: set[str] = set()
        # (group key, run without Tune) -> the processes it joined with on the group's node, until it leaves
        self._runs: dict[tuple[str, str], set[Process]] = {}
        self._reaper: asyncio.Task | None = None  # drops ended runs every _REAP_S while there are runs
        self._closing: asyncio.Event | None = None  # set by shutdown: the reaper stops
        self._lingering = Lingering()  # groups with no member kept for trials released to read them
        self._finished: dict[str, dict[str, Any]] = {}
        self._loaders: dict[str, tuple[int, dict[str, Any]]] = {}  # trial -> (its first loader, what it measured)
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

    async def group_for(self, spec: DataSpec, trial: str, node: str | None = None, process: Any = None) -> Any:
        """The coordinator of ``spec``'s group on node ``node`` (default: the registry's), created if
        needed or if the one there died; ``trial`` becomes a member (a trial may be in several groups).

        ``process`` is the calling process (:class:`~coordinated_prep.stream.watch.Process`, on ``node``): a
        run without Tune leaves the group once all the processes it joined with have ended.

        Raises:
            PrepError: ``trial`` was reported done already.
            PrepError, DatasetError: The group could not be started (the trial is then no member).
        """
        return await self._member_of(spec, trial, node or ray.get_runtime_context().get_node_id(),
                                     [] if process is None else [process])

    async def _member_of(self, spec: DataSpec, trial: str, node: str, processes: list[Any]) -> Any:
        """:meth:`group_for` with the member's processes on ``node`` (a placement's ranks there)."""
        key = f"{spec.group_key}@{node[:12]}"
        run = trial.startswith(_RUN) and bool(processes)
        if key not in self._groups:  # a start needs a budget share: ended runs and kept groups give theirs back
            await self._reap(node)
            await self._drop_kept(node)
        async with self._lock(key):  # one check-and-start per group at a time, and no completion inside it
            if trial in self._done:  # checked under the lock: trial_done's records and waits under it too
                raise PrepError(f"trial {trial}: Tune reported it complete already, so it cannot join data group "
                                f"{spec.group_key} on node {node} again; create loaders only while the trial runs")
            members = self._members.setdefault(key, set())
            added = trial not in members
            members.add(trial)  # before any await: see the module docstring
            self._lingering.cancel(key)
            self._trial_groups.setdefault(trial, set()).add(key)
            if run:  # in the same step: a run is a member only with processes that can end
                self._runs.setdefault((key, trial), set()).update(Process(*p) for p in processes)
                self._watch_runs()
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
                    self._keep(key)  # it may have cancelled a kept group's deadline
                raise
            return group.actor

    async def restored(self) -> None:
        """The sweep was restored (``Tuner.restore``) while this registry lived on: Tune runs its errored
        and unfinished trials again under their ids, so their earlier completions no longer hold."""
        self._done.clear()

    async def trial_done(self, trial: str, keep: Collection[str] = ()) -> None:
        """``trial`` ended for good: it leaves its groups, and a group left with no member is destroyed,
        or kept for ``LINGER_S`` if its spec's group key is in ``keep``: the searcher released (or
        holds) more trials of it (:mod:`coordinated_prep.stream.linger`).

        It never becomes a member again (see the module docstring).
        """
        self._done.add(trial)  # before any await: a membership added from here on is refused
        for key in [k for k in self._rendezvous if trial_of(k[1]) == trial]:
            del self._rendezvous[key]
        for key in sorted(self._trial_groups.get(trial, set())):
            await self._leave(trial, key, keep=key.split("@", 1)[0] in keep)

    async def _leave(self, trial: str | None, key: str, ended: set[Process] | None = None, keep: bool = False) -> None:
        """``trial`` leaves group ``key`` (None: no one, the kept group's deadline); the group is destroyed
        if no member is left, unless ``keep``. With ``ended`` (a run's processes found ended), only if
        every process the run joined ``key`` with is in it."""
        async with self._lock(key):  # waits for a start in progress (see the module docstring)
            if ended is not None:
                processes = self._runs.get((key, trial))
                if processes is None:
                    return  # it left already (another check, or the start it joined with failed)
                processes -= ended
                if key not in self._groups:
                    processes.clear()  # no coordinator: nothing to keep for it (see _reap)
                if processes:
                    return  # a process it joined with since (a restarted worker group) still runs
            if trial is not None:
                self._forget(trial, key)
            group = self._groups.get(key)
            if group is None or (trial is None and self._members.get(key)):
                return
            if self._members.get(key) or keep:  # the group lives on: the trial leaves its coordinator
                try:
                    await asyncio.wait_for(group.actor.leave_trial.remote(trial), CALL_TIMEOUT_S)
                except (ray.exceptions.RayError, asyncio.TimeoutError) as e:
                    logger.warning("data group %s: trial %s could not leave cleanly: %r", key, trial, e)
                return self._keep(key)  # kept on a deadline if it has no member left
            del self._groups[key]
            await asyncio.shield(self._destroy(key, group))  # a cancelled caller must not leave it half-destroyed
        await self._split(group.node)

    async def until_killed(self) -> None:
        """Answers never: a call of it pending in the driver fails when this actor's process is gone,
        which is how the driver waits for a kill to land (:func:`coordinated_prep.tune.starting.destroy`)."""
        await asyncio.Event().wait()

    async def shutdown(self) -> None:
        """Destroy every group, then the prep pools and the node caches."""
        if self._closing is not None:
            self._closing.set()
        self._lingering.close()
        if self._reaper is not None:  # it stops at its next wait; a check in progress is bounded
            try:
                await asyncio.wait_for(asyncio.shield(self._reaper), CALL_TIMEOUT_S)
            except asyncio.TimeoutError:
                self._reaper.cancel()
        for trial in list(self._trial_groups):
            await self.trial_done(trial)
        for key, group in list(self._groups.items()):  # groups whose coordinators were replaced
            del self._groups[key]
            await self._destroy(key, group)
        self._evals.clear()  # the resident evaluation pieces are freed with their references
        self._folder_indexes.clear()
        await self._stop_growing()
        for pool in self._pools.values():
            pool.kill()
        self._pools.clear()
        for node, actor in self._caches.items():
            try:
                await asyncio.wait_for(actor.clear.remote(), CALL_TIMEOUT_S)
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
        self._runs.pop((key, trial), None)

    async def _start_group(self, key: str, spec: DataSpec, node: str) -> _Group:
        pool = await self._pool(node)
        index, files = await self._coordinator_index(spec.dataset, node)
        start = await self._probe(spec, pool, "train")
        name = f"coordprep-{self.session}-{spec.group_key}-{node[:8]}-{next(self._incarnation)}"
        group = self._groups[key] = _Group(spec, node, None)
        budget = self._share(node, key, pool)
        samples = piece_size(spec.chunk_size, len(holdout_split(start[0], spec.holdout)[0]))  # the coordinator's
        piece_bytes = samples * start[1].sample_bytes
        if piece_bytes > budget:
            del self._groups[key]
            raise ConfigError(
                f"data group {spec.group_key} ({spec.dataset_name}): one piece of {samples} "
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
            streamed = ("; a dataset read by shard is read whole, once per node, before its first sample: raise "
                        "fetch_timeout_s to cover that read" if isinstance(spec.dataset, StreamedShards) else "")
            raise ConfigError(f"data group {spec.group_key} ({spec.dataset_name}): preparing its first {PROBED} samples "
                              f"took longer than fetch_timeout_s={spec.fetch_timeout_s}s{streamed}") from None
        except ray.exceptions.RayTaskError as e:
            raise (e.cause if isinstance(e.cause, CoordinatedPrepError) else e) from None


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
        pool = NodePool(node, cpus, store, self._pool_spec, await self._ensure_caches(), self._lent.pop(node, None))
        try:
            await pool.ready()
        except PrepError:
            pool.kill()
            raise
        self._pools[node] = pool
        self._start_growing(pool)
        return pool

    def _share(self, node: str, key: str, pool: NodePool) -> int:
        """Group ``key``'s share of ``node``'s staging budget (less its resident evaluation pieces),
        the group counted in."""
        caps = {k: g.spec.staging_bytes for k, g in self._groups.items() if g.node == node}
        caps.setdefault(key, self._groups[key].spec.staging_bytes if key in self._groups else None)
        return max(split_budget(pool.budget_bytes - self._eval_bytes(node), caps)[key], 1)


    async def _split(self, node: str, except_key: str | None = None) -> None:
        """Tell every coordinator of ``node`` its share of the node's budget (after a group came or went)."""
        pool = self._pools.get(node)
        if pool is None:
            return
        calls = [asyncio.wait_for(g.actor.set_budget.remote(self._share(node, k, pool)), CALL_TIMEOUT_S)
                 for k, g in self._groups.items() if g.node == node and k != except_key]
        results = await asyncio.gather(*calls, return_exceptions=True)  # a coordinator that hangs: named below
        for r in results:
            if isinstance(r, Exception):
                logger.warning("node %s: a coordinator did not take its new budget share within %g s: %r", node,
                               CALL_TIMEOUT_S, r)

    async def _destroy(self, key: str, group: _Group) -> None:
        try:
            _merge(self._finished, group.spec.group_key,
                   await asyncio.wait_for(group.actor.report.remote(), CALL_TIMEOUT_S), group.spec)
            await asyncio.wait_for(group.actor.close.remote(), CALL_TIMEOUT_S)
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


async def _alive(actor: Any) -> bool:
    """Whether ``actor`` answers (a dead one fails at once; a busy asyncio actor still answers)."""
    try:
        await asyncio.wait_for(actor.__ray_ready__.remote(), LIVENESS_TIMEOUT_S)
        return True
    except ray.exceptions.RayActorError:
        return False
    except asyncio.TimeoutError:
        return True  # slow, not dead: the trial's own timeouts apply


