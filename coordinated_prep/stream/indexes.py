"""Dataset index checks at the registry: an ImageFolder walked once per node, and every node's index the same."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from coordinated_prep.errors import (
    DatasetError,
)
from coordinated_prep.naming import CALL_TIMEOUT_S
from coordinated_prep.pipeline.sources import folder_root
from coordinated_prep.pipeline.sources.fingerprint import check_same_index
from coordinated_prep.pipeline.sources.shared_index import walk

logger = logging.getLogger(__name__)
#: A group's start on a node waits for the node's index of the dataset (a walk of an ImageFolder
#: tree, once per node) and then for the coordinator to fingerprint it, which stats every file: the
#: second bound grows with the files, ``CALL_TIMEOUT_S`` plus this much per file (5 ms: an
#: ImageNet-sized tree, 1.28 M files, is allowed 1.8 h on a network filesystem answering slowly).
_STAT_S_PER_FILE = 0.005
_WALK_TIMEOUT_S = 3600.0  # the walk itself (readdir only), once per dataset and node


class Indexes:
    """The registry's half for dataset indexes (:class:`~coordinated_prep.stream.registry.GroupRegistry` inherits it).

    It owns ``_folder_indexes`` (the walk of each ImageFolder per node, and the listing of each folder
    URL, until shutdown) and ``_indexes``
    (each dataset's first fingerprint), both created by the registry's constructor.
    """

    async def folder_index(self, root: str, node: str) -> list[ray.ObjectRef]:
        """The index of ImageFolder ``root`` on ``node``, walked once per sweep and node (a URL's
        listing once per sweep), in a list: the caller gets the reference, not the index, and borrows
        the object.

        Raises:
            DatasetError: The walk found no usable ImageFolder.
        """
        from coordinated_prep.pipeline.sources.remote import is_url

        key = (root, "" if is_url(root) else node)  # a URL's listing is the same from every node
        if key not in self._folder_indexes:  # concurrent first callers share one walk
            here = ray.get_runtime_context().get_node_id()
            self._folder_indexes[key] = asyncio.ensure_future(walk(root, node, here))
            logger.info("indexing dataset %s on node %s once for the sweep", root, node[:12])
        walking = self._folder_indexes[key]
        try:
            return [await asyncio.shield(walking)]
        except Exception:
            if is_url(root) and walking.done() and self._folder_indexes.get(key) is walking:
                del self._folder_indexes[key]  # a store may fail for a while: the next opener lists again
            raise

    async def _check_index(self, dataset: Any, node: str, coordinator: Any, files: int = 0) -> None:
        """Refuse a node whose copy of ``dataset`` indexes other samples than the first node's.

        The coordinator's start and its fingerprint (a ``stat`` of each of the ``files`` files) are
        allowed :func:`start_bound_s` seconds.

        Raises:
            DatasetError: Naming the dataset, both nodes and what differs (caches and coordinators of
                different nodes exchange samples by index); or naming the dataset, the node and the
                fix when the start ran past its bound.
        """
        if not isinstance(dataset, str):
            return  # a dataset object or factory: nothing on disk to compare between nodes
        timeout = start_bound_s(files)
        try:
            found = await asyncio.wait_for(coordinator.fingerprint.remote(), timeout)
        except asyncio.TimeoutError:
            raise DatasetError(
                f"dataset {dataset!r}: the data group's coordinator on node {node} did not open the dataset and stat "
                f"its {files} files within {timeout:.0f}s ({_STAT_S_PER_FILE * 1e3:.0f} ms per file allowed): its "
                "filesystem answers slower than that. Copy the dataset to a local disk, or convert it to Parquet "
                f"records (`coordprep convert {dataset} <dir>`, then use <dir>: a start then stats one file per "
                "shard)") from None
        first_node, first = self._indexes.setdefault(dataset, (node, found))
        check_same_index(dataset, first_node, first, node, found)

    async def _coordinator_index(self, dataset: str, node: str) -> tuple[Any, int]:
        """``node``'s index of ``dataset`` if it is an ImageFolder, as a reference to pass to its new
        coordinator (Ray resolves it before the coordinator starts, so the coordinator, an async
        actor, makes no blocking ``ray.get``), and the number of files (0 where unknown).

        (None, 0) for a Parquet dataset (no walk). A ``builtin:`` dataset on another node is found
        (generated if missing) by a zero-CPU task there: each node has its own copy.

        Raises:
            DatasetError: The walk found no usable ImageFolder, or took longer than its bound.
        """
        if not isinstance(dataset, str):
            return None, 0  # a dataset object or factory: no folder to walk
        try:
            if dataset.startswith("builtin:") and node != ray.get_runtime_context().get_node_id():
                affinity = NodeAffinitySchedulingStrategy(node_id=node, soft=False)
                root = await asyncio.wait_for(ray.remote(num_cpus=0, max_retries=0)(folder_root).options(
                    scheduling_strategy=affinity).remote(dataset), _WALK_TIMEOUT_S)
            else:
                root = await asyncio.to_thread(folder_root, dataset)
        except asyncio.TimeoutError:
            raise DatasetError(f"dataset {dataset!r}: node {node} did not generate it within {_WALK_TIMEOUT_S:.0f}s; "
                               "check that node's disk (COORDPREP_CACHE)") from None
        if root is None:
            return None, 0
        try:
            [ref] = await asyncio.wait_for(self.folder_index(root, node), _WALK_TIMEOUT_S)
            index = await asyncio.wait_for(ref, _WALK_TIMEOUT_S)
        except asyncio.TimeoutError:
            raise DatasetError(
                f"dataset {dataset!r}: walking its folders on node {node} took longer than {_WALK_TIMEOUT_S:.0f}s; "
                f"copy it to a local disk, or convert it to Parquet records (`coordprep convert {dataset} <dir>`)"
            ) from None
        except ray.exceptions.RayTaskError as e:
            raise (e.cause if isinstance(e.cause, DatasetError) else e) from None
        return ref, len(index)


def start_bound_s(files: int) -> float:
    """Seconds a group's coordinator may take to start on a node and fingerprint ``files`` files."""
    return CALL_TIMEOUT_S + files * _STAT_S_PER_FILE
