"""Where a trial's pieces come from: the group's coordinator (shared) or its own process (private)."""

from __future__ import annotations

import collections
import logging
import math
import time
import weakref
from typing import Any, Protocol

import numpy as np
import ray

from coordinated_prep.pipeline.chunk import PreparedChunk, prepare_chunk
from coordinated_prep.pipeline.part import part_fields, prepared_plan
from coordinated_prep.pipeline.probe import probe, train_indices
from coordinated_prep.pipeline.seeding import in_process
from coordinated_prep.pipeline.transforms import make_pipeline, shard_sizes
from coordinated_prep.trial.calls import fetch, find_registry
from coordinated_prep.trial.workers import WorkerPieces
from coordinated_prep.errors import PrepError
from coordinated_prep.plan import StreamPlan, stream_plan
from coordinated_prep.spec import DataSpec
from coordinated_prep.context import worker_group
from coordinated_prep.stream.watch import this_process

logger = logging.getLogger(__name__)


class PieceStream(Protocol):
    """An endless, in-order stream of prepared pieces, starting at ``start``."""

    start: int
    chunks_per_epoch: int
    samples_per_epoch: int
    chunk_size: int  # samples the plan puts in a piece (the epoch's last may hold fewer)
    dataset_samples: int  # samples in the dataset (training and held out): a trial's part is found from it
    coordinator: str | None  # name of the coordinator serving it; None when private
    private_samples: int  # samples this process prepared itself

    @property
    def position(self) -> int:
        """Number of the piece ``next_piece`` returns next."""
        ...

    def next_piece(self) -> PreparedChunk:
        """The next piece; raises PrepError naming the trial if it cannot be had."""
        ...

    def skip_to(self, g: int) -> None:
        """Pass over every piece before piece ``g`` without reading it, at once (no waiting)."""
        ...

    def chunk_samples(self, g: int) -> np.ndarray:
        """Dataset indices the plan puts in piece ``g``, in order (a piece may hold fewer: skipped samples)."""
        ...

    def ready(self, k: int = 1) -> bool:
        """Whether the next ``k`` pieces can be had without waiting for another process to prepare them."""
        ...

    def begin_epoch(self, epoch: int) -> None:
        """The reader begins its epoch ``epoch`` (0 the first, from ``start``)."""
        ...

    def close(self) -> None:
        """Release what the stream holds."""
        ...


class PrivateStream:
    """Prepares every piece for this process alone: the unshared baseline, and the loader outside a sweep.

    It walks the same plan from piece ``first`` with the same preparation function as the prep
    actors, so its bytes equal those of a shared trial reading the same pieces. With ``workers`` = 0
    each piece is prepared when asked, on the thread that iterates the loader (a helper thread that
    asks hands it there: :mod:`coordinated_prep.pipeline.seeding`, rule 2); with ``workers`` > 0 in
    that many worker processes, ``prefetch`` pieces ahead of each (:mod:`coordinated_prep.trial.workers`).

    Raises:
        ConfigError, StructureError: The group's start refuses the pipeline (probe).
    """

    def __init__(self, spec: DataSpec, first: int = 0, workers: int = 0, prefetch: int = 2) -> None:
        self._spec = spec
        self._pipeline = make_pipeline(spec)
        n = len(self._pipeline)
        self._layout = probe(self._pipeline, spec.seed, train_indices(n, spec.holdout), spec.ragged, spec.views).layout
        self._plan = stream_plan(n, spec.seed, spec.holdout, spec.chunk_size, spec.segments,
                                 shard_sizes(self._pipeline))
        self._prepared = prepared_plan(self._plan, spec, n)  # a trial reading a part prepares only its samples
        self._workers = WorkerPieces(spec, self._prepared, self._layout, workers, prefetch) if workers > 0 else None
        self.dataset_samples = n
        self.start = 0
        self.coordinator = None
        self.chunks_per_epoch = self._plan.chunks_per_epoch
        self.samples_per_epoch = self._plan.samples_per_epoch
        self.chunk_size = self._plan.chunk_size
        self.chunk_samples = self._plan.chunk_samples
        self.private_samples = 0
        self._next = first

    @property
    def position(self) -> int:
        return self._next

    def skip_to(self, g: int) -> None:
        self._next = max(self._next, g)

    def ready(self, k: int = 1) -> bool:
        """Always: this process prepares each piece when asked, and waits on nobody."""
        return True

    def begin_epoch(self, epoch: int) -> None:
        pass  # it prepares what it is asked for, when it is asked

    def next_piece(self) -> PreparedChunk:
        g, self._next = self._next, self._next + 1
        chunk = self._workers.next(g) if self._workers is not None else in_process(lambda: self._prepare(g))
        self.private_samples += len(chunk) // chunk.views  # samples, not their views
        return chunk

    def _prepare(self, g: int) -> PreparedChunk:
        epoch, _ = self._plan.locate(g)
        return prepare_chunk(self._pipeline, self._layout, self._spec.seed, epoch, self._prepared.chunk_samples(g),
                             self._spec.on_error, self._spec.views)[0]

    def close(self) -> None:
        if self._workers is not None:
            self._workers.close()


