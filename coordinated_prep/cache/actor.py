"""The node's raw-data cache actor: encoded samples in a shared-memory arena, admitted by MinIO.

Life cycle of a cached sample: a prep actor asks its owner node's cache for a piece's samples in one
call (``lookup``). On the first miss the cache reads the sample from storage (one read, however many
prep actors, groups or nodes ask at once) and, while the capacity lasts, appends its encoded bytes to
the node's arena (:mod:`coordinated_prep.cache.arena`), where they stay for the rest of the sweep.
A reader on the same node gets (offset, length) and slices its own read-only mapping of the arena,
zero-copy; a reader on another node gets the bytes in the reply, through Ray. The cache actor owns
the arena: the registry starts the actors when the sweep's first group starts
(:func:`coordinated_prep.cache.start.start_caches`, which waits until each has reserved its arena)
and calls ``clear`` (which deletes the arena) before destroying them. If the actor's node leaves,
the arena goes with it and readers go back to storage.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import logging
from typing import Any, NamedTuple

import numpy as np
import ray

from coordinated_prep import metrics
from coordinated_prep.cache.arena import Arena, ArenaId
from coordinated_prep.cache.policy import MinioPolicy
from coordinated_prep.cache.spec import CacheSpec
from coordinated_prep.errors import CacheError, SampleError
from coordinated_prep.pipeline.sources import open_source, open_source_async

logger = logging.getLogger(__name__)


class Region(NamedTuple):
    """Answer for a reader on the cache's node: where the sample lies in the node's arena."""

    offset: int
    length: int


class Reply(NamedTuple):
    """What ``lookup`` returns."""

    answers: list[Any]  # per index: Region, encoded bytes (uint8 array), SampleError, or None
    frozen: bool  # admission is closed: the cached set will not change again, a snapshot is final
    version: int  # samples cached so far (it only grows): a snapshot older than this lacks some
    hits: int  # answers that were already cached before this call (a snapshot may have saved the call)


class Snapshot(NamedTuple):
    """A dataset's cached set at ``version``: (offset, length) per sample, length 0 where not cached."""

    offsets: np.ndarray
    lengths: np.ndarray
    version: int
    frozen: bool


