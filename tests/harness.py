"""The central invariant, checked the same way everywhere: each trial epoch holds each sample once."""

from __future__ import annotations

import hashlib
import math
from typing import Iterable, Sequence

import numpy as np
import torch

from coordinated_prep import DataSpec
from coordinated_prep.pipeline.backends import make_preprocessor
from tests.utils import image_chunk
from coordinated_prep.pipeline.part import part_ids
from coordinated_prep.plan import holdout_split
from coordinated_prep.pipeline.sources import open_source


def assert_exactly_once(epochs: Sequence[np.ndarray], expected: Iterable[int], who: str = "trial") -> None:
    """Every epoch in ``epochs`` (arrays of dataset indices) is a permutation of ``expected``."""
    want = np.sort(np.fromiter(expected, dtype=np.int64))
    assert len(epochs) > 0, f"{who}: no epochs recorded"
    for k, got in enumerate(epochs):
        got = np.sort(np.asarray(got, dtype=np.int64))
        if got.shape != want.shape or not np.array_equal(got, want):
            dup = np.unique(got[1:][got[1:] == got[:-1]])
            missing = np.setdiff1d(want, got)
            raise AssertionError(
                f"{who} epoch {k}: {len(got)} samples for {len(want)} expected; "
                f"duplicates {dup[:10].tolist()}, missing {missing[:10].tolist()}"
            )


def sample_digests(images: np.ndarray) -> np.ndarray:
    """A 64-bit digest of each sample's bytes."""
    return np.array([int.from_bytes(hashlib.blake2b(img.tobytes(), digest_size=8).digest(), "little")
                     for img in images], dtype=np.uint64)


def batch_digests(batch) -> np.ndarray:
    """A 64-bit digest of each sample of a Batch, over all its leaves (stacked, ragged, strings, metadata)."""
    out = np.empty(len(batch), dtype=np.uint64)
    for i in range(len(batch)):
        h = hashlib.blake2b(digest_size=8)
        for leaf in batch.leaves:
            row = leaf[i]
            if row is None or isinstance(row, dict):  # a tv_tensor's metadata (a hidden leaf): format, canvas size
                h.update(repr(sorted(row.items())).encode())
                continue
            h.update(row.encode() if isinstance(row, str) else row.contiguous().view(-1).view(torch.uint8).numpy().tobytes()
                     if row.dim() else row.reshape(1).view(torch.uint8).numpy().tobytes())
        out[i] = int.from_bytes(h.digest(), "little")
    return out


def train_ids(spec: DataSpec) -> np.ndarray:
    """The samples each epoch of a trial of ``spec`` holds: its part of the training split
    (:mod:`coordinated_prep.pipeline.part`), or the whole split."""
    n = len(open_source(spec.dataset))
    part = part_ids(spec, n)
    return holdout_split(n, spec.holdout)[0] if part is None else part


def stream_samples(starts: Iterable[int], epochs: int, samples_per_epoch: int, chunk_size: int) -> int:
    """Samples in the pieces that trials starting on pieces ``starts`` and reading ``epochs`` epochs
    each cover together: what a group that prepares each piece once prepares for them, whenever
    each of them joined."""
    per_epoch = math.ceil(samples_per_epoch / chunk_size)
    pieces = set().union(*(range(s, s + epochs * per_epoch) for s in starts))
    return sum(min(chunk_size, samples_per_epoch - (g % per_epoch) * chunk_size) for g in pieces)


#: Digests the unshared pipeline gave, per (source, pipeline, seed, stream epoch, view): the source
#: (kept alive here, so that its id is not reused) and the digest per index. The trials of a group
#: read the same samples, so each is prepared here once per test session.
_REFERENCE: dict[tuple, tuple[object, dict[int, int]]] = {}


