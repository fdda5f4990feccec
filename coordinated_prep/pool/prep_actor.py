"""The prep actor: prepares the pieces any data group of its node assigns, into the object store."""

from __future__ import annotations

import gc
import threading
import time
from typing import Any

import numpy as np
import ray

from coordinated_prep.cache.layout import CacheLayout
from coordinated_prep.cache.reader import CachedSource
from coordinated_prep.cache.spec import CacheSpec
from coordinated_prep.errors import PrepError
from coordinated_prep.pipeline.chunk import ChunkTiming, PreparedChunk, eval_chunk, prepare_chunk
from coordinated_prep.pipeline.probe import Probe, probe, train_indices
from coordinated_prep.pipeline.sources import open_source
from coordinated_prep.pipeline.structure import Layout
from coordinated_prep.pipeline.transforms import Pipeline, make_pipeline
from coordinated_prep.pipeline.part import held_out
from coordinated_prep.pages import padded_empty
from coordinated_prep.spec import DataSpec
from coordinated_prep.tier.client import TierClient

_KEPT = 16  # pipelines kept open per actor (a sweep has a few)
_IMPORT_TIMEOUT_S = 300.0  # importing torch and torchvision takes 5-10 s on 2 busy cores

#: How a spec reaches a prep actor: ``[ref]``, a list holding its reference in the object store,
#: so that Ray passes the reference, not the spec: the actor fetches a group's spec (and its
#: dataset, if it is an object) once, at its first piece, not with every piece.
SpecBox = list


@ray.remote(max_restarts=-1, max_task_retries=3)
class PrepActor:
    """Reads and preprocesses pieces for every data group of its node.

    One of the node's prep pool (:mod:`coordinated_prep.pool.node`), owned by the sweep's group
    registry, which creates it with a share of the pool's reserved CPUs. Any coordinator of the
    node submits pieces to it; each call names its group's key and spec box, and the actor keeps
    the pipelines it has built. A killed actor is restarted by Ray and its in-flight pieces are
    prepared again (``max_task_retries``); every draw is a pure function of (seed, epoch, sample,
    view), so a retry is byte-identical.

    Args:
        cache: The sweep's cache layout and options, if it has node caches: reads go through them.
        tier: The name of the node's decoded tier and its claim timeout, if it has one: prefix
            outputs go through it (:mod:`coordinated_prep.tier`).
    """

    def __init__(self, cache: tuple[CacheLayout, CacheSpec] | None = None, tier: tuple[str, float] | None = None) -> None:
        # Placed, the actor holds its CPUs: it answers at once, so that the pool's start (which Tune's
        # first trial waits for) does not wait for torch. It imports torch meanwhile, on a thread of
        # its own, while the trials start; its first task waits for that (imported).
        self._importing = threading.Thread(target=_import_torch, name="coordprep-import", daemon=True)
        self._importing.start()
        self._threads_set = False
        self._buffer = ReusedBuffer()
        self.reset(cache, tier)

    @ray.method(max_task_retries=0)  # its failure is the answer: never sent again to a restarted actor
    def until_killed(self, timeout_s: float) -> None:
        """Returns after ``timeout_s``: sent just before ``ray.kill``, it fails once this actor's process
        is gone, which is how its killer waits for that (:func:`coordinated_prep.pool.warm._kill`)."""
        threading.Event().wait(timeout_s)

    def reset(self, cache: tuple[CacheLayout, CacheSpec] | None = None, tier: tuple[str, float] | None = None) -> None:
        """Serve a new sweep (a pool kept warm, :mod:`coordinated_prep.pool.warm`): its cache and tier,
        and no pipeline, spec, opened dataset or folder index of the last one (a dataset may have
        changed since, and the last sweep's objects must leave the store)."""
        from coordinated_prep.pipeline import datasets
        from coordinated_prep.pipeline.sources import shared_index

        open_source.cache_clear()
        datasets._built.cache_clear()
        shared_index.forget()
        self._cache = cache
        self._tier = TierClient.named(tier[0], ray.get_runtime_context().get_actor_id(), tier[1]) if tier else None
        self._pipelines: dict[str, Pipeline] = {}
        self._specs: dict[str, DataSpec] = {}
        self._sources: dict[str, tuple[Any, CachedSource | None]] = {}
        gc.collect()  # what a failed piece's traceback still held (a cycle through its frames): the spec box's ref

    def probe(self, spec: DataSpec, mode: str = "train") -> tuple[int, Probe]:
        """A group's start: (samples in the dataset, the layout and bytes of its training or
        held-out samples); refuses a transform that cannot be seeded
        (:mod:`coordinated_prep.pipeline.probe`)."""
        self.imported()
        pipeline = self._pipeline(spec, [spec])
        n = len(pipeline)
        ids = train_indices(n, spec.holdout) if mode == "train" else held_out(spec, n)
        where = "data" if mode == "train" else "data (evaluation)"
        return n, probe(pipeline, spec.seed, ids, spec.ragged, spec.views if mode == "train" else 1, mode, where)

    def prepare(self, key: str, box: SpecBox, epoch: int, indices: np.ndarray,
                layout: Layout) -> tuple[ChunkTiming, PreparedChunk]:
        """Prepare one piece of group ``key``. Returns (timing, piece) as two objects: the
        coordinator awaits the small first one and never pulls the piece into its own process."""
        self.imported()
        cpu = time.process_time()
        pipeline = self._pipeline(key, box)
        spec = self._specs[key]
        cached = getattr(pipeline, "cached", None)
        reads, hits = (cached.storage_reads, cached.cache_hits) if cached else (0, 0)
        chunk, timing = prepare_chunk(pipeline, layout, spec.seed, epoch, indices, spec.on_error, spec.views,
                                      alloc=self._buffer, decoded=self._tier.outputs if self._tier else None)
        # The put stage (serialising into the object store) happens after this returns; the
        # coordinator measures it as the time from here until it learns the task finished.
        if cached is not None:
            reads, hits = cached.storage_reads - reads, cached.cache_hits - hits
        else:
            reads = timing.decodes if getattr(pipeline, "prefix_key", None) is not None else len(indices)
        return timing._replace(finished_at=time.time(), cpu_s=time.process_time() - cpu, storage_reads=reads,
                               cache_hits=hits, nbytes=piece_nbytes(chunk)), chunk

    def held_out(self, spec: DataSpec) -> tuple[np.ndarray, Probe]:
        """The held-out indices of ``spec``'s dataset, in index order, and their probe."""
        n, found = self.probe(spec, "eval")
        return held_out(spec, n), found

    def prepare_eval(self, key: str, box: SpecBox, indices: np.ndarray,
                     layout: Layout) -> tuple[tuple[tuple[tuple[int, str, str], ...], int], PreparedChunk]:
        """Prepare held-out samples for evaluation (draws keyed by sample only).

        The same function per sample as an unshared trial's ``eval_loader``, so the bytes are equal.
        Called with ``num_returns=2``: small, for the registry, the samples left out under
        ``on_error="skip"`` (index, path, reason), to count and log, and the piece's real bytes
        (:func:`piece_nbytes`), to charge a resident piece; and the piece.

        Raises:
            SampleError: With ``on_error="raise"``, a sample cannot be read or prepared; names the
                index and where it lives.
        """
        self.imported()
        pipeline = self._pipeline(key, box)
        spec = self._specs[key]
        skipped: list[tuple[int, str, str]] = []
        chunk = eval_chunk(pipeline, layout, spec.seed, indices, spec.on_error, skipped)
        return (tuple(skipped), piece_nbytes(chunk)), chunk

    def imported(self) -> None:
        """Wait (bounded) until the actor's imports are done, and prepare with one torch thread from
        then on: one actor per core, and every preparation's bytes are a single thread's (seeding, rule
        1). Every preparing task calls it first; a pool that grows adds an actor once it returns."""
        if self._threads_set:
            return
        self._importing.join(_IMPORT_TIMEOUT_S)
        if self._importing.is_alive():
            raise PrepError(f"a prep actor did not import torch and torchvision within {_IMPORT_TIMEOUT_S:.0f} s; "
                            "the node is overloaded: lower the trials' concurrency or pool.actors")
        import torch

        torch.set_num_threads(1)
        self._threads_set = True

    def _pipeline(self, key: Any, box: SpecBox) -> Pipeline:
        """The pipeline of group ``key`` (a DataSpec itself for the start's probe), built once."""
        spec = key if isinstance(key, DataSpec) else None
        key = spec.group_key if spec is not None else key
        if key not in self._pipelines:
            if spec is None:
                spec = box[0] if isinstance(box[0], DataSpec) else ray.get(box[0])  # once per group and actor
            if len(self._pipelines) >= _KEPT:  # forget the oldest (insertion order)
                oldest = next(iter(self._pipelines))
                del self._pipelines[oldest], self._specs[oldest]
            source = cached = None
            if isinstance(spec.dataset, str):
                source, cached = self._source(spec.dataset)
            pipeline = make_pipeline(spec, source)
            pipeline.cached = cached  # type: ignore[attr-defined]
            self._pipelines[key], self._specs[key] = pipeline, spec
        return self._pipelines[key]

    def _source(self, dataset: str) -> tuple[Any, CachedSource | None]:
        """A directory or built-in dataset, opened once per actor and shared by its groups (one
        node-cache reader, whose snapshot serves every group of the dataset without calls)."""
        if dataset not in self._sources:
            if len(self._sources) >= _KEPT:
                del self._sources[next(iter(self._sources))]
            source = open_source(dataset)
            cached = CachedSource(source, dataset, *self._cache) if self._cache is not None else None
            self._sources[dataset] = (cached or source, cached)
        return self._sources[dataset]


