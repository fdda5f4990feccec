"""The prep actor: prepares the pieces its coordinator assigns and returns them to the object store."""

from __future__ import annotations

import time

import numpy as np
import ray

from coordinated_prep.backends import make_preprocessor
from coordinated_prep.cache.layout import CacheLayout
from coordinated_prep.cache.reader import CachedSource
from coordinated_prep.cache.spec import CacheSpec
from coordinated_prep.chunk import ChunkTiming, PreparedChunk, prepare_chunk
from coordinated_prep.sources import open_source
from coordinated_prep.spec import DataSpec


@ray.remote(num_cpus=0)
class PrepActor:
    """Reads and preprocesses pieces for one data group.

    Owned by the group's coordinator (it dies with it). Created with ``max_restarts=-1`` and
    ``max_task_retries`` by the coordinator, so a killed actor is restarted and its in-flight piece
    prepared again; augmentation is a pure function of (seed, epoch, sample), so the retry is
    byte-identical.

    Args:
        spec: The group's data spec.
        cache: The sweep's cache layout and options, if it has node caches: reads go through them.
    """

    def __init__(self, spec: DataSpec, cache: tuple[CacheLayout, CacheSpec] | None = None) -> None:
        import torch

        torch.set_num_threads(1)  # one actor per core: intra-op threads would only oversubscribe
        self._spec = spec
        source = open_source(spec.dataset)
        self._cached = CachedSource(source, spec.dataset, *cache) if cache is not None else None
        self._source = source if self._cached is None else self._cached
        self._preprocessor = make_preprocessor(spec.pipeline)  # type: ignore[arg-type]

    def prepare(self, epoch: int, indices: np.ndarray) -> tuple[ChunkTiming, PreparedChunk]:
        """Prepare one piece. Returns (timing, piece) as two objects: the coordinator awaits the
        small first one and never pulls the images into its own process."""
        cpu = time.process_time()
        reads, hits = (self._cached.storage_reads, self._cached.cache_hits) if self._cached else (0, 0)
        chunk, timing = prepare_chunk(
            self._source, self._preprocessor, self._spec.seed, epoch, indices,
            self._spec.pipeline.size, self._spec.on_error,  # type: ignore[union-attr]
        )
        # The put stage (serialising into the object store) happens after this returns; the
        # coordinator measures it as the time from here until it learns the task finished.
        if self._cached is not None:
            reads, hits = self._cached.storage_reads - reads, self._cached.cache_hits - hits
        else:
            reads = len(indices)
        return timing._replace(finished_at=time.time(), cpu_s=time.process_time() - cpu, storage_reads=reads,
                               cache_hits=hits), chunk