def reference_digests(spec: DataSpec, epochs: np.ndarray, indices: np.ndarray,
                      views: np.ndarray | None = None) -> np.ndarray:
    """What the unshared pipeline makes of each (stream epoch, index[, view]), computed in this process.

    A sample's bytes are a function of (seed, stream epoch, index, view) alone (the invariant the
    shared path is checked against), so each is prepared once and remembered for the next trial."""
    source, prep = open_source(spec.dataset), make_preprocessor(spec.pipeline)
    views = np.zeros(len(indices), dtype=np.int64) if views is None else np.asarray(views)
    out = np.empty(len(indices), dtype=np.uint64)
    for e in np.unique(epochs):
        for v in np.unique(views[epochs == e]):
            sel = (epochs == e) & (views == v)
            _, known = _REFERENCE.setdefault((id(source), spec.pipeline, spec.seed, int(e), int(v)), (source, {}))
            todo = np.unique(np.asarray(indices)[sel])
            todo = todo[[int(i) not in known for i in todo]]
            if todo.size:
                chunk, _ = image_chunk(source, prep, spec.seed, int(e), todo, spec.pipeline.size, views=int(v) + 1)
                known.update(zip(todo.tolist(), sample_digests(chunk.images[int(v) * todo.size:]).tolist()))
            out[sel] = [known[int(i)] for i in np.asarray(indices)[sel]]
    return out


def check_trial_records(spec: DataSpec, epochs: list[dict], batch_size: int, who: str) -> None:
    """A trial's recorded epochs: exactly once each, batches of its size, bytes of the unshared pipeline."""
    ids = train_ids(spec)
    assert_exactly_once([e["indices"] for e in epochs], ids, who)
    for e in epochs:
        sizes = e["batch_sizes"]
        assert (sizes[:-1] == batch_size).all() and 0 < sizes[-1] <= batch_size, (who, sizes)
        assert len(sizes) == math.ceil(len(ids) / batch_size)
        want = reference_digests(spec, e["stream_epochs"], e["indices"])
        assert np.array_equal(e["digests"], want), f"{who}: bytes differ from the unshared pipeline"


def assert_fresh_exactly_once(epochs: Sequence[dict], expected: Iterable[int], most: int, who: str = "trial") -> None:
    """Echoed epochs (dicts with ``indices`` and ``repeats`` per delivered row): the fresh rows
    (``repeats == 0``) hold each sample exactly once, every row's (index, repeat) is delivered once,
    and no sample comes more than ``most`` times (``most - 1`` repeats)."""
    want = np.fromiter(expected, dtype=np.int64)
    assert_exactly_once([np.asarray(e["indices"])[np.asarray(e["repeats"]) == 0] for e in epochs], want, who)
    for k, e in enumerate(epochs):
        indices, repeats = np.asarray(e["indices"], dtype=np.int64), np.asarray(e["repeats"], dtype=np.int64)
        assert set(np.unique(indices).tolist()) <= set(want.tolist()), f"{who} epoch {k}: a sample not in the split"
        pairs = indices * (most + 1) + repeats
        assert np.unique(pairs).size == pairs.size, f"{who} epoch {k}: a (sample, repeat) delivered twice"
        assert repeats.min() >= 0 and repeats.max() < most, f"{who} epoch {k}: repeat {repeats.max()} >= {most}"
        counts = np.bincount(indices)
        assert counts.max() <= most, f"{who} epoch {k}: sample {int(counts.argmax())} came {counts.max()} times"


def assert_same_unshared_batches(dataset_a: str, dataset_b: str) -> None:
    """Two datasets holding the same samples (an ImageFolder and its conversion) give byte-identical
    unshared training batches for 2 epochs, and evaluation batches, under one seed."""
    from coordinated_prep import eval_loader, train_loader

    specs = [DataSpec(dataset=d, pipeline={"size": 32}, seed=5, coordinated=False, chunk_size=16, segments=3)
             for d in (dataset_a, dataset_b)]
    a_loader, b_loader = (train_loader(spec, batch_size=24, epochs=2) for spec in specs)
    for _ in range(2):
        pairs = list(zip(a_loader, b_loader, strict=True))
        assert pairs
        for a, b in pairs:
            assert torch.equal(a.images, b.images) and torch.equal(a.labels, b.labels)
            assert torch.equal(a.indices, b.indices)
    for a, b in zip(eval_loader(specs[0], 16), eval_loader(specs[1], 16), strict=True):
        assert torch.equal(a.images, b.images) and torch.equal(a.labels, b.labels)
