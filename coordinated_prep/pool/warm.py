"""Prep actors kept warm between the sweeps of one driver process (``PoolSpec(keep_warm=True)``).

A node's prep pool costs its actors' start: a process each, which imports torch and torchvision
(about 5 CPU-seconds each on the 2-core machines, the longest part of a small sweep's start). A
driver that runs one sweep after another (a notebook, a script of sweeps, a test suite) can keep
them: the sweep closed with ``keep_warm`` gives its actors back here instead of killing them, and
the driver's next sweep whose pool has the same shape on a node (actors, logical CPUs each) starts
on them.

Life cycle of a kept actor, and who owns it at each step:

1. :func:`lend` (the searcher, before it starts the registry) takes the node's kept actors if their
   shape matches and they answer; otherwise it kills them, waits until their CPUs are free, and,
   for a ``keep_warm`` sweep, creates new ones *from the driver*, so that they outlive the sweep's
   registry (an actor dies with the worker that created it). Ray owner: the driver, always.
2. The registry's :class:`~coordinated_prep.pool.node.NodePool` of that node uses them instead of
   starting its own: ``reset`` hands them the sweep's cache and decoded tier and drops every
   pipeline, spec and opened dataset of the last sweep. The registry never kills them.
3. :func:`give_back` (the searcher's ``close``, after the registry is gone): with ``keep_warm`` they
   drop what the sweep left them (``reset``: the tier's samples they map, pipelines, datasets) and
   are kept, one pool shape per node (they hold their CPUs meanwhile); without, they are killed.
   :func:`release` kills every kept actor; the driver's exit (or ``ray.shutdown``) ends them too.

A kept actor that Ray restarts during a later sweep (it died) comes back with its creation
arguments, without that sweep's cache and tier: it reads storage and decodes itself, with the same
bytes. Not thread-safe: one searcher of a driver starts or closes at a time, as the searcher says.
"""

from __future__ import annotations

import logging
from typing import Any

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from coordinated_prep.pool.node import node_table
from coordinated_prep.pool.prep_actor import PrepActor
from coordinated_prep.pool.spec import PoolSpec

logger = logging.getLogger(__name__)

_ANSWER_S = 10.0  # a kept actor that does not answer a ping in this long is replaced
_GONE_S = 30.0  # how long a killed actor may take to give its CPUs back before the new pool asks for them
_PLACED_S = 0.5  # a kept actor that answers within this long holds its CPUs (see placed)

Shape = tuple[int, float]  # (prep actors, logical CPUs each) of a node's pool

#: Per node id: the shape of the pool kept there and its actors. At most one pool per node.
_kept: dict[str, tuple[Shape, list[Any]]] = {}


def lend(spec: PoolSpec) -> dict[str, list[Any]]:
    """Per live node, the prep actors its pool of ``spec`` starts on (kept ones, or new for a
    ``keep_warm`` sweep); a node missing from the answer gets a pool of the registry's own."""
    lent: dict[str, list[Any]] = {}
    nodes = _nodes()
    for node in list(_kept):
        if node not in nodes:
            del _kept[node]  # its node is gone (or this is another Ray instance): so are its actors
    for node, cpus in nodes.items():
        shape = spec.shape_for(cpus)
        kept = _take(node, shape)
        if kept is not None:
            lent[node] = kept
        elif spec.keep_warm:
            affinity = NodeAffinitySchedulingStrategy(node_id=node, soft=False)
            lent[node] = [PrepActor.options(num_cpus=shape[1], scheduling_strategy=affinity).remote()
                          for _ in range(shape[0])]
    return lent


def placed(lent: dict[str, list[Any]], timeout_s: float = _PLACED_S) -> bool:
    """Whether ``lent`` has actors on every live node with CPUs and each answers within ``timeout_s``:
    then they hold their CPUs already (kept from the last sweep: an idle actor answers in
    milliseconds), and Tune may place trials before the registry's start is done. New actors are
    still starting their processes then: False, and the searcher waits for their placement."""
    nodes = _nodes()
    if not nodes or set(nodes) - set(lent) or not any(lent.values()):
        return False
    refs = [actor.__ray_ready__.remote() for actors in lent.values() for actor in actors]
    ready, _ = ray.wait(refs, num_returns=len(refs), timeout=timeout_s)
    return len(ready) == len(refs)


def give_back(lent: dict[str, list[Any]], spec: PoolSpec) -> None:
    """The sweep that borrowed ``lent`` is closed: keep its actors (``spec.keep_warm``) or kill them."""
    nodes = _nodes() if spec.keep_warm else {}
    for node, actors in lent.items():
        if node in nodes and _emptied(node, actors):
            _kill(_kept.pop(node, (None, []))[1])  # one pool per node: an older shape gives its CPUs back
            _kept[node] = (spec.shape_for(nodes[node]), actors)
        else:
            _kill(actors)


def release() -> None:
    """Kill every kept prep actor now, giving their CPUs back to Ray."""
    for _, actors in _kept.values():
        _kill(actors)
    _kept.clear()


def kept() -> dict[str, Shape]:
    """Per node id, the shape of the pool kept there."""
    return {node: shape for node, (shape, _) in _kept.items()}


def _nodes() -> dict[str, float]:
    """Per live node with CPUs (the nodes a pool starts on), its CPUs."""
    return {node: cpus for node, (cpus, _) in node_table().items() if cpus > 0}


def _take(node: str, shape: Shape) -> list[Any] | None:
    """The node's kept actors if they have ``shape`` and all answer; else None, with none kept."""
    if node not in _kept:
        return None
    kept_shape, actors = _kept.pop(node)
    if kept_shape == shape:
        try:
            ray.get([a.__ray_ready__.remote() for a in actors], timeout=_ANSWER_S)
            return actors
        except (ray.exceptions.RayError, ray.exceptions.GetTimeoutError) as e:
            logger.warning("node %s: a prep actor kept from the last sweep did not answer (%r); starting new ones",
                           node, e)
    _kill(actors)
    return None


def _emptied(node: str, actors: list[Any]) -> bool:
    """Whether every actor dropped what the closed sweep left it (``reset``): the samples of the
    sweep's decoded tier it still maps, its pipelines and datasets. Until then those stay in the
    node's object store."""
    try:
        ray.get([a.reset.remote() for a in actors], timeout=_ANSWER_S)
        return True
    except (ray.exceptions.RayError, ray.exceptions.GetTimeoutError) as e:
        logger.warning("node %s: a prep actor of the closed sweep did not answer (%r); not keeping its pool", node, e)
        return False


def _kill(actors: list[Any]) -> None:
    """Kill ``actors`` and wait (bounded) until they are gone, so that their CPUs are free again.

    A call made after the kill may still be answered (the kill reaches the process later); one sent
    before it fails only once the process is gone."""
    gone = [actor.until_killed.remote(_GONE_S) for actor in actors]
    for actor in actors:
        ray.kill(actor, no_restart=True)
    for ref in gone:
        try:
            ray.get(ref, timeout=_GONE_S + _ANSWER_S)
        except (ray.exceptions.RayActorError, ray.exceptions.ActorUnschedulableError):
            continue  # dead, or its node is gone (the actor with it): its CPUs are back
        except ray.exceptions.GetTimeoutError:
            pass
        logger.warning("a killed prep actor was still alive after %.0f s", _GONE_S)
