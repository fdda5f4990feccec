"""The node pool's options, the pure split of a node's staging budget among its groups, and the pure
rule by which a pool sized by demand grows (:mod:`coordinated_prep.pool.elastic`)."""

from __future__ import annotations

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from coordinated_prep import ConfigError
from coordinated_prep.pool import PoolSpec, split_budget
from coordinated_prep.pool.elastic import (BACKOFF, CALM, GROW, LOW, PATIENCE, RELEASE, RESERVE, THRESHOLD,
                                           Growth)


def test_defaults_are_one_actor_per_cpu_at_most_reserving_half_and_a_quarter_of_the_store():
    spec = PoolSpec()
    assert spec.grows and not PoolSpec(actors=2).grows, "unset actors: sized by demand; a number: fixed"
    assert spec.actors_for(8) == 8 and spec.cpus_for(8) == 4 and spec.budget_for(1000) == 250
    assert spec.actors_for(0.5) == 1, "a node with less than a CPU still gets an actor"
    assert PoolSpec(actors=3, cpus=0, staging_bytes="1KiB").budget_for(10**9) == 1024
    assert spec.shape_for(2) == (2, 0.5) and PoolSpec(actors=3, cpus=8).shape_for(4) == (3, 4 / 3), \
        "a pool never reserves more CPUs than its node has"
    assert not spec.keep_warm


@pytest.mark.parametrize("values, message", [
    ({"actors": 0}, r"pool.actors=0 must be an integer >= 1"),
    ({"cpus": -1}, r"pool.cpus=-1 must be a number >= 0"),
    ({"staging_fraction": 1.0}, r"pool.staging_fraction=1.0 must be in \(0, 0.9\]"),
    ({"staging_bytes": "lots"}, r"pool.staging_bytes='lots' must be a byte count"),
    ({"actor": 2}, r"pool: unknown key\(s\) \['actor'\]"),
    ({"keep_warm": "yes"}, r"pool.keep_warm='yes' must be true or false"),
    ({"cpus": float("nan")}, r"pool.cpus=nan must be a number >= 0"),
    ({"start_timeout_s": True}, r"pool.start_timeout_s=True must be a positive number of seconds"),
    ({"start_timeout_s": float("inf")}, r"pool.start_timeout_s=inf must be a positive number"),
    ({"staging_fraction": True}, r"pool.staging_fraction=True must be in \(0, 0.9\]"),
])
def test_bad_values_name_the_key(values, message):
    with pytest.raises(ConfigError, match=message):
        PoolSpec.from_mapping(values)


def test_a_staging_budget_and_decoded_tier_in_bytes_must_leave_the_trials_part_of_the_store():
    """Fractions are checked when the spec is made; byte counts once the node's store size is known."""
    store = 10 * 2**30
    PoolSpec().check_store(store, "n" * 28)  # a quarter each
    PoolSpec(staging_bytes="6GiB", decoded_bytes="3GiB").check_store(store, "n" * 28)  # 0.9: the most
    for spec in (PoolSpec(staging_bytes="8GiB", decoded_fraction=0.6), PoolSpec(staging_fraction=0.9,
                 decoded_bytes="8GiB"), PoolSpec(decoded_bytes="64GiB")):
        with pytest.raises(ConfigError, match=r"node nnnnnnnnnnnn: the staging budget \(\d+ bytes: pool.staging_bytes "
                                              r"or staging_fraction\) and the decoded tier .* more than 0.9 of its "
                                              rf"{store}-byte object store.*lower one of them"):
            spec.check_store(store, "n" * 28)


def test_equal_shares_and_caps_water_filled():
    assert split_budget(100, {"a": None}) == {"a": 100}
    assert split_budget(100, {"a": None, "b": None, "c": None, "d": None}) == {k: 25 for k in "abcd"}
    assert split_budget(100, {"a": 10, "b": None, "c": None}) == {"a": 10, "b": 45, "c": 45}
    assert split_budget(100, {"a": 500, "b": None}) == {"a": 50, "b": 50}, "a cap above the share changes nothing"


