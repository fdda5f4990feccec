"""The timed pass every training loop shares (coordinated_prep.trial.timing), without Ray or torch."""

from __future__ import annotations

import gc
import weakref

from coordinated_prep.trial.timing import Timing, timed


class _Epoch:
    """An iterable whose iterators can be watched: ``self.live`` is a weak reference to the last one."""

    def __init__(self, n: int) -> None:
        self.n, self.live = n, None

    def __iter__(self):
        it = _Iterator(self.n)
        self.live = weakref.ref(it)
        return it


class _Iterator:
    def __init__(self, n: int) -> None:
        self.left = n

    def __iter__(self):
        return self

    def __next__(self) -> int:
        if not self.left:
            raise StopIteration
        self.left -= 1
        return self.left


def test_a_pass_yields_every_batch_or_the_limit_and_counts_them_while_the_caller_works():
    timing = Timing()
    seen = [(batch, timing.steps) for batch in timed(_Epoch(5), timing)]
    assert seen == [(4, 1), (3, 2), (2, 3), (1, 4), (0, 5)]
    assert [b for b in timed(_Epoch(5), timing, limit=2)] == [4, 3] and timing.steps == 7  # one Timing, two passes
    assert timing.wait >= 0 and timing.compute >= 0 and 0 <= timing.stall_fraction <= 1


def test_a_pass_cut_short_by_its_limit_drops_its_iterator_before_the_next_pass():
    # A DataLoader iterator shuts its workers down when dropped: the benchmark relies on it per epoch.
    gc.disable()  # only reference counting may free it, as it frees a DataLoader's at once
    try:
        epoch = _Epoch(5)
        for _ in timed(epoch, Timing(), limit=2):
            assert epoch.live() is not None
        assert epoch.live() is None
    finally:
        gc.enable()