class SharedStream:
    """Fetches pieces from the group's coordinator, keeping ``prefetch`` requests in flight.

    Args:
        spec: The trial's data spec.
        trial: The Tune trial id.
        consumer: The id the coordinator knows this loader by: the trial id, with ``#k`` appended
            for the trial's k-th loader, so that one trial may read several loaders (and
            ``@<rank>`` for a data-parallel rank, appended by the coordinator).
        batch_size: The trial's batch size (a data-parallel rank's global batch: it reads those).
        prefetch: Pieces requested ahead (bounded); None: two batches' worth, and at least two pieces.
        epochs: Epochs the trial will read, if it knows: nothing past them is requested or prepared.
        rank: ``(r, k)``: rank ``r`` of a data-parallel trial of ``k`` workers, which reads every
            piece of the trial's epochs and keeps its share (:mod:`coordinated_prep.trial.shard`).
    """

    def __init__(self, spec: DataSpec, trial: str, consumer: str, batch_size: int, prefetch: int | None = None,
                 epochs: int | None = None, rank: tuple[int, int] | None = None) -> None:
        self._spec = spec
        self._trial = consumer
        self._fallback: PrivateStream | None = None  # set when the lease detaches this trial
        self.private_reason: str | None = None  # why it prepares its own pieces, once it does (the summary says)
        self._timeout = spec.fetch_timeout_s
        info = self._join(trial, epochs, rank)
        self._trial = consumer = info["consumer"]  # ``<consumer>@<rank>`` for a data-parallel rank
        if info["token"] is None:  # its node released the ranks' start already: its own pieces from there
            self._fallback = in_process(lambda: PrivateStream(spec, first=info["start"]))  # its probe prepares
            self.private_reason = (f"it met its sibling ranks after its node had released their start, "
                                   f"piece {info['start']}")
            info.update(token=-1, chunks_per_epoch=self._fallback.chunks_per_epoch,  # -1: no incarnation to leave
                        samples_per_epoch=self._fallback.samples_per_epoch,
                        chunk_size=self._fallback._plan.chunk_size, dataset_samples=self._fallback.dataset_samples)
        self.start: int = info["start"]
        self.chunks_per_epoch: int = info["chunks_per_epoch"]
        self.samples_per_epoch: int = info["samples_per_epoch"]
        self.chunk_size: int = info["chunk_size"]
        self.dataset_samples: int = info["dataset_samples"]
        self._plan: StreamPlan | None = None  # built only if a data-parallel rank meets a piece short of samples
        self.coordinator: str = info["name"]
        self._token: int = info["token"]
        self._next = self.start
        self._end = None if epochs is None else self.start + epochs * self.chunks_per_epoch
        # Without declared epochs: requests stop at the end of the epoch begun (begin_epoch moves
        # it), so the group prepares nothing past the last epoch the trial reads (staging's docstring).
        self._fence = self.start + self.chunks_per_epoch if epochs is None else self._end
        if prefetch is None:  # the piece being cut and the next, or two batches' worth if batches are larger
            prefetch = max(2, 2 * math.ceil(batch_size / info["chunk_size"]))
        self._prefetch = max(1, prefetch)
        self._pending: collections.deque[tuple[int, ray.ObjectRef]] = collections.deque()
        # Blocked on answers not yet at hand since the last request: told to the coordinator with the next.
        self._blocked_s = 0.0
        self._closed = False
        # A loader dropped without close() leaves its group when it is collected: one call sent, not
        # awaited (a finalizer may run anywhere, under any lock), and none at interpreter exit (the
        # coordinator's watch releases a trial whose process ends).
        self._finalizer = weakref.finalize(self, _leave_unawaited, self._coordinator, consumer, self._token)
        self._finalizer.atexit = False

    def widen(self, ratio: float) -> None:
        """Request ``ratio`` times as many pieces ahead (at most 64): a trial reading a part of the split
        (:mod:`coordinated_prep.trial.subset`) takes ``ratio`` times as many pieces per batch."""
        self._prefetch = max(self._prefetch, min(64, math.ceil(self._prefetch * ratio)))

    def _join(self, trial: str, epochs: int | None, rank: tuple[int, int] | None) -> dict[str, Any]:
        """Find the group's coordinator on this node and join it; once more if it died in between.

        The registry replaces a dead coordinator when asked again, so a death between the two
        calls costs one retry, not the trial.
        """
        registry = find_registry(trial)
        node = ray.get_runtime_context().get_node_id()  # the group's coordinator on this node serves it
        process = this_process(ray.get_runtime_context().get_actor_id())  # watched: a paused trial's process ends
        if rank is not None:  # the trial's ranks meet at the registry, which places each on its node at one start
            placed = self._call(registry.meet.remote(self._spec, trial, self._trial, rank[0], rank[1], node, epochs,
                                                     process, self._timeout, worker_group()),
                                "meeting its sibling ranks", self._timeout + 120)  # the registry gives up first
            self._coordinator = placed["coordinator"]
            consumer = f"{self._trial}@{rank[0]}"
            if placed["info"] is None:
                logger.warning("trial %s: its node released the ranks' start (piece %d) already; it prepares its own "
                               "pieces", consumer, placed["start"])
                return {"token": None, "start": placed["start"], "name": None, "consumer": consumer}
            return placed["info"]
        for attempt in (1, 2):
            self._coordinator = self._call(registry.group_for.remote(self._spec, trial, node, process),
                                           "finding its data group")  # a run without Tune leaves when it ends
            try:
                return self._call(self._coordinator.join.remote(self._trial, epochs, process, part_fields(self._spec)),
                                  "joining its data group")
            except PrepError as e:
                if attempt == 2 or not isinstance(e.__cause__, ray.exceptions.RayActorError):
                    raise
                logger.warning("trial %s: its data group's coordinator died as it joined; asking for a new one",
                               self._trial)
        raise AssertionError("unreachable")

    @property
    def position(self) -> int:
        if self._fallback is not None:
            return self._fallback.position
        return self._pending[0][0] if self._pending else self._next

    @property
    def private_samples(self) -> int:
        return self._fallback.private_samples if self._fallback is not None else 0

    def next_piece(self) -> PreparedChunk:
        g, answer = self._answer()
        if answer is None:
            return self._fallback.next_piece()  # type: ignore[union-attr]
        # Other trials read these bytes: this process writes into a copy of its own.
        return self._call(answer["ref"], f"reading piece {g}").guarded()

    def chunk_samples(self, g: int) -> np.ndarray:
        """Dataset indices the plan puts in piece ``g``: the group's plan, built here once when first asked
        (a data-parallel rank whose node skipped broken samples; :mod:`coordinated_prep.trial.shard`)."""
        if self._plan is None and self._fallback is not None:
            self._plan = self._fallback._plan  # the same plan, built already
        if self._plan is None:
            spec = self._spec
            pipeline = make_pipeline(spec)
            plan = stream_plan(len(pipeline), spec.seed, spec.holdout, spec.chunk_size, spec.segments,
                               shard_sizes(pipeline))
            if (plan.samples_per_epoch, plan.chunk_size) != (self.samples_per_epoch, self.chunk_size):
                raise PrepError(f"trial {self._trial}: the dataset here has {plan.samples_per_epoch} training samples "
                                f"in pieces of {plan.chunk_size}, its data group's {self.samples_per_epoch} in "
                                f"pieces of {self.chunk_size}: is it the same dataset on every node?")
            self._plan = plan
        return self._plan.chunk_samples(g)

    def skip_to(self, g: int) -> None:
        """Pass over the pieces before ``g``: one call to the coordinator, and no waiting."""
        if self._fallback is not None:
            self._fallback.skip_to(g)
            return
        while self._pending and self._pending[0][0] < g:
            self._pending.popleft()  # their answers are dropped unread: the coordinator says "passed"
        self._next = max(self._next, g)
        self._coordinator.skip_to.remote(self._trial, self._token, g)  # ordered before later fetches

    def ready(self, k: int = 1) -> bool:
        """Whether the coordinator has answered for the next ``k`` pieces (or as many as are requested).

        The coordinator answers a fetch once the piece is prepared, so an answer at hand means the
        piece is in the object store; asking costs no wait (``ray.wait`` with timeout 0)."""
        if self._fallback is not None:
            return True
        self._request_ahead()
        refs = [ref for _, ref in list(self._pending)[: max(1, k)]]
        if not refs:
            return True  # nothing left to read: next_piece fails at once, no waiting either
        if len(refs) < k and self._next < self._fence:
            return False  # more pieces than are requested (prefetch below a batch): not all at hand
        done, _ = ray.wait(refs, num_returns=len(refs), timeout=0, fetch_local=False)
        return len(done) == len(refs)

    def begin_epoch(self, epoch: int) -> None:
        """The trial begins its epoch ``epoch`` (0 the first): without declared epochs, its pieces may
        now be requested, and the group prepares them."""
        if self._end is None:
            self._fence = max(self._fence, self.start + (epoch + 1) * self.chunks_per_epoch)

    def _request_ahead(self) -> None:
        """Keep ``prefetch`` requests in flight (bounded), none past the declared epochs or the epoch begun."""
        while len(self._pending) < self._prefetch:
            if self._next >= self._fence:
                break
            g, self._next = self._next, self._next + 1
            self._pending.append((g, self._coordinator.fetch.remote(self._trial, self._token, g, self._timeout,
                                                                    self._blocked_s)))
            self._blocked_s = 0.0

    def _answer(self) -> tuple[int, dict[str, Any] | None]:
        """The coordinator's answer for the next piece; None once this trial prepares its own."""
        if self._fallback is not None:
            return self._fallback.position, None
        self._request_ahead()
        if not self._pending:
            if self._end is None:  # a reader that did not call begin_epoch: a bug of ours, not the user's
                raise PrepError(f"trial {self._trial}: piece {self._next} read before its epoch began")
            raise PrepError(f"trial {self._trial}: read past the {self._end - self.start} pieces it declared "
                            "(train_loader's epochs); raise epochs or leave it unset")
        g, ref = self._pending.popleft()
        if ray.wait([ref], timeout=0, fetch_local=False)[0]:
            # At hand: reading it (0.3 to 1 ms in a trial on 2 cores, measured) is not waiting on the
            # pool; counted, it alone put a trial whose pieces were all ready above the pool's `low`.
            answer = self._call(ref, f"reading the answer for piece {g}")
        else:
            asked = time.perf_counter()
            answer = self._call(ref, f"waiting for piece {g}", self._timeout + 30)
            self._blocked_s += time.perf_counter() - asked
        if answer["status"] == "evicted":
            self._detach(g, ref)
            return g, None
        if answer["status"] != "ok":
            raise PrepError(f"trial {self._trial}: its data group ended or dropped it while it waited for piece {g} "
                            f"({answer['status']}: was its process ended by Tune, or the loader closed?)")
        return g, answer

    def _detach(self, g: int, ref: ray.ObjectRef) -> None:
        """Prepare this trial's own pieces from ``g`` on (the lease detached it).

        The private stream's start prepares samples (its probe), so it runs where preparation may
        (:func:`~coordinated_prep.pipeline.seeding.in_process`); if it cannot start now (the loop
        stopped iterating), ``g`` stays the next piece, whose answer stays "evicted".
        """
        try:
            fallback = in_process(lambda: PrivateStream(self._spec, first=g))
        except BaseException:
            self._pending.appendleft((g, ref))
            raise
        logger.warning("trial %s: detached from %s after the lease (it held the staging budget); preparing "
                       "its own pieces from piece %d on", self._trial, self.coordinator, g)
        self._pending.clear()
        self._fallback = fallback
        self.private_reason = (f"the lease of {self._spec.lease_s:g} s detached it at piece {g}: it held the group's "
                               "staging budget while other trials waited")

    def close(self) -> None:
        """Leave the group (idempotent); pieces only this trial still needed are freed."""
        if self._closed:
            return
        self._closed = True
        self._finalizer.detach()
        self._pending.clear()
        try:
            ray.get(self._coordinator.leave.remote(self._trial, self._token), timeout=30)
        except (ray.exceptions.RayError, ray.exceptions.GetTimeoutError):
            pass  # the coordinator is gone or busy: the searcher's on_trial_complete removes us anyway

    def _call(self, ref: ray.ObjectRef, doing: str, timeout: float | None = None) -> Any:
        return fetch(ref, self._trial, doing, timeout or self._timeout)


def _leave_unawaited(coordinator: Any, consumer: str, token: int) -> None:
    """Tell ``coordinator`` that ``consumer`` (incarnation ``token``) leaves, without waiting for it."""
    try:
        coordinator.leave.remote(consumer, token)
    except Exception as e:  # Ray shut down already: the coordinator's watch or the registry releases it
        logger.debug("consumer %s could not leave %r at collection: %r", consumer, coordinator, e)
