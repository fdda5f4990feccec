"""Watching the processes of a coordinator's trials: Tune ends them without telling a search algorithm.

Tune pauses trials (HyperBand, PBT) by ending their actor, and tells the search algorithm nothing;
a trial killed outright is reported only when Tune gets to it. A consumer whose process is gone
would hold the group's budget until the lease ran out, so the coordinator watches the Tune actor of
each consumer and releases it within about a second of its end.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, Awaitable, Callable

import ray

logger = logging.getLogger(__name__)

WATCH_S = 1.0  # a live process is looked at again this long after it last answered


def trial_of(consumer: str) -> str:
    """The Tune trial id of a consumer id (``<trial>``, or ``<trial>#<k>`` for its k-th loader)."""
    return consumer.split("#", 1)[0]


class ProcessWatch:
    """One watching task per consumer; owned by a coordinator, cancelled in :meth:`close`.

    Args:
        is_current: Whether incarnation ``token`` of a consumer is still registered.
        on_end: Releases a consumer whose process ended (a coroutine function).
        changed: The coordinator's condition, notified whenever a consumer leaves.
    """

    def __init__(self, is_current: Callable[[str, int], bool], on_end: Callable[[str, int], Awaitable[None]],
                 changed: asyncio.Condition) -> None:
        self._is_current = is_current
        self._on_end = on_end
        self._changed = changed
        self._tasks: dict[str, asyncio.Task] = {}
        self._actors: dict[str, str] = {}  # consumer -> the id of the actor it reads from

    def add(self, consumer: str, token: int, process: Any, actor_id: str) -> list[str]:
        """Watch ``process`` (a Tune actor's handle) for ``consumer``.

        Returns:
            The consumers of other trials that read from the same actor: Tune reused it for this
            trial, so those trials are over and the caller releases them.
        """
        for other in [c for c in self._actors if c not in self._tasks]:
            del self._actors[other]  # their watch ended: forget them
        reused = [c for c, a in self._actors.items() if a == actor_id and trial_of(c) != trial_of(consumer)]
        old = self._tasks.pop(consumer, None)
        if old is not None:
            old.cancel()
        self._actors[consumer] = actor_id
        self._tasks[consumer] = asyncio.get_running_loop().create_task(self._watch(consumer, token, process))
        return reused

    def close(self) -> None:
        """Stop every watch."""
        for task in self._tasks.values():
            task.cancel()
        self._tasks.clear()

    async def _watch(self, consumer: str, token: int, process: Any) -> None:
        """A call on the trial's actor queues behind its running ``train`` call and fails at once when the
        actor dies; while the actor lives it answers between two results. So a watch costs one tiny call
        per reported result at most, and sees a death within seconds."""
        try:
            while self._is_current(consumer, token):
                try:
                    await process.__ray_ready__.remote()
                except ray.exceptions.RayActorError:
                    if self._is_current(consumer, token):
                        logger.info("the process of trial %s ended (paused, stopped or lost): released", consumer)
                        await self._on_end(consumer, token)
                    return
                except Exception as e:  # noqa: BLE001 (cannot watch it: the registry and the lease still apply)
                    logger.warning("cannot watch the process of trial %s: %r", consumer, e)
                    return
                async with self._changed:  # look again after a while, or stop as soon as it leaves
                    try:
                        await asyncio.wait_for(self._changed.wait_for(lambda: not self._is_current(consumer, token)),
                                               WATCH_S)
                    except asyncio.TimeoutError:
                        pass
        finally:
            if self._tasks.get(consumer) is asyncio.current_task():
                del self._tasks[consumer]