@ray.remote(num_cpus=0, max_concurrency=1000)
class RawCache:
    """One per node and sweep, shared by every data group of the sweep on the node.

    ``lookup`` answers, per sample: a :class:`Region` (cached; the reader is on this node), the
    encoded bytes (cached or just read, for a reader elsewhere), a :class:`SampleError` (the file is
    broken), or None (not cached and the cache is full: the reader reads storage itself, and no
    bytes pass through this actor). Readers on the node take a :meth:`snapshot` of the cached set
    when a reply shows it has hits their snapshot lacks, and serve those samples from the arena
    without calling this actor at all: an actor call costs milliseconds, a lookup in a local array
    microseconds. The cached set only grows, so a snapshot is never wrong, at most incomplete; once
    admission closes it is final, and readers send the samples it lacks straight to storage.

    Args:
        spec: Capacity and reading options.
        node: Id of the node it runs on (it is created with hard node affinity).
        name: Its actor name: also the start of the arena's file name.

    An arena that cannot be reserved does not fail the constructor (Ray would report a bare
    ``ActorDiedError``): :meth:`ready` returns the reason, and the other calls raise it.
    """

    def __init__(self, spec: CacheSpec, node: str, name: str) -> None:
        self.spec = spec
        self.node = node
        self.name = name
        capacity = int(spec.capacity_bytes)
        self.error: str | None = None
        try:
            self.arena: Arena | None = Arena(name, capacity)  # reserves the capacity now
        except CacheError as e:
            self.arena, self.error = None, str(e)
        self.policy = MinioPolicy(capacity)
        self.regions: dict[tuple[str, int], tuple[int, int]] = {}
        self.cached: collections.Counter[str] = collections.Counter()  # samples cached per dataset
        self.loading: dict[tuple[str, int], asyncio.Future] = {}
        self.opened: set[str] = set()  # datasets this process has opened (with the sweep's index, awaited)
        self.pool = concurrent.futures.ThreadPoolExecutor(spec.read_threads, thread_name_prefix="coordprep-cache")
        self.stats: dict[str, Any] = {"node": node, "capacity_bytes": capacity, "hits_local": 0, "hits_remote": 0,
                                      "misses": 0, "coalesced": 0, "storage_reads": 0, "storage_bytes": 0}
        self.tags = {"node": node[:16]}
        metrics.set_gauge("cache_capacity_bytes", capacity, **self.tags)
        for where in ("local", "remote"):  # every counter at 0 from the start, not after its first event
            metrics.declare("cache_hits", **self.tags, where=where)
        metrics.declare("cache_misses", **self.tags)
        for reader in ("cache", "prep"):
            metrics.declare("storage_reads", **self.tags, reader=reader)

    async def ready(self) -> str | None:
        """None once the arena is reserved; else why it could not be (the cache is unusable)."""
        return self.error

    async def arena_id(self) -> ArenaId:
        """The arena's file and identity, for readers on this node to map and check."""
        return self._arena().id

    async def lookup(self, dataset: str, indices: list[int], caller: str) -> Reply:
        """One answer per index of ``dataset``, in order, for a reader on node ``caller``."""
        self._arena()
        if dataset not in self.opened:  # before any read: the reading threads then find it open
            await open_source_async(dataset)
            self.opened.add(dataset)
        tally: collections.Counter[str] = collections.Counter()  # this call's events (calls overlap)
        local = caller == self.node
        answers: list[Any] = []
        misses: list[tuple[int, Any]] = []
        for k, index in enumerate(indices):  # hits are answered right here; only misses wait
            key = (dataset, index)
            if self.policy.lookup(key):
                tally["hits_local" if local else "hits_remote"] += 1
                answers.append(self._answer(self.regions[key], local))
            elif self.policy.full and key not in self.loading:  # the reader goes to storage itself
                tally["misses"] += 1
                answers.append(None)
            else:
                answers.append(None)
                misses.append((k, self._miss(dataset, index, local, tally)))
        if misses:
            for (k, _), answer in zip(misses, await asyncio.gather(*(m for _, m in misses))):
                answers[k] = answer
        for stat, value in tally.items():
            self.stats[stat] += value
        metrics.inc("cache_hits", tally["hits_local"], **self.tags, where="local")
        metrics.inc("cache_hits", tally["hits_remote"], **self.tags, where="remote")
        metrics.inc("cache_misses", tally["misses"], **self.tags)
        metrics.inc("storage_reads", tally["storage_reads"], **self.tags, reader="cache")
        metrics.set_gauge("cache_bytes", self.policy.used_bytes, **self.tags)
        return Reply(answers, self.policy.full, self.cached[dataset], tally["hits_local"] + tally["hits_remote"])

    async def snapshot(self, dataset: str) -> Snapshot:
        """Where every cached sample of ``dataset`` lies in the arena, now."""
        n = len(await open_source_async(dataset))  # the sweep's index awaited: no ray.get blocks this loop
        offsets, lengths = np.zeros(n, dtype=np.int64), np.zeros(n, dtype=np.int64)
        for (name, index), (offset, length) in self.regions.items():
            if name == dataset:
                offsets[index], lengths[index] = offset, length
        return Snapshot(offsets, lengths, self.cached[dataset], self.policy.full)

    async def report(self) -> dict[str, Any]:
        """Counters, bytes and items held."""
        return dict(self.stats, used_bytes=self.policy.used_bytes, items=len(self.policy), full=self.policy.full)

    async def clear(self) -> None:
        """Delete the arena and stop reading (the registry calls it at the end of the sweep)."""
        self.pool.shutdown(wait=False, cancel_futures=True)
        if self.arena is not None:
            self.arena.close()
        metrics.set_gauge("cache_bytes", 0, **self.tags)

    async def _miss(self, dataset: str, index: int, local: bool, tally: collections.Counter[str]) -> Any:
        key = (dataset, index)
        tally["misses"] += 1
        region = self.regions.get(key)
        if region is not None:  # another call loaded it between this call's look and now
            tally["coalesced"] += 1
            return self._answer(region, local)
        pending = self.loading.get(key)
        if pending is not None:  # another reader asked first: share its one storage read
            tally["coalesced"] += 1
            result = await asyncio.shield(pending)
        elif self.policy.full:
            return None
        else:
            result = await self._load(dataset, index, tally)
        if isinstance(result, tuple):
            return self._answer(result, local)
        return result  # bytes read but not admitted, or a SampleError

    async def _load(self, dataset: str, index: int, tally: collections.Counter[str]) -> Any:
        """Read a sample from storage once; admit it if it fits. Returns its region, or the bytes/error."""
        key = (dataset, index)
        loop = asyncio.get_running_loop()
        future = self.loading[key] = loop.create_future()
        try:
            data = await loop.run_in_executor(self.pool, _read, dataset, index)
            if isinstance(data, SampleError):
                result: Any = data  # not cached: a broken file stays visible to every reader
            else:
                tally["storage_reads"] += 1
                tally["storage_bytes"] += len(data)
                if self.policy.admit(key, len(data)):
                    result = self.regions[key] = self._arena().append(data)
                    self.cached[dataset] += 1
                else:
                    result = np.frombuffer(data, dtype=np.uint8)
            future.set_result(result)
            return result
        except BaseException as e:
            future.set_exception(e)
            future.exception()  # retrieved: no "never retrieved" warning when nobody else waited
            raise
        finally:
            del self.loading[key]

    def _answer(self, region: tuple[int, int], local: bool) -> Any:
        if local:
            return Region(*region)
        return np.frombuffer(self._arena().view(*region), dtype=np.uint8).copy()  # travels in the reply

    def _arena(self) -> Arena:
        if self.arena is None:
            raise CacheError(f"cache on node {self.node}: {self.error}")
        return self.arena


def _read(dataset: str, index: int) -> bytes | SampleError:
    try:
        return open_source(dataset).read(index)
    except SampleError as e:
        return e
