"""Preparing one piece of the stream, and how a piece holds its samples: the same function in prep
actors, in a private stream's workers and in evaluation.

A piece stacks the samples of one :class:`~coordinated_prep.pipeline.structure.Layout` leaf by leaf
into one buffer padded by a page on each side (:func:`~coordinated_prep.pages.padded_empty`): a
dense leaf as one array ``(rows, *shape)``, a ragged leaf as its samples' bytes end to end with
their offsets and shapes; strings ride along as a list. The piece pickles that whole buffer (Ray
stores it zero-copy), so a trial holds the piece's pages copy-on-write without touching another
object's bytes (:mod:`coordinated_prep.pages`), and a batch inside one piece is a view of it.

A piece of a group with ``views`` = k > 1 (echoing before augmentation) holds k augmented views of
each of its n samples, view-major: rows ``[v*n, (v+1)*n)`` are view ``v``, so ``indices`` repeat
k times and the views of one sample lie n rows apart.
"""

from __future__ import annotations

import functools
import time
from typing import Any, Callable, Literal, NamedTuple, Sequence

import numpy as np

from coordinated_prep.errors import SampleError, StructureError
from coordinated_prep.pipeline.seeding import preserved
from coordinated_prep.pipeline.structure import LeafSpec, Layout
from coordinated_prep.pages import guard, padded_base, padded_empty

_ALIGN = 64  # each leaf's bytes start at a multiple of this: any dtype's alignment, a cache line


class PreparedChunk:
    """One prepared piece: ``len(piece)`` rows of one layout, their dataset indices and stream epoch.

    Attributes:
        layout: The samples' structure and how each leaf is stored.
        leaves: Per leaf: a dense ``np.ndarray`` (rows, *shape) (for a bfloat16 leaf, its int16 bits),
            a ragged leaf's list of per-row arrays, or a list of strings. Views of ``buffer``.
        buffer: The uint8 bytes of every dense and ragged leaf (in a padded buffer).
        indices: int64 (rows,): dataset index of each row.
        epoch: The stream epoch whose draws produced these samples (-1: evaluation).
        views: Augmented views per sample, laid view-major.
    """

    __slots__ = ("layout", "leaves", "buffer", "indices", "epoch", "views", "_meta")

    def __init__(self, layout: Layout, buffer: np.ndarray, meta: tuple, indices: np.ndarray, epoch: int,
                 views: int = 1) -> None:
        self.layout, self.buffer, self._meta = layout, buffer, meta
        self.indices, self.epoch, self.views = indices, epoch, views
        rows = len(indices)
        leaves: list[Any] = []
        for spec, entry in zip(layout.leaves, meta):
            if spec.kind == "object":
                leaves.append(entry)
                continue
            start, nbytes = entry[0], entry[1]
            flat = buffer[start : start + nbytes]
            if spec.kind == "dense":
                leaves.append(flat.view(_storage(spec.dtype)).reshape((rows, *spec.shape)))  # type: ignore[misc]
            else:
                offsets, shapes = entry[2], entry[3]
                leaves.append([flat[offsets[i] : offsets[i + 1]].view(_storage(spec.dtype)).reshape(shapes[i])
                               for i in range(rows)])
        self.leaves = tuple(leaves)

    def __len__(self) -> int:
        return len(self.indices)

    @property
    def images(self) -> np.ndarray:
        """The first leaf (the input of an ``(input, target)`` sample), stacked."""
        return self.leaves[0]

    @property
    def labels(self) -> np.ndarray:
        """The second leaf (the target of an ``(input, target)`` sample)."""
        return self.leaves[1]

    def guarded(self) -> "PreparedChunk":
        """This piece, its bytes copy-on-write in this process (a shared piece a trial reads:
        :func:`coordinated_prep.pages.guard`); a piece over a private copy where they cannot be."""
        buffer = guard(self.buffer)
        if buffer is self.buffer:
            return self
        return PreparedChunk(self.layout, buffer, self._meta, self.indices, self.epoch, self.views)

    def __reduce__(self) -> tuple:
        found = padded_base(self.buffer)
        if found is None:  # not in a padded buffer (a piece built by hand): pickled as it is
            return PreparedChunk, (self.layout, self.buffer, self._meta, self.indices, self.epoch, self.views)
        base, offset = found
        return _unpickle_padded, (base, offset, self.buffer.nbytes, self.layout, self._meta, self.indices,
                                  self.epoch, self.views)


