"""Starting a sweep's node caches: every cache has reserved its memory, or the sweep stops with the reason."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from coordinated_prep.cache.actor import RawCache
from coordinated_prep.cache.layout import CacheLayout
from coordinated_prep.cache.spec import CacheSpec
from coordinated_prep.errors import CacheError
from coordinated_prep.naming import NAMESPACE

logger = logging.getLogger(__name__)

#: Longest wait for one cache to start and reserve its arena (reserving touches every page: about
#: a second per few GiB, and an actor's process takes seconds to start on a busy node).
START_TIMEOUT_S = 120.0


async def start_caches(spec: CacheSpec, layout: CacheLayout, timeout_s: float = START_TIMEOUT_S) -> dict[str, Any]:
    """Create a :class:`RawCache` on every node of ``layout`` and wait until each has reserved its arena.

    The caches start in parallel, each with hard affinity to its node and named
    ``layout.actor_name(node)`` in the library's namespace. If any cannot start, every cache this
    call created is cleared (its arena deleted) and destroyed before the error is raised, so no
    memory is left reserved and no prep actor ever reads from a cache that is not there.

    Args:
        spec: The sweep's cache options.
        layout: The nodes (and the session, part of the actors' names).
        timeout_s: Longest wait for each cache.

    Returns:
        The actor handle of each node's cache, by node id.

    Raises:
        CacheError: Naming the node (the first that failed, and how many did) and the reason: the
            capacity cannot be reserved there (with the fix: lower ``cache.capacity_bytes``), the
            actor died, or it did not start within ``timeout_s``.
    """
    handles = {
        node: RawCache.options(
            name=layout.actor_name(node), namespace=NAMESPACE,
            scheduling_strategy=NodeAffinitySchedulingStrategy(node_id=node, soft=False),
        ).remote(spec, node, layout.actor_name(node))
        for node in layout.nodes
    }
    reasons = await asyncio.gather(*(_ready(handle, timeout_s) for handle in handles.values()))
    failed = {node: reason for node, reason in zip(handles, reasons) if reason}
    if failed:
        await _destroy(handles)
        node, reason = next(iter(failed.items()))
        others = f" ({len(failed)} of {len(handles)} nodes failed)" if len(handles) > 1 else ""
        raise CacheError(f"cache.capacity_bytes={spec.capacity_bytes} cannot be reserved on node {node}{others}: "
                         f"{reason}")
    logger.info("node caches started on %d node(s), %d bytes reserved on each (%s)", len(handles),
                spec.capacity_bytes, "partitioned" if spec.partitioned else "each its own")
    return handles


async def _ready(handle: Any, timeout_s: float) -> str | None:
    """None when the cache reserved its arena, else why it did not."""
    try:
        return await asyncio.wait_for(handle.ready.remote(), timeout_s)
    except asyncio.TimeoutError:
        return (f"the cache actor did not start within {timeout_s:.0f} s (its node is busy, out of memory for "
                "a worker, or gone)")
    except ray.exceptions.RayError as e:
        return f"the cache actor died while starting: {str(e).splitlines()[0] if str(e) else type(e).__name__}"


async def _destroy(handles: dict[str, Any]) -> None:
    """Clear (delete the arena of) and kill every cache in ``handles``; errors are ignored (gone already)."""
    for handle in handles.values():
        try:
            await asyncio.wait_for(handle.clear.remote(), 10.0)
        except (ray.exceptions.RayError, asyncio.TimeoutError):
            pass
        ray.kill(handle)
