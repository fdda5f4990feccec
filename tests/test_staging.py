"""StagingBuffer: joins, leaves, budget and freeing, without Ray (unit and property-based)."""

from __future__ import annotations

import copy
import random
from dataclasses import dataclass, field

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from coordinated_prep.plan import StreamPlan
from coordinated_prep.stream.staging import SlotState, StagingBuffer
from tests.harness import assert_exactly_once

PIECE = 100  # bytes per full piece in these tests


def _buffer(plan: StreamPlan, pieces_budget: int, lookahead: int = 100, fenced: bool = False) -> StagingBuffer:
    """``fenced``: as the coordinator builds it, production runs ahead of an undeclared trial only
    into the epochs it has begun."""
    return StagingBuffer(pieces_budget * PIECE, plan.next_join_point, lookahead,
                         epoch_pieces=plan.chunks_per_epoch if fenced else None)


def test_first_join_starts_at_zero_and_skips_unwanted_pieces():
    plan = StreamPlan(np.arange(40), 0, chunk_size=4, segments=5)  # 10 pieces, segments of 2
    buf = _buffer(plan, 4)
    assert not buf.wanted()
    assert buf.join("a")[1] == 0
    assert buf.wanted()
    buf.leave("a")
    buf.head = 3  # as if three pieces had been produced and freed
    assert buf.join("b")[1] == 4, "a lone joiner starts at the next join point; nobody needs piece 3"
    assert buf.head == 4


def test_joiner_is_served_from_what_is_staged():
    plan = StreamPlan(np.arange(40), 0, chunk_size=4, segments=5)
    buf = _buffer(plan, 10)
    buf.join("a")
    for _ in range(5):
        buf.mark_ready(buf.reserve(PIECE).g, object())
    assert buf.fetched("a", 0, 4) is not None  # only consumer: freed at once
    assert buf.join("b")[1] == 2, "pieces 1..4 are staged: b starts at the first join point among them"
    assert "b" in buf.slots[2].waiting and "b" not in buf.slots[1].waiting


def test_joining_behind_in_flight_pieces_keeps_production_alive():
    """Regression: the only trial leaves with pieces in flight; the next joiner must not stall."""
    plan = StreamPlan(np.arange(400), 0, chunk_size=4, segments=25)  # segments of 4 pieces
    buf = _buffer(plan, 100)
    buf.join("a")
    for _ in range(7):
        buf.reserve(PIECE)
    for g in range(5):
        buf.mark_ready(g, 1)
        buf.fetched("a", g, 4)
    buf.leave("a")  # pieces 5 and 6 still in flight
    _, start = buf.join("b")
    assert start == 8 and buf.head == 8 and buf.wanted()


def test_a_stale_incarnation_cannot_consume_or_unregister_the_new_one():
    plan = StreamPlan(np.arange(40), 0, chunk_size=4, segments=5)
    buf = _buffer(plan, 10)
    old, _ = buf.join("t")
    new, _ = buf.join("t")  # a retry under the same id
    assert old != new and buf.is_current("t", new) and not buf.is_current("t", old)
    assert buf.leave("t", token=old) == [] and "t" in buf.consumers
    assert buf.leave("t", token=new) == [] and "t" not in buf.consumers


def test_budget_blocks_reservation_until_a_release():
    plan = StreamPlan(np.arange(40), 0, chunk_size=4, segments=5)
    buf = _buffer(plan, 2)
    buf.join("a")
    buf.mark_ready(buf.reserve(PIECE).g, 1)
    buf.mark_ready(buf.reserve(PIECE).g, 2)
    assert not buf.fits(PIECE)
    buf.fetched("a", 0, 4)
    assert buf.fits(PIECE) and buf.staged_bytes == PIECE


def test_lookahead_bounds_production_past_the_furthest_request():
    plan = StreamPlan(np.arange(400), 0, chunk_size=4, segments=5)
    buf = _buffer(plan, 1000, lookahead=3)
    buf.join("a")
    produced = 0
    while buf.wanted():
        buf.mark_ready(buf.reserve(PIECE).g, 1)
        produced += 1
    assert produced == 3
    buf.request("a", 0)
    assert buf.wanted() and buf.reserve(PIECE).g == 3 and not buf.wanted()


def test_the_lease_holders_are_the_trials_holding_the_oldest_piece_while_another_waits():
    plan = StreamPlan(np.arange(40), 0, chunk_size=4, segments=5)
    buf = _buffer(plan, 2)
    buf.join("fast")
    buf.join("slow")
    assert buf.lease_holders(PIECE) == set()
    for g in range(2):
        buf.mark_ready(buf.reserve(PIECE).g, g)
        buf.fetched("fast", g, 4)
    assert not buf.fits(PIECE)
    assert buf.lease_holders(PIECE) == set(), "nobody waits for a piece: no lease runs (a lone trial evaluating)"
    buf.request("fast", 2)
    assert buf.lease_holders(PIECE) == {"slow"}
    buf.leave("slow")  # what the coordinator does when the lease runs out
    assert buf.fits(PIECE) and not buf.slots