def _import_torch() -> None:
    """What every preparation needs, imported ahead of the first piece (an error shows there again)."""
    try:
        import torch  # noqa: F401

        import coordinated_prep.pipeline.backends.torchvision_backend  # noqa: F401
    except Exception:  # the task that needs them imports them again and raises the error itself
        pass


def piece_nbytes(chunk: PreparedChunk) -> int:
    """The bytes ``chunk`` holds in the object store: its samples' buffer, its indices, a ragged
    leaf's offsets and an object leaf's characters (the buffer's two guard pages left out)."""
    total = chunk.buffer.nbytes + chunk.indices.nbytes
    for spec, leaf in zip(chunk.layout.leaves, chunk.leaves):
        if spec.kind == "ragged":
            total += 8 * (len(chunk) + 1)  # int64 offsets
        elif spec.kind == "object":
            total += sum(len(s) for s in leaf)
    return total


class ReusedBuffer:
    """The padded buffer of the last piece, reused for the next piece of the same size.

    Ray copies a task's returned piece into the object store before this actor (one task at a
    time) starts its next task, so the buffer is free again then; reusing it spares the page faults
    of fresh memory (a 224 px float piece is 154 MB: ~38,000 pages touched anew per piece).
    """

    def __init__(self) -> None:
        self._buffer: np.ndarray | None = None

    def __call__(self, nbytes: int) -> np.ndarray:
        if self._buffer is None or self._buffer.nbytes != nbytes:
            self._buffer = padded_empty((nbytes,))
        return self._buffer

