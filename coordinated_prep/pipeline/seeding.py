"""Randomness as a pure function of (seed, epoch, sample, view), and the process-global state around
a preparation, which only the thread that asked for the data may touch.

torchvision's ``transforms.v2`` draws from torch's global generator, many user transforms from
Python's ``random`` or NumPy's global ``np.random``. :func:`reseed` seeds all three from one key
before a call and :func:`preserved` restores them after, so a sample is byte-identical whichever
process prepares it, and the caller's own random state is untouched. A transform that draws from a
generator of its own (``np.random.default_rng()``, a ``torch.Generator``) cannot be seeded this way:
the group's start prepares a few samples twice and refuses it (:mod:`coordinated_prep.pipeline.probe`).

Rules for preparing in a process that also trains (a private stream with ``num_workers=0``: an
unshared trial, a trial the lease detached, a data-parallel rank that came too late):

1. **One thread count.** Prep actors and loader workers prepare with one torch thread, and torch
   splits reductions and matmuls by its thread count, so a per-clip normalisation would give other
   bytes under the trainer's count. The outermost :func:`preserved` block sets torch's intra-op
   threads to 1 and gives the caller's count back after (two calls, under a microsecond; a no-op
   where the count is 1 already, as in actors and workers). It is set on the thread that prepares,
   which is the thread that asked for data (rule 2), so the trainer is blocked in ``next()`` while
   its count is 1. What else is process-wide in it: MKL's count, and the count a thread that first
   runs a parallel op during the block starts with; only a thread of the user's computing at that
   moment could see them (the pinning thread is waiting, rule 2).
2. **Preparation runs on the thread that iterates the loader.** Python's ``random``, NumPy's legacy
   ``RandomState`` and torch's default CPU generator are process-global: a thread that seeds them
   while another draws hands that thread seeded numbers, takes some of its draws, and on restoring
   rewinds its generator. No per-thread generator can be given instead (``transforms.v2`` draws
   from torch's global generator, whoever calls it). So in-process preparation happens only while
   the thread that asked for the data waits for it, on that thread: its generators are saved,
   seeded and restored by itself, between its own draws. A helper thread of the loader (the
   pinning thread, which fetches, cuts and pins batches ahead) runs under :func:`serving` and hands
   each preparation to that thread with :func:`in_process`; the iterating thread runs it in
   :meth:`Handoff.wait` when it next asks for a batch. Handing over only the preparation keeps the
   rest (waiting for a shared piece, cutting, pinning) in the background.
3. **Nothing else draws for preparation from a global generator**: starting worker processes uses
   a generator of its own (:mod:`coordinated_prep.trial.workers`).
"""

from __future__ import annotations

import contextlib
import random
import threading
from concurrent.futures import Future
from typing import Any, Callable, Iterator, TypeVar

import numpy as np

T = TypeVar("T")

_TRANSFORM_STREAM = 0x7A5F  # separates these draws from the plan's sample order and the built-in crops
_FETCH, _VIEW = 0, 1  # the dataset's own __getitem__, and each view's transforms
_POLL_S = 1.0  # how often a helper waiting for the iterating thread checks that it is still alive


def key_seed(seed: int, epoch: int, index: int, view: int = 0, stage: int = _VIEW) -> int:
    """A 63-bit seed that is a pure function of its arguments (``epoch`` -1: evaluation)."""
    words = np.random.SeedSequence([_TRANSFORM_STREAM, stage, seed, epoch + 1, index, view]).generate_state(2)
    return (int(words[0]) << 31 ^ int(words[1])) & (2**63 - 1)


def reseed(seed: int) -> None:
    """Seed Python's ``random``, NumPy's global generator and torch's from ``seed`` (inside :func:`preserved`)."""
    import torch

    random.seed(seed)
    np.random.seed(seed & 0xFFFFFFFF)
    torch.random.default_generator.manual_seed(seed)  # (torch.manual_seed also seeds accelerators: 100x slower)


