"""When the CoordinatedSearcher releases each suggested trial to Tune: a data group's trials
together, and no suggestion starved. Pure logic, tested without Ray (tests/test_group_order.py).

Tune's variant generation interleaves a grid's data groups: a grid over two crop scales with
``num_samples: 2`` comes out A, B, A, B, so with two trials at a time the running pair never
shares a group (each group prepared 1.00x what it served). The searcher pulls suggestions ahead
into a bounded window and releases them by this rule, first that applies:

1. **Due.** A suggestion passed over ``patience`` times goes next (the oldest due first).
2. **Join.** The oldest suggestion whose group has a trial live (released and not complete): it
   runs beside that group's trials and reads the pieces they prepare.
3. **Oldest.** The oldest suggestion.

Only the order changes, never which configs are tried: every suggestion pulled is released.
A suggestion without a data group (no DataSpec in its config) is never preferred by rule 2.

Bound (no starvation): after a suggestion enters the window, at most ``patience + window - 1`` others
are released before it. A release that takes a younger suggestion passes it over, at most
``patience`` times before it is due; one that takes an older suggestion takes one of the at most
``window - 1`` that were in the window when it entered (suggestions enter at the young end, and a
due suggestion goes before every younger one). So as long as Tune keeps asking (each trial that
completes frees a place), every waiting suggestion is served.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable, Hashable

#: How many suggestions are pulled ahead of Tune (a grid with up to this many data groups is regrouped).
DEFAULT_WINDOW = 32


def _itself(item: Any) -> Any:
    return item


@dataclass
class _Waiting:
    item: Any
    group: Hashable | None
    passed: int = 0  # releases that went before it since it entered the window


@dataclass
class GroupOrder:
    """The release order of suggestions, by data group (see the module's rule and bound).

    Args:
        window: Most suggestions held back at once (pulled from the search algorithm, not yet released).
        patience: Releases a suggestion may be passed over before it is due.
        key: A released suggestion's id, as :meth:`complete` is later told it (a Tune trial's ``trial_id``).
    """

    window: int = DEFAULT_WINDOW
    patience: int = DEFAULT_WINDOW
    key: Callable[[Any], Hashable] = _itself
    _waiting: list[_Waiting] = field(default_factory=list)
    _live: Counter = field(default_factory=Counter)  # group -> trials released and not complete
    _groups: dict[Any, Hashable | None] = field(default_factory=dict)  # released trial id -> its group
    _unclaimed: int = 0  # running trials a restored sweep restarts under ids not known yet (see forget_running)

    def __post_init__(self) -> None:
        if self.window < 1 or self.patience < 0:
            raise ValueError(f"GroupOrder: window={self.window} must be >= 1 and patience={self.patience} >= 0")

    @property
    def bound(self) -> int:
        """Most releases between a suggestion entering the window and its own release."""
        return self.patience + self.window - 1

    def room(self) -> bool:
        """Whether the window takes another suggestion."""
        return len(self._waiting) < self.window

    def __len__(self) -> int:
        return len(self._waiting)

    def offer(self, item: Any, group: Hashable | None) -> None:
        """Hold ``item`` (a suggestion of data group ``group``, None for none) until it is released."""
        if not self.room():
            raise RuntimeError(f"GroupOrder: the window of {self.window} is full; release one first")
        self._waiting.append(_Waiting(item, group))

    def running(self) -> int:
        """Suggestions released and not complete (Tune's live trials of this searcher)."""
        return len(self._groups) + self._unclaimed

    def release(self) -> Any | None:
        """The next suggestion by the rule, counted live until :meth:`complete` is told its key;
        None when none waits."""
        if not self._waiting:
            return None
        index = self._choose()
        chosen = self._waiting.pop(index)
        for other in self._waiting[:index]:  # those it went before (the younger ones were not passed)
            other.passed += 1
        if chosen.group is not None:
            self._live[chosen.group] += 1
        self._groups[self.key(chosen.item)] = chosen.group
        return chosen.item

    def complete(self, trial_id: Hashable) -> Hashable | None:
        """Trial ``trial_id`` is over (finished, stopped or errored); its group (None for unknown ids)."""
        if trial_id not in self._groups and self._unclaimed:  # a restarted trial over before it reported
            self._unclaimed -= 1
        group = self._groups.pop(trial_id, None)
        if group is not None:
            self._live[group] -= 1
            if not self._live[group]:
                del self._live[group]
        return group

    def adopt(self, trial_id: Hashable) -> None:
        """Count trial ``trial_id`` as running if it is not counted: a trial Tune runs that this order
        never released (an errored trial a restored sweep resumes, a trial it restarts under a new id)."""
        if trial_id not in self._groups:
            self._unclaimed -= bool(self._unclaimed)  # it takes the place its restart kept for it
            self._groups[trial_id] = None

    def forget_running(self, restarted: bool) -> list[Hashable]:
        """Forget the released trials' ids; returns them. For a restored sweep whose unfinished trials
        Tune ends (``restarted`` False) or restarts under new ids: none of them completes under its id,
        so each would hold a place of ``max_concurrent`` for ever. A restarted one keeps its place,
        unnamed, until its new id reports (:meth:`adopt`) or completes."""
        dropped = list(self._groups)
        self._unclaimed = len(dropped) if restarted else 0
        self._groups.clear()
        self._live.clear()
        return dropped

    def wanted(self) -> set[Hashable]:
        """The groups of the trials released and not complete, and of the suggestions held back."""
        return set(self._live) | {w.group for w in self._waiting if w.group is not None}

    def clear(self) -> int:
        """Drop every held suggestion (the sweep ends without them); returns how many."""
        dropped, self._waiting = len(self._waiting), []
        return dropped

    def live(self) -> dict[Hashable, int]:
        """Per data group, its trials released and not complete."""
        return dict(self._live)

    def waiting(self) -> list[tuple[Any, Hashable | None, int]]:
        """The held suggestions, oldest first: (item, group, times passed over)."""
        return [(w.item, w.group, w.passed) for w in self._waiting]

    def _choose(self) -> int:
        for i, w in enumerate(self._waiting):
            if w.passed >= self.patience:
                return i
        for i, w in enumerate(self._waiting):
            if w.group is not None and w.group in self._live:
                return i
        return 0
