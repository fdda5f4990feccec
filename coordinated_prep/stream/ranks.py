"""Data-parallel ranks at the registry: they meet, and are placed on their nodes' coordinators at one start."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import ray

from coordinated_prep.errors import (
    PrepError,
)
from coordinated_prep.naming import CALL_TIMEOUT_S
from coordinated_prep.pipeline.part import part_fields
from coordinated_prep.spec import DataSpec
from coordinated_prep.stream.watch import Process

logger = logging.getLogger(__name__)
_PLACE_TIMEOUT_S = 3 * CALL_TIMEOUT_S  # placing a trial's ranks: a group's start and two calls to its coordinators


class Ranks:
    """The registry's half for data-parallel trials (:class:`~coordinated_prep.stream.registry.GroupRegistry` inherits it).

    It reads the registry's ``_rendezvous``, ``_done`` and ``group_for``; it owns nothing of its own.
    """

    async def meet(self, spec: DataSpec, trial: str, consumer: str, rank: int, world: int, node: str,
                   epochs: int | None, process: Any, timeout_s: float, workers: str | None = None) -> dict[str, Any]:
        """Rank ``rank`` of ``world`` of data-parallel ``trial`` arrives from ``node`` with its loader
        ``consumer`` (the trial id, or ``<trial>#<k>`` for its k-th loader); returns, once every rank
        of that loader has arrived, its coordinator and its place there.

        The ranks must read the same epochs, so they start on one piece, and each node's
        coordinator serves the ranks on its node:

        1. Another worker group (``workers``: Ray Train V2's id of the group, where it has one), a
           rank number that arrived already, or another world size is a new worker group (Ray
           Train restarted it after a failure): the old rendezvous is dropped. A rank that gives up
           waiting takes its arrival back (the last one drops the rendezvous), and the arrivals of
           ranks whose process ended on the registry's node are taken back at the next arrival
           (``_Rendezvous.drop_gone``), so a dead group's arrivals do not complete a new one
           (elsewhere, where Ray Train gives no group id, as V1: not before they time out).
        2. When all ``world`` ranks are there, each of their nodes' coordinators says the lowest
           join point it can serve from (what it still holds), the start is the highest, and each
           registers its own ranks there at once (``Coordinator.join_ranks``), keeping every piece
           from the start until each of them has fetched it. Ranks all on one node skip the
           question: their coordinator registers them at its own join point, in the same call.
        3. A node that no longer holds the start when asked to register (it released pieces in
           between: only where the ranks are on several nodes) answers ``behind`` for its ranks,
           which then prepare their own pieces from the start: the same bytes, exactly once still.

        Raises:
            PrepError: The other ranks did not arrive, or were not placed, within ``timeout_s`` (named).
        """
        if trial in self._done:
            raise PrepError(f"trial {trial}: rank {rank} of {world} arrived after Tune reported the trial complete; "
                            "create loaders only while the trial runs")
        key = (spec.group_key, consumer)
        meeting = self._rendezvous.get(key)
        if meeting is not None and meeting.placing is None:
            meeting.drop_gone(ray.get_runtime_context().get_node_id())
        if (meeting is None or meeting.world != world or rank in meeting.arrivals
                or workers is not None and meeting.workers != workers):
            meeting = self._rendezvous[key] = _Rendezvous(world, workers)
        meeting.arrivals[rank] = (node, process, epochs)
        if len(meeting.arrivals) == world:
            meeting.placing = asyncio.ensure_future(self._place(spec, trial, consumer, meeting))
            async with meeting.arrived:
                meeting.arrived.notify_all()
        deadline = asyncio.get_running_loop().time() + timeout_s  # the bound for arriving and being placed
        try:
            async with meeting.arrived:
                await asyncio.wait_for(meeting.arrived.wait_for(lambda: meeting.placing is not None), timeout_s)
            # placing is quick and bounded itself; a rank that waited long for the last still sees it done
            left = max(_PLACE_TIMEOUT_S, deadline - asyncio.get_running_loop().time())
            placed = await asyncio.wait_for(asyncio.shield(meeting.placing), left)  # type: ignore[arg-type]
        except asyncio.TimeoutError:
            if meeting.placing is None:
                meeting.arrivals.pop(rank, None)  # gone: a later group must not count this rank as arrived
                if not meeting.arrivals and self._rendezvous.get(key) is meeting:
                    del self._rendezvous[key]  # nobody waits on it: a run without Tune has no completion to drop it
            missing = sorted(set(range(world)) - set(meeting.arrivals) - {rank})
            waited = f"for ranks {missing} to create their loaders" if missing else "for its ranks to be placed"
            raise PrepError(f"trial {trial}: rank {rank} of {world} waited {timeout_s}s {waited}; every rank must "
                            "call train_loader (raise data.fetch_timeout_s if the workers start slowly)") from None
        return placed[rank]

    async def _place(self, spec: DataSpec, trial: str, consumer: str,
                     meeting: "_Rendezvous") -> dict[int, dict[str, Any]]:
        """Register every rank of ``meeting`` on its node's coordinator at one start (see :meth:`meet`)."""
        by_node: dict[str, dict[int, Any]] = {}
        for rank, (node, process, _) in sorted(meeting.arrivals.items()):
            by_node.setdefault(node, {})[rank] = process
        epochs = meeting.arrivals[0][2]
        start: int | None = None  # on one node: its coordinator's own join point, taken as it registers them
        answers: list[Any] = []
        for attempt in (1, 2):  # a coordinator that died in between is replaced when asked again: once
            # one node at a time; a completion in between makes the next group_for refuse (module docstring)
            coordinators = {node: await self._member_of(spec, trial, node, [p for p in ranks.values() if p])
                            for node, ranks in by_node.items()}
            try:
                if len(coordinators) > 1:
                    lows = await asyncio.wait_for(asyncio.gather(*(c.join_point.remote()
                                                                   for c in coordinators.values())), CALL_TIMEOUT_S)
                    start = max(lows)
                else:
                    [(node, ranks)] = by_node.items()
                    answers = [await _answer(coordinators[node].join_ranks.remote(
                        consumer, ranks, meeting.world, None, epochs, part_fields(spec)))]
                break
            except ray.exceptions.RayActorError:
                if attempt == 2:
                    raise
                logger.warning("trial %s: a coordinator of group %s died as its ranks were placed; asking for a new one",
                               trial, spec.group_key)
        if start is not None:
            answers = await asyncio.wait_for(
                asyncio.gather(*(coordinators[node].join_ranks.remote(consumer, ranks, meeting.world, start, epochs,
                                                                      part_fields(spec))
                                 for node, ranks in by_node.items()), return_exceptions=True),
                CALL_TIMEOUT_S)  # past it, ranks registered on a node are released by its watch when they fail
        failed = [a for a in answers if isinstance(a, BaseException)]
        if trial in self._done and not failed:  # completed while placed: trial_done's leave came before these
            failed = [PrepError(f"trial {trial}: Tune reported it complete while its {meeting.world} ranks were "
                                "placed; they leave their data groups again")]
        if failed:  # no half-placed group: the ranks registered elsewhere leave again, and every rank fails
            for node, answer in zip(by_node, answers):
                if isinstance(answer, dict):
                    for rank, token in answer["tokens"].items():
                        coordinators[node].leave.remote(f"{consumer}@{rank}", token)
            raise failed[0]
        if start is None:
            [answer] = answers
            start = answer["info"]["start"]
        placed: dict[int, dict[str, Any]] = {}
        for node, answer in zip(by_node, answers):
            for rank in by_node[node]:
                placed[rank] = {"coordinator": coordinators[node], "start": start,
                                "info": None if answer is None else dict(answer["info"], token=answer["tokens"][rank],
                                                                          consumer=f"{consumer}@{rank}")}
        logger.info("trial %s: %d ranks on %d node(s) start at piece %d of group %s", trial, meeting.world,
                    len(by_node), start, spec.group_key)
        return placed


async def _answer(call: Any) -> Any:
    """A coordinator's answer within ``CALL_TIMEOUT_S``, or the error it raised, as ``gather`` with
    ``return_exceptions`` gives it; except a dead coordinator's, raised (the placement asks for a new one)."""
    try:
        return await asyncio.wait_for(call, CALL_TIMEOUT_S)
    except ray.exceptions.RayActorError:
        raise
    except Exception as e:  # a coordinator shut down, or one that did not answer in time
        return e


class _Rendezvous:
    """The ranks of one worker group of a data-parallel trial, as they arrive (see ``meet``)."""

    def __init__(self, world: int, workers: str | None = None) -> None:
        self.world = world
        self.workers = workers  # the worker group's id, where Ray Train gives one
        self.arrivals: dict[int, tuple[str, Any, int | None]] = {}  # rank -> (node, process, epochs)
        self.arrived = asyncio.Condition()
        self.placing: asyncio.Future | None = None  # once every rank is there

    def drop_gone(self, here: str) -> None:
        """Take back the arrivals of ranks whose process on node ``here`` (the registry's) has ended:
        a worker group that died before all its ranks arrived must not complete a new group's
        meeting (where Ray Train gives no group id, as V1). Other nodes' ranks time out instead."""
        for rank, (node, process, _) in list(self.arrivals.items()):
            if node == here and Process(*process).ended():
                del self.arrivals[rank]