@contextlib.contextmanager
def preserved() -> Iterator[None]:
    """Prepare with one torch thread and restore the three global generators after the block.

    Nested blocks save nothing: saving NumPy's state costs ~70 us and reseeding ~7 us, so a piece
    is prepared inside one block and its samples' calls reuse it."""
    import torch

    if getattr(_depth, "n", 0):
        yield
        return
    generator = torch.random.default_generator
    saved = random.getstate(), np.random.get_state(legacy=False), generator.get_state()
    threads = torch.get_num_threads()
    if threads != 1:
        torch.set_num_threads(1)  # rule 1: the bytes of a prep actor's or a worker's single thread
    _depth.n = 1
    try:
        yield
    finally:
        _depth.n = 0
        if threads != 1:
            torch.set_num_threads(threads)
        random.setstate(saved[0])
        np.random.set_state(saved[1])
        generator.set_state(saved[2])


_depth = threading.local()  # inside a preserved() block on this thread


class HandoffClosed(RuntimeError):
    """The iterating thread stopped asking (an epoch cut short) while a helper waited for it."""


class Handoff:
    """Preparation handed from a loader's helper thread to the thread that iterates the loader.

    One job at a time: the helper posts it and waits; the iterating thread runs it inside
    :meth:`wait`. The helper waits as long as the handoff is open and the thread that last waited
    lives (it may train for a while between batches); :meth:`close` releases it.
    """

    def __init__(self) -> None:
        self._cv = threading.Condition()
        self._job: Callable[[], Any] | None = None
        self._done: Future | None = None  # the posted job's outcome, for the helper
        self._closed = False
        self._waiter: threading.Thread | None = None

    def run(self, job: Callable[[], T]) -> T:
        """Run ``job`` on the iterating thread and return its result (called by the helper).

        Raises:
            HandoffClosed: The iterating thread closed the handoff or ended first.
            Exception: What ``job`` raised.
        """
        done: Future = Future()
        with self._cv:
            if self._closed:
                raise HandoffClosed("the loader's iterator was closed")
            self._job, self._done = job, done
            self._cv.notify_all()
            # Liveness: the iterating thread runs the job when it next waits, or closes the handoff.
            while not done.done() and not self._closed:
                if not self._cv.wait(_POLL_S) and self._waiter is not None and not self._waiter.is_alive():
                    self._closed = True
        if not done.done():
            raise HandoffClosed("the loader's iterator was closed before it prepared the piece")
        return done.result()

    def wait(self, result: Future) -> Any:
        """``result.result()``, running the helper's jobs on this thread meanwhile (called by the iterating thread)."""
        result.add_done_callback(self._wake)
        while True:
            with self._cv:
                self._waiter = threading.current_thread()
                # No timeout needed: the helper either finishes ``result`` or posts a job, and both notify.
                self._cv.wait_for(lambda: self._job is not None or result.done())
                job, done, self._job, self._done = self._job, self._done, None, None
            if job is None:
                return result.result()
            self._serve(job, done)  # type: ignore[arg-type]

    def _serve(self, job: Callable[[], Any], done: Future) -> None:
        try:
            value = job()
        except Exception as e:  # the helper re-raises it where it asked
            done.set_exception(e)
        except BaseException:  # KeyboardInterrupt on this thread: stop here, and release the helper
            self.close()
            raise
        else:
            done.set_result(value)
        finally:
            self._wake(None)

    def _wake(self, _: Any) -> None:
        with self._cv:
            self._cv.notify_all()

    def close(self) -> None:
        """Release a helper waiting for this thread; later jobs raise HandoffClosed."""
        with self._cv:
            self._closed = True
            self._cv.notify_all()


_host = threading.local()  # .handoff: the Handoff through which this (helper) thread prepares


@contextlib.contextmanager
def serving(handoff: Handoff) -> Iterator[None]:
    """On a loader's helper thread: :func:`in_process` hands preparation to the iterating thread."""
    previous = getattr(_host, "handoff", None)
    _host.handoff = handoff
    try:
        yield
    finally:
        _host.handoff = previous


def in_process(job: Callable[[], T]) -> T:
    """Run ``job``, a preparation in this process: here, or on the iterating thread this helper serves (rule 2)."""
    handoff = getattr(_host, "handoff", None)
    return job() if handoff is None else handoff.run(job)
