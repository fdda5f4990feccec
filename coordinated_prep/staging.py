"""The staging buffer: who still needs each prepared piece, and when it may be freed.

Pure Python over explicit state, so that every rule here is tested without Ray; the coordinator
actor is a thin shell that calls these methods and stores the object references in ``payload``.

Life cycle of a piece ``g`` (the legal transitions; nothing else changes a slot):

    (absent) --reserve--> RESERVED --mark_ready--> READY --last consumer fetched--> released
                                   \\--mark_failed--> FAILED --last consumer fetched--> released

- ``reserve`` happens only while the staged bytes plus the piece fit the byte budget (or nothing
  else is staged, so one piece larger than the budget cannot deadlock the stream), and only up to
  ``lookahead`` pieces past the furthest piece any trial has asked for: the budget bounds memory,
  the lookahead bounds work nobody may use (pieces prepared when the last trials leave).
- The consumers of a piece are fixed when it is reserved: every registered trial whose range
  ``[start, end)`` holds ``g``; a trial that joins later with ``g`` in its range is added then. A
  trial that declares how many pieces it will read (its epochs) has a finite ``end``, so nothing is
  prepared past the last piece any trial will read.
- A consumer leaving removes it from every slot; slots left without consumers are released as
  soon as they are no longer in flight.
- Release means the coordinator drops its reference. A trial that fetched the piece may still hold
  its own (borrowed) reference to the current batch; Ray frees the memory when that is dropped too.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any, Callable


class SlotState(enum.Enum):
    """Where a staged piece is in its life cycle."""

    RESERVED = "reserved"
    READY = "ready"
    FAILED = "failed"


@dataclass
class Slot:
    """One staged piece: its size, state, the trials that have not fetched it, and its payload."""

    g: int
    nbytes: int
    waiting: set[str]
    state: SlotState = SlotState.RESERVED
    payload: Any = None


@dataclass
class Consumer:
    """A registered trial: its incarnation token, its range of pieces ``[start, end)``, samples served.

    The token tells a trial that re-joined under the same id (a Tune retry) from requests its
    previous incarnation left in flight: those must not consume the new incarnation's pieces.
    """

    token: int
    start: int
    end: int | None = None  # None: the trial reads on until it leaves
    served_samples: int = 0

    def covers(self, g: int) -> bool:
        """Whether piece ``g`` is one this trial reads."""
        return self.start <= g and (self.end is None or g < self.end)


class StagingBuffer:
    """Consumers, staged pieces and the byte budget of one data group.

    Args:
        budget_bytes: Most bytes of pieces staged at once (reserved or ready).
        next_join_point: Maps a piece number to the first join point at or after it.
        lookahead: Most pieces reserved beyond the furthest piece requested so far.
    """

    def __init__(self, budget_bytes: int, next_join_point: Callable[[int], int], lookahead: int = 8) -> None:
        if budget_bytes < 1 or lookahead < 1:
            raise ValueError(f"budget_bytes={budget_bytes} and lookahead={lookahead} must be positive")
        self.budget_bytes = budget_bytes
        self.lookahead = lookahead
        self._next_join_point = next_join_point
        self.head = 0  # the next piece to reserve
        self.demand = 0  # one past the furthest piece any consumer has requested
        self.slots: dict[int, Slot] = {}
        self.consumers: dict[str, Consumer] = {}
        self.staged_bytes = 0
        self.peak_bytes = 0
        self._tokens = 0

    # -- consumers --------------------------------------------------------------------------
    def join(self, trial: str, pieces: int | None = None) -> tuple[int, int]:
        """Register ``trial``; returns ``(token, start)``: its incarnation and its first epoch's piece.

        ``pieces`` is how many pieces the trial will read (its epochs times the pieces per epoch),
        or None if it reads until it leaves.

        A trial that is already registered (a retry under the same id) is first removed, so it
        starts a fresh epoch. The start is the first join point from which every piece up to the
        head is still staged, so the trial is served from what is already prepared when it can be.
        """
        self.leave(trial)
        low = self.head
        for g in range(self.head - 1, -1, -1):  # walk down over the contiguous staged run
            if g not in self.slots:
                break
            low = g
        start = self._next_join_point(low)
        if not any(c.covers(self.head) or c.start > self.head for c in self.consumers.values()):
            # Nobody needs the pieces between the head and this start (pieces still in flight there
            # are freed when they land): skip them, or no consumer would ever want the head again.
            self.head = max(self.head, start)
        self._tokens += 1
        consumer = Consumer(token=self._tokens, start=start, end=None if pieces is None else start + pieces)
        self.consumers[trial] = consumer
        self.demand = max(self.demand, start)
        for g, slot in self.slots.items():
            if consumer.covers(g):
                slot.waiting.add(trial)
        return self._tokens, start

    def is_current(self, trial: str, token: int) -> bool:
        """Whether ``token`` is the live incarnation of ``trial``."""
        consumer = self.consumers.get(trial)
        return consumer is not None and consumer.token == token

    def leave(self, trial: str, token: int | None = None) -> list[Slot]:
        """Unregister ``trial`` (only incarnation ``token`` if given); returns the slots this released."""
        if trial not in self.consumers or token is not None and not self.is_current(trial, token):
            return []
        del self.consumers[trial]
        released = []
        for slot in list(self.slots.values()):
            slot.waiting.discard(trial)
            if not slot.waiting and slot.state is not SlotState.RESERVED:
                released.append(self._release(slot.g))
        return released

    # -- producing ---------------------------------------------------------------------------
    def wanted(self) -> bool:
        """Whether some registered trial needs the head piece, and it is within the lookahead."""
        return self.head < self.demand + self.lookahead and any(c.covers(self.head) for c in self.consumers.values())

    def laggards(self) -> set[str]:
        """The trials that still have to fetch the oldest staged piece (the ones holding the window)."""
        if not self.slots:
            return set()
        return set(self.slots[min(self.slots)].waiting)

    def request(self, g: int) -> None:
        """A consumer asked for piece ``g``: production may run ``lookahead`` pieces past it."""
        self.demand = max(self.demand, g + 1)

    def fits(self, nbytes: int) -> bool:
        """Whether reserving ``nbytes`` more keeps the staged bytes within the budget."""
        return not self.slots or self.staged_bytes + nbytes <= self.budget_bytes

    def reserve(self, nbytes: int) -> Slot:
        """Stage the head piece as in flight; its consumers are the trials that started at or before it."""
        g = self.head
        waiting = {t for t, c in self.consumers.items() if c.covers(g)}
        slot = Slot(g=g, nbytes=nbytes, waiting=waiting)
        self.slots[g] = slot
        self.head += 1
        self.staged_bytes += nbytes
        self.peak_bytes = max(self.peak_bytes, self.staged_bytes)
        return slot

    def mark_ready(self, g: int, payload: Any) -> Slot | None:
        """Piece ``g`` is prepared; returns the slot if it is released at once (nobody waits for it)."""
        return self._settle(g, SlotState.READY, payload)

    def mark_failed(self, g: int, error: BaseException) -> Slot | None:
        """Preparing piece ``g`` failed; its consumers will receive ``error`` instead of data."""
        return self._settle(g, SlotState.FAILED, error)

    # -- consuming ---------------------------------------------------------------------------
    def fetched(self, trial: str, g: int, samples: int) -> Slot | None:
        """``trial`` took piece ``g`` of ``samples`` samples; returns the slot if it is now released."""
        slot = self.slots[g]
        if trial not in slot.waiting:
            raise KeyError(f"trial {trial!r} does not wait for piece {g} (already fetched or not its consumer)")
        slot.waiting.discard(trial)
        self.consumers[trial].served_samples += samples
        if not slot.waiting:
            return self._release(g)
        return None

    def needs(self, trial: str, g: int) -> bool:
        """Whether ``g`` is a piece ``trial`` may still fetch."""
        consumer = self.consumers.get(trial)
        if consumer is None or not consumer.covers(g):
            return False
        slot = self.slots.get(g)
        return slot is None and g >= self.head or slot is not None and trial in slot.waiting

    def clear(self) -> list[Slot]:
        """Release every slot at once (the group is shutting down); returns them."""
        released = list(self.slots.values())
        self.slots.clear()
        self.staged_bytes = 0
        return released

    # -- internals ---------------------------------------------------------------------------
    def _settle(self, g: int, state: SlotState, payload: Any) -> Slot | None:
        slot = self.slots[g]
        if slot.state is not SlotState.RESERVED:
            raise RuntimeError(f"piece {g} settled twice ({slot.state.value} -> {state.value})")
        slot.state, slot.payload = state, payload
        return self._release(g) if not slot.waiting else None

    def _release(self, g: int) -> Slot:
        slot = self.slots.pop(g)
        self.staged_bytes -= slot.nbytes
        return slot
