"""Runs of Ray Train without Tune at the registry: with no completion report, a run leaves when its processes end."""

from __future__ import annotations

import asyncio
import logging

import ray

from coordinated_prep.naming import LIVENESS_TIMEOUT_S
from coordinated_prep.stream.watch import trial_of

logger = logging.getLogger(__name__)


_REAP_S = 10.0  # how often the registry asks whether the processes of runs without Tune have ended


class Runs:
    """The registry's half for runs without Tune (:class:`~coordinated_prep.stream.registry.GroupRegistry` inherits it).

    It owns the timer task ``_reaper`` (started with the first run, ended when no run is left or at
    shutdown) and reads the registry's ``_runs`` (per (group, run), the processes it joined with).
    """

    async def _reap(self, node: str | None = None) -> None:
        """Runs without Tune whose processes (on ``node``, or any) all ended leave their groups.

        Each group's coordinator, on its members' node, says which ended (bounded by
        ``LIVENESS_TIMEOUT_S``; a slow one is asked again later). A dead coordinator, or none,
        holds nothing more for its runs: they leave, and one still running joins again through
        ``group_for``.
        """
        if not self._runs:
            return
        if node is None:  # no coordinator (a replacement's start failed) nor a start under way: it holds nothing
            idle = [(k, t) for k, t in self._runs if k not in self._groups and not (k in self._locks and
                                                                                   self._locks[k].locked())]
            for key, trial in idle:
                await self._leave(trial, key, ended=set(self._runs.get((key, trial), ())))
        keys = sorted({k for k, _ in self._runs if k in self._groups and node in (None, self._groups[k].node)})
        asked = {k: list({p for (key, _), ps in self._runs.items() if key == k for p in ps}) for k in keys}
        answers = await asyncio.gather(*(asyncio.wait_for(self._groups[k].actor.ended.remote(asked[k]),
                                                          LIVENESS_TIMEOUT_S) for k in keys), return_exceptions=True)
        for key, answer in zip(keys, answers):
            if isinstance(answer, ray.exceptions.RayActorError):
                answer = [True] * len(asked[key])
            elif isinstance(answer, BaseException):
                logger.warning("data group %s: could not ask whether its runs' processes ended: %r", key, answer)
                continue
            ended = {p for p, gone in zip(asked[key], answer) if gone}
            for trial in sorted(t for (k, t), ps in list(self._runs.items()) if k == key and ps & ended):
                await self._leave(trial, key, ended)  # under the lock: it leaves only if none it joined with runs
                if trial not in self._trial_groups:  # in no group any more: its settled meetings go too
                    for meeting in [k for k, m in self._rendezvous.items() if trial_of(k[1]) == trial
                                    and (not m.arrivals or m.placing is not None and m.placing.done())]:
                        del self._rendezvous[meeting]

    def _watch_runs(self) -> None:
        """Start the timer that drops ended runs (:meth:`_reap`), unless it runs; it ends with the runs."""
        if self._reaper is None or self._reaper.done():
            self._closing = self._closing or asyncio.Event()
            self._reaper = asyncio.get_running_loop().create_task(self._reap_while_runs(self._closing))

    async def _reap_while_runs(self, closing: asyncio.Event) -> None:
        while self._runs and not closing.is_set():
            try:  # a timer, not an event: the processes are on other nodes; shutdown ends the wait
                await asyncio.wait_for(closing.wait(), _REAP_S)
            except asyncio.TimeoutError:
                try:
                    await self._reap()
                except Exception:  # a bug here must not stop the runs from being dropped later
                    logger.exception("the check of ended runs failed; trying again in %.0fs", _REAP_S)