def test_one_piece_larger_than_the_budget_still_flows():
    plan = StreamPlan(np.arange(8), 0, chunk_size=4, segments=1)
    buf = StagingBuffer(10, plan.next_join_point)
    buf.join("a")
    assert buf.fits(PIECE), "an empty buffer always takes one piece, so the stream cannot deadlock"


def test_leave_frees_what_only_the_leaver_needed_but_not_in_flight_pieces():
    plan = StreamPlan(np.arange(40), 0, chunk_size=4, segments=5)
    buf = _buffer(plan, 10)
    buf.join("a")
    buf.join("b")
    buf.mark_ready(buf.reserve(PIECE).g, 1)
    inflight = buf.reserve(PIECE)
    buf.fetched("b", 0, 4)
    released = buf.leave("a")
    assert [s.g for s in released] == [0]
    assert inflight.g in buf.slots and buf.slots[inflight.g].waiting == {"b"}
    buf.leave("b")
    assert buf.mark_ready(inflight.g, 2) is not None, "a piece nobody waits for is freed when it lands"
    assert not buf.slots and buf.staged_bytes == 0


def test_failed_piece_reaches_its_consumers_then_is_freed():
    plan = StreamPlan(np.arange(8), 0, chunk_size=4, segments=1)
    buf = _buffer(plan, 4)
    buf.join("a")
    slot = buf.reserve(PIECE)
    buf.mark_failed(slot.g, RuntimeError("bad jpeg"))
    assert buf.slots[0].state is SlotState.FAILED
    assert buf.fetched("a", 0, 4) is slot and not buf.slots
    with pytest.raises(RuntimeError, match="settled twice"):
        buf.reserve(PIECE)
        buf.mark_ready(1, 1)
        buf.mark_ready(1, 1)


# -- property-based: random joins, leaves, production order and consumption order ----------------

@dataclass
class _Trial:
    """What the random schedule knows of a trial's loader (as ``SharedStream`` keeps it)."""

    start: int
    end: float = float("inf")  # a trial that declared its epochs reads pieces [start, end)
    floor: int = 0  # the first piece of the epoch it reads now (it rises when it skips)
    next_ask: int = 0  # its requests are in order: the next piece it will ask for
    got: set[int] = field(default_factory=set)  # pieces answered to it, in its whole epochs and its current one

    @property
    def cursor(self) -> int:
        """The next piece it reads in order."""
        g = self.floor
        while g in self.got:
            g += 1
        return g


def _head_bytes(buf: StagingBuffer, plan: StreamPlan) -> int:
    return plan.chunk_len(buf.head) * PIECE


def _answer(buf: StagingBuffer, plan: StreamPlan) -> list[tuple[str, int, SlotState]]:
    """The coordinator answers every request whose piece has settled (no trial acts for this)."""
    answered = []
    for name, consumer in list(buf.consumers.items()):
        for g in sorted(consumer.waits):
            slot = buf.slots.get(g)
            if slot is not None and slot.state is not SlotState.RESERVED and name in slot.waiting:
                while g in consumer.waits:
                    buf.end_wait(name, g)
                buf.fetched(name, g, plan.chunk_len(g))
                answered.append((name, g, slot.state))
    return answered


def _served_alone(buf: StagingBuffer, plan: StreamPlan, trial: str, g: int) -> bool:
    """Liveness: from this state, with no other trial acting, ``trial``'s request for piece ``g`` is answered.

    ``trial`` has asked for every piece from its cursor to ``g`` (requests are in order). Only the
    coordinator (answering settled requests), the producer (reserve when wanted and within budget),
    landing pieces and the lease (which may detach only other trials, and only while ``trial``
    waits) act. Runs on a copy.
    """
    buf = copy.deepcopy(buf)
    in_flight = [s.g for s in buf.slots.values() if s.state is SlotState.RESERVED]
    for _ in range(10_000):
        if any(name == trial and piece == g for name, piece, _ in _answer(buf, plan)):
            return True  # its data (or its error) is there
        if g not in buf.consumers[trial].waits:
            return False  # its request vanished unanswered
        if in_flight:
            buf.mark_ready(in_flight.pop(), "ref")
        elif buf.wanted() and buf.fits(_head_bytes(buf, plan)):
            in_flight.append(buf.reserve(_head_bytes(buf, plan)).g)
        else:
            holders = buf.lease_holders(_head_bytes(buf, plan))
            if not holders:
                return False  # stranded: nobody will ever produce its piece
            assert trial not in holders, "the lease would detach the trial that waits"
            for held in holders:
                buf.leave(held)
    return False


