"""When a node's prep pool grows: the rule, pure (no Ray), and the bound it keeps.

A pool left to size itself (``PoolSpec(actors=None)``) starts one prep actor on its node, so that a
sweep whose trials need little preparation pays for one process that imports torch, not one per
CPU (on the 2-core machines each costs about 9 CPU-seconds, a fifth of a small sweep). Each actor
reserves ``cpus / most`` of the node's CPUs, as each of a full pool does, so the pool reserves only
what its live actors can use and leaves the rest to Tune's trials.

The registry (:class:`~coordinated_prep.stream.registry.GroupRegistry`) asks every coordinator of
the node, once per tick (``TICK_S``), how long its trials have been blocked on its pieces, how many
trials it serves, and how long its lease clock has run (``Coordinator.demand``): a trial tells its
coordinator how long it was blocked with its next request, so a long block arrives in one lump, and
the rule therefore looks at a window of ticks, not at each tick alone. It hands the node's figures
to :meth:`Growth.tick`.

Rule:
- Grow by one actor when, over the last ``patience`` ticks, the node's trials were blocked on their
  pieces for at least ``threshold`` of the time on average (per trial), the lease clock of no group
  ran (a full budget is the lease's business: another actor would not help), the pool has fewer
  than ``most`` actors, and no actor is starting. The window starts again after each decision, so
  a sweep's first pieces (every trial waits for the pool's first results) grow it only if the
  waiting lasts ``patience`` ticks.
- An actor asked for is added once it has imported what it needs; one that does not start within
  the pool's ``start_timeout_s`` (no CPU came free: the trials hold them) is given up, and the
  pool does not ask again for ``backoff`` ticks (a pending actor competes with Tune's next trial
  for the next CPU that comes free).
- The pool never shrinks during a sweep (its actors are the registry's until the sweep ends).

Bounds (checked after every step of random schedules in ``tests/test_pool.py``):
- Safety: ``1 <= actors <= most``; at most one actor starting; nothing grows without a full
  window of ``patience`` ticks whose mean wait per trial reaches ``threshold``.
- Liveness: while the trials wait at least ``threshold`` of every tick (no lease running) and the
  pool has fewer than ``most`` actors, an actor is asked for within ``patience`` ticks of the last
  one being added (``patience + backoff`` of one given up), with no other party acting.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass, field

#: Seconds between two looks at a node's demand.
TICK_S = 2.0
#: Ticks in a row of waiting before the pool grows.
PATIENCE = 3
#: The share of the window a trial of the node must have been blocked on its pieces, on average.
THRESHOLD = 0.2
#: Ticks without asking again after an actor was given up.
BACKOFF = 15


@dataclass
class Growth:
    """The growth of one node's pool.

    Args:
        most: The most actors the pool may have (one per CPU of the node, unless set).
        actors: Actors it has now (it starts with one).
        patience: Ticks of the window it looks at.
        threshold: Share of the window a trial must have been blocked, on average.
        backoff: Ticks it waits after an actor was given up.
    """

    most: int
    actors: int = 1
    patience: int = PATIENCE
    threshold: float = THRESHOLD
    backoff: int = BACKOFF
    starting: bool = False
    #: The window: per tick, the mean seconds a trial was blocked (None: a tick whose lease ran).
    window: collections.deque = field(default_factory=collections.deque)
    quiet: int = 0  # ticks left of the back-off
    grown: int = 0
    given_up: int = 0
    #: The latest decisions, ``(seconds since the sweep started, what, why)``: bounded.
    decisions: collections.deque = field(default_factory=lambda: collections.deque(maxlen=16))

    def __post_init__(self) -> None:
        if not 1 <= self.actors <= self.most or self.patience < 1 or not 0.0 < self.threshold <= 1.0:
            raise ValueError(f"Growth(most={self.most}, actors={self.actors}, patience={self.patience}, "
                             f"threshold={self.threshold}) is not a pool's growth")

    def tick(self, waited_s: float, trials: int, leased: bool, tick_s: float, at_s: float) -> bool:
        """One tick of ``tick_s``: ``waited_s`` seconds the node's ``trials`` trials reported blocked
        on their pieces since the last, and whether a lease clock ran meanwhile (``leased``).

        Returns:
            True: ask for one more actor now (then report it with :meth:`started`).
        """
        if self.starting or self.actors >= self.most:
            self.window.clear()
            return False
        if self.quiet > 0:
            self.quiet -= 1
            return False
        self.window.append(None if leased else waited_s / max(trials, 1))
        while len(self.window) > self.patience:
            self.window.popleft()
        if len(self.window) < self.patience or None in self.window:
            return False
        mean = sum(self.window) / (self.patience * tick_s)
        if mean < self.threshold:
            return False
        self.window.clear()
        self.starting = True
        self.decisions.append((round(at_s, 1), "grow", f"each trial was blocked {mean:.0%} of the last "
                               f"{self.patience * tick_s:.0f} s on the pool's {self.actors} actor(s)"))
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
            self.quiet = self.backoff
            self.decisions.append((round(at_s, 1), "given up", why))

    def report(self) -> dict:
        """What the summary and the pool report show."""
        return {"most_actors": self.most, "grown": self.grown, "given_up": self.given_up,
                "decisions": [list(d) for d in self.decisions]}
