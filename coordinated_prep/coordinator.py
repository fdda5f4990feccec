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
from typing import Any

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

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
    """

    def __init__(self, spec: DataSpec, name: str) -> None:
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
            ).remote(spec)
            for _ in range(n_actors)
        ]
        self.max_in_flight = 2 * n_actors  # keep every actor busy while one result travels back
        self.in_flight = 0
        self.changed = asyncio.Condition()
        self.closed = False
        self.fatal: BaseException | None = None  # an unexpected producer failure, re-raised to every trial
        self.producer: asyncio.Task | None = None
        self.settling: set[asyncio.Task] = set()  # strong references: asyncio keeps only weak ones
        self.stats: dict[str, Any] = {
            "group": spec.group_key, "coordinator": name, "prep_actors": n_actors, "budget_bytes": budget, "lookahead": lookahead,
            "samples_per_epoch": self.plan.samples_per_epoch, "chunks_per_epoch": self.plan.chunks_per_epoch,
            "pieces_prepared": 0, "samples_prepared": 0, "samples_served": 0, "pieces_failed": 0,
            "fetch_s": 0.0, "transform_s": 0.0, "trials_joined": 0,
        }

    # -- trial-facing API -------------------------------------------------------------------
    async def join(self, trial: str) -> dict[str, Any]:
        """Register ``trial`` as a consumer; returns where its first epoch starts and the epoch size."""
        if self.closed or self.fatal is not None:
            raise PrepError(f"trial {trial}: coordinator {self.name} is shut down or failed ({self.fatal!r})")
        if self.producer is None:  # created here because __init__ runs outside the event loop
            self.producer = asyncio.get_running_loop().create_task(self._produce())
        token, start = self.buffer.join(trial)
        self.stats["trials_joined"] += 1
        logger.info("trial %s joined group %s at piece %d", trial, self.spec.group_key, start)
        await self._notify()
        return {"token": token, "start": start, "chunks_per_epoch": self.plan.chunks_per_epoch,
                "samples_per_epoch": self.plan.samples_per_epoch, "name": self.name}

    async def fetch(self, trial: str, token: int, g: int, timeout_s: float) -> list[ray.ObjectRef]:
        """Wait (at most ``timeout_s``) for piece ``g`` and hand ``trial`` (incarnation ``token``) a reference.

        Returns the reference inside a list so that Ray passes the reference, not the data; the
        trial becomes a borrower and reads the piece zero-copy from the object store. Returns an
        empty list if the trial left or the group shut down meanwhile: such an answer usually
        belongs to a prefetch the trial will never read, and the trial raises if it does.
        """
        if self.closed or not self.buffer.is_current(trial, token):
            return []  # left, re-joined since (a stale request of an earlier incarnation), or shut down
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
                "a slower trial may hold the staging budget: raise data.staging_bytes or data.fetch_timeout_s"
            ) from None
        if self.fatal is not None:
            raise PrepError(f"trial {trial}: coordinator {self.name} failed: {self.fatal!r}")
        slot = self.buffer.slots.get(g)
        if self.closed or not self.buffer.is_current(trial, token) or slot is None:
            return []
        n = self.plan.chunk_len(g)
        self.buffer.fetched(trial, g, n)
        await self._notify()  # a release may let the producer go on
        if slot.state is SlotState.READY:
            self.stats["samples_served"] += n
        else:
            raise PrepError(f"trial {trial}: preparing piece {g} (epoch {self.plan.locate(g)[0]}) failed: {slot.payload}")
        return [slot.payload]

    async def leave(self, trial: str, token: int | None = None) -> None:
        """Unregister ``trial`` (only incarnation ``token`` if given); pieces only it still needed are freed."""
        released = self.buffer.leave(trial, token)
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
        self.buffer.slots.clear()
        self.buffer.staged_bytes = 0
        for actor in self.actors:
            ray.kill(actor, no_restart=True)
        await self._notify()

    # -- producing ---------------------------------------------------------------------------
    async def _produce(self) -> None:
        try:
            await self._produce_loop()
        except Exception as e:  # a bug, not a data error: fail every waiting trial at once, loudly
            logger.exception("%s: the producer failed", self.name)
            self.fatal = e
            await self._notify()

    async def _produce_loop(self) -> None:
        while not self.closed:
            async with self.changed:
                # Woken on every state change; the timeout is only a liveness re-check.
                try:
                    await asyncio.wait_for(self.changed.wait_for(self._can_produce), _PRODUCER_CHECK_S)
                except asyncio.TimeoutError:
                    continue
            if self.closed:
                return
            g = self.buffer.head
            slot = self.buffer.reserve(self.plan.chunk_len(g) * self.spec.pipeline.sample_bytes)  # type: ignore[union-attr]
            epoch, _ = self.plan.locate(g)
            actor = self.actors[g % len(self.actors)]
            timing_ref, chunk_ref = actor.prepare.options(num_returns=2).remote(epoch, self.plan.chunk_samples(g))
            self.in_flight += 1
            task = asyncio.get_running_loop().create_task(self._settle(slot.g, timing_ref, chunk_ref))
            self.settling.add(task)
            task.add_done_callback(self.settling.discard)

    def _can_produce(self) -> bool:
        if self.closed:
            return True
        nbytes = self.plan.chunk_len(self.buffer.head) * self.spec.pipeline.sample_bytes  # type: ignore[union-attr]
        return self.in_flight < self.max_in_flight and self.buffer.wanted() and self.buffer.fits(nbytes)

    async def _settle(self, g: int, timing_ref: ray.ObjectRef, chunk_ref: ray.ObjectRef) -> None:
        try:
            timing = await timing_ref
        except Exception as e:  # the prep task failed for good (bad sample, retries exhausted)
            if g in self.buffer.slots:
                self.buffer.mark_failed(g, _root_cause(e))
            self.stats["pieces_failed"] += 1
            logger.warning("group %s: piece %d failed: %s", self.spec.group_key, g, _root_cause(e))
        else:
            if g in self.buffer.slots:  # absent only after close()
                self.buffer.mark_ready(g, chunk_ref)
            self.stats["pieces_prepared"] += 1
            self.stats["samples_prepared"] += self.plan.chunk_len(g)
            self.stats["fetch_s"] += timing.fetch_s
            self.stats["transform_s"] += timing.transform_s
        finally:
            self.in_flight -= 1
            await self._notify()

    def _settled_or_gone(self, trial: str, token: int, g: int) -> bool:
        if self.closed or self.fatal is not None or not self.buffer.is_current(trial, token):
            return True
        slot = self.buffer.slots.get(g)
        return slot is not None and slot.state is not SlotState.RESERVED

    async def _notify(self) -> None:
        async with self.changed:
            self.changed.notify_all()


def _root_cause(error: BaseException) -> BaseException:
    """The user-level exception inside a RayTaskError (e.g. the SampleError naming the file)."""
    cause = getattr(error, "cause", None)
    return cause if isinstance(cause, BaseException) else error
