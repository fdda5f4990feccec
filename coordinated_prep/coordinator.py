"""The coordinator actor: one per node and data group, it stages prepared pieces for every trial.

A thin asyncio shell around :class:`~coordinated_prep.staging.StagingBuffer` (who needs what) and
:class:`~coordinated_prep.plan.StreamPlan` (which samples each piece holds). Ownership: the
coordinator is the owner of every prepared piece (it submits the prep tasks, so Ray makes it the
owner of their results) and of its prep actors (they die with it); the CoordinatedSearcher owns
the coordinator and kills it when the group's last trial ends.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from coordinated_prep import metrics
from coordinated_prep.cache.layout import CacheLayout
from coordinated_prep.cache.spec import CacheSpec
from coordinated_prep.errors import PrepError
from coordinated_prep.plan import StreamPlan, holdout_split
from coordinated_prep.prep_actor import PrepActor
from coordinated_prep.sources import open_source
from coordinated_prep.spec import DataSpec
from coordinated_prep.staging import SlotState, StagingBuffer

logger = logging.getLogger(__name__)

_PRODUCER_CHECK_S = 10.0  # the producer re-checks its state at least this often (liveness)
_PREP_TASK_RETRIES = 3


def node_resources() -> tuple[str, float, float]:
    """(node id, CPUs, object store bytes) of the node this process runs on."""
    node_id = ray.get_runtime_context().get_node_id()
    for node in ray.nodes():
        if node["NodeID"] == node_id:
            res = node["Resources"]
            return node_id, res.get("CPU", 1.0), res.get("object_store_memory", 2**30)
    return node_id, 1.0, float(2**30)


@ray.remote(num_cpus=0, max_concurrency=10_000)
class Coordinator:
    """Plans the stream of one data group, drives its prep actors and serves trials.

    Args:
        spec: The group's data spec.
        name: The actor's own name, used in error messages.
        cache: The sweep's node caches (layout and options), handed to the prep actors; None: none.
    """

    def __init__(self, spec: DataSpec, name: str, cache: tuple[CacheLayout, CacheSpec] | None = None) -> None:
        self.spec = spec
        self.name = name
        source = open_source(spec.dataset)
        train_ids, _ = holdout_split(len(source), spec.holdout)
        self.plan = StreamPlan(train_ids, spec.seed, spec.chunk_size, spec.segments)
        node_id, cpus, store_bytes = node_resources()
        budget = spec.staging_bytes or max(spec.chunk_bytes, int(store_bytes * spec.staging_fraction))
        n_actors = spec.prep_actors or max(1, int(cpus))
        lookahead = spec.lookahead or max(8, 4 * n_actors)
        self.buffer = StagingBuffer(budget, self.plan.next_join_point, lookahead)
        affinity = NodeAffinitySchedulingStrategy(node_id=node_id, soft=False)
        self.actors = [
            PrepActor.options(
                max_restarts=-1, max_task_retries=_PREP_TASK_RETRIES, scheduling_strategy=affinity
            ).remote(spec, cache)
            for _ in range(n_actors)
        ]
        self.max_in_flight = 2 * n_actors  # keep every actor busy while one result travels back
        self.in_flight = 0
        self.changed = asyncio.Condition()
        self.closed = False
        self.fatal: BaseException | None = None  # an unexpected producer failure, re-raised to every trial
        self.blocked_since: float | None = None  # when the byte budget started to block production
        self.evicted: dict[str, int] = {}  # trial -> token of the incarnation the lease detached
        self.skipped: set[int] = set()  # samples left out under on_error="skip" (bounded by the dataset)
        self.producer: asyncio.Task | None = None
        self.settling: set[asyncio.Task] = set()  # strong references: asyncio keeps only weak ones
        self.stats: dict[str, Any] = {
            "group": spec.group_key, "coordinator": name, "prep_actors": n_actors, "budget_bytes": budget,
            "lookahead": lookahead,
            "samples_per_epoch": self.plan.samples_per_epoch, "chunks_per_epoch": self.plan.chunks_per_epoch,
            "pieces_prepared": 0, "samples_prepared": 0, "samples_served": 0, "pieces_failed": 0,
            "fetch_s": 0.0, "transform_s": 0.0, "put_s": 0.0, "prep_cpu_s": 0.0, "trials_joined": 0, "evictions": 0,
            "samples_skipped": 0, "storage_reads": 0, "cache_hits": 0, "node": node_id,
        }
        self.group = spec.group_key
        metrics.set_gauge("staging_budget_bytes", budget, group=self.group)

    # -- trial-facing API -------------------------------------------------------------------
    async def join(self, trial: str, epochs: int | None = None) -> dict[str, Any]:
        """Register ``trial`` as a consumer reading ``epochs`` epochs (None: until it leaves).

        Returns where its first epoch starts, the epoch size, and the trial's incarnation token.
        """
        if self.closed or self.fatal is not None:
            raise PrepError(f"trial {trial}: coordinator {self.name} is shut down or failed ({self.fatal!r})")
        if self.producer is None:  # created here because __init__ runs outside the event loop
            self.producer = asyncio.get_running_loop().create_task(self._produce())
        token, start = self.buffer.join(trial, None if epochs is None else epochs * self.plan.chunks_per_epoch)
        self.evicted.pop(trial, None)
        self.stats["trials_joined"] += 1
        logger.info("trial %s joined group %s at piece %d", trial, self.spec.group_key, start)
        await self._notify()
        return {"token": token, "start": start, "chunks_per_epoch": self.plan.chunks_per_epoch,
                "samples_per_epoch": self.plan.samples_per_epoch, "name": self.name}

    async def fetch(self, trial: str, token: int, g: int, timeout_s: float) -> dict[str, Any]:
        """Wait (at most ``timeout_s``) for piece ``g`` and hand ``trial`` (incarnation ``token``) a reference.

        Returns ``{"status": "ok", "ref": ref}``: Ray passes the nested reference, not the data;
        the trial becomes a borrower and reads the piece zero-copy from the object store. Otherwise
        ``"evicted"`` (the lease detached this trial: it must prepare its own pieces from ``g`` on)
        or ``"gone"`` (it left, re-joined since, or the group shut down). Neither is an error here:
        such answers usually belong to prefetches the trial will never read.
        """
        if self.evicted.get(trial) == token:
            return {"status": "evicted"}
        if self.closed or not self.buffer.is_current(trial, token):
            return {"status": "gone"}
        if not self.buffer.needs(trial, g):
            raise PrepError(f"trial {trial}: piece {g} is not one it may fetch from {self.name} "
                            "(before its start, or fetched already)")
        self.buffer.request(g)
        await self._notify()
        try:
            async with self.changed:
                await asyncio.wait_for(self.changed.wait_for(lambda: self._settled_or_gone(trial, token, g)), timeout_s)
        except asyncio.TimeoutError:
            raise PrepError(
                f"trial {trial}: piece {g} was not prepared within {timeout_s}s by {self.name} "
                f"(head {self.buffer.head}, staged {self.buffer.staged_bytes} of {self.buffer.budget_bytes} bytes); "
                "is the data group overloaded? raise data.fetch_timeout_s or data.prep_actors, or lower data.lease_s"
            ) from None
        if self.fatal is not None:
            raise PrepError(f"trial {trial}: coordinator {self.name} failed: {self.fatal!r}")
        slot = self.buffer.slots.get(g)
        if self.evicted.get(trial) == token:
            return {"status": "evicted"}
        if self.closed or not self.buffer.is_current(trial, token) or slot is None:
            return {"status": "gone"}
        if slot.state is SlotState.FAILED:
            self.buffer.fetched(trial, g, 0)
            await self._notify()  # a release may let the producer go on
            raise PrepError(f"trial {trial}: preparing piece {g} (epoch {self.plan.locate(g)[0]}) failed: {slot.payload}")
        ref, n = slot.payload
        self.buffer.fetched(trial, g, n)
        self.stats["samples_served"] += n
        metrics.inc("samples_served", n, group=self.group, trial=trial)
        await self._notify()
        return {"status": "ok", "ref": ref}

    async def leave(self, trial: str, token: int | None = None) -> None:
        """Unregister ``trial`` (only incarnation ``token`` if given); pieces only it still needed are freed."""
        released = self.buffer.leave(trial, token)
        if token is None or self.evicted.get(trial) == token:
            self.evicted.pop(trial, None)
        if released:
            logger.info("trial %s left group %s; freed %d pieces", trial, self.spec.group_key, len(released))
        await self._notify()

    async def report(self) -> dict[str, Any]:
        """Counters for the sweep summary and tests."""
        trials = {t: c.served_samples for t, c in self.buffer.consumers.items()}
        return dict(self.stats, staged_bytes=self.buffer.staged_bytes, peak_staged_bytes=self.buffer.peak_bytes,
                    head=self.buffer.head, consumers=trials, in_flight=self.in_flight)

    async def close(self, drain_timeout_s: float = 10.0) -> None:
        """Stop producing, let in-flight pieces land (bounded), drop every piece, kill the prep actors."""
        self.closed = True
        await self._notify()
        try:
            async with self.changed:
                await asyncio.wait_for(self.changed.wait_for(lambda: self.in_flight == 0), drain_timeout_s)
        except asyncio.TimeoutError:
            logger.warning("%s: %d pieces still in flight at close", self.name, self.in_flight)
        self.buffer.clear()
        for actor in self.actors:
            ray.kill(actor, no_restart=True)
        await self._notify()
        metrics.set_gauge("consumers", 0, group=self.group)  # the gauges outlive this actor in the agent

    # -- producing ---------------------------------------------------------------------------
    async def _produce(self) -> None:
        try:
            await self._produce_loop()
        except Exception as e:  # a bug, not a data error: fail every waiting trial at once, loudly
            logger.exception("%s: the producer failed", self.name)
            self.fatal = e
            await self._notify()

    async def _produce_loop(self) -> None:
        while True:
            state = self._producer_state()
            if state == "closed":
                return
            if state == "go":
                self.blocked_since = None
                self._reserve_and_submit()
                continue
            if state == "blocked" and self.blocked_since is None:
                self.blocked_since = time.monotonic()
            elif state == "idle":
                self.blocked_since = None  # not the budget's fault: nobody waits on a laggard
            async with self.changed:
                # Wait for the state to change; the timeout is the lease while the budget blocks,
                # and otherwise a periodic liveness re-check.
                try:
                    await asyncio.wait_for(self.changed.wait_for(lambda now=state: self._producer_state() != now),
                                           self._wait_s())
                except asyncio.TimeoutError:
                    self._enforce_lease()

    def _producer_state(self) -> str:
        """``go`` (reserve the head now), ``idle`` (nothing wanted or enough in flight), ``blocked``
        (wanted, but the byte budget is full) or ``closed``."""
        if self.closed:
            return "closed"
        if not (self.in_flight < self.max_in_flight and self.buffer.wanted()):
            return "idle"
        nbytes = self.plan.chunk_len(self.buffer.head) * self.spec.pipeline.sample_bytes  # type: ignore[union-attr]
        return "go" if self.buffer.fits(nbytes) else "blocked"

    def _reserve_and_submit(self) -> None:
        g = self.buffer.head
        slot = self.buffer.reserve(self.plan.chunk_len(g) * self.spec.pipeline.sample_bytes)  # type: ignore[union-attr]
        epoch, _ = self.plan.locate(g)
        actor = self.actors[g % len(self.actors)]
        timing_ref, chunk_ref = actor.prepare.options(num_returns=2).remote(epoch, self.plan.chunk_samples(g))
        self.in_flight += 1
        task = asyncio.get_running_loop().create_task(self._settle(slot.g, timing_ref, chunk_ref))
        self.settling.add(task)
        task.add_done_callback(self.settling.discard)

    def _wait_s(self) -> float:
        if self.blocked_since is None:
            return _PRODUCER_CHECK_S
        return max(0.01, self.spec.lease_s - (time.monotonic() - self.blocked_since))

    def _enforce_lease(self) -> None:
        """Detach the trials holding the oldest piece once the budget has blocked production for the lease."""
        if self.blocked_since is None or time.monotonic() - self.blocked_since < self.spec.lease_s:
            return
        for trial in sorted(self.buffer.laggards()):
            token = self.buffer.consumers[trial].token
            self.buffer.leave(trial, token)
            self.evicted[trial] = token
            self.stats["evictions"] += 1
            metrics.inc("errors", 1, group=self.group, kind="lease_detached")
            logger.warning("group %s: trial %s held the staging budget for %.0fs (dead or straggling); it now "
                           "prepares its own pieces", self.spec.group_key, trial, self.spec.lease_s)
        self.blocked_since = None
        self.changed.notify_all()  # we hold the condition's lock here

    async def _settle(self, g: int, timing_ref: ray.ObjectRef, chunk_ref: ray.ObjectRef) -> None:
        try:
            timing = await timing_ref
        except Exception as e:  # the prep task failed for good (bad sample, retries exhausted)
            if g in self.buffer.slots:
                self.buffer.mark_failed(g, _root_cause(e))
            self.stats["pieces_failed"] += 1
            metrics.inc("errors", 1, group=self.group, kind="failed_piece")
            logger.warning("group %s: piece %d failed: %s", self.spec.group_key, g, _root_cause(e))
        else:
            if g in self.buffer.slots:  # absent only after close()
                self.buffer.mark_ready(g, (chunk_ref, self.plan.chunk_len(g) - len(timing.skipped)))
            put_s = max(0.0, time.time() - timing.finished_at) if timing.finished_at else 0.0
            samples = self.plan.chunk_len(g) - len(timing.skipped)
            self.stats["pieces_prepared"] += 1
            self.stats["samples_prepared"] += samples
            metrics.inc("samples_prepared", samples, group=self.group)
            for stage, seconds in (("fetch", timing.fetch_s), ("decode_augment", timing.transform_s), ("put", put_s)):
                metrics.inc("prep_seconds", seconds, group=self.group, stage=stage)
            metrics.inc("errors", len(timing.skipped), group=self.group, kind="skipped_sample")
            for index, path, reason in timing.skipped:
                if index not in self.skipped:  # logged once per sample, whatever the epoch
                    self.skipped.add(index)
                    logger.warning("group %s: skipping sample %d (%s): %s", self.spec.group_key, index, path, reason)
            self.stats["samples_skipped"] = len(self.skipped)
            self.stats["fetch_s"] += timing.fetch_s
            self.stats["transform_s"] += timing.transform_s
            self.stats["put_s"] += put_s
            self.stats["prep_cpu_s"] += timing.cpu_s
            self.stats["storage_reads"] += timing.storage_reads
            self.stats["cache_hits"] += timing.cache_hits
        finally:
            self.in_flight -= 1
            await self._notify()

    def _settled_or_gone(self, trial: str, token: int, g: int) -> bool:
        if self.closed or self.fatal is not None or not self.buffer.is_current(trial, token):
            return True
        slot = self.buffer.slots.get(g)
        return slot is not None and slot.state is not SlotState.RESERVED

    async def _notify(self) -> None:
        metrics.set_gauge("staged_bytes", self.buffer.staged_bytes, group=self.group)
        metrics.set_gauge("consumers", len(self.buffer.consumers), group=self.group)
        async with self.changed:
            self.changed.notify_all()


def _root_cause(error: BaseException) -> BaseException:
    """The user-level exception inside a RayTaskError (e.g. the SampleError naming the file)."""
    cause = getattr(error, "cause", None)
    return cause if isinstance(cause, BaseException) else error
