"""The trial's side: one timed pass over a loader, telling the time spent waiting for data from the
time spent on each batch (what ``data_wait_s``, ``compute_s`` and ``stall_fraction`` report).

Rule: the time ``next()`` on the loader takes is data wait, the end of the pass included (a loader
that is slow to say it is done stalls the trial too); the time the caller spends on a batch, until
it asks for the next, is compute. Creating the iterator is neither: a DataLoader starts its workers
there, which a trial pays once per epoch whatever it trains. Pure Python, no torch: the ready
trainables (:mod:`trainables.training`) and the benchmark's trial (:mod:`coordinated_prep.bench.trials`)
both time their passes with it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Iterable, Iterator, TypeVar

T = TypeVar("T")


@dataclass
class Timing:
    """Seconds spent waiting for batches and on them, and the batches taken (one pass, or several)."""

    wait: float = 0.0
    compute: float = 0.0
    steps: int = 0

    @property
    def stall_fraction(self) -> float:
        """The share of the time spent waiting for data."""
        return self.wait / max(self.wait + self.compute, 1e-9)


def timed(batches: Iterable[T], timing: Timing, limit: int = 0) -> Iterator[T]:
    """Yield one pass over ``batches`` (at most ``limit`` batches; 0: all), timed into ``timing``.

    ``timing.steps`` already counts a batch while the caller works on it. When the pass ends, its
    iterator over ``batches`` is dropped (a DataLoader's, cut short, shuts its workers down then).
    """
    it = iter(batches)
    taken = 0
    while not limit or taken < limit:
        t0 = time.perf_counter()
        batch = next(it, None)
        t1 = time.perf_counter()
        timing.wait += t1 - t0
        if batch is None:
            return
        timing.steps += 1
        taken += 1
        yield batch
        timing.compute += time.perf_counter() - t1


__all__ = ["Timing", "timed"]