@given(total=st.integers(1, 10**9), caps=st.dictionaries(st.text(min_size=1, max_size=3),
                                                        st.one_of(st.none(), st.integers(1, 10**9)),
                                                        min_size=1, max_size=8))
def test_shares_never_exceed_the_budget_or_a_cap_and_leave_nothing_idle(total, caps):
    shares = split_budget(total, caps)
    assert set(shares) == set(caps)
    if total >= len(caps):
        assert sum(shares.values()) <= total
    assert all(shares[k] <= c for k, c in caps.items() if c is not None)
    uncapped = [k for k, c in caps.items() if c is None or shares[k] < c]
    if uncapped:  # what the capped groups leave goes to the others, up to rounding
        assert total - sum(shares.values()) < len(caps)


def test_a_pool_grows_only_after_its_trials_were_blocked_a_whole_window():
    growth = Growth(most=2)
    enough = THRESHOLD * 2.0 * 3  # 3 trials, each blocked the least share that counts, over a tick of 2 s
    for _ in range(PATIENCE - 1):
        assert not growth.tick(enough, 3, False, 2.0, 0.0)
    assert not growth.tick(enough, 3, True, 2.0, 0.0), "a lease ran: the budget, not the pool, held the trials"
    for _ in range(PATIENCE - 1):
        assert not growth.tick(enough, 3, False, 2.0, 0.0)
    assert not growth.tick(enough * 0.9, 3, False, 2.0, 0.0), "blocked less than the threshold on average"
    assert not growth.tick(enough / 3, 3, False, 2.0, 0.0), "one trial's wait, shared by three, is a third"
    lump = [0.0] * (PATIENCE - 1) + [THRESHOLD * 2.0 * PATIENCE]  # a long block reported in one piece
    assert [growth.tick(w, 1, False, 2.0, 7.5) for w in lump][-1] and growth.starting
    assert not growth.tick(10.0, 1, False, 2.0, 8.0), "one actor starts at a time"
    growth.started(False, 9.0, "no CPU")
    assert not any(growth.tick(10.0, 1, False, 2.0, 9.0) for _ in range(BACKOFF + PATIENCE - 1)), "backs off"
    assert growth.tick(10.0, 1, False, 2.0, 10.0)
    growth.started(True, 12.0)
    assert growth.actors == 2 and not growth.tick(10.0, 1, False, 2.0, 14.0), "never above its most"
    assert [d[1] for d in growth.report()["decisions"]] == ["grow", "given up", "grow", "added"]
    with pytest.raises(ValueError):
        Growth(most=2, actors=3)


