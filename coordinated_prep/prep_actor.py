"""The prep actor: prepares the pieces any data group of its node assigns, into the object store."""

from __future__ import annotations

import time

import numpy as np
import ray

from coordinated_prep.pipeline.backends import make_preprocessor
from coordinated_prep.cache.layout import CacheLayout
from coordinated_prep.cache.reader import CachedSource
from coordinated_prep.cache.spec import CacheSpec
from coordinated_prep.pipeline.chunk import ChunkTiming, PreparedChunk, eval_chunk, prepare_chunk
from coordinated_prep.contracts import DataSource, Preprocessor
from coordinated_prep.plan import holdout_split
from coordinated_prep.pipeline.sources import open_source
from coordinated_prep.spec import DataSpec, PipelineSpec

_KEPT = 16  # datasets and pipelines kept open per actor (a sweep has a few)


@ray.remote(max_restarts=-1, max_task_retries=3)
class PrepActor:
    """Reads and preprocesses pieces for every data group of its node.

    One of the node's prep pool (:mod:`coordinated_prep.pool.node`), owned by the sweep's group
    registry, which creates it with a share of the pool's reserved CPUs. Any coordinator of the
    node submits pieces to it; each call names its group's spec, and the actor keeps the sources and
    preprocessors it has opened. A killed actor is restarted by Ray and its in-flight pieces are
    prepared again (``max_task_retries``); augmentation is a pure function of (seed, epoch, sample),
    so a retry is byte-identical.

    Args:
        cache: The sweep's cache layout and options, if it has node caches: reads go through them.
    """

    def __init__(self, cache: tuple[CacheLayout, CacheSpec] | None = None) -> None:
        import torch

        import coordinated_prep.pipeline.backends.torchvision_backend  # noqa: F401  (now, not in the first piece)

        torch.set_num_threads(1)  # one actor per core: intra-op threads would only oversubscribe
        self._cache = cache
        self._sources: dict[str, tuple[DataSource, CachedSource | None]] = {}
        self._preprocessors: dict[PipelineSpec, Preprocessor] = {}

    def prepare(self, spec: DataSpec, epoch: int, indices: np.ndarray) -> tuple[ChunkTiming, PreparedChunk]:
        """Prepare one piece of ``spec``'s group. Returns (timing, piece) as two objects: the
        coordinator awaits the small first one and never pulls the images into its own process."""
        cpu = time.process_time()
        source, cached = self._source(spec.dataset)
        preprocessor = self._preprocessor(spec.pipeline)  # type: ignore[arg-type]
        reads, hits = (cached.storage_reads, cached.cache_hits) if cached else (0, 0)
        chunk, timing = prepare_chunk(
            source, preprocessor, spec.seed, epoch, indices, spec.pipeline.size, spec.on_error,  # type: ignore[union-attr]
            spec.views,
        )
        # The put stage (serialising into the object store) happens after this returns; the
        # coordinator measures it as the time from here until it learns the task finished.
        if cached is not None:
            reads, hits = cached.storage_reads - reads, cached.cache_hits - hits
        else:
            reads = len(indices)
        return timing._replace(finished_at=time.time(), cpu_s=time.process_time() - cpu, storage_reads=reads,
                               cache_hits=hits), chunk

    def held_out(self, spec: DataSpec) -> np.ndarray:
        """The held-out indices of ``spec``'s dataset, in index order (the dataset opened here, once)."""
        source, _ = self._source(spec.dataset)
        return holdout_split(len(source), spec.holdout)[1]

    def prepare_eval(self, spec: DataSpec, indices: np.ndarray) -> tuple[tuple[tuple[int, str, str], ...], PreparedChunk]:
        """Prepare held-out samples for evaluation: decode, resize, centre crop (no randomness).

        The same function per sample as an unshared trial's ``eval_loader``, so the bytes are equal.
        Called with ``num_returns=2``: the samples left out under ``on_error="skip"`` (index, path,
        reason), small, for the registry to count and log; and the piece.

        Raises:
            SampleError: With ``on_error="raise"``, a sample cannot be read or decoded; names the
                index and the file.
        """
        source, _ = self._source(spec.dataset)
        preprocessor = self._preprocessor(spec.pipeline)  # type: ignore[arg-type]
        skipped: list[tuple[int, str, str]] = []
        chunk = eval_chunk(source, preprocessor, indices, spec.on_error, skipped)
        return tuple(skipped), chunk

    def _source(self, dataset: str) -> tuple[DataSource, CachedSource | None]:
        if dataset not in self._sources:
            _bound(self._sources)
            source = open_source(dataset)
            cached = CachedSource(source, dataset, *self._cache) if self._cache is not None else None
            self._sources[dataset] = (cached or source, cached)
        return self._sources[dataset]

    def _preprocessor(self, pipeline: PipelineSpec) -> Preprocessor:
        if pipeline not in self._preprocessors:
            _bound(self._preprocessors)
            self._preprocessors[pipeline] = make_preprocessor(pipeline)
        return self._preprocessors[pipeline]


def _bound(kept: dict) -> None:
    """Forget the oldest entry once ``_KEPT`` are open (insertion order)."""
    if len(kept) >= _KEPT:
        del kept[next(iter(kept))]
