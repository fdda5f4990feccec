"""One walk of an ImageFolder per sweep and node: the group registry keeps the index in the object store.

A folder in object storage (a URL) is listed once per sweep, whatever the node, the same way
(:func:`~coordinated_prep.pipeline.sources.remote_folder.listing`).

Ownership: the sweep's :class:`~coordinated_prep.stream.registry.GroupRegistry` owns one index object per
(dataset directory, node), made on first request and kept until the registry shuts down. On the
registry's own node it walks the tree in a thread of its own process and puts the result; on another
node a zero-CPU task pinned there walks it. Every process of the sweep's Ray job that opens the
dataset (coordinators, prep actors, trials) borrows the object and maps it zero-copy, so a trial's
start costs no walk at all. Outside a sweep (no registry in this job), :func:`shared_index` returns
None and the caller walks the tree itself.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from typing import Any

from coordinated_prep.errors import DatasetError
from coordinated_prep.naming import NAMESPACE, registry_name
from coordinated_prep.pipeline.sources.folder_index import FolderIndex, scan

logger = logging.getLogger(__name__)

_TIMEOUT_S = 600.0  # an ImageNet-sized tree on a slow network filesystem takes minutes to walk
#: Indexes this process already holds (root -> index), handed to it without a blocking ``ray.get``:
#: a coordinator gets its node's index as an argument, an async actor awaits it
#: (:func:`shared_index_async`). An async actor's ``ray.get`` would block its event loop.
_HELD: dict[str, Any] = {}  # a FolderIndex, or a URL's listing


def remember(index: FolderIndex) -> None:
    """Keep ``index`` as this process's copy of the sweep's index of ``index.root``."""
    _HELD[index.root] = index


def forget() -> None:
    """Drop every index this process holds (a prep actor kept for another sweep, whose registry
    owns new ones)."""
    _HELD.clear()


def shared_index(root: str) -> Any:
    """The sweep's index of ImageFolder ``root`` on this node (for a URL, its listing), or None
    outside a sweep.

    Raises:
        DatasetError: The walk found no usable ImageFolder (the same error a local walk raises).
    """
    import ray

    if root in _HELD:
        return _HELD[root]
    if not ray.is_initialized():
        return None
    context = ray.get_runtime_context()
    try:
        registry = ray.get_actor(registry_name(context.get_job_id()), namespace=NAMESPACE)
    except ValueError:
        return None  # not in a coordinated sweep's job
    try:
        [ref] = ray.get(registry.folder_index.remote(root, context.get_node_id()), timeout=_TIMEOUT_S)
        return ray.get(ref, timeout=_TIMEOUT_S)
    except ray.exceptions.RayTaskError as e:
        if isinstance(e.cause, DatasetError):
            raise e.cause from None
        raise
    except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError) as e:
        logger.warning("the sweep's index of %s could not be had (%r); walking it in this process", root, e)
        return None


async def shared_index_async(root: str) -> None:
    """Fetch the sweep's index of ``root`` for this process without blocking its event loop (for
    async actors): a later :func:`shared_index` (and ``open_source``) finds it held. Outside a sweep,
    or if the index cannot be had, nothing is held and the caller walks the tree itself.

    Raises:
        DatasetError: The walk found no usable ImageFolder.
    """
    import ray

    if root in _HELD or not ray.is_initialized():
        return
    context = ray.get_runtime_context()
    try:
        registry = ray.get_actor(registry_name(context.get_job_id()), namespace=NAMESPACE)
    except ValueError:
        return
    try:
        [ref] = await asyncio.wait_for(registry.folder_index.remote(root, context.get_node_id()), _TIMEOUT_S)
        _HELD[root] = await asyncio.wait_for(ref, _TIMEOUT_S)
    except ray.exceptions.RayTaskError as e:
        if isinstance(e.cause, DatasetError):
            raise e.cause from None
        raise
    except (ray.exceptions.RayActorError, asyncio.TimeoutError) as e:
        logger.warning("the sweep's index of %s could not be had (%r); walking it in this process", root, e)


async def walk(root: str, node: str, local_node: str) -> Any:
    """Walk ``root`` on ``node``; a reference to its :class:`FolderIndex`, owned by the caller.

    On ``local_node`` (the caller's) the walk runs in a thread of the calling process, so no worker
    process has to start for it; elsewhere in a zero-CPU task pinned to ``node``. A URL is listed in
    a thread of the calling process whatever ``node`` (the reference is then to its listing,
    :func:`~coordinated_prep.pipeline.sources.remote_folder.listing`).

    Raises:
        DatasetError: A walk on the local node found no usable ImageFolder (on another node, the
            reference holds the error and every reader raises it).
    """
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    from coordinated_prep.pipeline.sources.remote import is_url

    if is_url(root):  # a folder in object storage: one listing, here, whatever the node
        from coordinated_prep.pipeline.sources.remote_folder import listing

        return await asyncio.to_thread(lambda: ray.put(listing(root)))  # pickled off the event loop too
    if node == local_node:
        return ray.put(await asyncio.to_thread(scan, root))
    affinity = NodeAffinitySchedulingStrategy(node_id=node, soft=False)
    return _scan_task().options(scheduling_strategy=affinity).remote(root)


@functools.lru_cache(maxsize=1)
def _scan_task() -> Any:
    import ray

    return ray.remote(num_cpus=0, max_retries=0)(scan)