def test_a_lending_pool_gives_its_cpus_back_while_preparation_runs_ahead_and_takes_them_again_when_trials_wait():
    growth = Growth(most=2, lends=True)
    for _ in range(CALM - 1):
        assert growth.tick(0.0, 2, False, 2.0, 1.0) is None
    assert growth.tick(0.0, 0, False, 2.0, 1.0) is None, "no trial: no evidence that preparation runs ahead"
    for _ in range(CALM - 1):
        assert growth.tick(0.0, 2, False, 2.0, 1.0) is None
    assert growth.tick(0.0, 2, True, 2.0, 1.0) is None, "a lease ran: the trials waited on the budget"
    for _ in range(CALM - 1):
        assert growth.tick(0.0, 2, False, 2.0, 1.0) is None
    assert growth.tick(LOW * 2.0 * CALM * 2 * 1.5, 2, False, 2.0, 1.0) is None, "blocked more than the low share"
    for _ in range(CALM - 1):
        assert growth.tick(0.0, 2, False, 2.0, 1.0) is None
    assert growth.tick(0.01, 2, False, 2.0, 5.0) == RELEASE and (growth.actors, growth.shares) == (1, 0)
    assert all(growth.tick(0.0, 2, False, 2.0, 6.0) is None for _ in range(2 * CALM)), "nothing left to give back"
    enough = THRESHOLD * 2.0  # one trial, blocked the least share that counts of each tick
    for _ in range(PATIENCE - 1):  # the trials wait: the share comes back before a second actor starts
        assert growth.tick(enough, 1, False, 2.0, 7.0) is None
    assert growth.tick(enough, 1, False, 2.0, 8.0) == RESERVE and growth.starting == RESERVE
    assert growth.tick(0.0, 2, False, 2.0, 8.0) is None, "nothing is given back while a share starts"
    growth.started(True, 9.0)
    assert (growth.actors, growth.shares, growth.reserved) == (1, 1, 1)
    assert [growth.tick(2.0, 1, False, 2.0, 10.0) for _ in range(PATIENCE)][-1] == GROW
    growth.started(True, 11.0)
    assert (growth.actors, growth.shares, growth.grown) == (2, 2, 1)
    assert [d[1] for d in growth.report()["decisions"]] == [RELEASE, RESERVE, "added", GROW, "added"]
    assert all(Growth(most=2).tick(0.0, 2, False, 2.0, 0.0) is None for _ in range(3 * CALM)), "only a lending pool"
    for bad in (dict(shares=0), dict(lends=True, shares=2), dict(lends=True, low=THRESHOLD)):
        with pytest.raises(ValueError):
            Growth(most=2, **bad)


@given(steps=st.lists(st.tuples(st.floats(0.0, 8.0), st.integers(0, 4), st.booleans(), st.booleans(),
                                 st.integers(0, 2)), max_size=80),
       most=st.integers(1, 6), lends=st.booleans())
@example(steps=[(2.0, 1, False, True, 0)] * 6, most=4, lends=False)  # asks twice: the window starts again between
@example(steps=[(2.0, 1, False, True, 0)] * 3 + [(0.0, 2, False, True, 0)] * 6, most=2, lends=True)  # gives back twice
@settings(max_examples=300, deadline=None)
def test_growth_is_safe_after_every_step_and_serves_waiting_trials_within_its_bound(steps, most, lends):
    """Safety after each step of a random schedule (per tick: seconds blocked, trials, whether a
    lease ran; each start asked for succeeds or is given up, after 0 to 2 more ticks), then liveness
    from the state reached, with no other party acting: ticks in which every trial stays blocked ask
    for a share or an actor within ``BACKOFF + PATIENCE`` ticks (``PATIENCE`` once one was added)
    until the pool holds its most; then, for a lending pool, ticks in which no trial waits give a
    share back within ``CALM`` ticks until it holds none."""
    growth = Growth(most=most, lends=lends)
    history: list[tuple[float, bool, bool]] = []  # per tick: mean seconds a trial was blocked, lease ran, trials
    last_event = given_up = -10**6  # the tick of the last decision or start resolved; of the last give-up
    pending: list = []  # a start asked for: [ticks left before it resolves, whether it succeeds]
    for tick, (waited, trials, leased, ok, delay) in enumerate(steps):
        was_actors, was_shares = growth.actors, growth.shares
        asked = growth.tick(waited, trials, leased, 2.0, 0.0)
        history.append((waited / max(trials, 1), leased, trials > 0))
        if asked in (GROW, RESERVE):
            assert not pending, "asked while a start was pending"
            last = history[-PATIENCE:]
            assert len(last) == PATIENCE and not any(lease for _, lease, _ in last), "asked on a lease's wait"
            assert sum(w for w, _, _ in last) >= THRESHOLD * 2.0 * PATIENCE, "asked without a window of waiting"
            assert tick - last_event >= PATIENCE, "the window did not start again after the last decision"
            assert tick - given_up >= PATIENCE + BACKOFF, "asked again within the back-off"
            assert (asked == RESERVE) == (was_shares < was_actors), "a share held back comes back before an actor"
            pending, last_event = [delay, ok], tick
        elif asked == RELEASE:
            assert not pending, "gave back while a start was pending"
            last = history[-CALM:]
            assert lends and len(last) == CALM and all(t and not lease for _, lease, t in last), "gave back unseen"
            assert sum(w for w, _, _ in last) <= LOW * 2.0 * CALM, "gave back while trials waited"
            assert tick - last_event >= CALM, "the calm window did not start again after the last decision"
            assert growth.shares == was_shares - 1
            last_event = tick
        else:
            assert asked is None
        if pending and pending[0] == 0:
            growth.started(pending[1], 0.0, "" if pending[1] else "no CPU")
            given_up = given_up if pending[1] else tick
            pending, last_event = [], tick
        elif pending:
            pending[0] -= 1
        assert 1 <= growth.actors <= most and 0 <= growth.shares <= growth.actors
        assert bool(growth.starting) == bool(pending) and (lends or growth.shares == growth.actors)
        assert 0 <= growth.actors - was_actors <= 1 and abs(growth.shares - was_shares) <= 1
        assert len(growth.report()["decisions"]) <= 16
    if pending:
        growth.started(pending[1], 0.0, "" if pending[1] else "no CPU")
    bound = BACKOFF + PATIENCE
    while growth.shares < most:
        ticks = 1
        while (asked := growth.tick(2.0, 1, False, 2.0, 0.0)) is None:
            ticks += 1
            assert ticks <= bound, "trials blocked every tick were not served within the bound"
        assert asked in (GROW, RESERVE)
        growth.started(True, 0.0)
        bound = PATIENCE
    assert growth.tick(2.0, 1, False, 2.0, 0.0) is None and growth.actors == most
    while lends and growth.shares > 0:
        assert RELEASE in [growth.tick(0.0, 1, False, 2.0, 0.0) for _ in range(CALM)], "a calm pool kept its CPUs"


