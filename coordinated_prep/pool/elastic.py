"""When a node's prep pool grows, and when it gives its CPUs back: the rule, pure (no Ray), and the
bounds it keeps.

A pool left to size itself (``PoolSpec(actors=None)``) starts one prep actor on its node, so that a
sweep whose trials need little preparation pays for one process that imports torch, not one per
CPU (on the 2-core machines each costs about 9 CPU-seconds, a fifth of a small sweep). Each actor
is worth ``cpus / most`` of the node's CPUs (a *share*), as each of a full pool is, so the pool
reserves only what its live actors can use and leaves the rest to Tune's trials.

Where the pool *lends* its CPUs (a pool sized by demand that is not kept warm), its actors reserve
nothing themselves: the pool holds its shares apart (one placement group per share,
:class:`~coordinated_prep.pool.node.NodePool`), so that it can give a share back to Tune while its
preparation runs ahead of the trials, and take one again when they wait. A pool that does not lend
(kept warm, or of a fixed size) holds one share per actor, in the actor, for the whole sweep.

The registry (:class:`~coordinated_prep.stream.registry.GroupRegistry`) asks every coordinator of
the node, once per tick (``TICK_S``), how long its trials have been blocked on its pieces, how many
trials it serves, and how long its lease clock has run (``Coordinator.demand``): a trial tells its
coordinator how long it was blocked with its next request, so a long block arrives in one lump, and
the rule therefore looks at a window of ticks, not at each tick alone. A trial counts only answers
it had to wait for: reading one already at hand costs it about 0.5 ms, 0.8% of the time of a trial
reading 14 pieces a second, which is not waiting on the pool (``docs/benchmarks.md``, the suite's
section). It hands the node's figures
to :meth:`Growth.tick`, which answers with one of:

- ``RESERVE``: take one share back (only a lending pool holds fewer shares than actors), or
  ``GROW``: start one more actor, with its share. Either when, over the last ``patience`` ticks,
  the node's trials were blocked on their pieces for at least ``threshold`` of the time on average
  (per trial), the lease clock of no group ran (a full budget is the lease's business: another
  actor would not help), and no start is pending. The window starts again after each decision, so
  a sweep's first pieces (every trial waits for the pool's first results) grow it only if the
  waiting lasts ``patience`` ticks. A share not placed within ``SHARE_TIMEOUT_S``, or an actor
  that does not start within the pool's ``start_timeout_s`` (no CPU came free: the trials hold
  them), is given up, and the pool does not ask again for ``backoff`` ticks (a pending request
  competes with Tune's next trial for the next CPU that comes free). A pool that gave a share back
  takes it again before it grows.
- ``RELEASE`` (a lending pool only): give one share back to Tune when, over the last ``calm``
  ticks, the node had trials, no lease clock ran, and its trials were blocked at most ``low`` of the
  time on average: preparation runs ahead of them. The pool keeps its actors (they prepare on the
  CPUs the trials leave, unseen by Ray's scheduler), so a later ``RESERVE`` costs no process.
- ``None``: nothing.

The pool never loses an actor during a sweep (its actors are the registry's until the sweep ends).

Bounds (checked after every step of random schedules in ``tests/test_pool.py``):
- Safety: ``1 <= actors <= most`` and ``0 <= shares <= actors`` (``shares == actors`` where the pool
  does not lend); at most one start pending; nothing is asked for without a full window of
  ``patience`` ticks whose mean wait per trial reaches ``threshold``, and nothing is given back
  without a full window of ``calm`` ticks with trials whose mean wait stays at most ``low``.
- Liveness: while the trials wait at least ``threshold`` of every tick (no lease running) and the
  pool holds fewer than ``most`` shares, a share or an actor is asked for within ``patience`` ticks
  of the last one being added (``patience + backoff`` of one given up), with no other party acting;
  while a lending pool's trials wait at most ``low`` of every tick and it holds a share, a share is
  given back within ``calm`` ticks of its last decision.
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
#: Ticks in a row of trials served without waiting before a lending pool gives a share back.
CALM = 3
#: The most share of the window a trial of the node may have been blocked, on average, for that.
LOW = 0.02

#: Longest wait for a share of CPUs asked for to be placed before it is given up (the trials hold
#: them): short, since a pending share competes with Tune's next trial for the next CPU to come free.
SHARE_TIMEOUT_S = 10.0

#: What :meth:`Growth.tick` asks of the pool.
GROW, RESERVE, RELEASE = "grow", "reserve", "release"


@dataclass
class Growth:
    """The growth of one node's pool, and the shares of its CPUs it holds.

    Args:
        most: The most actors the pool may have (one per CPU of the node, unless set).
        actors: Actors it has now (it starts with one).
        lends: Whether it holds its shares apart from its actors, so that it can give them back.
        patience: Ticks of the window it looks at before asking.
        threshold: Share of that window a trial must have been blocked, on average.
        backoff: Ticks it waits after a start was given up.
        calm: Ticks of the window it looks at before giving a share back.
        low: The most share of that window a trial may have been blocked, on average.
    """

    most: int
    actors: int = 1
    lends: bool = False
    patience: int = PATIENCE
    threshold: float = THRESHOLD
    backoff: int = BACKOFF
    calm: int = CALM
    low: float = LOW
    #: What is starting (``GROW`` or ``RESERVE``) until :meth:`started`; None: nothing.
    starting: str | None = None
    shares: int = -1  # shares of the node's CPUs held (set to ``actors`` at the start)
    #: The windows: per tick, the mean seconds a trial was blocked (None: a lease ran; in the calm
    #: window, a tick without trials ends it).
    window: collections.deque = field(default_factory=collections.deque)
    calm_window: collections.deque = field(default_factory=collections.deque)
    quiet: int = 0  # ticks left of the back-off
    grown: int = 0
    given_up: int = 0
    reserved: int = 0
    released: int = 0
    #: The latest decisions, ``(seconds since the sweep started, what, why)``: bounded.
    decisions: collections.deque = field(default_factory=lambda: collections.deque(maxlen=16))

    def __post_init__(self) -> None:
        if self.shares < 0:
            self.shares = self.actors
        if (not 1 <= self.actors <= self.most or self.patience < 1 or self.calm < 1 or not 0.0 < self.threshold <= 1.0
                or not 0.0 <= self.low < self.threshold or not 0 <= self.shares <= self.actors
                or (not self.lends and self.shares != self.actors)):
            raise ValueError(f"Growth(most={self.most}, actors={self.actors}, shares={self.shares}, "
                             f"lends={self.lends}, patience={self.patience}, calm={self.calm}, "
                             f"threshold={self.threshold}, low={self.low}) is not a pool's growth")

    @property
    def settled(self) -> bool:
        """Whether no tick can ask for anything more: the pool holds its most, and gives nothing back."""
        return not self.lends and self.actors >= self.most

    def tick(self, waited_s: float, trials: int, leased: bool, tick_s: float, at_s: float) -> str | None:
        """One tick of ``tick_s``: ``waited_s`` seconds the node's ``trials`` trials reported blocked
        on their pieces since the last, and whether a lease clock ran meanwhile (``leased``).

        Returns:
            ``GROW`` or ``RESERVE``: ask for it now (then report it with :meth:`started`);
            ``RELEASE``: give one share back now (done when this returns); None: nothing.
        """
        if self.starting:
            self.window.clear()
            self.calm_window.clear()
            return None
        share = None if leased or trials <= 0 else waited_s / trials
        calm = self._calm(share, tick_s)
        if calm is not None:
            self.shares -= 1
            self.released += 1
            self.decisions.append((round(at_s, 1), RELEASE, f"each trial was blocked {calm:.1%} of the last "
                                   f"{self.calm * tick_s:.0f} s: preparation runs ahead, so {self.shares} of "
                                   f"{self.actors} actor(s)' CPUs stay reserved"))
            return RELEASE
        if self.shares >= self.most:
            self.window.clear()
            return None
        if self.quiet > 0:
            self.quiet -= 1
            return None
        self.window.append(None if leased else waited_s / max(trials, 1))
        while len(self.window) > self.patience:
            self.window.popleft()
        if len(self.window) < self.patience or None in self.window:
            return None
        mean = sum(self.window) / (self.patience * tick_s)
        if mean < self.threshold:
            return None
        self.window.clear()
        self.calm_window.clear()
        self.starting = RESERVE if self.shares < self.actors else GROW
        self.decisions.append((round(at_s, 1), self.starting, f"each trial was blocked {mean:.0%} of the last "
                               f"{self.patience * tick_s:.0f} s on the pool's {self.actors} actor(s), "
                               f"{self.shares} reserving CPUs"))
        return self.starting

    def _calm(self, share: float | None, tick_s: float) -> float | None:
        """The mean share of the calm window a trial was blocked, if a lending pool gives a share back
        at this tick (``share``: this tick's mean seconds a trial was blocked; None: no trial, or a
        lease ran); None: it does not."""
        if not self.lends or self.shares <= 0 or share is None:
            self.calm_window.clear()
            return None
        self.calm_window.append(share)
        while len(self.calm_window) > self.calm:
            self.calm_window.popleft()
        if len(self.calm_window) < self.calm:
            return None
        mean = sum(self.calm_window) / (self.calm * tick_s)
        if mean > self.low:
            return None
        self.calm_window.clear()
        self.window.clear()
        return mean

    def started(self, ok: bool, at_s: float, why: str = "") -> None:
        """What was asked for (an actor, or a share) has started (``ok``), or was given up (``why``)."""
        if not self.starting:
            raise RuntimeError("Growth.started without anything starting")
        what, self.starting = self.starting, None
        if ok:
            self.shares += 1
            if what == GROW:
                self.actors += 1
                self.grown += 1
            else:
                self.reserved += 1
            self.decisions.append((round(at_s, 1), "added", f"{self.actors} actor(s), {self.shares} reserving CPUs"))
        else:
            self.given_up += 1
            self.quiet = self.backoff
            self.decisions.append((round(at_s, 1), "given up", why))

    def report(self) -> dict:
        """What the summary and the pool report show."""
        return {"most_actors": self.most, "grown": self.grown, "given_up": self.given_up, "lends": self.lends,
                "reserved": self.reserved, "released": self.released, "shares": self.shares,
                "decisions": [list(d) for d in self.decisions]}
