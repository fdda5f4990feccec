"""Which node's cache holds which sample: a pure function of the seed and the node list."""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class CacheLayout:
    """The nodes whose caches share a sweep's datasets, and how samples are divided among them.

    Every process derives the same assignment from (``seed``, dataset length, ``nodes``), so no
    metadata is exchanged. The node list is fixed when the sweep's first data group starts; a node
    that leaves takes its part with it (its samples are read from storage from then on), and a
    node that joins later reads from the others' caches but holds no part.

    Args:
        session: The searcher session the cache actors belong to (part of their names).
        nodes: Node ids, in a fixed order; a sample's owner is an index into it.
        seed: Seed of the assignment.
        partitioned: False: every node is the owner of every sample (each caches on its own).
    """

    session: str
    nodes: tuple[str, ...]
    seed: int = 0
    partitioned: bool = True

    def owners(self, n_items: int, node: str) -> np.ndarray:
        """Owner (index into ``nodes``) of each of ``n_items`` samples, as seen from node ``node``.

        Partitioned: a seeded permutation dealt round-robin, so parts differ by at most one sample.
        Otherwise every sample belongs to ``node`` itself.
        """
        if not self.partitioned or len(self.nodes) == 1:
            return np.full(n_items, self.nodes.index(node) if node in self.nodes else -1, dtype=np.int64)
        return _dealt(n_items, self.seed, len(self.nodes))

    def actor_name(self, node: str) -> str:
        """Name of the cache actor on ``node``."""
        return cache_actor_name(self.session, node)


def cache_actor_name(session: str, node: str) -> str:
    """Name of session ``session``'s cache actor on node ``node``."""
    return f"coordprep-{session}-cache-{node[:16]}"


@functools.lru_cache(maxsize=16)
def _dealt(n_items: int, seed: int, n_nodes: int) -> np.ndarray:
    perm = np.random.default_rng([seed, n_items]).permutation(n_items)
    owners = np.empty(n_items, dtype=np.int64)
    owners[perm] = np.arange(n_items) % n_nodes
    owners.setflags(write=False)
    return owners
