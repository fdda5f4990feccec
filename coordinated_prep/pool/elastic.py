"""When a node's prep pool grows: the rule, pure (no Ray), and the bound it keeps.

A pool left to size itself (``PoolSpec(actors=None)``) starts one prep actor on its node, so that a
sweep whose trials need little preparation pays for one process that imports torch, not one per
CPU (on the 2-core machines each costs about 9 CPU-seconds, a fifth of a small sweep). Each actor
reserves ``cpus / most`` of the node's CPUs, as each of a full pool does, so the pool reserves only
what its live actors can use and leaves the rest to Tune's trials.

The registry (:class:`~coordinated_prep.stream.registry.GroupRegistry`) asks every coordinator of
the node, once per tick (``TICK_S``), how long its trials waited for pieces that were being
prepared or that the pool had no room to start (``Coordinator.demand``): waits for the staging
budget are the lease's business, not the pool's. It hands the sum to :meth:`Growth.tick`.

Rule:
- Grow by one actor when the trials waited for the pool for at least ``threshold`` of each of the
  last ``patience`` ticks, the pool has fewer than ``most`` actors, and no actor is starting. One
  quiet tick starts the count again, so the first pieces of a sweep (every trial waits for the
  pool's first results) do not grow it.
- An actor asked for is added once it has started; one that does not start within the pool's
  ``start_timeout_s`` (no CPU freed: the trials hold them) is given up, and the count starts again.
- The pool never shrinks during a sweep (its actors are the registry's until the sweep ends).

Bounds (checked after every step of random schedules in ``tests/test_pool.py``):
- Safety: ``1 <= actors <= most``; at most one actor starting; nothing grows without
  ``patience`` waiting ticks in a row.
- Liveness: while the trials wait at least ``threshold`` of every tick and the pool has fewer than
  ``most`` actors, an actor is asked for within ``patience`` ticks of the last one starting or
  being given up, with no other party acting.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass, field

#: Seconds between two looks at a node's demand.
TICK_S = 2.0
#: Ticks in a row of waiting before the pool grows.
PATIENCE = 3
#: The share of a tick the node's trials must have waited for the pool (summed over trials).
THRESHOLD = 0.2


@dataclass
class Growth:
    """The growth of one node's pool.

    Args:
        most: The most actors the pool may have (one per CPU of the node, unless set).
        actors: Actors it has now (it starts with one).
        patience: Waiting ticks in a row before it grows.
        threshold: Share of a tick that counts as waiting.
    """

    most: int
    actors: int = 1
    patience: int = PATIENCE
    threshold: float = THRESHOLD
    starting: bool = False
    streak: int = 0
    grown: int = 0
    given_up: int = 0
    #: The latest decisions, ``(seconds since the sweep started, what, why)``: bounded.
    decisions: collections.deque = field(default_factory=lambda: collections.deque(maxlen=16))

    def __post_init__(self) -> None:
        if not 1 <= self.actors <= self.most or self.patience < 1 or not 0.0 < self.threshold <= 1.0:
            raise ValueError(f"Growth(most={self.most}, actors={self.actors}, patience={self.patience}, "
                             f"threshold={self.threshold}) is not a pool's growth")

    def tick(self, waited_s: float, tick_s: float, at_s: float) -> bool:
        """One tick: ``waited_s`` seconds the node's trials waited for the pool over ``tick_s``.

        Returns:
            True: ask for one more actor now (then report it with :meth:`started`).
        """
        if self.starting or self.actors >= self.most:
            self.streak = 0
            return False
        self.streak = self.streak + 1 if waited_s >= self.threshold * tick_s else 0
        if self.streak < self.patience:
            return False
        self.streak, self.starting = 0, True
        self.decisions.append((round(at_s, 1), "grow", f"trials waited {waited_s:.1f} s of the last {tick_s:.0f} s "
                               f"for the pool's {self.actors} actor(s), {self.patience} ticks in a row"))
        return True

    def started(self, ok: bool, at_s: float, why: str = "") -> None:
        """The actor asked for has started (``ok``), or was given up (``why``)."""
        if not self.starting:
            raise RuntimeError("Growth.started without an actor starting")
        self.starting = False
        if ok:
            self.actors += 1
            self.grown += 1
            self.decisions.append((round(at_s, 1), "added", f"{self.actors} actor(s) now"))
        else:
            self.given_up += 1
            self.decisions.append((round(at_s, 1), "given up", why))

    def report(self) -> dict:
        """What the summary and the pool report show."""
        return {"most_actors": self.most, "grown": self.grown, "given_up": self.given_up,
                "decisions": [list(d) for d in self.decisions]}
