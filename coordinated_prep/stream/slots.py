"""A staged piece and a registered consumer: the state the staging buffer keeps (its rules: :mod:`.staging`)."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any


class SlotState(enum.Enum):
    """Where a staged piece is in its life cycle."""

    RESERVED = "reserved"
    READY = "ready"
    FAILED = "failed"


@dataclass
class Slot:
    """One staged piece: its bytes (its estimate while in flight, its real bytes once landed), state,
    the trials that have not fetched it, and its payload."""

    g: int
    nbytes: int
    waiting: set[str]
    state: SlotState = SlotState.RESERVED
    payload: Any = None


@dataclass
class Consumer:
    """A registered trial's loader: its incarnation, its range of pieces, its requests, samples served.

    The token tells a consumer that re-joined under the same id (a Tune retry) from requests its
    previous incarnation left in flight: those must not consume the new incarnation's pieces.
    """

    token: int
    start: int  # the first piece of its first epoch
    end: int | None = None  # None: it reads on until it leaves
    floor: int = 0  # pieces below it are read or passed over (never below start)
    requested: int = 0  # one past the furthest piece it has asked for
    waits: dict[int, int] = field(default_factory=dict)  # pieces it waits for now -> outstanding requests
    served_samples: int = 0

    def covers(self, g: int) -> bool:
        """Whether piece ``g`` is one this consumer still reads."""
        return self.floor <= g and (self.end is None or g < self.end)

    def reads_past(self, g: int, epoch_pieces: int | None) -> bool:
        """Whether this consumer will surely read some piece at or after ``g``: one it covers before
        its declared end or, if it declared none, inside an epoch it has begun (asked a piece of;
        its first epoch counts as begun). ``epoch_pieces`` None: any covered piece counts."""
        g = max(g, self.floor)
        if self.end is not None or epoch_pieces is None:
            return self.end is None or g < self.end
        begun = max(1, -(-(self.requested - self.start) // epoch_pieces))
        return g < self.start + begun * epoch_pieces

    def first_needed(self, head: int) -> int | None:
        """The first piece at or after ``head`` it still reads, or None."""
        g = max(head, self.floor)
        return g if self.end is None or g < self.end else None