def _unpickle_padded(base: np.ndarray, offset: int, nbytes: int, layout: Layout, meta: tuple, indices: np.ndarray,
                     epoch: int, views: int) -> PreparedChunk:
    return PreparedChunk(layout, base[offset : offset + nbytes], meta, indices, epoch, views)


@functools.lru_cache(maxsize=None)
def _storage(dtype: str) -> np.dtype:
    """NumPy dtype that stores torch dtype ``dtype`` (bfloat16's bits as int16)."""
    import torch

    if dtype == "bfloat16":
        return np.dtype(np.int16)
    return torch.empty(0, dtype=getattr(torch, dtype)).numpy().dtype


def stack(layout: Layout, rows: Sequence[Sequence[Any]], indices: np.ndarray, epoch: int,
          views: int = 1, alloc: Callable[[int], np.ndarray] | None = None) -> PreparedChunk:
    """One piece of ``rows`` (each a sample's leaves, checked by :meth:`Layout.check`), in a padded
    buffer, or in the uint8 buffer ``alloc(nbytes)`` returns (shared memory for a worker)."""
    n = len(rows)
    plan: list[tuple] = []
    total = 0
    for j, spec in enumerate(layout.leaves):
        if spec.kind == "object":
            plan.append((spec, None))
            continue
        if spec.kind == "dense":
            nbytes = n * int(np.prod(spec.shape, dtype=np.int64)) * _storage(spec.dtype).itemsize  # type: ignore[arg-type]
            plan.append((spec, (total, nbytes)))
        else:
            sizes = [rows[i][j].nbytes for i in range(n)]
            offsets = np.zeros(n + 1, dtype=np.int64)
            np.cumsum(sizes, out=offsets[1:])
            nbytes = int(offsets[-1])
            plan.append((spec, (total, nbytes, offsets, tuple(rows[i][j].shape for i in range(n)))))
        total += -(-nbytes // _ALIGN) * _ALIGN
    buffer = padded_empty((total,)) if alloc is None else alloc(total)
    meta: list[Any] = []
    for j, (spec, where) in enumerate(plan):
        if spec.kind == "object":
            meta.append([rows[i][j] for i in range(n)])
            continue
        start, nbytes = where[0], where[1]
        flat = buffer[start : start + nbytes]
        if spec.kind == "dense":
            out = flat.view(_storage(spec.dtype)).reshape((n, *spec.shape))
            for i in range(n):
                out[i] = rows[i][j]
            meta.append((start, nbytes))
        else:
            offsets = where[2]
            for i in range(n):
                flat[offsets[i] : offsets[i + 1]] = rows[i][j].reshape(-1).view(np.uint8)
            meta.append((start, nbytes, offsets, where[3]))
    return PreparedChunk(layout, buffer, tuple(meta), np.asarray(indices, dtype=np.int64), epoch, views)


def image_layout(shape: tuple[int, ...]) -> Layout:
    """The layout of ``(uint8 image of shape, int label)`` samples: the built-in pipeline's."""
    return Layout(("tuple", (("leaf",), ("leaf",))), (LeafSpec("dense", "uint8", tuple(shape)), LeafSpec("dense", "int64", ())))


def image_piece(images: np.ndarray, labels: np.ndarray, indices: np.ndarray, epoch: int,
                views: int = 1) -> PreparedChunk:
    """A piece of ``(image, label)`` samples from stacked arrays (tests and hand-made pieces)."""
    layout = image_layout(tuple(images.shape[1:]))
    rows = [(images[i], np.int64(labels[i])) for i in range(len(indices))]
    return stack(layout, rows, np.asarray(indices, dtype=np.int64), epoch, views)


class ChunkTiming(NamedTuple):
    """Seconds spent per stage preparing one piece, and the samples left out of it."""

    fetch_s: float  # reading encoded bytes
    transform_s: float  # decoding and augmenting
    skipped: tuple[tuple[int, str, str], ...] = ()  # (index, path, reason) under on_error="skip"
    finished_at: float = 0.0  # wall-clock time (time.time) the prep actor finished; 0 when unset
    cpu_s: float = 0.0  # CPU seconds of the preparing process (threads included); 0 when unset
    storage_reads: int = 0  # samples the preparing process read from storage itself
    cache_hits: int = 0  # samples that came from a node's raw-data cache
    decodes: int = 0  # samples whose prefix (decode, ...) ran here (:mod:`coordinated_prep.pipeline.split`)
    tier_hits: int = 0  # samples whose prefix output came from the node's decoded tier
    nbytes: int = 0  # the piece's real bytes (set by the prep actor; 0 when unset)


#: How a prep actor gets prefix outputs: ``(prefix key, indices, produce) -> (outputs, decodes,
#: hits)``, where ``produce(indices)`` reads and runs the prefix (:class:`~coordinated_prep.tier.client.TierClient`).
Decoded = Callable[[str, list[int], Callable[[list[int]], list[Any]]], tuple[list[Any], int, int]]


def prepare_chunk(
    pipeline: Any, layout: Layout, seed: int, epoch: int, indices: np.ndarray,
    on_error: Literal["raise", "skip"] = "raise", views: int = 1, alloc: Callable[[int], np.ndarray] | None = None,
    decoded: Decoded | None = None,
) -> tuple[PreparedChunk, ChunkTiming]:
    """Read, decode and transform the samples ``indices`` for stream epoch ``epoch``.

    All samples are read first (the fetch stage), then transformed: in one call for a pipeline with
    ``train_batch`` (DALI), else one by one. With ``views`` = k > 1 each sample is read once and
    transformed k times (view ``v`` drawn from seed, epoch, index and ``v``; view 0 is the draw of
    ``views=1``), laid view-major (into ``alloc``'s buffer, if given: see :func:`stack`). With
    ``on_error="skip"`` a sample that cannot be read, decoded
    or transformed is left out of the piece (so every trial reading the piece leaves it out alike)
    and reported in the timing's ``skipped``; a failed batch is retried sample by sample to find
    the culprit.

    A pipeline that splits (``prefix_key``: :mod:`coordinated_prep.pipeline.split`) gets its prefix
    outputs from ``decoded`` (the node's decoded tier), which runs the fetch and prefix only for the
    samples it does not keep; without it, every sample's prefix runs here. Either way each sample's
    tail then runs on the same prefix output, so the bytes are the same. The timing's ``fetch_s``
    then covers reading and the prefix, ``transform_s`` the tail.

    Raises:
        SampleError: With ``on_error="raise"``, a sample cannot be read, decoded or transformed;
            names the index and where it lives.
        StructureError: A sample's structure differs from the layout's (always raised: no sample
            of the pipeline can be trusted then).
    """
    with preserved():  # the global generators are saved once per piece, not per sample
        if getattr(pipeline, "prefix_key", None) is not None:
            return _prepare_split(pipeline, layout, seed, epoch, indices, on_error, views, alloc, decoded)
        return _prepare(pipeline, layout, seed, epoch, indices, on_error, views, alloc)


def _prepare_split(pipeline: Any, layout: Layout, seed: int, epoch: int, indices: np.ndarray, on_error: str,
                   views: int, alloc: Callable[[int], np.ndarray] | None,
                   decoded: Decoded | None) -> tuple[PreparedChunk, ChunkTiming]:
    """:func:`prepare_chunk` for a pipeline with a prefix: prefix outputs (kept, or made here), then tails."""

    def produce(ids: list[int]) -> list[Any]:  # per sample its prefix output, or the SampleError making it
        out: list[Any] = []
        for index, raw in zip(ids, pipeline.fetch(ids, seed, epoch)):
            try:
                out.append(_sample(pipeline, index, raw, lambda r: pipeline.prefix(r, index)))
            except SampleError as error:
                out.append(error)
        return out

    t0 = time.perf_counter()
    ids = [int(i) for i in indices]
    if decoded is not None:
        outputs, decodes, hits = decoded(pipeline.prefix_key, ids, produce)
    else:
        outputs, decodes, hits = produce(ids), len(ids), 0
    t1 = time.perf_counter()
    skipped: list[tuple[int, str, str]] = []
    per_view: list[list[Any]] = [[] for _ in range(views)]
    kept: list[int] = []
    for index, packed in zip(ids, outputs):
        try:
            out = _sample(pipeline, index, packed, lambda p: pipeline.tail(p, seed, epoch, index, views))
        except SampleError as error:
            if on_error == "raise":
                raise
            skipped.append((error.index, error.path, error.reason))
            continue
        for v in range(views):
            per_view[v].append(out[v])
        kept.append(index)
    rows = [layout.check(sample, kept[k], "data") for v in range(views) for k, sample in enumerate(per_view[v])]
    chunk = stack(layout, rows, np.tile(np.asarray(kept, dtype=np.int64), views), epoch, views, alloc)
    return chunk, ChunkTiming(t1 - t0, time.perf_counter() - t1, tuple(skipped), decodes=decodes, tier_hits=hits)


def _sample(pipeline: Any, index: int, value: Any, call: Callable[[Any], Any]) -> Any:
    """``call(value)`` for sample ``index``: a SampleError ``value`` raised as it is, and any error of
    the call (decoders raise RuntimeError/ValueError/OSError, transforms anything) as a SampleError
    naming the sample; a StructureError stays one (no sample of the pipeline can be trusted then)."""
    if isinstance(value, SampleError):
        raise value
    try:
        return call(value)
    except (StructureError, SampleError):
        raise
    except Exception as e:
        raise SampleError(index, pipeline.describe(index), f"cannot decode or transform: {type(e).__name__}: {e}") from e


def _prepare(pipeline: Any, layout: Layout, seed: int, epoch: int, indices: np.ndarray, on_error: str, views: int,
             alloc: Callable[[int], np.ndarray] | None) -> tuple[PreparedChunk, ChunkTiming]:
    skipped: list[tuple[int, str, str]] = []
    t0 = time.perf_counter()
    ids = [int(i) for i in indices]
    raws: list[tuple[int, Any]] = []
    for index, raw in zip(ids, pipeline.fetch(ids, seed, epoch)):
        if not isinstance(raw, SampleError):
            raws.append((index, raw))
        elif on_error == "raise":
            raise raw
        else:
            skipped.append((raw.index, raw.path, raw.reason))
    t1 = time.perf_counter()
    per_view: list[list[Any]] | None = None
    kept: list[int] = []
    if getattr(pipeline, "train_batch", None) is not None and raws:
        try:
            datas, rows_ids = [d for _, d in raws] * views, [i for i, _ in raws] * views  # view-major
            samples = pipeline.train_batch(datas, seed, epoch, rows_ids, [v for v in range(views) for _ in raws])
            n = len(raws)
            per_view = [samples[v * n : (v + 1) * n] for v in range(views)]
            kept = [i for i, _ in raws]
        except Exception:  # one bad sample fails the whole batch: find it sample by sample below
            per_view = None
    if per_view is None:
        per_view = [[] for _ in range(views)]
        for index, raw in raws:
            try:
                out = pipeline.train(raw, seed, epoch, index, views)
            except (StructureError,):
                raise
            except Exception as e:  # decoders raise RuntimeError/ValueError/OSError, transforms anything
                error = e if isinstance(e, SampleError) else SampleError(
                    index, pipeline.describe(index), f"cannot decode or transform: {type(e).__name__}: {e}")
                if on_error == "raise":
                    raise error from e
                skipped.append((error.index, error.path, error.reason))
                continue
            for v in range(views):
                per_view[v].append(out[v])
            kept.append(index)
    where = "data"
    rows = [layout.check(sample, kept[k], where) for v in range(views) for k, sample in enumerate(per_view[v])]
    chunk = stack(layout, rows, np.tile(np.asarray(kept, dtype=np.int64), views), epoch, views, alloc)
    return chunk, ChunkTiming(t1 - t0, time.perf_counter() - t1, tuple(skipped))


def eval_chunk(pipeline: Any, layout: Layout, seed: int, indices: np.ndarray,
               on_error: Literal["raise", "skip"] = "raise",
               skipped: list[tuple[int, str, str]] | None = None) -> PreparedChunk:
    """Read and prepare the held-out samples ``indices`` for evaluation (epoch -1).

    With ``on_error="skip"`` a sample that cannot be read or prepared is left out of the piece and
    appended to ``skipped`` as (index, path, reason), as :func:`prepare_chunk` does for training.

    Raises:
        SampleError: With ``on_error="raise"``, a sample cannot be read or prepared; names the
            index and where it lives.
    """
    rows: list[Any] = []
    kept: list[int] = []
    ids = [int(i) for i in indices]
    for index, raw in zip(ids, pipeline.fetch(ids, seed, -1)):
        try:
            sample = _sample(pipeline, index, raw, lambda r: pipeline.eval(r, seed, index))
        except SampleError as error:
            if on_error == "raise":
                raise
            if skipped is not None:
                skipped.append((error.index, error.path, error.reason))
            continue
        rows.append(layout.check(sample, index, "data (evaluation)"))
        kept.append(index)
    return stack(layout, rows, np.asarray(kept, dtype=np.int64), -1)
