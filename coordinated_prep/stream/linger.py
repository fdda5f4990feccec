"""A data group kept a while after its last member left, for the trials released to read it.

The searcher releases a group's trials together (:mod:`coordinated_prep.tune.order`), but Tune
starts each one's process later: a few seconds on a busy node, while the trials before it may end;
and with fewer places than trials, the next one starts only once one ended. A group destroyed when
its last member leaves is then started again for the next trial: a new coordinator process, its
dataset index check and its probe, and the pieces prepared ahead for the leavers are lost. (Three
trials of one group, one at a time: 8.8-9.0 s with a coordinator each, 7.3-7.4 s with one kept
between them; two at a time: 5.7-5.9 s and 4.9 s. ``docs/scripts/sequential_trials.py``, before
and after alternated, two runs each, 2 cores.)

So when Tune reports a trial done and the searcher still holds or runs trials of the same group
(``trial_done(keep=...)``), the registry keeps the group's coordinator and its kept pieces for
``LINGER_S`` instead of destroying it (the trial leaves the coordinator as any leaver does, so
what was prepared for it and not fetched is kept for the next joiner). A trial that joins meanwhile
cancels the deadline and starts on those pieces; at the deadline a group still without members is
destroyed, exactly as it would have been at once. A group that starts on the node first destroys
the node's kept groups: it needs their budget share more than a trial that may come. The wait is
bounded, and a sweep's end destroys a kept group with every other group.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, Awaitable, Callable

logger = logging.getLogger("coordinated_prep.stream.registry")

#: Seconds a memberless group is kept for the trials released to read it (a trial's process start
#: takes 5-10 s on 2 busy cores; Tune may wait for resources before it starts one).
LINGER_S = 60.0


class Lingering:
    """The timers of the groups kept with no member, by group key (one per group at most)."""

    def __init__(self, seconds: float = LINGER_S) -> None:
        self.seconds = seconds
        self._timers: dict[str, asyncio.Task] = {}

    def start(self, key: str, expire: Callable[[], Awaitable[None]]) -> None:
        """Call ``expire()`` in ``seconds`` unless :meth:`cancel` is called for ``key`` first."""
        self.cancel(key)
        self._timers[key] = asyncio.get_running_loop().create_task(self._after(key, expire))

    def cancel(self, key: str) -> None:
        """A member joined ``key``'s group: it is no longer kept only for the trials to come."""
        timer = self._timers.pop(key, None)
        if timer is not None:
            timer.cancel()

    def keys(self) -> list[str]:
        """The groups kept with no member."""
        return list(self._timers)

    def timer(self, key: str) -> asyncio.Task | None:
        """The pending timer of ``key``'s group, if it is kept with no member."""
        return self._timers.get(key)

    def close(self) -> None:
        """Cancel every timer (the sweep ends: its groups are destroyed anyway)."""
        for timer in self._timers.values():
            timer.cancel()
        self._timers.clear()

    async def _after(self, key: str, expire: Callable[[], Awaitable[None]]) -> None:
        await asyncio.sleep(self.seconds)  # a deadline, not a wait for another party
        if self._timers.get(key) is asyncio.current_task():
            del self._timers[key]
        await expire()


class Kept:
    """The registry's side (a part of :class:`~coordinated_prep.stream.registry.GroupRegistry`):
    keeping a group whose last member left, and dropping it."""

    def _keep(self: Any, key: str) -> None:
        """Put ``key``'s group on a deadline if it exists with no member (its last trial left it, or
        a join that cancelled its deadline failed)."""
        if key in self._groups and not self._members.get(key):
            self._lingering.start(key, lambda: self._leave(None, key))
            logger.info("data group %s: no trial reads it; kept %.0f s for those released to", key,
                        self._lingering.seconds)

    async def _drop_kept(self: Any, node: str) -> None:
        """Destroy ``node``'s kept groups: a group starting there needs their share of its budget."""
        for key in self._lingering.keys():
            group = self._groups.get(key)
            if group is not None and group.node == node:
                self._lingering.cancel(key)
                await self._leave(None, key)
