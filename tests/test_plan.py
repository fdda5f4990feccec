"""StreamPlan: pieces, segments and join points, without Ray."""

import numpy as np
import pytest

from coordinated_prep.plan import SHARDS_PER_SEGMENT, StreamPlan, holdout_split
from tests.harness import assert_exactly_once


def _epoch_from(plan: StreamPlan, start: int, k: int) -> np.ndarray:
    c = plan.chunks_per_epoch
    return np.concatenate([plan.chunk_samples(g) for g in range(start + k * c, start + (k + 1) * c)])


@pytest.mark.parametrize("n, chunk, segments", [(100, 8, 4), (97, 10, 3), (5, 8, 4), (64, 8, 100), (33, 1, 7)])
def test_every_window_from_a_join_point_is_an_exact_epoch(n, chunk, segments):
    ids = np.arange(1000, 1000 + n)
    plan = StreamPlan(ids, seed=3, chunk_size=chunk, segments=segments)
    joins = [g for g in range(3 * plan.chunks_per_epoch) if plan.is_join_point(g)]
    assert len(joins) == 3 * plan.num_segments
    for start in joins:
        assert_exactly_once([_epoch_from(plan, start, k) for k in range(2)], ids, f"start {start}")


def test_segments_keep_their_members_but_shuffle_within():
    ids = np.arange(200)
    plan = StreamPlan(ids, seed=0, chunk_size=10, segments=4)
    e0 = _epoch_from(plan, 0, 0)
    e1 = _epoch_from(plan, 0, 1)
    assert not np.array_equal(e0, e1), "epochs must be reshuffled"
    seg = plan.segment_chunks * plan.chunk_size
    for lo in range(0, 200, seg):
        assert set(e0[lo : lo + seg]) == set(e1[lo : lo + seg])


def test_plan_is_a_pure_function_of_the_seed():
    ids = np.arange(50)
    a, b = StreamPlan(ids, 7, 8, 3), StreamPlan(ids[::-1], 7, 8, 3)
    assert all(np.array_equal(a.chunk_samples(g), b.chunk_samples(g)) for g in range(30))
    c = StreamPlan(ids, 8, 8, 3)
    assert not all(np.array_equal(a.chunk_samples(g), c.chunk_samples(g)) for g in range(7))


def test_next_join_point():
    plan = StreamPlan(np.arange(100), 0, chunk_size=10, segments=3)  # 10 chunks, segments of 4
    assert plan.segment_chunks == 4
    assert [plan.next_join_point(g) for g in range(12)] == [0, 4, 4, 4, 4, 8, 8, 8, 8, 10, 10, 14]
    assert plan.chunk_len(9) == 10 and StreamPlan(np.arange(95), 0, 10, 3).chunk_len(9) == 5


def test_holdout_split_is_disjoint_and_fixed():
    train, held = holdout_split(100, 0.2)
    assert len(held) == 20 and len(train) == 80 and not set(train) & set(held)
    assert np.array_equal(held, holdout_split(100, 0.2)[1])
    with pytest.raises(ValueError, match="no training samples"):
        holdout_split(1, 0.9)


@pytest.mark.parametrize("sizes, chunk, segments", [((10,) * 10, 8, 4), ((1, 30, 2, 7, 60), 5, 6), ((97,), 10, 3),
                                                    ((3,) * 40, 4, 100)])
def test_a_plan_over_shards_keeps_exact_epochs_and_reads_each_segments_shards_in_a_run(sizes, chunk, segments):
    """Read shard by shard (a shard index), a segment is a run of consecutive shards in a seeded order:
    the samples before every join point are still the same set in every epoch, so every window from a
    join point is an exact epoch; and a piece needs only the shards of its segment."""
    n = sum(sizes)
    train, _ = holdout_split(n, 0.1)
    plan = StreamPlan(train, seed=5, chunk_size=chunk, segments=segments, shard_sizes=sizes)
    joins = [g for g in range(3 * plan.chunks_per_epoch) if plan.is_join_point(g)]
    for start in joins:
        assert_exactly_once([_epoch_from(plan, start, k) for k in range(2)], train, f"start {start}")
    starts = np.cumsum([0, *sizes])
    step = plan.segment_chunks * plan.chunk_size
    epoch = _epoch_from(plan, 0, 0)
    shards = [set((np.searchsorted(starts, epoch[lo: lo + step], side="right") - 1).tolist())
              for lo in range(0, len(epoch), step)]  # per segment, the shards its samples come from
    for a, b in zip(shards, shards[1:]):  # a run of shards each: neighbours share at most the one between them
        assert len(a & b) <= 1, (a, b)
    for s in set().union(*shards):  # and a shard lies in consecutive segments
        held = [k for k, found in enumerate(shards) if s in found]
        assert held == list(range(held[0], held[-1] + 1)), (s, held)
    order = sorted(set().union(*shards), key=lambda s: min(k for k, found in enumerate(shards) if s in found))
    if len(sizes) > 2:
        assert order != sorted(order), "the shards are taken in a seeded order, not their own"
        other = StreamPlan(train, seed=6, chunk_size=chunk, segments=segments, shard_sizes=sizes)
        assert not np.array_equal(_epoch_from(other, 0, 0), epoch)


def test_the_first_piece_over_many_shards_needs_a_few_of_them_where_a_plan_over_samples_needs_most():
    sizes = (10,) * 64
    train, _ = holdout_split(640, 0.1)
    shards = lambda plan: len(set((plan.chunk_samples(0) // 10).tolist()))  # noqa: E731
    by_shards = StreamPlan(train, 0, chunk_size=16, segments=16, shard_sizes=sizes)
    by_samples = StreamPlan(train, 0, chunk_size=16, segments=16)
    assert shards(by_shards) <= 6 < 12 <= shards(by_samples)
    # 1,024 shards: 16 segments would give a piece 64 of them to fetch first; the plan takes more segments
    many = StreamPlan(np.arange(102_400), 0, chunk_size=256, segments=16, shard_sizes=(100,) * 1024)
    assert many.num_segments > 16
    assert max(len(set((many.chunk_samples(g) // 100).tolist())) for g in range(0, 400, 7)) <= SHARDS_PER_SEGMENT + 1