ops = st.lists(
    st.one_of(
        st.tuples(st.just("join"), st.integers(0, 3)),
        st.tuples(st.just("join_for"), st.integers(0, 11)),  # trial arg % 4 declares arg // 4 + 1 epochs
        st.tuples(st.just("join_ranks"), st.integers(0, 11)),  # t(arg) and t(arg + 1) join as one trial's ranks
        st.tuples(st.just("leave"), st.integers(0, 3)),  # a close, a pause, a stop or a death
        st.tuples(st.just("produce"), st.integers(0, 0)),
        st.tuples(st.just("settle"), st.integers(0, 5)),
        st.tuples(st.just("fail"), st.integers(0, 5)),  # a piece whose preparation failed for good
        st.tuples(st.just("ask"), st.integers(0, 3)),  # a fetch or a prefetch: its next piece in order
        st.tuples(st.just("skip"), st.integers(0, 3)),  # it cuts its epoch short
        st.tuples(st.just("lease"), st.integers(0, 0)),
        st.tuples(st.just("budget"), st.integers(1, 6)),  # the node's budget was split anew
        st.tuples(st.just("keep"), st.integers(0, 6)),  # keep_bytes: arg pieces, 6: up to the budget
    ),
    max_size=300,
)
_PREFETCH = 3  # requests a trial keeps in flight at most


def _skip(buf: StagingBuffer, plan: StreamPlan, name: str, t: _Trial) -> None:
    """``name`` cuts its epoch short: on to its next epoch, its requests below it dropped unread."""
    nxt = t.floor + plan.chunks_per_epoch
    if nxt < t.end:
        buf.skip_to(name, buf.consumers[name].token, nxt)
        t.got = {g for g in t.got if g < t.floor or g >= nxt}  # the cut epoch is no epoch
        t.floor, t.next_ask = nxt, max(t.next_ask, nxt)


def _check_step(buf: StagingBuffer, plan: StreamPlan, trials: dict[str, _Trial], op: str) -> None:
    """Safety and liveness after one step of a random schedule."""
    assert buf.staged_bytes == sum(s.nbytes for s in buf.slots.values())
    if op == "reserved":  # a shrinking budget may leave more staged; a reservation never exceeds it
        assert buf.staged_bytes <= buf.budget_bytes or len(buf.slots) == 1
    for name, t in trials.items():
        consumer = buf.consumers[name]
        assert set(consumer.waits) == set(range(t.cursor, t.next_ask)) - t.got, (name, consumer.waits)
        cursor = t.cursor
        assert cursor >= t.end or cursor in buf.slots or cursor >= buf.head, (t, buf.head)
        for g in range(cursor, int(min(buf.head, t.end))):  # nothing it has not read is gone
            assert g in t.got or g in buf.slots and name in buf.slots[g].waiting, (name, g)
        # Liveness: every request it has in flight is answered without anyone else acting.
        for g in consumer.waits:
            assert _served_alone(buf, plan, name, g), f"{name} stranded at piece {g} (head {buf.head})"


@settings(max_examples=1000, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=ops, n=st.integers(1, 40), chunk=st.integers(1, 6), segments=st.integers(1, 6),
       budget=st.integers(1, 6), lookahead=st.integers(1, 4), seed=st.integers(0, 3), fenced=st.booleans())
