"""The coordinator actor: one per node and data group, it stages prepared pieces for every trial.

A thin asyncio shell around :class:`~coordinated_prep.stream.staging.StagingBuffer` (who needs what) and
:class:`~coordinated_prep.plan.StreamPlan` (which samples each piece holds).

Ownership: the group registry owns the coordinator (it creates it when the group's first trial on
the node joins and kills it when the last one ends, or a while after when more trials of the group
are coming: :mod:`coordinated_prep.stream.linger`) and the node's prep pool; the coordinator
submits its pieces to the pool's actors, so Ray makes it the owner of every prepared piece.

Life cycle of a prepared piece ``g``:

1. *Reserved*: the producer takes the head piece when a consumer needs it, it lies within the
   lookahead and the group's share of the node's staging budget has room; its consumers are fixed
   (every registered trial whose range holds ``g``; later joiners are added).
2. *Preparing*: a task on one of the node's prep actors reads, decodes and augments its samples
   and returns them to the object store (two objects: timing, and the piece itself).
3. *Staged*: when the task's timing lands, the slot holds the piece's reference (or its error).
4. *Fetched*: each consumer's ``fetch`` hands it the nested reference (a borrow); the trial maps
   the arrays zero-copy, copy-on-write (``pages.py``), hands out every batch that lies inside the
   piece as a view of it and copies only batches that straddle two pieces (``trial/batching.py``).
5. *Freed*: when the last consumer fetched it, the coordinator drops its reference; Ray frees the
   memory once the trials drop theirs too. A piece whose last consumers left, passed over it or
   were detached by the lease before fetching it is *kept* instead: the next trial to join starts
   on it (Tune pauses and resumes trials under HyperBand and PBT, each time a new consumer), so
   what was prepared ahead for a leaver is read after all. Kept pieces are dropped when production
   needs their bytes, when no joiner could start on them, or when the group closes.

What the budget bounds, and what it does not: the bytes a group's coordinator holds (reserved
and prepared pieces not yet fetched by all their readers) stay within its share of the node's
staging budget, but the node's object store can hold more at once, by at most:
(1) per trial, the pieces it has fetched and still maps: the piece being cut, up to ``prefetch``
answered requests ahead (default two batches' worth, at least two pieces), and the pieces its echo
buffer's samples lie in (``buffer`` samples, default 4 batches' worth, taken in stream order: at
most ceil(``buffer`` / ``chunk_size``) + 1 pieces); (2) after the registry shrinks a group's share (another group joined the node), the
pieces staged above the new share, until their readers fetch them (nothing new is reserved until
the group is under it again): at most the old share minus the new; (3) resident evaluation pieces,
carved out of the node's budget (``pool.eval_fraction``, 0.5), so they take budget from the groups
rather than adding to it, plus per evaluating trial the streamed evaluation piece being read and
``STREAM_AHEAD`` (2) requested ahead; (4) one piece larger than the whole share, which ``reserve``
lets through when nothing else is staged; (5) what the pieces in flight at the last reservation land
larger than their estimates (pieces are charged their real bytes once they land, the prep task
measures them; the bound is in :mod:`coordinated_prep.stream.staging`).

A consumer leaves when its loader closes, when Tune reports its trial complete (the registry),
as soon as its trial's process ends (a paused, stopped or dead trial: the coordinator watches each
consumer's process, ``watch.py``), or when the lease detaches it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from types import SimpleNamespace
from typing import Any

import numpy as np
import ray

from coordinated_prep import metrics
from coordinated_prep.errors import ConfigError, PrepError
from coordinated_prep.pipeline.part import part_ids, part_mask
from coordinated_prep.pipeline.probe import Probe
from coordinated_prep.pipeline.sources import open_source_async
from coordinated_prep.pipeline.sources.fingerprint import Fingerprint, index_fingerprint
from coordinated_prep.pipeline.sources.shared_index import remember
from coordinated_prep.plan import stream_plan
from coordinated_prep.spec import DataSpec
from coordinated_prep.stream.producer import Producer
from coordinated_prep.stream.staging import SlotState, StagingBuffer
from coordinated_prep.stream.watch import Process, ProcessWatch, trial_of

logger = logging.getLogger(__name__)



@ray.remote(num_cpus=0, max_concurrency=10_000)
class Coordinator(Producer):
    """Plans the stream of one data group on one node, feeds the node's prep pool and serves trials.

    Args:
        spec: The group's data spec.
        name: The actor's own name, used in error messages.
        actors: The node's prep actors (the registry's), shared with the node's other groups.
        budget_bytes: The group's share of the node's staging budget (the registry may change it).
        index: The sweep's index of the dataset on this node (an ImageFolder's), resolved by Ray
            before this runs, so that opening the dataset here makes no blocking ``ray.get`` (in an
            async actor it blocks the event loop); None: the dataset is opened as anywhere else.
        start: (samples in the dataset, the group's :class:`~coordinated_prep.pipeline.probe.Probe`),
            found by a prep actor at the group's start; None (tests): probed here from one sample.
    """

    def __init__(self, spec: DataSpec, name: str, actors: list[Any], budget_bytes: int, index: Any = None,
                 start: tuple[int, Probe] | None = None) -> None:
        if index is not None:
            remember(index)
        self.spec = spec
        self.name = name
        samples, found = start if start is not None else (None, None)
        if found is None:  # a coordinator made by hand (tests): the built-in pipeline's layout, from one sample
            from coordinated_prep.pipeline.probe import probe
            from coordinated_prep.pipeline.transforms import make_pipeline

            pipeline = make_pipeline(spec)
            samples, found = len(pipeline), probe(pipeline, spec.seed, [0], spec.ragged, spec.views)
        self.layout = found.layout
        self.box = [ray.put(spec)]  # owned here: each prep actor fetches the spec (and its dataset) once
        self.plan = stream_plan(samples, spec.seed, spec.holdout, spec.chunk_size, spec.segments, found.shard_sizes)
        self.dataset_samples = samples  # a trial reading a part of the split finds it from this (pipeline/part.py)
        node_id = ray.get_runtime_context().get_node_id()
        n_actors = len(actors)
        lookahead = spec.lookahead or max(8, 4 * n_actors)
        # Pieces left unfetched when their trials leave (a paused, exploited or stopped trial's
        # lookahead and in-flight pieces) stay staged while the budget has room, for the next joiner.
        # Pieces are reserved at an estimate (the largest bytes per sample seen, the probe's first) and
        # charged their real bytes when they land. Ragged or object leaves: the probe's few samples may
        # be the dataset's smallest (a length-sorted speech set), so the first piece is sized alone.
        self.buffer = StagingBuffer(budget_bytes, self.plan.next_join_point, lookahead, keep_bytes=None,
                                    sample_bytes=found.sample_bytes,
                                    calibrate=any(leaf.kind != "dense" for leaf in found.layout.leaves),
                                    epoch_pieces=self.plan.chunks_per_epoch)
        self.probe_bytes = found.sample_bytes  # for the warning when the real bytes outgrow the budget
        self.oversized = False  # warned that one piece outgrew the budget
        self.actors = actors
        self.max_in_flight = 2 * n_actors  # keep every actor busy while one result travels back
        self.in_flight = 0
        self.tasks: dict[int, ray.ObjectRef] = {}  # piece -> its prep task's timing reference, while in flight
        self.changed = asyncio.Condition()
        self.watch = ProcessWatch(lambda t, k: (self.buffer.is_current(t, k) or self.evicted.get(t) == k)
                                  and not self.closed, self._released)  # a detached trial's process too
        self.closed = False
        self.fatal: BaseException | None = None  # an unexpected producer failure, re-raised to every trial
        self.blocked_since: float | None = None  # since when the lease has been running (see lease_holders)
        # consumer -> token of the incarnation the lease detached (the latest per consumer), until that
        # consumer leaves, re-joins, its process ends, or Tune reports its trial over: bounded by the
        # detached consumers still running
        self.evicted: dict[str, int] = {}
        self.skipped: set[int] = set()  # samples left out under on_error="skip" (bounded by the dataset)
        # consumer -> its part of the split, for the consumers reading one now (until they leave), and
        # each distinct part's mask over the dataset (while a consumer reads it): what it is served of each piece
        self.parts: dict[str, str] = {}
        self.part_masks: dict[str, np.ndarray] = {}

        self.producer: asyncio.Task | None = None
        self.settling: set[asyncio.Task] = set()  # strong references: asyncio keeps only weak ones
        self.stats: dict[str, Any] = {
            "group": spec.group_key, "coordinator": name, "prep_actors": n_actors, "budget_bytes": budget_bytes,
            "lookahead": lookahead,
            "samples_per_epoch": self.plan.samples_per_epoch, "chunks_per_epoch": self.plan.chunks_per_epoch,
            "pieces_prepared": 0, "samples_prepared": 0, "samples_served": 0, "pieces_failed": 0,
            "fetch_s": 0.0, "transform_s": 0.0, "put_s": 0.0, "prep_cpu_s": 0.0, "trials_joined": 0, "evictions": 0,
            "samples_skipped": 0, "storage_reads": 0, "cache_hits": 0, "decodes": 0, "tier_hits": 0,
            "decodes_by_epoch": {}, "node": node_id,
            "released_dead": 0, "stall_s": 0.0, "pieces_passed": 0, "cohorts": 0, "ranks": {},
            "starts": {}, "pool_wait_s": 0.0,
        }
        self.group = spec.group_key
        metrics.set_gauge("staging_budget_bytes", budget_bytes, group=self.group)
        metrics.declare_group(self.group)  # exported at 0 from the start: the dashboard shows 0, not "No data"

    # -- trial-facing API -------------------------------------------------------------------
    async def join(self, trial: str, epochs: int | None = None, process: Process | None = None,
                   part: dict[str, Any] | None = None) -> dict[str, Any]:
        """Register consumer ``trial`` (a trial id, ``#k`` appended for its k-th loader) reading
        ``epochs`` epochs (None: until it leaves).

        Args:
            trial: The consumer's id.
            epochs: Epochs it will read, or None.
            process: The trial's process (on this node), or None: the coordinator watches it and
                releases the consumer as soon as the process ends (Tune pauses, stops and kills
                trials without telling a search algorithm). A trial id joining from a Tune actor
                that another trial id's consumers came from means Tune reused the actor: those
                consumers are released at once.
            part: The trial's part fields (``subset``, ``fraction``, ``fold``) when it reads a part of
                the split: it is served only its part's samples of each piece, so only those count.

        Returns:
            Where its first epoch starts, the epoch size, the piece size, its incarnation token and
            its consumer id.
        """
        if self.closed or self.fatal is not None:
            raise PrepError(f"trial {trial}: coordinator {self.name} is shut down or failed ({self.fatal!r})")
        if self.producer is None:  # created here because __init__ runs outside the event loop
            self.producer = asyncio.get_running_loop().create_task(self._produce())
        token, start = self.buffer.join(trial, None if epochs is None else epochs * self.plan.chunks_per_epoch)
        self.evicted.pop(trial, None)
        self.stats["trials_joined"] += 1
        self.stats["starts"][trial] = start  # the piece its first epoch starts on; bounded by the trials that joined
        self._note_part(trial, part)
        metrics.declare_trial(self.group, trial.split("#", 1)[0])  # here too: this process outlives the trial's
        if process is not None:
            for other in self.watch.add(trial, token, Process(*process)):
                logger.info("group %s: Tune reused the actor of %s for trial %s; %s released",
                            self.spec.group_key, other, trial, other)
                self._gone(other)
        logger.info("trial %s joined group %s at piece %d", trial, self.spec.group_key, start)
        await self._notify()
        return {"token": token, "start": start, "chunks_per_epoch": self.plan.chunks_per_epoch,
                "chunk_size": self.plan.chunk_size, "consumer": trial,
                "samples_per_epoch": self.plan.samples_per_epoch, "dataset_samples": self.dataset_samples,
                "name": self.name}

    async def join_point(self) -> int:
        """The first piece a trial joining now would start on (the registry's rendezvous of ranks asks)."""
        return self.buffer.join_point()

    async def join_ranks(self, trial: str, ranks: dict[int, Process | None], world: int, start: int | None,
                         epochs: int | None, part: dict[str, Any] | None = None) -> dict[str, Any] | None:
        """Register ranks ``ranks`` (rank -> its process on this node) of data-parallel ``trial`` of
        ``world`` ranks at piece ``start`` (None: this group's join point now, where the ranks are all
        on this node), as consumers ``<trial>@<rank>``; the registry's rendezvous calls this on the
        node of each rank (``GroupRegistry.meet``).

        Every piece from ``start`` is kept until each of these ranks has fetched it, also for a rank
        whose loader is slower to begin. Consumers already registered under these ids (a worker
        group Ray Train replaced) leave first.

        Returns:
            Per rank its token, and the group's start and sizes; None if a piece between ``start``
            and the head is no longer staged here (those ranks prepare their own pieces).
        """
        if self.closed or self.fatal is not None:
            raise PrepError(f"trial {trial}: coordinator {self.name} is shut down or failed ({self.fatal!r})")
        if self.producer is None:
            self.producer = asyncio.get_running_loop().create_task(self._produce())
        ids = {rank: f"{trial}@{rank}" for rank in ranks}
        joined = self.buffer.join_together(list(ids.values()), None if epochs is None
                                           else epochs * self.plan.chunks_per_epoch, at=start)
        if joined is None:
            logger.warning("trial %s: ranks %s cannot start at piece %d on %s (released already); they prepare "
                           "their own pieces", trial, sorted(ranks), start, self.name)
            return None
        tokens, start = dict(zip(ids, joined[0])), joined[1]
        for rank, consumer in ids.items():
            self.evicted.pop(consumer, None)
            metrics.declare_trial(self.group, consumer)
            self._note_part(consumer, part)
            if ranks[rank] is not None:
                for other in self.watch.add(consumer, tokens[rank], Process(*ranks[rank])):
                    self._gone(other)  # Tune reused that actor: its earlier trial is over
        self.stats["trials_joined"] += len(ids)
        self.stats["cohorts"] += 1
        self.stats["ranks"][trial] = world  # bounded by the trials that joined
        self.stats["starts"][trial] = start
        logger.info("trial %s: ranks %s of %d joined group %s at piece %d", trial, sorted(ranks), world,
                    self.spec.group_key, start)
        await self._notify()
        return {"tokens": tokens, "info": {"start": start, "chunks_per_epoch": self.plan.chunks_per_epoch,
                                           "chunk_size": self.plan.chunk_size, "name": self.name,
                                           "samples_per_epoch": self.plan.samples_per_epoch,
                                           "dataset_samples": self.dataset_samples}}

    async def fetch(self, trial: str, token: int, g: int, timeout_s: float, waited_s: float = 0.0) -> dict[str, Any]:
        """Wait (at most ``timeout_s``) for piece ``g`` and hand ``trial`` (incarnation ``token``) a reference.

        ``waited_s``: how long the trial was blocked on this group's answers since its last request
        (what the pool's growth reads, :meth:`demand`).

        Returns ``{"status": "ok", "ref": ref}``: Ray passes the nested reference, not the data;
        the trial becomes a borrower and reads the piece zero-copy from the object store. Otherwise
        ``"evicted"`` (the lease detached this trial: it must prepare its own pieces from ``g`` on)
        or ``"gone"`` (it left, re-joined since, or the group shut down). Neither is an error here:
        such answers usually belong to prefetches the trial will never read.
        """
        self.stats["pool_wait_s"] += waited_s
        if self.evicted.get(trial) == token:
            return {"status": "evicted"}
        if self.closed or not self.buffer.is_current(trial, token):
            return {"status": "gone"}
        if self.buffer.passed(trial, g):
            return {"status": "passed"}  # a prefetch of a piece the trial has since passed over
        if not self.buffer.needs(trial, g):
            raise PrepError(f"trial {trial}: piece {g} is not one it may fetch from {self.name} "
                            "(before its start, or fetched already)")
        self.buffer.request(trial, g)
        await self._notify()
        try:
            async with self.changed:
                await asyncio.wait_for(self.changed.wait_for(lambda: self._settled_or_gone(trial, token, g)), timeout_s)
        except asyncio.TimeoutError:
            held = sorted(self.buffer.lease_holders(self._head_bytes())) if self.blocked_since is not None else []
            why = (f"the staging budget is full of pieces trials {held} have not read yet, and the lease (data.lease_s="
                   f"{self.spec.lease_s}) detaches them only after this wait's {timeout_s}s: lower data.lease_s below "
                   "data.fetch_timeout_s" if held else "the node's prep pool is too slow for this data: raise "
                   "data.fetch_timeout_s or pool.actors")
            raise PrepError(f"trial {trial}: piece {g} was not prepared within {timeout_s}s by {self.name} (head "
                            f"{self.buffer.head}, staged {self.buffer.staged_bytes} of {self.buffer.budget_bytes} bytes, "
                            f"{self.in_flight} pieces in flight on {len(self.actors)} prep actors shared by the node's "
                            f"groups); {why}") from None
        finally:
            if self.buffer.is_current(trial, token):
                self.buffer.end_wait(trial, g)
        if self.fatal is not None:
            raise PrepError(f"trial {trial}: coordinator {self.name} failed: {self.fatal!r}")
        slot = self.buffer.slots.get(g)
        if self.evicted.get(trial) == token:
            return {"status": "evicted"}
        if self.closed or not self.buffer.is_current(trial, token):
            return {"status": "gone"}
        if slot is None or trial not in slot.waiting:
            return {"status": "passed"}  # it passed over the piece while this request waited
        if slot.state is SlotState.FAILED:
            self.buffer.fetched(trial, g, 0)
            await self._notify()  # a release may let the producer go on
            raise PrepError(f"trial {trial}: preparing piece {g} (epoch {self.plan.locate(g)[0]}) failed: {slot.payload}")
        ref, n = slot.payload
        self.buffer.fetched(trial, g, n)
        if trial in self.parts:  # the rows of its part, pro rata of the planned samples (exact without skips)
            planned = self.plan.chunk_samples(g)
            n = n * int(self.part_masks[self.parts[trial]][planned].sum()) // max(len(planned), 1)
        if _counts_served(trial):
            self.stats["samples_served"] += n
            metrics.inc("samples_served", n, group=self.group, trial=trial_of(trial))
        await self._notify()
        return {"status": "ok", "ref": ref}

    def _note_part(self, consumer: str, part: dict[str, Any] | None) -> None:
        """Remember which samples ``consumer`` reads when it reads a part of the split: one mask per
        distinct part, shared by its consumers (a part the dataset cannot hold is not remembered: the
        trial's loader raises naming it)."""
        self._forget_part(consumer)
        if not part:
            return
        key = repr(sorted(part.items()))
        if key not in self.part_masks:
            try:
                ids = part_ids(SimpleNamespace(holdout=self.spec.holdout, **part), self.dataset_samples)
            except ConfigError:
                return
            self.part_masks[key] = part_mask(ids, self.dataset_samples)
        self.parts[consumer] = key

    def _gone(self, consumer: str) -> None:  # its trial is over (Tune ran another in its process): nothing stays
        self.buffer.leave(consumer)
        self.evicted.pop(consumer, None)
        self._forget_part(consumer)

    def _forget_part(self, consumer: str) -> None:
        key = self.parts.pop(consumer, None)
        if key is not None and key not in self.parts.values():
            del self.part_masks[key]

    async def leave(self, trial: str, token: int | None = None) -> None:
        """Unregister ``trial`` (only incarnation ``token`` if given); pieces only it still needed are freed."""
        released = self.buffer.leave(trial, token)
        if trial not in self.buffer.consumers:
            self._forget_part(trial)
        if token is None or self.evicted.get(trial) == token:
            self.evicted.pop(trial, None)
        if released:
            logger.info("trial %s left group %s; freed %d pieces", trial, self.spec.group_key, len(released))
        await self._notify()

    async def leave_trial(self, trial: str) -> None:
        """Unregister every consumer of Tune trial ``trial`` (each of its loaders)."""
        for consumer in [c for c in self.buffer.consumers if trial_of(c) == trial]:
            await self.leave(consumer)
        for consumer in [c for c in self.evicted if trial_of(c) == trial]:
            del self.evicted[consumer]  # detached earlier: not a consumer any more, but remembered
            self._forget_part(consumer)

    async def skip_to(self, trial: str, token: int, g: int) -> None:
        """``trial`` (incarnation ``token``) passes over its pieces below ``g``: one call, no waiting."""
        released = self.buffer.skip_to(trial, token, g)
        self.stats["pieces_passed"] += len(released)
        await self._notify()

    async def _released(self, trial: str, token: int) -> None:
        """The watch saw ``trial``'s process end: it leaves now, not when the lease runs out."""
        if self.evicted.get(trial) == token:  # a detached trial's process ended: nothing to answer it any more
            del self.evicted[trial]
            self._forget_part(trial)
            return
        self.buffer.leave(trial, token)
        if trial not in self.buffer.consumers:
            self._forget_part(trial)
        self.stats["released_dead"] += 1
        await self._notify()

    async def ended(self, processes: list[Process]) -> list[bool]:
        """Per process of this node, whether it has ended (the registry asks for its runs without Tune)."""
        return [Process(*p).ended() for p in processes]

    async def set_budget(self, budget_bytes: int) -> None:
        """The group's new share of the node's staging budget (the registry split it anew)."""
        self.buffer.set_budget(budget_bytes)
        self.stats["budget_bytes"] = budget_bytes
        metrics.set_gauge("staging_budget_bytes", budget_bytes, group=self.group)
        await self._notify()

    async def demand(self) -> dict[str, Any]:
        """What the node pool's growth reads (:mod:`coordinated_prep.pool.elastic`): the seconds this
        group's trials reported blocked on its pieces so far, its trials now, and the seconds its
        lease clock has run (a full budget, the lease's business)."""
        lease = time.monotonic() - self.blocked_since if self.blocked_since is not None else 0.0
        return {"waited_s": self.stats["pool_wait_s"], "trials": len(self.buffer.consumers),
                "lease_s": self.stats["stall_s"] + lease}

    async def set_actors(self, actors: list[Any]) -> None:
        """The node's prep actors, after the pool grew: pieces go to every one of them from now on."""
        self.actors = list(actors)
        self.max_in_flight = 2 * len(self.actors)
        if self.spec.lookahead is None:  # as for a pool of this size from the start
            self.buffer.lookahead = self.stats["lookahead"] = max(8, 4 * len(self.actors))
        self.stats["prep_actors"] = len(self.actors)
        await self._notify()

    async def fingerprint(self) -> Fingerprint | None:
        """The fingerprint of this node's copy of the dataset's index (compared across nodes)."""
        if not isinstance(self.spec.dataset, str):
            return None  # a dataset object or factory: the same object on every node
        source = await open_source_async(self.spec.dataset)  # a folder URL's listing awaited, not fetched blocking
        return await asyncio.to_thread(index_fingerprint, source, self.spec.dataset)

    async def report(self) -> dict[str, Any]:
        """Counters for the sweep summary and tests."""
        trials = {t: c.served_samples for t, c in self.buffer.consumers.items()}
        stall = time.monotonic() - self.blocked_since if self.blocked_since is not None else 0.0
        return dict(self.stats, stall_s=self.stats["stall_s"] + stall, staged_bytes=self.buffer.staged_bytes,
                    peak_staged_bytes=self.buffer.peak_bytes, head=self.buffer.head, consumers=trials,
                    in_flight=self.in_flight, detached=sorted(self.evicted), pieces_kept=self.buffer.pieces_kept,
                    pieces_reused=self.buffer.pieces_reused, kept_bytes=self.buffer.kept_bytes)

    async def close(self, drain_timeout_s: float = 10.0) -> None:
        """Stop producing, let in-flight pieces land (bounded), drop every piece (the pool lives on)."""
        self.closed = True
        for ref in self.tasks.values():  # pieces nobody will read: a task still queued on the pool never runs
            ray.cancel(ref)
        await self._notify()
        try:
            async with self.changed:
                await asyncio.wait_for(self.changed.wait_for(lambda: self.in_flight == 0), drain_timeout_s)
        except asyncio.TimeoutError:
            logger.warning("%s: %d pieces still in flight at close", self.name, self.in_flight)
        self.buffer.clear()
        self.watch.close()
        await self._notify()
        metrics.set_gauge("consumers", 0, group=self.group)  # the gauges outlive this actor in the agent


def _counts_served(consumer: str) -> bool:
    """Whether the samples ``consumer`` fetches count as served. Every rank of a data-parallel trial
    (consumer ``<trial>@<rank>``) fetches every piece and keeps its share of the rows, so the ranks
    together read the trial's epoch once: rank 0's fetches count it, the other ranks' none (the
    sharing factor, served over prepared, is then the real saving)."""
    return "@" not in consumer or consumer.rsplit("@", 1)[1] == "0"
