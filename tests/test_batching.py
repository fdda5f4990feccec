"""Cutting pieces into batches (pure, no Ray): views inside one piece, copies only across pieces."""

from __future__ import annotations

import numpy as np
import pytest

from coordinated_prep.trial.batching import BatchStats, batched
from coordinated_prep.pipeline.chunk import PreparedChunk, image_piece
from coordinated_prep.plan import piece_size
from tests.harness import assert_exactly_once


def _pieces(sizes: list[int], start: int = 0) -> list[PreparedChunk]:
    """Pieces of ``sizes`` samples whose pixels encode the sample index (2 x 2 images)."""
    out, index = [], start
    for n in sizes:
        ids = np.arange(index, index + n, dtype=np.int64)
        images = np.broadcast_to((ids % 251).astype(np.uint8)[:, None, None, None], (n, 3, 2, 2)).copy()
        images.setflags(write=False)  # as a piece read from the object store is
        out.append(image_piece(images, ids % 7, ids, 0))
        index += n
    return out


def _shares(batch, pieces) -> bool:
    return any(np.shares_memory(batch.images.numpy(), p.images) for p in pieces)


@pytest.mark.parametrize("batch_size", [32, 64, 128, 256])
def test_batches_that_divide_the_piece_are_all_views_of_it(batch_size):
    pieces = _pieces([256, 256, 256, 100])  # an epoch of 868 samples ends with a short piece
    stats = BatchStats()
    batches = list(batched(iter(pieces), batch_size, stats))
    assert stats.copied == 0 and stats.batches == len(batches)
    assert all(_shares(b, pieces) for b in batches), "every batch is a view of a piece"
    assert_exactly_once([np.concatenate([b.indices.numpy() for b in batches])], range(868))


@pytest.mark.parametrize("batch_size", [1, 7, 48, 100, 300, 1000])
def test_straddling_batches_are_copies_and_the_rest_views(batch_size):
    pieces = _pieces([256, 256, 256, 100])
    stats = BatchStats()
    batches = list(batched(iter(pieces), batch_size, stats))
    copies = [b for b in batches if not _shares(b, pieces)]
    assert len(copies) == stats.copied > 0 or batch_size == 1
    for b in batches:  # the pixels are those of the samples named, copied or not
        assert np.array_equal(b.images.numpy()[:, 0, 0, 0], (b.indices.numpy() % 251).astype(np.uint8))
        assert np.array_equal(b.labels.numpy(), b.indices.numpy() % 7)
    sizes = [len(b) for b in batches]
    assert all(s == batch_size for s in sizes[:-1]) and 0 < sizes[-1] <= batch_size
    assert_exactly_once([np.concatenate([b.indices.numpy() for b in batches])], range(868))


def test_a_copy_owns_its_memory():
    pieces = _pieces([10, 10])
    view, copy = list(batched(iter(pieces), 8))[:2]
    assert _shares(view, pieces) and not _shares(copy, pieces)


def test_mixed_batch_sizes_over_one_stream_each_see_every_sample_once():
    pieces = _pieces([256] * 7 + [41])
    for batch_size in (16, 32, 48, 64, 96, 128):
        batches = list(batched(iter(pieces), batch_size))
        assert_exactly_once([np.concatenate([b.indices.numpy() for b in batches])], range(256 * 7 + 41),
                            f"batch {batch_size}")


def test_stats_count_cpu_and_fraction():
    stats = BatchStats()
    list(batched(iter(_pieces([64, 64, 64])), 48, stats))
    assert stats.batches == 4 and stats.copied == 2 and stats.copied_fraction == 0.5
    assert stats.cpu_s >= 0 and stats.cpu_ms_per_batch >= 0


@pytest.mark.parametrize("samples, expected", [(3686, 256), (2700, 256), (2048, 256), (2047, 128), (540, 64),
                                               (162, 32), (10, 32)])
def test_automatic_piece_size(samples, expected):
    assert piece_size(None, samples) == expected
    assert piece_size(48, samples) == 48  # a chunk_size set by the user wins
