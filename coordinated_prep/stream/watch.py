"""Watching the processes of a coordinator's trials: Tune ends them without telling a search algorithm.

Tune pauses trials (HyperBand, PBT) by ending their actor, and tells the search algorithm nothing;
a trial killed outright is reported only when Tune gets to it. A consumer whose process is gone
would hold the group's budget until the lease ran out, so the coordinator watches the process of
each consumer and releases it as soon as the process ends.

A trial always reads from the coordinator on its own node, so the watch is by process id: the
trial sends its pid and the process's start time (which tells a reused pid apart), and the
coordinator opens a pidfd (Linux 5.3+), which becomes readable when the process exits: an event,
not a poll. Where pidfds are missing, the process is looked at once a second instead. (An earlier
version passed the trial's actor handle and called it; receiving a handle costs the trial 1.5-3.6 s
at join on a busy 2-core machine, as the borrower registers with the handle's owner, the driver.)

Where start times are unknown (no ``/proc``, as on macOS, where a process describes itself with
the start time ``""``), a process has ended only when its pid is in use by no process at all
(``kill(pid, 0)``): a live process is never called ended, and a reused pid keeps a dead one
"alive" until Tune's completion report, the registry's check of a run or the lease releases it.
"""

from __future__ import annotations

import asyncio
import logging
import os
from typing import Awaitable, Callable, NamedTuple

logger = logging.getLogger(__name__)

WATCH_S = 1.0  # how often a watch re-checks whether its consumer is still registered (or, without pidfds, alive)


class Process(NamedTuple):
    """A trial's process, as the trial describes itself to its coordinator (on the same node)."""

    pid: int
    started: str  # the kernel's start time of the process (``/proc/<pid>/stat`` field 22)
    actor_id: str | None  # the Tune actor it runs, if any: one actor reused for another trial ends the first

    def ended(self) -> bool:
        """Whether this process has ended (asked on its own node: pid reuse shows as another start time).

        With no start time (none where it described itself): whether no process has its pid.
        """
        if not self.started:
            return not _pid_in_use(self.pid)
        return _start_time(self.pid) != self.started


def this_process(actor_id: str | None) -> Process:
    """The calling process's :class:`Process`."""
    return Process(os.getpid(), _start_time(os.getpid()) or "", actor_id)


def _start_time(pid: int) -> str | None:
    """The start time of process ``pid`` (clock ticks since boot), or None if it is gone (or not Linux)."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii") as f:
            return f.read().rsplit(")", 1)[1].split()[19]  # fields after the command name; 22 is the 20th
    except (OSError, IndexError):
        return None


def _pid_in_use(pid: int) -> bool:
    """Whether a process of this machine has pid ``pid`` (signal 0 checks, sends nothing)."""
    if pid <= 0:
        return False  # kill(0 or -n, 0) would ask about process groups, not this pid
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # PermissionError: another user's process has the pid
        return True
    return True


def trial_of(consumer: str) -> str:
    """The Tune trial id of a consumer id (``<trial>``, ``<trial>#<k>`` for its k-th loader, and
    ``@<rank>`` after either for a data-parallel rank)."""
    return consumer.split("@", 1)[0].split("#", 1)[0]


class ProcessWatch:
    """One watching task per consumer; owned by a coordinator, cancelled in :meth:`close`.

    Args:
        is_current: Whether incarnation ``token`` of a consumer is still registered.
        on_end: Releases a consumer whose process ended (a coroutine function).
    """

    def __init__(self, is_current: Callable[[str, int], bool], on_end: Callable[[str, int], Awaitable[None]]) -> None:
        self._is_current = is_current
        self._on_end = on_end
        self._tasks: dict[str, asyncio.Task] = {}
        self._actors: dict[str, str] = {}  # consumer -> the actor (or process) it reads from

    def add(self, consumer: str, token: int, process: Process) -> list[str]:
        """Watch ``process`` for ``consumer``.

        Returns:
            The consumers of other trials that read from the same actor: Tune reused it for this
            trial, so those trials are over and the caller releases them.
        """
        for other in [c for c in self._actors if c not in self._tasks]:
            del self._actors[other]  # their watch ended: forget them
        # Without a start time (no /proc) the watch still runs: Process.ended then asks whether the pid is in use
        key = process.actor_id or f"pid {process.pid}/{process.started}"
        reused = [c for c, a in self._actors.items() if a == key and trial_of(c) != trial_of(consumer)]
        old = self._tasks.pop(consumer, None)
        if old is not None:
            old.cancel()
        self._actors[consumer] = key
        self._tasks[consumer] = asyncio.get_running_loop().create_task(self._watch(consumer, token, process))
        return reused

    def close(self) -> None:
        """Stop every watch."""
        for task in self._tasks.values():
            task.cancel()
        self._tasks.clear()

    async def _watch(self, consumer: str, token: int, process: Process) -> None:
        """Release ``consumer`` when its process ends; stop within ``WATCH_S`` once it leaves otherwise."""
        loop = asyncio.get_running_loop()
        ended: asyncio.Future = loop.create_future()
        fd = _pidfd(process)
        try:
            if fd is not None:  # a pidfd turns readable when its process exits
                loop.add_reader(fd, lambda: ended.done() or ended.set_result(None))
            while self._is_current(consumer, token):
                if not ended.done() and process.ended():
                    ended.set_result(None)  # gone (the check that finds it without a pidfd)
                try:
                    await asyncio.wait_for(asyncio.shield(ended), WATCH_S)
                except asyncio.TimeoutError:
                    continue  # alive: look again whether the consumer is still registered
                if self._is_current(consumer, token):
                    logger.info("the process of trial %s ended (paused, stopped or lost): released", consumer)
                    await self._on_end(consumer, token)
                return
        finally:
            if fd is not None:
                loop.remove_reader(fd)
                os.close(fd)
            if self._tasks.get(consumer) is asyncio.current_task():
                del self._tasks[consumer]


def _pidfd(process: Process) -> int | None:
    """A pidfd of ``process``, or None where there are none (or it is gone: the start-time check sees it)."""
    try:
        return os.pidfd_open(process.pid)
    except (AttributeError, OSError):
        return None
