"""The coordinator's producer: it reserves the head piece when a trial needs it, and settles it when it lands."""

from __future__ import annotations

import asyncio
import logging
import time

import ray

from coordinated_prep import metrics
from coordinated_prep.stream.staging import SlotState

logger = logging.getLogger(__name__)

_PRODUCER_CHECK_S = 10.0  # the producer re-checks its state at least this often (liveness)


class Producer:
    """The coordinator's producing half (:class:`~coordinated_prep.stream.coordinator.Coordinator` inherits it).

    One producer task per coordinator runs :meth:`_produce`; it owns the pieces in flight (``tasks``,
    ``settling``) and the lease's clock (``blocked_since``). The life cycle of a piece it drives is in
    :mod:`coordinated_prep.stream.coordinator`; the rules it follows are the staging buffer's.
    """

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
                self._end_stall()  # production goes on: whoever held the oldest piece let it go
                self._reserve_and_submit()
                continue
            if state == "stalled" and self.blocked_since is None:
                self.blocked_since = time.monotonic()  # the lease starts running
            elif state != "stalled":
                self._end_stall()  # not the holders' fault: nobody waits on them
            async with self.changed:
                # Wait for the state to change; the timeout is the lease while it runs, and
                # otherwise a periodic liveness re-check.
                try:
                    await asyncio.wait_for(self.changed.wait_for(lambda now=state: self._producer_state() != now),
                                           self._wait_s())
                except asyncio.TimeoutError:
                    self._enforce_lease()

    def _head_bytes(self) -> int:
        return self.buffer.estimate(self.plan.chunk_len(self.buffer.head))

    def _producer_state(self) -> str:
        """``go`` (reserve the head now), ``stalled`` (the budget is full of pieces some trials have
        not fetched while another waits: the lease runs), ``wait`` (for anything else) or ``closed``."""
        if self.closed:
            return "closed"
        if self.buffer.lease_holders(self._head_bytes()):
            return "stalled"
        if self.in_flight < self.max_in_flight and self.buffer.wanted() and self.buffer.fits(self._head_bytes()):
            return "go"
        return "wait"

    def _reserve_and_submit(self) -> None:
        g = self.buffer.head
        slot = self.buffer.reserve(self._head_bytes())
        epoch, _ = self.plan.locate(g)
        actor = self.actors[g % len(self.actors)]
        timing_ref, chunk_ref = actor.prepare.options(num_returns=2).remote(
            self.spec.group_key, self.box, epoch, self.plan.chunk_samples(g), self.layout)
        self.in_flight += 1
        self.tasks[g] = timing_ref
        task = asyncio.get_running_loop().create_task(self._settle(slot.g, timing_ref, chunk_ref))
        self.settling.add(task)
        task.add_done_callback(self.settling.discard)

    def _wait_s(self) -> float:
        if self.blocked_since is None:
            return _PRODUCER_CHECK_S
        return max(0.01, self.spec.lease_s - (time.monotonic() - self.blocked_since))

    def _end_stall(self) -> None:
        if self.blocked_since is not None:
            self.stats["stall_s"] += time.monotonic() - self.blocked_since
            self.blocked_since = None

    def _enforce_lease(self) -> None:
        """Detach the trials holding the oldest piece once they have stalled a waiting trial for the lease."""
        if self.blocked_since is None or time.monotonic() - self.blocked_since < self.spec.lease_s:
            return
        for trial in sorted(self.buffer.lease_holders(self._head_bytes())):
            token = self.buffer.consumers[trial].token
            self.buffer.leave(trial, token)
            self.evicted[trial] = token
            self.stats["evictions"] += 1
            metrics.inc("errors", 1, group=self.group, kind="lease_detached")
            logger.warning("group %s: trial %s held the staging budget for %.0fs while another trial waited (a "
                           "straggler); it now prepares its own pieces", self.spec.group_key, trial, self.spec.lease_s)
        self._end_stall()
        self.changed.notify_all()  # we hold the condition's lock here

    async def _settle(self, g: int, timing_ref: ray.ObjectRef, chunk_ref: ray.ObjectRef) -> None:
        try:
            timing = await timing_ref
        except Exception as e:  # the prep task failed for good (bad sample, retries exhausted)
            if self.closed:
                return  # cancelled by close(): not a failure (the finally clause still counts it down)
            if g in self.buffer.slots:
                self.buffer.mark_failed(g, _root_cause(e))
            self.stats["pieces_failed"] += 1
            metrics.inc("errors", 1, group=self.group, kind="failed_piece")
            logger.warning("group %s: piece %d failed: %s", self.spec.group_key, g, _root_cause(e))
        else:
            samples = self.plan.chunk_len(g) - len(timing.skipped)
            if g in self.buffer.slots:  # absent only after close()
                self.buffer.mark_ready(g, (chunk_ref, samples), timing.nbytes or None, samples)  # its real bytes
                self._warn_oversized()
            put_s = max(0.0, time.time() - timing.finished_at) if timing.finished_at else 0.0
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
            self.stats["decodes"] += timing.decodes
            self.stats["tier_hits"] += timing.tier_hits
            by_epoch = self.stats["decodes_by_epoch"]  # stream epoch -> prefix runs (the decoded tier's effect)
            epoch = g // self.plan.chunks_per_epoch
            by_epoch[epoch] = by_epoch.get(epoch, 0) + timing.decodes
        finally:
            self.in_flight -= 1
            self.tasks.pop(g, None)
            await self._notify()

    def _warn_oversized(self) -> None:
        """Say once that a piece, at the real bytes per sample, outgrew the group's budget."""
        piece = self.buffer.estimate(self.plan.chunk_size)
        if not self.oversized and piece > self.buffer.budget_bytes:
            self.oversized = True
            logger.warning(
                "group %s: a piece of %d samples takes about %d bytes as prepared (%d per sample; the probe "
                "saw %d), more than the group's staging budget of %d bytes: pieces are staged one at a time; "
                "lower data.chunk_size or raise pool.staging_fraction (or data.staging_bytes)",
                self.spec.group_key, self.plan.chunk_size, piece, self.buffer.sample_bytes, self.probe_bytes,
                self.buffer.budget_bytes)

    def _settled_or_gone(self, trial: str, token: int, g: int) -> bool:
        if self.closed or self.fatal is not None or not self.buffer.is_current(trial, token):
            return True
        if self.buffer.passed(trial, g):
            return True  # a prefetch the trial skipped past: nobody may prepare it, so it ends now
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
