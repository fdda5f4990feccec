"""The staging buffer: who still needs each prepared piece, and when it may be freed.

Pure Python over explicit state, so that every rule here is tested without Ray; the coordinator
actor is a thin shell that calls these methods and stores the object references in ``payload``.

Life cycle of a piece ``g`` (the legal transitions; nothing else changes a slot):

    (absent) --reserve--> RESERVED --mark_ready--> READY --last consumer fetched--> released
                                   \\--mark_failed--> FAILED --last consumer fetched--> released
    READY --its last consumers left or passed over it unfetched--> kept (READY, nobody waits)
    RESERVED --mark_ready after its consumers left--> kept
    kept --a joiner's range holds it--> READY (the joiner waits)
    kept --evicted (reserve needs its bytes, over ``keep_bytes``) or no joiner can start on it--> released

- ``reserve`` happens only while the staged bytes plus the piece's estimate fit the byte budget
  (landed pieces at their real bytes: see *Bytes* below), or nothing else is staged (so one piece
  larger than the budget cannot deadlock the stream), and only up to ``lookahead`` pieces past
  the furthest piece any trial has asked for: the budget bounds memory, the lookahead bounds work
  nobody may use (pieces prepared when the last trials leave).
- The consumers of a piece are fixed when it is reserved: every registered trial whose range
  ``[start, end)`` holds ``g``; a trial that joins later with ``g`` in its range is added then. A
  trial that declares how many pieces it will read (its epochs) has a finite ``end``, so nothing is
  prepared past the last piece any trial will read.
- A consumer leaving removes it from every slot; slots left without consumers are released as
  soon as they are no longer in flight. A consumer passing over the rest of an epoch
  (``skip_to``) leaves the slots below its new floor the same way, at once.
- Unless it is *kept* (``keep_bytes``, off by default): a prepared piece that nobody waits for any
  more because its consumers left or passed over it unfetched stays staged, so that the next
  trial to join (a trial Tune paused and resumes, PBT's exploit, a retry) starts on it instead of
  on pieces prepared afresh: what a leaver's lookahead prepared is read after all. A joiner
  starts at the first join point of the run of staged pieces that ends at the head, so a kept
  piece is released as soon as no joiner could start at or below it (a gap below it, or no join
  point at or below it in the run); the lowest kept pieces go first when they exceed
  ``keep_bytes`` or when ``reserve`` needs their bytes. Kept pieces never hold the budget against
  production (``fits`` does not count them), so liveness is as without them.
- The head never rests on a piece nobody will read: after every change of the head or of a
  consumer's range (join, leave, skip, reserve) it moves up to the first piece some consumer still
  needs (the pieces passed over are never prepared). Moving it after ``reserve`` matters when the
  piece just reserved was the last one a trial declared and the next reader starts further on.
- A consumer that did not declare its end (``pieces`` None: a loader without ``epochs``, as Lightning
  and loops with early stopping use) is a consumer of every piece from its start, but production
  reserves the head only while some consumer will surely read a piece from the head on
  (``epoch_pieces``): a declared consumer before its end, an undeclared one inside an epoch it has
  begun (asked a piece of; its first epoch from its join). Pieces are prepared in order, so a
  piece an undeclared consumer may never read is still prepared when a later one is surely read.
  The trial asks for its next epoch's pieces only when it begins that epoch, so for a trial alone
  nothing is prepared past the last epoch it reads: an undeclared end costs no pieces, only that
  each epoch's first pieces are prepared once it begins (:meth:`~coordinated_prep.stream.slots.Consumer.reads_past`).
- A consumer's requests for pieces it has passed over end at once (``skip_to`` drops them): a
  wait for a piece nobody will prepare would otherwise count it as starving and exempt it from the
  lease.

Bytes: what ``staged_bytes`` counts, and the bound.

- A slot is charged its estimate while in flight (``reserve(nbytes)``) and its real bytes from
  the moment it lands (``mark_ready(g, payload, nbytes, samples)``: the prep task measured them; a
  failed piece holds an error, not a piece, and is charged 0). So ``staged_bytes`` is the real
  bytes of the landed pieces plus the estimates of the pieces in flight, never a guess about a
  piece that has landed, and ``fits`` admits a piece only while those plus its estimate fit.
- Estimates (``estimate(samples)``): the samples times the largest bytes per sample among the
  probe's and every piece landed so far, so a piece is under-estimated only when its samples are
  larger on average than those of every piece before it. With ``calibrate`` (a layout with ragged
  or object leaves, whose sizes the probe's few first samples may badly under-represent, as the
  shortest clips of a length-sorted speech set do) no piece is reserved beside the first one
  until a piece has landed with its real size.
- The bound, whatever the sizes: right after a reservation the staged bytes are within the budget,
  or one piece is staged alone. Until the next reservation they grow only when a piece in flight
  lands larger than its estimate, by that surplus; and nothing is reserved while they exceed the
  budget, so a surplus is paid back as pieces are fetched, never compounded. Hence after every
  step ``staged_bytes <= max(budget, the lone piece) + the surplus of the pieces that were in
  flight at the last reservation``: a group holds at most its budget plus its pieces in flight
  at their real sizes (one piece when they are produced one at a time; none beyond the budget
  while no piece outgrows the largest bytes per sample seen before it), however the real sizes
  stray from the probe's. ``peak_bytes`` is the most it held, real bytes included.

The budget bounds the bytes of the slots here (``staged_bytes``), not every byte the node's object
store holds for the group's trials: fetched pieces the trials still map, a share that shrank below
what is staged, and evaluation pieces come on top (the coordinator's docstring states by how much).

Liveness (``tests/test_staging.py`` checks it after every step of random schedules): for every
registered consumer, production reaches its next piece without any other consumer acting, unless
the budget is full of settled pieces that other, live consumers have not fetched; then
:meth:`StagingBuffer.lease_holders` names those consumers, and once the lease detaches them
production goes on. A consumer that waits for nothing (a lone trial evaluating) never makes the
lease run out for anyone.
- Release means the coordinator drops its reference. A trial that fetched the piece may still hold
  its own (borrowed) reference to the current batch; Ray frees the memory when that is dropped too.
"""

