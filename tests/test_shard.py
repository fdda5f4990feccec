"""Data-parallel ranks end to end, without Ray: a rank's loader over its node's pieces, echo included.

Each rank reads every piece of the trial's epoch on its own node; nodes may skip different broken
samples (``on_error="skip"``, a transient read error on one node only). Whatever they skipped, every
rank must take as many steps as its siblings (an all-reduce waits for each) and no fresh row may go
to two ranks.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from coordinated_prep.trial.echo import EchoSpec
from coordinated_prep.errors import PrepError
from coordinated_prep.trial.loader import TrainLoader
from coordinated_prep.pipeline.chunk import PreparedChunk, image_piece
from coordinated_prep.trial.shard import Shard
from coordinated_prep.plan import StreamPlan


class _NodeStream:
    """A node's pieces of one plan (a PieceStream without Ray): its broken samples left out of each piece,
    as ``prepare_chunk`` leaves them out under ``on_error="skip"``; pixels encode index, view and epoch."""

    coordinator = None
    private_samples = 0

    def __init__(self, plan: StreamPlan, start: int, views: int, skipped: frozenset[int]) -> None:
        self._plan, self._views, self._skipped = plan, views, skipped
        self.start = self._next = start
        self.chunk_size = plan.chunk_size
        self.chunks_per_epoch = plan.chunks_per_epoch
        self.samples_per_epoch = plan.samples_per_epoch

    @property
    def position(self) -> int:
        return self._next

    def chunk_samples(self, g: int) -> np.ndarray:
        return self._plan.chunk_samples(g)

    def next_piece(self) -> PreparedChunk:
        g, self._next = self._next, self._next + 1
        kept = np.array([i for i in self._plan.chunk_samples(g).tolist() if i not in self._skipped], np.int64)
        ids = np.tile(kept, self._views)
        view = np.repeat(np.arange(self._views), len(kept))
        epoch = self._plan.locate(g)[0]
        pixels = ((ids * 7 + view + 3 * epoch) % 251).astype(np.uint8)
        images = np.broadcast_to(pixels[:, None, None, None], (len(ids), 3, 2, 2)).copy()
        images.setflags(write=False)  # as a piece read from the object store is
        return image_piece(images, ids % 5, ids, epoch, self._views)

    def skip_to(self, g: int) -> None:
        self._next = max(self._next, g)

    def ready(self, k: int = 1) -> bool:
        return True

    def begin_epoch(self, epoch: int) -> None:
        pass

    def close(self) -> None:
        pass


_ECHO = st.sampled_from(["off", "example:2", "example:3", "batch:2", "batch:3"])


@settings(max_examples=150, deadline=None)
@given(n=st.integers(1, 48), chunk=st.integers(1, 12), segments=st.integers(1, 3), world=st.integers(1, 4),
       batch=st.integers(1, 7), views=st.integers(1, 3), echo=_ECHO, drop_last=st.booleans(), data=st.data())
def test_every_rank_takes_as_many_steps_and_no_fresh_row_goes_to_two_ranks(
        n, chunk, segments, world, batch, views, echo, drop_last, data):
    plan = StreamPlan(np.arange(n), seed=3, chunk_size=chunk, segments=segments)
    start = data.draw(st.sampled_from([g for g in range(plan.chunks_per_epoch * 2) if plan.is_join_point(g)]))
    node_of = data.draw(st.lists(st.integers(0, world - 1), min_size=world, max_size=world), label="node of rank")
    skips = {node: frozenset(data.draw(st.sets(st.integers(0, n - 1), max_size=n - 1), label=f"node {node} skips"))
             for node in sorted(set(node_of))}
    assume(world * batch * 2 > n or any(skips.values()))  # small epochs and skips: where the cuts meet holes
    spec = EchoSpec.parse(echo)
    ranks = []
    for rank in range(world):
        stream = _NodeStream(plan, start, views, skips[node_of[rank]])
        loader = TrainLoader(stream, batch, echo=spec, views=views, shard=Shard(rank, world, drop_last))
        ranks.append((loader, list(loader)))
    steps = [len(batches) for _, batches in ranks]
    assert len(set(steps)) == 1, f"steps per rank {steps}: an all-reduce would wait forever"
    assert all(len(loader) == steps[0] for loader, _ in ranks), "len(loader) is the steps the rank takes"
    fresh = []
    for rank, (_, batches) in enumerate(ranks):
        assert all(0 < len(b) <= batch for b in batches)
        for b in batches:  # every row is its own sample's bytes, of its stream epoch (a pad copies a whole row)
            pixels = b.images.numpy()[:, 0, 0, 0].astype(np.int64)
            drawn = b.indices.numpy() * 7 + 3 * b.stream_epochs.numpy()
            assert np.all((pixels - drawn) % 251 < views), f"rank {rank}: a row's bytes are not its own"
        mine = np.concatenate([b.indices[b.repeats == 0].numpy() for b in batches] or [np.zeros(0, np.int64)])
        assert not set(mine.tolist()) & skips[node_of[rank]], f"rank {rank} served a sample its node skipped"
        fresh.append(mine)
    every = np.concatenate(fresh)
    assert len(np.unique(every)) == len(every), (
        f"fresh rows given twice: {sorted(i for i in set(every.tolist()) if (every == i).sum() > 1)[:10]}, "
        f"per rank {[sorted(f.tolist()) for f in fresh]}")
    if not drop_last:  # a sample is missing only where the node of the rank it falls to skipped it
        missing = set(range(n)) - set(every.tolist())
        assert missing <= frozenset.union(*skips.values()), f"samples {sorted(missing)} skipped on no node are lost"
        if not any(skips.values()):
            assert sorted(every.tolist()) == list(range(n)), "no skips: the ranks' fresh rows are the epoch"


def test_a_node_that_skipped_fifteen_samples_takes_as_many_echoed_steps_as_its_sibling():
    # the reported case: 80 samples, 2 ranks of 8; node A skipped 15, node B none; example:2 echo
    plan = StreamPlan(np.arange(80), seed=1, chunk_size=16, segments=1)
    skipped = frozenset(plan.chunk_samples(2)[:15].tolist())
    loaders = [TrainLoader(_NodeStream(plan, 0, 1, node), 8, echo=EchoSpec.parse("example:2"), shard=Shard(r, 2))
               for r, node in enumerate([skipped, frozenset()])]
    epochs = [list(loader) for loader in loaders]
    assert [len(e) for e in epochs] == [10, 10] == [len(loader) for loader in loaders]
    fresh = [{int(i) for b in e for i in b.indices[b.repeats == 0]} for e in epochs]
    lost = set(plan.chunk_samples(2)[:8].tolist())  # skipped where they fall to rank 0: rows 0-7 of piece 2
    assert not fresh[0] & fresh[1] and fresh[0] | fresh[1] == set(range(80)) - lost


def test_a_node_that_skipped_every_sample_of_the_epoch_is_an_error_that_says_so():
    plan = StreamPlan(np.arange(6), seed=0, chunk_size=2, segments=1)
    loader = TrainLoader(_NodeStream(plan, 0, 1, frozenset(range(6))), 2, shard=Shard(1, 2))
    with pytest.raises(PrepError, match="every sample of this epoch was skipped"):
        list(loader)


def test_ranks_reading_a_part_pass_over_a_piece_that_holds_none_of_it_after_a_skipped_sample():
    """A part (here a subset) may hold nothing of a piece: after a piece whose one part sample was skipped,
    that piece waits with it for the first row, in order (before: an IndexError ended every epoch)."""
    from coordinated_prep.pipeline.part import Part
    from coordinated_prep.plan import stream_plan

    plan = stream_plan(100, 0, 0.1, 8, 4)
    first, _, third = (plan.chunk_samples(g) for g in range(3))
    ids = np.sort(np.concatenate([first[:1], third]))  # one sample of piece 0 (broken here), none of 1, all of 2
    epochs = []
    for rank in range(2):
        stream = _NodeStream(plan, 0, 1, frozenset([int(first[0])]))
        stream.dataset_samples = 100
        epochs.append([b.indices.tolist() for b in TrainLoader(stream, 4, epochs=1, shard=Shard(rank, 2),
                                                               part=Part(ids, 100))])
    assert [len(e) for e in epochs] == [2, 2], "as many steps on each rank"
    fresh = [i for e in epochs for b in e for i in b]
    assert set(fresh) == set(third.tolist()), "every sample of the part but the broken one"


def test_a_shared_rank_builds_the_groups_own_plan_for_a_short_piece(small_dataset):
    from coordinated_prep import DataSpec
    from coordinated_prep.trial.streams import PrivateStream, SharedStream

    spec = DataSpec(dataset=small_dataset, pipeline={"size": 24}, chunk_size=16, holdout=0.2, segments=2)
    own = PrivateStream(spec)  # the coordinator's plan: the same function of the spec and the dataset
    shared = object.__new__(SharedStream)  # its plan, without joining a group (no Ray here)
    shared._spec, shared._fallback, shared._plan, shared._trial = spec, None, None, "t@1"
    shared.samples_per_epoch, shared.chunk_size = own.samples_per_epoch, own.chunk_size
    for g in (0, 3, own.chunks_per_epoch - 1, own.chunks_per_epoch + 2):
        assert np.array_equal(shared.chunk_samples(g), own.chunk_samples(g))
    shared._plan, shared.chunk_size = None, own.chunk_size + 1  # another dataset on this node
    with pytest.raises(PrepError, match="is it the same dataset on every node"):
        shared.chunk_samples(0)