def test_exactly_once_freeing_and_liveness_under_random_schedules(ops, n, chunk, segments, budget, lookahead, seed,
                                                                  fenced):
    ids = np.arange(n) * 3 + 1
    plan = StreamPlan(ids, seed, chunk, segments)
    buf = _buffer(plan, budget, lookahead, fenced)
    trials: dict[str, _Trial] = {}
    finished: list[_Trial] = []
    in_flight: list[int] = []
    bound = 0
    for op, arg in ops:
        name = f"t{arg % 4}"
        t = trials.get(name)
        if op in ("join", "join_for"):
            if t is not None:
                finished.append(trials.pop(name))  # a re-join (retry) starts a fresh consumer
            pieces = (arg // 4 + 1) * plan.chunks_per_epoch if op == "join_for" else None
            _, start = buf.join(name, pieces)
            assert plan.is_join_point(start)
            trials[name] = _Trial(start, float("inf") if pieces is None else start + pieces, start, start)
        elif op == "join_ranks":  # a data-parallel trial's worker group: its ranks at one start
            names = [name, f"t{(arg + 1) % 4}"]
            finished.extend(trials.pop(who) for who in names if who in trials)
            pieces = (arg // 4 + 1) * plan.chunks_per_epoch if arg >= 4 else None
            _, start = buf.join_together(names, pieces)
            assert plan.is_join_point(start)
            for who in names:
                trials[who] = _Trial(start, float("inf") if pieces is None else start + pieces, start, start)
        elif op == "leave" and t is not None:
            buf.leave(name)
            finished.append(trials.pop(name))
        elif op == "produce" and buf.wanted() and buf.fits(_head_bytes(buf, plan)):
            in_flight.append(buf.reserve(_head_bytes(buf, plan)).g)
            op = "reserved"
        elif op in ("settle", "fail") and in_flight:
            g = in_flight.pop(arg % len(in_flight))
            buf.mark_ready(g, "ref") if op == "settle" else buf.mark_failed(g, RuntimeError("bad sample"))
        elif op == "ask" and t is not None and t.next_ask < min(t.end, t.cursor + _PREFETCH):
            assert buf.needs(name, t.next_ask)
            buf.request(name, t.next_ask)
            t.next_ask += 1
        elif op == "skip" and t is not None:
            _skip(buf, plan, name, t)
        elif op == "lease":  # the lease ran out (the coordinator's timer): the holders are detached
            for held in buf.lease_holders(_head_bytes(buf, plan)):
                buf.leave(held)
                finished.append(trials.pop(held))
        elif op == "budget":
            buf.set_budget(arg * PIECE)
        elif op == "keep":  # the coordinator keeps unfetched pieces for later joiners
            buf.set_keep_bytes(None if arg == 6 else arg * PIECE)
        for who, g, state in _answer(buf, plan):
            if state is SlotState.FAILED:  # the trial receives the error, fails, and Tune ends it
                buf.leave(who)
                finished.append(trials.pop(who))
            elif who in trials:
                trials[who].got.add(g)
        _check_kept(buf, plan)
        # Production stays within the lookahead of what some trial asked for, or where one starts.
        bound = max(bound, buf.demand + buf.lookahead, max((c.floor for c in buf.consumers.values()), default=0))
        assert buf.head <= bound
        _check_step(buf, plan, trials, op)
    # Every trial's completed epochs hold every sample exactly once.
    for t in finished + list(trials.values()):
        k = 0
        while t.start + (k + 1) * plan.chunks_per_epoch <= t.end:
            epoch = range(t.start + k * plan.chunks_per_epoch, t.start + (k + 1) * plan.chunks_per_epoch)
            if all(g in t.got for g in epoch):
                assert_exactly_once([np.concatenate([plan.chunk_samples(g) for g in epoch])], ids)
            elif any(g in t.got for g in epoch) and k < (max(t.got) - t.start) // plan.chunks_per_epoch:
                raise AssertionError(f"a partial epoch {k} before a later one: {sorted(t.got)}")
            k += 1
            if k > 50:
                break
    # Everything is freed once every trial has left and every piece has landed.
    for name in list(trials):
        buf.leave(name)
    for g in in_flight:
        buf.mark_ready(g, "ref")
    assert all(not s.waiting for s in buf.slots.values()), "only kept pieces are left"
    buf.set_keep_bytes(0)
    assert not buf.slots and buf.staged_bytes == 0


def test_a_declared_end_does_not_strand_a_trial_that_skipped_past_it():
    """Issue 22's reproduction: A's declared end is reached by a reservation while B waits further on."""
    plan = StreamPlan(np.arange(64), 0, chunk_size=4, segments=2)  # 16 pieces an epoch, join points 0 and 8
    buf = _buffer(plan, 100)
    buf.join("A", pieces=16)
    for _ in range(12):
        buf.mark_ready(buf.reserve(PIECE).g, "ref")
    for g in range(8):
        buf.fetched("A", g, 4)
    token, start = buf.join("B")
    assert start == 8
    for g in range(8, 11):
        buf.fetched("B", g, 4)
    buf.skip_to("B", token, 24)
    buf.request("B", 24)
    while buf.wanted() and buf.head < 16:
        buf.mark_ready(buf.reserve(PIECE).g, "ref")
    assert buf.head == 24 and buf.wanted(), "production moves on to B's piece, A still registered"


def test_a_skip_ends_the_requests_it_passed_over():
    plan = StreamPlan(np.arange(64), 0, chunk_size=4, segments=4)
    buf = _buffer(plan, 2, lookahead=4)
    fast, _ = buf.join("fast")
    slow, _ = buf.join("slow")
    for g in range(2):
        buf.mark_ready(buf.reserve(PIECE).g, "ref")
        buf.fetched("slow", g, 4)
    buf.request("slow", 2)  # a prefetch it will pass over
    buf.skip_to("slow", slow, 16)
    assert buf.consumers["slow"].waits == {} and "slow" not in buf.starving()
    buf.request("slow", 16)
    assert buf.lease_holders(PIECE) == {"fast"}, "fast holds the budget while slow waits past its skip"


def test_a_trial_that_declares_its_epochs_gets_nothing_past_them():
    plan = StreamPlan(np.arange(40), 0, chunk_size=4, segments=5)  # 10 pieces an epoch
    buf = _buffer(plan, 1000, lookahead=100)
    _, start = buf.join("a", pieces=plan.chunks_per_epoch)
    assert start == 0 and buf.needs("a", 9) and not buf.needs("a", 10)
    produced = []
    while buf.wanted():
        produced.append(buf.reserve(PIECE).g)
    assert produced == list(range(10)), "production stops at the end of the only trial's epoch"
    _, start = buf.join("b")  # an open-ended trial joining now still gets pieces past a's end
    assert buf.wanted() and buf.reserve(PIECE).g == 10 and "a" not in buf.slots[10].waiting


def test_a_trial_without_declared_epochs_gets_nothing_past_the_epoch_it_began():
    """Lightning and early stopping leave epochs unset: the group prepares an epoch only once the
    trial begins it (its first request there), so nothing is prepared past its last epoch."""
    plan = StreamPlan(np.arange(40), 0, chunk_size=4, segments=5)  # 10 pieces an epoch
    buf = _buffer(plan, 1000, lookahead=100, fenced=True)
    buf.join("a")
    produced = []
    while buf.wanted():
        produced.append(buf.reserve(PIECE).g)
    assert produced == list(range(10)), "its first epoch, then nothing it has not begun"
    for g in range(10):
        buf.request("a", g)
    assert not buf.wanted()
    buf.request("a", 10)  # it begins its second epoch
    while buf.wanted():
        produced.append(buf.reserve(PIECE).g)
    assert produced == list(range(20))
    _, start = buf.join("b", pieces=3 * plan.chunks_per_epoch)  # a declared trial: production runs ahead for it
    assert buf.wanted() and buf.reserve(PIECE).g == 20 and "a" in buf.slots[20].waiting, "a still reads it"


def test_a_joiner_past_the_head_is_served_when_the_head_trials_leave():
    """The stranded joiner (issue 10): X reads, Y joins past the head, X leaves; Y and Z are served."""
    plan = StreamPlan(np.arange(64), 0, chunk_size=4, segments=4)  # 16 pieces, segments of 4
    buf = _buffer(plan, 100)
    buf.join("X")
    for _ in range(6):
        buf.mark_ready(buf.reserve(PIECE).g, "ref")
    for g in range(5):
        buf.fetched("X", g, 4)
    _, start = buf.join("Y")
    assert start == 8 and buf.head == 6
    buf.leave("X")
    assert buf.needs("Y", 8) and buf.head == 8 and buf.wanted(), "production moves on to Y's first piece"
    _, z_start = buf.join("Z")
    assert z_start == 8 and buf.reserve(PIECE).waiting == {"Y", "Z"}


def test_a_lone_trial_that_waits_for_nothing_is_never_leased():
    plan = StreamPlan(np.arange(64), 0, chunk_size=4, segments=4)
    buf = _buffer(plan, 2)
    buf.join("lone")
    while buf.wanted() and buf.fits(PIECE):
        buf.mark_ready(buf.reserve(PIECE).g, "ref")
    assert buf.lease_holders(PIECE) == set(), "its own unread pieces do not make it a straggler"
    buf.request("lone", 0)
    assert buf.lease_holders(PIECE) == set(), "it waits for a staged piece: nothing blocks it"


def test_skip_to_passes_over_an_epochs_rest_at_once():
    plan = StreamPlan(np.arange(64), 0, chunk_size=4, segments=4)  # 16 pieces an epoch
    buf = _buffer(plan, 100, lookahead=4)
    token, _ = buf.join("a")
    buf.join("b")
    for _ in range(4):
        buf.mark_ready(buf.reserve(PIECE).g, "ref")
    buf.fetched("a", 0, 4)
    released = buf.skip_to("a", token, 16)
    assert released == [] and all("a" not in s.waiting for s in buf.slots.values()), "b still reads them"
    assert buf.passed("a", 5) and not buf.needs("a", 5) and buf.needs("a", 16)
    buf.leave("b")
    assert not buf.slots and buf.head == 16 and buf.wanted(), "nothing between is prepared for a"


def test_demand_falls_when_the_furthest_trial_leaves():
    plan = StreamPlan(np.arange(400), 0, chunk_size=4, segments=1)
    buf = _buffer(plan, 1000, lookahead=2)
    buf.join("fast")
    buf.join("slow")
    buf.request("fast", 50)
    assert buf.demand == 51
    buf.leave("fast")
    assert buf.demand == 0, "the lookahead counts from the trials still there"


# -- kept pieces: what a leaver left unfetched is read by the next joiner ------------------------

def _keeping(plan: StreamPlan, pieces_budget: int, lookahead: int = 100, keep_bytes: int | None = None) -> StagingBuffer:
    return StagingBuffer(pieces_budget * PIECE, plan.next_join_point, lookahead, keep_bytes=keep_bytes)


def test_a_leavers_unfetched_pieces_are_kept_and_the_next_joiner_starts_on_them():
    plan = StreamPlan(np.arange(40), 0, chunk_size=4, segments=10)  # 10 pieces an epoch, each a join point
    buf = _keeping(plan, 100, lookahead=3)
    buf.join("a", pieces=20)  # declared two epochs; stopped (PBT, HyperBand) after three pieces
    for g in range(3):
        buf.request("a", g)
        while buf.wanted():
            buf.mark_ready(buf.reserve(PIECE).g, "ref")
        buf.fetched("a", g, 4)
    assert sorted(buf.slots) == [3, 4, 5], "its lookahead"
    assert buf.leave("a") == [] and buf.kept_bytes == 3 * PIECE and buf.pieces_kept == 3
    assert not buf.wanted(), "nobody registered: nothing more is prepared"
    _, start = buf.join("b", pieces=10)
    assert start == 3 and buf.pieces_reused == 3 and buf.kept_bytes == 0
    assert all(buf.slots[g].waiting == {"b"} for g in (3, 4, 5)) and buf.head == 6
    assert buf.needs("b", 3) and buf.fetched("b", 3, 4) is not None


def test_without_keep_bytes_a_leavers_pieces_are_freed_as_before():
    plan = StreamPlan(np.arange(40), 0, chunk_size=4, segments=10)
    buf = _buffer(plan, 100)
    buf.join("a")
    for _ in range(3):
        buf.mark_ready(buf.reserve(PIECE).g, "ref")
    assert [s.g for s in buf.leave("a")] == [0, 1, 2] and not buf.slots and buf.pieces_kept == 0


def test_a_piece_that_lands_after_its_trials_left_is_kept():
    plan = StreamPlan(np.arange(40), 0, chunk_size=4, segments=10)
    buf = _keeping(plan, 100)
    buf.join("a")
    in_flight = buf.reserve(PIECE)
    assert buf.leave("a") == [] and buf.slots[0].state is SlotState.RESERVED
    assert buf.mark_ready(in_flight.g, "ref") is None, "kept, not released"
    assert buf.join("b")[1] == 0 and buf.slots[0].waiting == {"b"}


def test_kept_pieces_no_joiner_could_start_on_are_released_at_once():
    plan = StreamPlan(np.arange(40), 0, chunk_size=4, segments=5)  # 10 pieces an epoch, join points every 2
    buf = _keeping(plan, 100)
    token, _ = buf.join("a")
    for _ in range(5):
        buf.mark_ready(buf.reserve(PIECE).g, "ref")
    for g in range(3):
        buf.fetched("a", g, 4)
    assert [s.g for s in buf.leave("a")] == [3], "piece 3 lies below the next join point (4): nobody starts there"
    assert sorted(buf.slots) == [4] and buf.join("b")[1] == 4
    # A gap below the head: the trial passes over its epoch's rest, the head jumps past what nobody
    # needs, and the pieces below the gap could never be a joiner's start.
    buf.leave("b")
    token, start = buf.join("c")
    assert start == 4
    buf.mark_ready(buf.reserve(PIECE).g, "ref")
    assert sorted(s.g for s in buf.skip_to("c", token, start + plan.chunks_per_epoch)) == [4, 5]
    assert not buf.slots and buf.head == 14


def test_kept_pieces_never_hold_the_budget_and_go_lowest_first():
    plan = StreamPlan(np.arange(40), 0, chunk_size=4, segments=10)
    buf = _keeping(plan, 3)
    buf.join("a")
    buf.join("b")
    for _ in range(3):
        buf.mark_ready(buf.reserve(PIECE).g, "ref")
    for g in range(3):
        buf.fetched("b", g, 4)
    buf.fetched("a", 0, 4)
    assert buf.leave("a") == [] and sorted(buf.slots) == [1, 2] and buf.kept_bytes == 2 * PIECE
    buf.request("b", 3)
    assert buf.fits(PIECE) and buf.wanted() and buf.lease_holders(PIECE) == set()
    buf.mark_ready(buf.reserve(PIECE).g, "ref")
    buf.mark_ready(buf.reserve(PIECE).g, "ref")
    assert sorted(buf.slots) == [2, 3, 4] and buf.staged_bytes == 3 * PIECE, "piece 1 made room, then piece 2 is next"
    assert buf.set_keep_bytes(0)[0].g == 2 and sorted(buf.slots) == [3, 4]


def test_keep_bytes_caps_the_kept_pieces_lowest_first():
    plan = StreamPlan(np.arange(40), 0, chunk_size=4, segments=10)
    buf = _keeping(plan, 100, keep_bytes=2 * PIECE)
    buf.join("a")
    for _ in range(4):
        buf.mark_ready(buf.reserve(PIECE).g, "ref")
    assert [s.g for s in buf.leave("a")] == [0, 1] and sorted(buf.slots) == [2, 3]
    assert buf.join("b")[1] == 2
    with pytest.raises(ValueError):
        buf.set_keep_bytes(-1)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=ops, n=st.integers(1, 40), chunk=st.integers(1, 6), segments=st.integers(1, 6),
       budget=st.integers(1, 6), lookahead=st.integers(1, 4), seed=st.integers(0, 3))
def test_keeping_pieces_under_random_schedules(ops, n, chunk, segments, budget, lookahead, seed):
    """The random-schedule property test, with every unfetched piece kept from the start and
    production fenced at the epochs undeclared trials began (the coordinator's settings), on top of
    the ``keep`` op's changes."""
    test_exactly_once_freeing_and_liveness_under_random_schedules.hypothesis.inner_test(
        [("keep", 6)] + ops, n, chunk, segments, budget, lookahead, seed, True)


def _check_kept(buf: StagingBuffer, plan: StreamPlan) -> None:
    """Kept pieces are ready, within ``keep_bytes``, and each one a joiner could start at or below:
    in the staged run that ends at the head, at or past its first join point."""
    kept = sorted(g for g, s in buf.slots.items() if s.state is SlotState.READY and not s.waiting)
    assert sum(buf.slots[g].nbytes for g in kept) == buf.kept_bytes
    assert buf.keep_bytes is None or buf.kept_bytes <= buf.keep_bytes
    assert buf.kept_bytes <= buf.budget_bytes or len(kept) == 1 and len(buf.slots) == 1
    if kept:
        assert buf.keep_bytes != 0
        assert all(g in buf.slots for g in range(kept[0], buf.head)), "a gap below the head"
        low = kept[0]
        while low - 1 in buf.slots:
            low -= 1
        assert kept[0] >= plan.next_join_point(low), "no joiner could start on it"


def test_a_request_already_answered_does_not_count_as_starving():
    """A wait left behind for a piece the trial has fetched (below the head, released) is not a
    wait for production: it must not exempt the trial from the lease while another one waits."""
    plan = StreamPlan(np.arange(40), 0, chunk_size=4, segments=1)  # joins at epoch boundaries only
    buf = _buffer(plan, 1)
    buf.join("a")
    buf.request("a", 0)  # answered below without end_wait: a stale wait
    buf.mark_ready(buf.reserve(PIECE).g, "ref")
    buf.fetched("a", 0, 4)
    buf.join("b")  # starts at the next epoch, past the head
    buf.mark_ready(buf.reserve(PIECE).g, "ref")  # piece 1: a's, unfetched, fills the budget
    buf.request("b", 10)
    assert buf.starving() == {"b"} and buf.lease_holders(PIECE) == {"a"}


_OPS = (("join", 3), ("join_for", 11), ("leave", 3), ("produce", 0), ("settle", 5), ("fail", 5), ("ask", 3),
        ("skip", 3), ("lease", 0), ("budget", 6), ("keep", 6))


@pytest.mark.parametrize("block", range(4))
def test_liveness_on_long_seeded_schedules(block):
    """The property test's body on long schedules (Hypothesis draws mostly short ones): 50 seeded
    schedules of 300 steps per block, asks and production weighted up so trials get far."""
    weights = [3, 2, 1, 6, 6, 1, 8, 1, 1, 1, 1]
    for seed in range(block * 50, (block + 1) * 50):
        rng = random.Random(seed)
        ops = [(op, rng.randint(1 if op == "budget" else 0, top))
               for op, top in rng.choices(_OPS, weights=weights, k=300)]
        args = (rng.randint(1, 40), rng.randint(1, 6), rng.randint(1, 6), rng.randint(1, 6), rng.randint(1, 4),
                rng.randint(0, 3), seed % 2 == 0)
        test_exactly_once_freeing_and_liveness_under_random_schedules.hypothesis.inner_test(ops, *args)


# -- real bytes: a piece is charged what it holds once it lands ------------------------------------

def _grow(plan: StreamPlan, probe: int, g: int) -> int:
    """Real bytes of piece ``g`` of a dataset sorted by length (speech clips of 1 to 30 s): the probe
    saw the shortest samples, and piece ``g`` lands ``g % 30 + 1`` times its bytes per sample."""
    return plan.chunk_len(g) * probe * (g % 30 + 1)


@pytest.mark.parametrize("most", [1, 4])
def test_landed_pieces_are_charged_their_real_bytes_and_the_budget_holds(most):
    """Pieces land 1x to 30x the probe's estimate, ``most`` in flight at a time: after every step the
    staged bytes are the real bytes of the landed pieces plus the estimates of those in flight, and
    they exceed the budget (or one piece alone) only by what the pieces in flight at the last
    reservation landed larger than their estimates: never more than the budget plus one piece here."""
    plan = StreamPlan(np.arange(480), 0, chunk_size=8, segments=1)  # 60 pieces an epoch
    probe = 10
    buf = StagingBuffer(40 * 8 * probe, plan.next_join_point, lookahead=100, sample_bytes=probe, calibrate=True)
    buf.join("a", pieces=60)
    rng = random.Random(most)
    estimates: dict[int, int] = {}
    flying: list[int] = []
    at_reservation: list[int] = []  # the pieces in flight at the last reservation
    floor = 0  # what a reservation left staged, the budget or one piece alone
    while buf.head < 60 or buf.slots:
        head_bytes = buf.estimate(plan.chunk_len(buf.head))
        if buf.head < 60 and len(flying) < most and buf.fits(head_bytes):
            assert head_bytes >= plan.chunk_len(buf.head) * max(
                [probe] + [-(-buf.slots[g].nbytes // plan.chunk_len(g)) for g in buf.slots if g not in flying])
            estimates[buf.reserve(head_bytes).g] = head_bytes
            flying.append(buf.head - 1)
            at_reservation = list(flying)
            floor = max(buf.budget_bytes, buf.staged_bytes)
            assert floor == buf.budget_bytes or len(buf.slots) == 1
        elif flying:
            g = flying.pop(rng.randrange(len(flying)))
            buf.mark_ready(g, "ref", _grow(plan, probe, g), plan.chunk_len(g))
        else:
            buf.fetched("a", min(buf.slots), plan.chunk_len(min(buf.slots)))
        real = {g: estimates[g] if g in flying else _grow(plan, probe, g) for g in buf.slots}
        assert buf.staged_bytes == sum(real.values()), "staged bytes are the real bytes of the landed pieces"
        surplus = sum(max(0, _grow(plan, probe, g) - estimates[g]) for g in at_reservation if g not in flying)
        assert buf.staged_bytes <= floor + surplus
        assert buf.staged_bytes <= buf.budget_bytes + max(real.values(), default=0)
    assert buf.peak_bytes <= buf.budget_bytes + _grow(plan, probe, 59)


def test_a_ragged_layout_sizes_its_first_piece_alone():
    """With ``calibrate``, nothing is reserved beside the first piece until it lands with its real
    size: the probe's few samples may be the dataset's smallest."""
    plan = StreamPlan(np.arange(80), 0, chunk_size=8, segments=1)
    buf = StagingBuffer(30 * 8 * 10, plan.next_join_point, sample_bytes=10, calibrate=True)
    buf.join("a")
    buf.reserve(buf.estimate(8))
    assert not buf.fits(buf.estimate(8)) and buf.lease_holders(buf.estimate(8)) == set()
    buf.mark_ready(0, "ref", 8 * 150, 8)  # 15x what the probe saw
    assert buf.staged_bytes == 8 * 150 and buf.estimate(8) == 8 * 150
    assert buf.fits(buf.estimate(8)), "sized: the budget decides again"
    failed = buf.reserve(buf.estimate(8))
    buf.mark_failed(failed.g, RuntimeError("bad sample"))
    assert buf.staged_bytes == 8 * 150, "a failed piece holds its error, not a piece"


def test_an_unmeasured_landing_keeps_its_estimate():
    plan = StreamPlan(np.arange(80), 0, chunk_size=8, segments=1)
    buf = _buffer(plan, 4)
    buf.join("a")
    buf.mark_ready(buf.reserve(PIECE).g, "ref")
    assert buf.staged_bytes == PIECE and buf.fits(PIECE)


def test_resident_evaluation_pieces_are_charged_their_real_bytes_within_the_allowance():
    """Held-out pieces, in index order, of a dataset sorted by length grow from 1x to 30x what the
    probe saw: each resident piece is charged its real bytes once it lands, the trailing ones are
    shed while they exceed the allowance, and more become resident only while their estimates fit."""
    from coordinated_prep.stream.eval_set import EvalSet, eval_pieces

    found = EvalSet("eval-k", None, "node", eval_pieces(np.arange(240), 8), sample_bytes=10)  # 30 pieces
    allowance = 40 * 8 * 10  # 40 pieces as the probe saw them, 3.4 as they land

    def real(i: int) -> int:
        return 8 * 10 * (i + 1)

    rng = random.Random(0)
    estimates: dict[int, int] = {}
    while True:
        while found.admits(allowance, 4):
            estimates[len(found.refs)] = found.estimate(len(found.refs))
            found.refs.append(f"ref-{len(found.refs)}")
        flying = [i for i in range(len(found.refs)) if i not in found.real]
        if not flying:
            break
        i = rng.choice(flying)
        found.land(i, real(i), 8)
        assert found.estimate(i + 1) >= real(i), "the next estimate is the largest bytes per sample seen"
        found.shed(allowance)
        charged = [found.real.get(j, found.estimate(j)) for j in range(len(found.refs))]
        assert found.resident_bytes == sum(charged) <= allowance
    assert found.refs and sum(real(i) for i in range(len(found.refs))) <= allowance
    assert not found.admits(allowance, 4), "the next piece does not fit: it is streamed"