from __future__ import annotations

from typing import Any, Callable

from coordinated_prep.stream.slots import Consumer, Slot, SlotState


class StagingBuffer:
    """Consumers, staged pieces and the byte budget of one data group.

    Args:
        budget_bytes: Most bytes of pieces staged at once (reserved or ready).
        next_join_point: Maps a piece number to the first join point at or after it.
        lookahead: Most pieces reserved beyond the furthest piece requested so far.
        keep_bytes: Most bytes of prepared pieces kept for later joiners after their consumers
            left them unfetched (0: none, the default; None: up to the byte budget).
        sample_bytes: Bytes per sample the group's probe found (all views): the first
            :meth:`estimate`, raised by every piece that lands larger per sample.
        epoch_pieces: Pieces per epoch, for consumers that do not declare their end (see the
            module's docstring); None: production runs ahead for them as for any other.
        calibrate: Reserve nothing beside the first piece until a piece has landed with its real
            size (samples whose sizes the probe cannot vouch for: ragged or object leaves).
    """

    def __init__(self, budget_bytes: int, next_join_point: Callable[[int], int], lookahead: int = 8,
                 keep_bytes: int | None = 0, sample_bytes: int = 1, calibrate: bool = False,
                 epoch_pieces: int | None = None) -> None:
        if budget_bytes < 1 or lookahead < 1 or sample_bytes < 1:
            raise ValueError(f"budget_bytes={budget_bytes}, lookahead={lookahead} and sample_bytes={sample_bytes} "
                             "must be positive")
        _check_keep(keep_bytes)
        self.sample_bytes = sample_bytes  # the largest bytes per sample seen (see estimate)
        self.sized = not calibrate  # whether a piece has landed with its real size (or none is needed)
        self.budget_bytes = budget_bytes
        self.lookahead = lookahead
        self.epoch_pieces = epoch_pieces
        self.keep_bytes = keep_bytes
        self.pieces_kept = 0  # pieces kept after their consumers left them unfetched
        self.pieces_reused = 0  # kept pieces a later joiner took up
        self._next_join_point = next_join_point
        self.head = 0  # the next piece to reserve
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
        head is still staged (kept pieces included), so the trial is served from what is already
        prepared when it can be.
        """
        joined = self.join_together([trial], pieces)
        assert joined is not None  # without ``at`` a start is always found
        return joined[0][0], joined[1]

    def join_point(self) -> int:
        """The first piece a consumer joining now would start on: the first join point from which
        every piece up to the head is still staged."""
        return self._next_join_point(self._run_low())

    def join_together(self, trials: list[str], pieces: int | None = None,
                      at: int | None = None) -> tuple[list[int], int] | None:
        """Register ``trials`` at one start, as :meth:`join` registers one; returns their tokens and the start.

        The ranks of a data-parallel trial join so: each reads its share of the same epochs
        (:mod:`coordinated_prep.trial.shard`), so they must start on the same piece, and every
        piece from there is kept until each rank has fetched it. ``at`` (a join point): start
        there, where the ranks on other nodes start; None when a piece between ``at`` and the head
        is no longer staged (the ranks here then prepare their own pieces). Consumers already
        registered under these ids (the ranks of a worker group that Ray Train replaced) leave first.
        """
        for trial in trials:
            self.leave(trial)
        if at is not None and at < self._run_low():
            return None
        start = self.join_point() if at is None else at
        tokens = []
        for trial in trials:
            self._tokens += 1
            tokens.append(self._tokens)
            consumer = Consumer(token=self._tokens, start=start, end=None if pieces is None else start + pieces,
                                floor=start, requested=start)
            self.consumers[trial] = consumer
            for g, slot in self.slots.items():
                if consumer.covers(g):
                    self.pieces_reused += self._is_kept(slot)
                    slot.waiting.add(trial)
        self._advance_head()
        self._prune_kept()  # kept pieces below its start: no later joiner starts lower
        return tokens, start

    def is_current(self, trial: str, token: int) -> bool:
        """Whether ``token`` is the live incarnation of ``trial``."""
        consumer = self.consumers.get(trial)
        return consumer is not None and consumer.token == token

    def leave(self, trial: str, token: int | None = None) -> list[Slot]:
        """Unregister ``trial`` (only incarnation ``token`` if given); returns the slots this released."""
        if trial not in self.consumers or token is not None and not self.is_current(trial, token):
            return []
        del self.consumers[trial]
        released = self._drop(trial, lambda g: True)
        self._advance_head()
        return released + self._prune_kept()

    def skip_to(self, trial: str, token: int, g: int) -> list[Slot]:
        """``trial`` passes over every piece below ``g`` it has not fetched (an epoch cut short).

        Returns the slots this released. Nothing waits: pieces below ``g`` not yet prepared will
        not be prepared for it, and staged ones are left at once.
        """
        consumer = self.consumers.get(trial)
        if consumer is None or consumer.token != token or g <= consumer.floor:
            return []
        consumer.floor = g
        consumer.requested = max(consumer.requested, g)
        consumer.waits = {p: n for p, n in consumer.waits.items() if p >= g}  # those requests end now
        released = self._drop(trial, lambda piece: piece < g)
        self._advance_head()
        return released + self._prune_kept()

    # -- producing ---------------------------------------------------------------------------
    @property
    def demand(self) -> int:
        """One past the furthest piece a registered consumer has asked for (falls when it leaves)."""
        return max((c.requested for c in self.consumers.values()), default=0)

    def wanted(self) -> bool:
        """Whether some registered trial needs the head piece, some trial will surely read a piece from
        it on (:meth:`Consumer.reads_past`: pieces are prepared in order), and it is within the lookahead."""
        consumers = self.consumers.values()
        return (self.head < self.demand + self.lookahead and any(c.covers(self.head) for c in consumers)
                and any(c.reads_past(self.head, self.epoch_pieces) for c in consumers))

    def starving(self) -> set[str]:
        """The consumers waiting for a piece that is not prepared yet (at or past the head: a request
        left for a piece below it was answered, or is for a piece it passed over)."""
        return {t for t, c in self.consumers.items()
                if any(g >= self.head and c.covers(g) for g in c.waits)}

    def lease_holders(self, nbytes: int) -> set[str]:
        """Whom the lease would detach now, with ``nbytes`` the size of the head piece.

        Non-empty only while production is wanted but the budget cannot take the head piece, some
        consumer waits for a piece not staged yet, and the oldest staged piece is settled: then
        the consumers that have not fetched it, other than the waiting ones, hold the window.
        (Waiting for the first piece's size is not the budget: nobody holds that.)
        """
        if not self.slots or not self.wanted() or self._within_budget(nbytes):
            return set()
        starving = self.starving()
        oldest = min(self._held_slots(), key=lambda s: s.g, default=None)  # kept pieces hold nothing
        if not starving or oldest is None or oldest.state is SlotState.RESERVED:
            return set()
        return oldest.waiting - starving

    def request(self, trial: str, g: int) -> None:
        """``trial`` asks for piece ``g`` and waits for it; production may run ``lookahead`` past it."""
        consumer = self.consumers[trial]
        consumer.requested = max(consumer.requested, g + 1)
        consumer.waits[g] = consumer.waits.get(g, 0) + 1

    def end_wait(self, trial: str, g: int) -> None:
        """A request of ``trial`` for piece ``g`` was answered (or abandoned)."""
        consumer = self.consumers.get(trial)
        if consumer is None or g not in consumer.waits:
            return
        consumer.waits[g] -= 1
        if not consumer.waits[g]:
            del consumer.waits[g]

    def set_budget(self, budget_bytes: int) -> None:
        """A new byte budget (the node's budget was split anew); staged pieces above it stay until freed."""
        if budget_bytes < 1:
            raise ValueError(f"budget_bytes={budget_bytes} must be positive")
        self.budget_bytes = budget_bytes
        self._prune_kept()

    def set_keep_bytes(self, keep_bytes: int | None) -> list[Slot]:
        """Keep up to ``keep_bytes`` of pieces left unfetched (0: none; None: up to the budget);
        returns the kept slots released because they no longer fit."""
        _check_keep(keep_bytes)
        self.keep_bytes = keep_bytes
        return self._prune_kept()

    @property
    def kept_bytes(self) -> int:
        """Bytes of the kept pieces: prepared, nobody waits for them, staged for a later joiner."""
        return sum(s.nbytes for s in self.slots.values() if self._is_kept(s))

    def estimate(self, samples: int) -> int:
        """Bytes to reserve for a piece of ``samples`` samples: the largest bytes per sample seen."""
        return samples * self.sample_bytes

    def fits(self, nbytes: int) -> bool:
        """Whether reserving ``nbytes`` more keeps the staged bytes (real for landed pieces) within the
        budget (kept pieces do not count: ``reserve`` evicts them to make room), and the first
        piece's real size is known if it had to be (``calibrate``)."""
        if not self.sized and any(s.state is SlotState.RESERVED for s in self.slots.values()):
            return False  # one piece at a time until one has landed with its real size
        return self._within_budget(nbytes)

    def _within_budget(self, nbytes: int) -> bool:
        return not self._held_slots() or self.staged_bytes - self.kept_bytes + nbytes <= self.budget_bytes

    def reserve(self, nbytes: int) -> Slot:
        """Stage the head piece as in flight; its consumers are the trials that started at or before it.

        Kept pieces are evicted, lowest first, while the staged bytes and the piece exceed the budget.
        """
        for kept in sorted(g for g, s in self.slots.items() if self._is_kept(s)):
            if self.staged_bytes + nbytes <= self.budget_bytes:
                break
            self._release(kept)
        g = self.head
        waiting = {t for t, c in self.consumers.items() if c.covers(g)}
        slot = Slot(g=g, nbytes=nbytes, waiting=waiting)
        self.slots[g] = slot
        self.head += 1
        self.staged_bytes += nbytes
        self.peak_bytes = max(self.peak_bytes, self.staged_bytes)
        self._advance_head()  # g may have been the last piece its readers declared
        self._prune_kept()  # the head may have jumped over a gap: kept pieces below it are no use
        return slot

    def mark_ready(self, g: int, payload: Any, nbytes: int | None = None, samples: int = 0) -> Slot | None:
        """Piece ``g`` is prepared, holding ``nbytes`` real bytes of ``samples`` samples; returns the
        slot if it is released at once (nobody waits for it).

        From now on the slot is charged ``nbytes``, not its estimate, and later estimates use its
        bytes per sample if they are the largest seen. ``nbytes=None``: the caller does not measure
        pieces; the estimate stands.
        """
        slot = self.slots[g]
        if nbytes is not None and slot.state is SlotState.RESERVED:
            self._charge(slot, nbytes)
            if samples > 0:
                self.sample_bytes = max(self.sample_bytes, -(-nbytes // samples))
                self.sized = True
        elif nbytes is None:
            self.sized = True  # the caller vouches for its estimates
        return self._settle(g, SlotState.READY, payload)

    def mark_failed(self, g: int, error: BaseException) -> Slot | None:
        """Preparing piece ``g`` failed; its consumers will receive ``error`` instead of data (charged 0)."""
        slot = self.slots[g]
        if slot.state is SlotState.RESERVED:
            self._charge(slot, 0)
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
            released = self._release(g)
            self._prune_kept()  # a gap below the head: no joiner starts on the kept pieces below it
            return released
        return None

    def passed(self, trial: str, g: int) -> bool:
        """Whether ``trial`` passed over piece ``g`` (it lies below its floor, past its start)."""
        consumer = self.consumers.get(trial)
        return consumer is not None and consumer.start <= g < consumer.floor

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
    def _drop(self, trial: str, which: Callable[[int], bool]) -> list[Slot]:
        """Remove ``trial`` from the slots ``which`` selects; returns those released by it."""
        released = []
        for slot in list(self.slots.values()):
            if which(slot.g) and trial in slot.waiting:
                slot.waiting.discard(trial)
                if not slot.waiting and slot.state is not SlotState.RESERVED and not self._keep(slot):
                    released.append(self._release(slot.g))
        return released

    def _advance_head(self) -> None:
        """Move the head up to the first piece some consumer still needs (liveness).

        Without this, a head that no consumer covers (its readers left, and the others start further
        on) would never be wanted again, and everyone after it would wait forever. Pieces passed over
        are never prepared; ones still in flight are freed when they land.
        """
        needed = [g for c in self.consumers.values() if (g := c.first_needed(self.head)) is not None]
        if needed:
            self.head = max(self.head, min(needed))

    def _settle(self, g: int, state: SlotState, payload: Any) -> Slot | None:
        slot = self.slots[g]
        if slot.state is not SlotState.RESERVED:
            raise RuntimeError(f"piece {g} settled twice ({slot.state.value} -> {state.value})")
        slot.state, slot.payload = state, payload
        if slot.waiting:
            return None
        if not self._keep(slot):
            released = self._release(g)
            self._prune_kept()  # a failed piece nobody reads leaves a gap below the head
            return released
        return slot if any(r is slot for r in self._prune_kept()) else None

    def _charge(self, slot: Slot, nbytes: int) -> None:
        """Charge ``slot`` ``nbytes`` instead of what it was charged (its estimate, while in flight)."""
        self.staged_bytes += nbytes - slot.nbytes
        slot.nbytes = nbytes
        self.peak_bytes = max(self.peak_bytes, self.staged_bytes)

    def _release(self, g: int) -> Slot:
        slot = self.slots.pop(g)
        self.staged_bytes -= slot.nbytes
        return slot

    # -- kept pieces -------------------------------------------------------------------------
    @staticmethod
    def _is_kept(slot: Slot) -> bool:
        return slot.state is SlotState.READY and not slot.waiting

    def _held_slots(self) -> list[Slot]:
        """The slots that are not kept: in flight, or waited for."""
        return [s for s in self.slots.values() if not self._is_kept(s)]

    def _keep(self, slot: Slot) -> bool:
        """Whether ``slot``, settled and left by its last consumer unfetched, is kept (for now)."""
        if slot.state is not SlotState.READY or self.keep_bytes == 0:
            return False
        self.pieces_kept += 1
        return True

    def _run_low(self) -> int:
        """The lowest piece from which every piece up to the head is staged (the head if none is)."""
        low = self.head
        while low - 1 in self.slots:
            low -= 1
        return low

    def _prune_kept(self) -> list[Slot]:
        """Release the kept pieces no joiner could start on (below the first join point of the
        staged run ending at the head), then the lowest ones while they exceed ``keep_bytes`` or the
        budget (which may have shrunk: kept pieces are the first memory to give back)."""
        released: list[Slot] = []
        while True:
            kept = sorted(g for g, s in self.slots.items() if self._is_kept(s))
            if not kept:
                return released
            low = self._run_low()
            first = self._next_join_point(low) if low < self.head else self.head
            cap = self.budget_bytes if self.keep_bytes is None else min(self.keep_bytes, self.budget_bytes)
            if kept[0] < first or sum(self.slots[g].nbytes for g in kept) > cap:
                released.append(self._release(kept[0]))
            else:
                return released


def _check_keep(keep_bytes: int | None) -> None:
    if keep_bytes is not None and keep_bytes < 0:
        raise ValueError(f"keep_bytes={keep_bytes} must be >= 0 or None")
