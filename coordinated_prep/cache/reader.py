"""The prep actor's side of the cache: a data source whose reads go through the nodes' caches."""

from __future__ import annotations

import logging
from typing import Any, Sequence

import numpy as np
import ray

from coordinated_prep import metrics
from coordinated_prep.cache.actor import Region, Snapshot
from coordinated_prep.cache.arena import ArenaReader
from coordinated_prep.cache.layout import CacheLayout
from coordinated_prep.cache.spec import CacheSpec
from coordinated_prep.contracts import DataSource, read_many
from coordinated_prep.errors import SampleError
from coordinated_prep.naming import NAMESPACE

logger = logging.getLogger(__name__)

_LOST = (ray.exceptions.ActorDiedError, ray.exceptions.ObjectLostError, ray.exceptions.OwnerDiedError)


class CachedSource:
    """Wraps a data source: samples come from their owner node's cache, else from storage.

    Each read of a piece asks every owner cache once for its samples (one call per node, all in
    flight together). Samples the own node's cache holds are read from its arena through a
    read-only mapping, zero-copy; another node's cache sends them in its reply. Once the own node's
    cached set is frozen, a snapshot of it answers those samples without any call. A cache that is
    gone (its node left the cluster) is marked lost and its samples are read from storage from then
    on; one that does not answer within the timeout is passed over for this piece only. Counts
    ``storage_reads`` and ``cache_hits`` (samples a cache delivered) for the caller.

    Args:
        source: The storage the samples come from on a miss.
        dataset: The dataset's name as the caches know it (``DataSpec.dataset``).
        layout: The sweep's nodes and the assignment of samples to them.
        spec: The cache options (timeout).
    """

    def __init__(self, source: DataSource, dataset: str, layout: CacheLayout, spec: CacheSpec) -> None:
        self._source = source
        self.root, self.labels = source.root, source.labels
        self._dataset = dataset
        self._layout = layout
        self._timeout = float(spec.timeout_s)
        self._node = ray.get_runtime_context().get_node_id()
        self._owners = layout.owners(len(source), self._node)
        self._handles: dict[int, Any] = {}
        self._arenas: dict[int, ArenaReader] = {}  # mappings of this node's cache's arena
        self._local = layout.nodes.index(self._node) if self._node in layout.nodes else -1
        self._snapshot: Snapshot | None = None  # this node's cached set, as last seen
        self._lost: set[int] = set()
        self.storage_reads = 0
        self.cache_hits = 0

    @property
    def shard_sizes(self) -> tuple[int, ...] | None:
        """The source's (:func:`~coordinated_prep.pipeline.transforms.shard_sizes`)."""
        return getattr(self._source, "shard_sizes", None)

    @property
    def classes(self) -> tuple[str, ...]:
        """The source's (asked only where needed: a shard index may have to read every shard for them)."""
        return self._source.classes

    def __len__(self) -> int:
        return len(self._source)

    def describe(self, index: int) -> str:
        return self._source.describe(index)

    def read(self, index: int) -> Any:
        """Encoded bytes of sample ``index`` (a read-only view or uint8 array when it came from a cache)."""
        (data,) = self.read_many([index])
        if isinstance(data, SampleError):
            raise data
        return data

    def read_many(self, indices: Sequence[int]) -> list[Any]:
        """Encoded bytes (or the SampleError) of each of ``indices``, in order."""
        out: list[Any] = [None] * len(indices)
        ids = np.asarray(indices, dtype=np.int64)
        owners = self._owners[ids] if len(ids) else np.empty(0, np.int64)
        if self._snapshot is not None:  # this node's cached samples need no call
            snap = self._snapshot
            arena = self._arena(self._local)
            mine = np.flatnonzero(owners == self._local)
            served = []
            for k in mine.tolist():
                if snap.lengths[ids[k]]:
                    out[k] = arena.view(int(snap.offsets[ids[k]]), int(snap.lengths[ids[k]]))
                    served.append(k)
            hits = len(served)
            owners = owners.copy()
            # Final snapshot: the rest of this node's part will never be cached, so it goes to
            # storage; otherwise the cache is asked for it (it may load it, or have it by now).
            owners[mine if snap.frozen else np.asarray(served, dtype=np.int64)] = -1
            self.cache_hits += hits
            metrics.inc("cache_hits", hits, node=self._node[:16], where="local")
            if snap.frozen:  # the rest of this node's part: misses the cache is not asked about
                metrics.inc("cache_misses", len(mine) - hits, node=self._node[:16])
        asks = []
        for owner in np.unique(owners).tolist():
            handle = self._handle(owner)
            if handle is None:
                continue
            where = np.flatnonzero(owners == owner)
            asks.append((owner, where, handle.lookup.remote(self._dataset, [indices[k] for k in where], self._node)))
        for owner, where, ask in asks:
            try:
                reply = ray.get(ask, timeout=self._timeout)
                arena = self._arena(owner) if any(isinstance(a, Region) for a in reply.answers) else None
            except _LOST as e:
                self._mark_lost(owner, e)
                continue
            except ray.exceptions.GetTimeoutError:
                logger.warning("cache on node %s did not answer in %.0fs; reading this piece's %d samples from "
                               "storage", self._layout.nodes[owner], self._timeout, len(where))
                continue
            except (ray.exceptions.RayError, OSError) as e:  # unavailable for now, or failed: not lost
                logger.warning("cache on node %s failed to answer (%s); reading this piece's %d samples from "
                               "storage", self._layout.nodes[owner], e, len(where))
                continue
            for k, answer in zip(where.tolist(), reply.answers):
                if isinstance(answer, Region):
                    out[k] = arena.view(answer.offset, answer.length)  # type: ignore[union-attr]
                    self.cache_hits += 1
                elif answer is not None:
                    out[k] = answer  # bytes from another node, or just read, or the SampleError
                    self.cache_hits += not isinstance(answer, SampleError)
            if owner == self._local and reply.hits and (self._snapshot is None
                                                        or reply.version > self._snapshot.version):
                self._refresh_snapshot(owner)
        missing = [k for k, data in enumerate(out) if data is None]
        for k, data in zip(missing, self._from_storage([indices[k] for k in missing])):
            out[k] = data
        return out

    def _from_storage(self, indices: Sequence[int]) -> list[Any]:
        """Per index, its bytes from storage or its SampleError (one call where the source reads many: a
        shard index fetches a piece's shards together)."""
        if not indices:
            return []
        self.storage_reads += len(indices)
        metrics.inc("storage_reads", len(indices), node=self._node[:16], reader="prep")
        return read_many(self._source, indices)

    def _refresh_snapshot(self, owner: int) -> None:
        """Take a new snapshot of this node's cached set (the cache had hits the old one lacked)."""
        try:
            self._snapshot = ray.get(self._handles[owner].snapshot.remote(self._dataset), timeout=self._timeout)
        except (ray.exceptions.RayError, ray.exceptions.GetTimeoutError) as e:
            logger.warning("no snapshot of the cache on node %s (%s); asking it per piece", self._layout.nodes[owner], e)

    def _arena(self, owner: int) -> ArenaReader:
        """This node's cache arena, mapped on first use."""
        if owner not in self._arenas:
            arena = ray.get(self._handles[owner].arena_id.remote(), timeout=self._timeout)
            self._arenas[owner] = ArenaReader(arena)  # refuses a file that is not the one the cache created
        return self._arenas[owner]

    def _handle(self, owner: int) -> Any:
        if owner < 0 or owner in self._lost:
            return None
        if owner not in self._handles:
            try:
                self._handles[owner] = ray.get_actor(self._layout.actor_name(self._layout.nodes[owner]),
                                                     namespace=NAMESPACE)
            except ValueError as e:  # never started, or gone with its node
                self._mark_lost(owner, e)
                return None
        return self._handles[owner]

    def _mark_lost(self, owner: int, error: BaseException) -> None:
        if owner not in self._lost:
            self._lost.add(owner)
            self._handles.pop(owner, None)
            self._arenas.pop(owner, None)
            if owner == self._local:
                self._snapshot = None
            logger.warning("cache on node %s is gone (%s); its part of the dataset is read from storage from now on",
                           self._layout.nodes[owner], type(error).__name__)