def test_the_waits_during_an_actors_start_do_not_grow_the_pool_again():
    """The registry's tick (:class:`~coordinated_prep.stream.growth.PoolGrowth`) with a coordinator and a
    pool of its own: the actor the trials' waits asked for takes 20 s to start, during which they go on
    waiting; once it is there nobody waits, so the pool stays at 2 (those 20 s, counted in the next
    window, grew it to its most)."""
    import asyncio
    from types import SimpleNamespace

    from coordinated_prep.pool.elastic import TICK_S
    from coordinated_prep.stream.growth import PoolGrowth

    class Coordinator:  # the demand a coordinator reports: its trials' blocked seconds so far
        def __init__(self) -> None:
            self.waited_s = 0.0
            self.demand = SimpleNamespace(remote=self._demand)
            self.set_actors = SimpleNamespace(remote=self._set_actors)

        async def _demand(self) -> dict:
            return {"waited_s": self.waited_s, "lease_s": 0.0, "trials": 1}

        async def _set_actors(self, actors) -> None:
            pass

    coordinator = Coordinator()

    class Pool:
        node, each, reserved_cpus, given_up_why = "node-a", 0.5, 0.5, ""

        def __init__(self) -> None:
            self.growth, self.actors = Growth(most=8), ["actor-0"]

        async def grow(self) -> bool:
            coordinator.waited_s += 20.0  # the trial waits on the one actor while the second starts
            self.actors.append(f"actor-{len(self.actors)}")
            return True

    registry = PoolGrowth()
    registry._groups = {"g": SimpleNamespace(node="node-a", actor=coordinator)}
    pool, seen = Pool(), {None: 0.0}

    async def ticks(blocked: list[float]) -> None:
        for waited in blocked:
            coordinator.waited_s += waited
            await registry._tick(pool, seen, 0.0)

    asyncio.run(ticks([TICK_S] * PATIENCE))  # blocked every whole tick: one actor more
    assert pool.growth.actors == 2 and len(pool.actors) == 2
    asyncio.run(ticks([0.0] * (PATIENCE + 2)))  # the new actor keeps up: nobody waits any more
    assert pool.growth.actors == 2 and not pool.growth.starting, pool.growth.report()["decisions"]
