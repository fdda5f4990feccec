"""The node's raw-data cache actor: encoded samples in the object store, admitted by MinIO.

Life cycle of a cached sample: a prep actor asks its owner node's cache for it (``lookup``); on
the first miss the cache reads it from storage (one read, however many prep actors, groups or
nodes ask at once), puts the encoded bytes into its node's object store as a uint8 array and,
while the capacity lasts, keeps the reference for the rest of the sweep. The cache actor owns
every cached object: readers borrow references and map the bytes zero-copy (on its own node) or
pull a copy over the network (on another node). When the cache actor dies (its node left, or the
sweep's registry destroyed it at the end) its objects go with it and readers go back to storage.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import logging
from typing import Any

import numpy as np
import ray

from coordinated_prep import metrics
from coordinated_prep.cache.policy import MinioPolicy
from coordinated_prep.cache.spec import CacheSpec
from coordinated_prep.errors import SampleError
from coordinated_prep.sources import open_source

logger = logging.getLogger(__name__)

#: What a lookup answers per sample: a reference to its bytes, a SampleError for a broken sample,
#: or None for "not cached and the cache is full: read it from storage yourself".
Answer = "ray.ObjectRef | SampleError | None"


@ray.remote(num_cpus=0, max_concurrency=1000)
class RawCache:
    """One per node and sweep, shared by every data group of the sweep on the node.

    Args:
        spec: Capacity and reading options.
        node: Id of the node it runs on (it is created with hard node affinity).
        name: Its actor name, for logs.
    """

    def __init__(self, spec: CacheSpec, node: str, name: str) -> None:
        self.spec = spec
        self.node = node
        self.name = name
        self.policy = MinioPolicy(int(spec.capacity_bytes))
        self.refs: dict[tuple[str, int], ray.ObjectRef] = {}
        self.loading: dict[tuple[str, int], asyncio.Future] = {}
        self.pool = concurrent.futures.ThreadPoolExecutor(spec.read_threads, thread_name_prefix="coordprep-cache")
        self.stats: dict[str, Any] = {"node": node, "capacity_bytes": self.policy.capacity_bytes, "hits_local": 0,
                                      "hits_remote": 0, "misses": 0, "coalesced": 0, "storage_reads": 0,
                                      "storage_bytes": 0}
        self.tags = {"node": node[:16]}
        store = _object_store_bytes(node)
        if store and self.policy.capacity_bytes > 0.5 * store:
            logger.warning("cache %s: capacity %d bytes is over half of the node's object store (%d bytes); cached "
                           "samples are pinned there and crowd out prepared pieces: lower cache.capacity_bytes",
                           name, self.policy.capacity_bytes, store)
        metrics.set_gauge("cache_capacity_bytes", self.policy.capacity_bytes, **self.tags)

    async def lookup(self, dataset: str, indices: list[int], caller: str) -> list[Any]:
        """One answer per index of ``dataset`` (see :data:`Answer`), in order, for a reader on node ``caller``."""
        tally: collections.Counter[str] = collections.Counter()  # this call's events (calls overlap)
        answers = await asyncio.gather(*(self._one(dataset, i, caller != self.node, tally) for i in indices))
        for stat, value in tally.items():
            self.stats[stat] += value
        metrics.inc("cache_hits", tally["hits_local"], **self.tags, where="local")
        metrics.inc("cache_hits", tally["hits_remote"], **self.tags, where="remote")
        metrics.inc("cache_misses", tally["misses"], **self.tags)
        metrics.inc("storage_reads", tally["storage_reads"], **self.tags, reader="cache")
        metrics.set_gauge("cache_bytes", self.policy.used_bytes, **self.tags)
        return list(answers)

    async def report(self) -> dict[str, Any]:
        """Counters, bytes and items held."""
        return dict(self.stats, used_bytes=self.policy.used_bytes, items=len(self.policy), full=self.policy.full)

    async def clear(self) -> None:
        """Drop every cached sample (the registry calls it at the end of the sweep)."""
        self.refs.clear()
        self.pool.shutdown(wait=False, cancel_futures=True)
        metrics.set_gauge("cache_bytes", 0, **self.tags)

    async def _one(self, dataset: str, index: int, remote: bool, tally: collections.Counter[str]) -> Any:
        key = (dataset, index)
        ref = self.refs.get(key)
        if self.policy.lookup(key) and ref is not None:
            tally["hits_remote" if remote else "hits_local"] += 1
            return ref
        tally["misses"] += 1
        pending = self.loading.get(key)
        if pending is not None:  # another reader asked first: share its one storage read
            tally["coalesced"] += 1
            return await asyncio.shield(pending)
        if self.policy.full:
            return None  # the reader goes to storage itself; no bytes travel through this actor
        loop = asyncio.get_running_loop()
        future = self.loading[key] = loop.create_future()
        try:
            data = await loop.run_in_executor(self.pool, _read, dataset, index)
            if isinstance(data, SampleError):
                answer: Any = data  # not cached: a broken file stays visible to every reader
            else:
                tally["storage_reads"] += 1
                tally["storage_bytes"] += data.nbytes
                answer = ray.put(data)  # this actor owns it; kept only if admitted
                if self.policy.admit(key, data.nbytes):
                    self.refs[key] = answer
            future.set_result(answer)
            return answer
        except BaseException as e:
            future.set_exception(e)
            future.exception()  # retrieved: no "never retrieved" warning when nobody else waited
            raise
        finally:
            del self.loading[key]


def _read(dataset: str, index: int) -> np.ndarray | SampleError:
    try:
        return np.frombuffer(open_source(dataset).read(index), dtype=np.uint8)
    except SampleError as e:
        return e


def _object_store_bytes(node: str) -> float:
    for info in ray.nodes():
        if info["NodeID"] == node:
            return float(info["Resources"].get("object_store_memory", 0.0))
    return 0.0
