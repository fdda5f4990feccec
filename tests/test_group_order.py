"""The release order of suggested trials by data group (coordinated_prep.tune.order): pure logic,
no Ray. Safety (every suggestion released once, none invented), liveness (each within the written
bound, with no one else acting), and the grouping itself on Tune's natural grid order."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from coordinated_prep.tune.order import GroupOrder


def simulate(groups: list, limit: int, window: int = 32, patience: int = 32) -> list[set]:
    """Tune's loop over a sweep whose suggestions have ``groups`` in this order, ``limit`` trials at
    a time, each running until the oldest running one completes: the sets of groups running at
    once, each time the running set is full or the suggestions are out."""
    order = GroupOrder(window=window, patience=patience)
    pending = list(enumerate(groups))
    running: list[int] = []
    together = []
    while pending or len(order) or running:
        while len(running) < limit:
            while pending and order.room():
                order.offer(*pending.pop(0))
            item = order.release()
            if item is None:
                break
            running.append(item)
        together.append({groups[i] for i in running})
        order.complete(running.pop(0))
    return together


def test_the_natural_grid_order_runs_each_groups_trials_together():
    # A YAML grid over two crop scales with num_samples: 2, two trials at a time: Tune generates A, B, A, B.
    assert simulate(list("ABAB"), limit=2)[0] == {"A"}
    # Two at a time throughout a longer sweep: every full pair is one group's.
    runs = simulate(list("ABCD") * 4, limit=2)
    assert sum(len(groups) == 1 for groups in runs) >= len(runs) - 4, runs
    # Without regrouping (a window of one suggestion) the same sweep never pairs a group.
    assert all(len(groups) == 2 for groups in simulate(list("ABAB"), limit=2, window=1)[:2])


def test_suggestions_without_a_group_keep_their_order():
    order = GroupOrder(window=4)
    for i in range(4):
        order.offer(i, None)
    assert [order.release() for _ in range(4)] == [0, 1, 2, 3]
    assert order.release() is None


def test_a_completed_trial_leaves_its_group_and_unknown_ids_are_ignored():
    order = GroupOrder(window=4)
    order.offer("a1", "A")
    assert order.release() == "a1" and order.live() == {"A": 1} and order.running() == 1
    order.complete("somebody else")
    order.complete("a1")
    assert order.live() == {} and order.running() == 0
    with pytest.raises(ValueError, match="window=0"):
        GroupOrder(window=0)


def test_a_full_window_refuses_an_offer():
    order = GroupOrder(window=1)
    order.offer(1, "A")
    assert not order.room()
    with pytest.raises(RuntimeError, match="window of 1 is full"):
        order.offer(2, "A")


steps = st.lists(st.tuples(st.sampled_from(["offer", "release", "complete"]), st.integers(0, 3)), max_size=120)


@settings(max_examples=300, deadline=None)
@given(steps=steps, window=st.integers(1, 6), patience=st.integers(0, 6))
def test_every_suggestion_is_released_once_and_within_the_bound(steps, window, patience):
    order = GroupOrder(window=window, patience=patience)
    offered: dict[int, int] = {}  # suggestion -> releases done when it entered
    released: list[int] = []
    live: list[int] = []
    n = 0
    for action, g in steps:
        if action == "offer" and order.room():
            order.offer(n, g if g < 3 else None)
            offered[n] = len(released)
            n += 1
        elif action == "release":
            item = order.release()
            if item is not None:
                released.append(item)
                live.append(item)
        elif action == "complete" and live:
            order.complete(live.pop(g % len(live)))
        # Safety after each step: nothing invented or released twice; the rest still waits; the
        # live groups are those of the released suggestions not complete.
        assert len(set(released)) == len(released) and set(released) <= set(offered)
        assert {item for item, _, _ in order.waiting()} == set(offered) - set(released)
        assert order.running() == len(live)
        # Liveness, as it goes: a waiting suggestion has not seen more than the bound go before it.
        for item, _, _ in order.waiting():
            assert len(released) - offered[item] <= order.bound
    # Liveness with no one else acting: releases alone serve every waiting suggestion, each within the bound.
    while len(order):
        released.append(order.release())
    assert sorted(released) == list(range(n))
    for item, entered in offered.items():
        assert released.index(item) - entered <= order.bound, (item, entered, released)


# -- the group of a suggested config, as tune.run hides it behind placeholders ----------------------

def _hidden(config):
    """``config`` as a search algorithm sees it inside tune.run (placeholders), and the resolvers."""
    from ray.tune.impl.placeholder import create_resolvers_map, inject_placeholders

    resolvers = create_resolvers_map()
    return inject_placeholders(config, resolvers), resolvers


def test_a_suggestions_group_is_read_through_tunes_placeholders(tmp_path):
    from ray import tune

    from coordinated_prep import DataSpec
    from coordinated_prep.sweep.data_space import DataSearch
    from coordinated_prep.tune.groups import group_of

    spec = DataSpec(dataset=str(tmp_path), pipeline={"size": 8}, seed=1)
    config, resolvers = _hidden({"data": spec, "lr": 0.1})
    assert config["data"] != spec, "tune.run hides a DataSpec"
    assert group_of(config, resolvers) == (spec.group_key,)
    assert group_of(config, None) is None  # unresolved: released in Tune's order
    assert group_of({"nested": {"train": spec, "other": [spec]}}, None) == (spec.group_key,)
    unshared = DataSpec(dataset=str(tmp_path), pipeline={"size": 8}, seed=1, coordinated=False)
    assert group_of({"data": unshared}, None) is None

    # A YAML sweep's data search is resolved from the trial's data keys.
    search = DataSearch({"dataset": str(tmp_path), "pipeline": {"size": 8}}, ("data.seed",))
    config, resolvers = _hidden({"data.seed": 7, "data": search.to_tune()})
    [key] = group_of(config, resolvers)
    assert key == search.spec({"data.seed": 7}).group_key != spec.group_key

    # A user's own sample_from function is never called (it may draw from a global random state).
    calls = []
    config, resolvers = _hidden({"data": spec, "x": tune.sample_from(lambda _: calls.append(1) or 3)})
    assert group_of(config, resolvers) == (spec.group_key,) and calls == []


def test_suggestions_held_back_are_saved_with_tunes_checkpoint_and_restored(tmp_path):
    """Tune saves the search algorithm at each experiment checkpoint and restores it on a resume:
    the suggestions pulled ahead (no longer in the inner generator's state) come back with it."""
    from ray import tune

    from coordinated_prep import CoordinatedSearcher

    tune.register_trainable("coordprep_order_test", tune.with_resources(lambda config: None, {"cpu": 0.5}))
    experiment = {"sweep": {"run": "coordprep_order_test", "config": {"i": tune.grid_search(list(range(40)))}}}
    first = CoordinatedSearcher(max_concurrent=2)
    first.add_configurations(experiment)
    first._pull()
    released = [first._order.release() for _ in range(3)]
    first.save_to_dir(str(tmp_path), session_str="s")
    held = len(first._order)
    assert held == 29  # a window of 32, 3 released

    again = CoordinatedSearcher(max_concurrent=2)
    again._inner.restore_from_dir(str(tmp_path))
    again._restore_order(str(tmp_path))
    assert again._order.running() == 3 and len(again._order) == held
    rest = []
    while not again.is_finished():
        again._pull()
        trial = again._order.release()
        rest.append(trial.config["i"])
    assert sorted([t.config["i"] for t in released] + rest) == list(range(40)), "a config lost or run twice"


@pytest.mark.parametrize("unfinished", ["skip", "restart"])
def test_a_restore_that_ends_or_restarts_the_running_trials_frees_their_places(tmp_path, unfinished):
    """Tune's default resume runs the unfinished trials again under their ids, and each completes:
    they keep their places. Where it ends them (SKIP) or restarts them under new ids (RESTART),
    none completes under its id: they must not hold max_concurrent's places for ever (the sweep
    would wait with nothing running). A restarted one keeps its place, unnamed, until its new id
    reports (more trials than max_concurrent ran meanwhile); a trial Tune runs that this searcher
    did not release (an errored one resumed) holds a place from its first result to its end."""
    from ray import tune
    from ray.tune import ResumeConfig

    from coordinated_prep import CoordinatedSearcher

    tune.register_trainable("coordprep_order_test", tune.with_resources(lambda config: None, {"cpu": 0.5}))
    experiment = {"sweep": {"run": "coordprep_order_test", "config": {"i": tune.grid_search(list(range(6)))}}}
    first = CoordinatedSearcher(max_concurrent=2)
    first.add_configurations(experiment)
    assert first._release() and first._release() and first._release() is None, "two running: the limit"
    first.save_to_dir(str(tmp_path), session_str="s")

    def restored(resume):
        again = CoordinatedSearcher(max_concurrent=2)
        again._inner.restore_from_dir(str(tmp_path))
        again._restore_order(str(tmp_path), resume)
        return again

    kept = restored(ResumeConfig())  # Tune's default: RESUME
    assert kept._order.running() == 2 and kept._release() is None
    freed = restored(ResumeConfig(unfinished=ResumeConfig.ResumeType(unfinished)))
    if unfinished == "restart":
        assert freed._order.running() == 2 and freed._release() is None, "the restarted trials hold theirs"
        freed._order.adopt("restarted-0")  # its first result, under its new id
        freed._order.complete("restarted-1")  # over before it reported
        assert freed._order.running() == 1
        freed._order.complete("restarted-0")
    assert freed._order.running() == 0
    assert freed._release() and freed._release() and freed._release() is None, "two places free again"
    freed._order.complete("no such trial")
    assert freed._order.running() == 2

    order = GroupOrder(key=lambda t: t)
    order.offer("t0", "A")
    order.release()
    order.adopt("t0")  # released here: counted once
    order.adopt("restarted")
    assert order.running() == 2 and order.live() == {"A": 1}
    order.complete("restarted")
    assert order.running() == 1


def test_a_model_based_searchers_restore_that_ends_the_running_trials_frees_its_limiters_places(tmp_path):
    """The inner ConcurrencyLimiter (max_concurrent + window - 1) learns that the skipped trials are
    over, as the searcher does: it kept their ids for ever, so 1 trial ran at a time of 4."""
    from ray import tune
    from ray.tune import ResumeConfig
    from ray.tune.search import Searcher

    from coordinated_prep import CoordinatedSearcher

    class Counting(Searcher):
        def __init__(self):
            super().__init__(metric="accuracy", mode="max")
            self.n = 0

        def suggest(self, trial_id):
            if self.n >= 20:
                return Searcher.FINISHED
            self.n += 1
            return {"i": self.n - 1}

        def on_trial_complete(self, trial_id, result=None, error=False):
            pass

        def save(self, path):
            with open(path, "w") as f:
                f.write(str(self.n))

        def restore(self, path):
            with open(path) as f:
                self.n = int(f.read())

    tune.register_trainable("coordprep_limiter_test", tune.with_resources(lambda config: None, {"cpu": 0.5}))

    def searcher():
        made = CoordinatedSearcher(Counting(), max_concurrent=4, window=2)
        made.add_configurations({"sweep": {"run": "coordprep_limiter_test", "config": {}, "num_samples": 20}})
        return made

    first = searcher()
    while first._release() is not None:
        pass
    assert first._order.running() == 4
    first.save_to_dir(str(tmp_path), session_str="s")
    again = searcher()
    again._inner.restore_from_dir(str(tmp_path))
    again._restore_order(str(tmp_path), ResumeConfig(unfinished=ResumeConfig.ResumeType.SKIP))
    running, most = [], 0
    while not again.is_finished():
        trial = again._release() if len(running) < 4 else None
        if trial is None:
            again.on_trial_complete(running.pop(0).trial_id, result={"accuracy": 0.5})
            continue
        running.append(trial)
        most = max(most, len(running))
    assert most == 4


# -- a model-based searcher's bounded look-ahead ----------------------------------------------------

def _sequential(specs):
    """A stand-in for a model-based Tune Searcher: suggests configs of data groups in a fixed order,
    and counts the suggestions it has out (suggested, not yet complete)."""
    from ray.tune.search import Searcher

    class Sequential(Searcher):
        def __init__(self):
            super().__init__(metric="accuracy", mode="max")
            self.specs, self.made, self.out, self.most_out = list(specs), [], set(), 0

        def suggest(self, trial_id):
            if len(self.made) == len(self.specs):
                return Searcher.FINISHED
            self.made.append(trial_id)
            self.out.add(trial_id)
            self.most_out = max(self.most_out, len(self.out))
            return {"data": self.specs[len(self.made) - 1], "i": len(self.made) - 1}

        def on_trial_complete(self, trial_id, result=None, error=False):
            self.out.discard(trial_id)

    return Sequential()


def _drive(searcher, limit: int) -> list[list[int]]:
    """Run ``searcher``'s trials as Tune would at ``limit`` at once, completing the oldest running
    trial whenever no other can start; returns the indices running after each release."""
    from ray import tune

    tune.register_trainable("coordprep_ahead_test", tune.with_resources(lambda config: None, {"cpu": 0.5}))
    searcher.add_configurations({"sweep": {"run": "coordprep_ahead_test", "config": {}, "num_samples": 8}})
    running, seen = [], []
    while not searcher.is_finished():
        trial = searcher._release() if len(running) < limit else None
        if trial is None:
            done = running.pop(0)
            searcher.on_trial_complete(done.trial_id, result={"accuracy": 0.5})
            continue
        running.append(trial)
        seen.append(sorted(t.config["i"] for t in running))
    return seen


def test_a_sequential_searchers_suggestions_run_group_by_group_within_a_bounded_look_ahead(tmp_path):
    from coordinated_prep import CoordinatedSearcher, DataSpec
    from coordinated_prep.tune.wrapping import SEARCHER_WINDOW

    a, b = (DataSpec(dataset=str(tmp_path), pipeline={"size": 8}, seed=s) for s in (1, 2))
    specs = [a, b] * 4  # the searcher suggests A, B, A, B, ...
    group = {i: ("A" if i % 2 == 0 else "B") for i in range(8)}

    inner = _sequential(specs)
    pairs = _drive(CoordinatedSearcher(inner, max_concurrent=2), limit=2)
    full = [p for p in pairs if len(p) == 2]
    mixed = [p for p in full if group[p[0]] != group[p[1]]]
    assert len(full) == 7 and len(mixed) == 1, pairs  # one group's pairs, then the other's: one hand-over
    assert sorted(inner.made) == sorted(set(inner.made)) and len(inner.made) == 8, "each config suggested once"
    assert sorted({i for p in pairs for i in p}) == list(range(8)), "and each released"
    # Never asked more than the window ahead of the trials that run (the bound on its lost information),
    # and no suggestion waits past the order's bound, which the window sets too.
    assert inner.most_out <= 2 + SEARCHER_WINDOW - 1
    assert CoordinatedSearcher(_sequential([]))._order.bound == 2 * SEARCHER_WINDOW - 1

    # Its own order, as before: the two running trials are of different groups.
    inner = _sequential(specs)
    pairs = _drive(CoordinatedSearcher(inner, max_concurrent=2, order="tune"), limit=2)
    assert all(group[i] != group[j] for i, j in (p for p in pairs if len(p) == 2)), pairs
    assert inner.most_out <= 2


def test_a_searchers_look_ahead_and_limit_are_checked_and_a_limiter_passed_in_is_applied_around_it(tmp_path):
    from ray.tune.search import ConcurrencyLimiter
    from ray.tune.search.basic_variant import BasicVariantGenerator
    from ray.tune.search.search_generator import SearchGenerator

    from coordinated_prep import ConfigError, CoordinatedSearcher

    searcher = CoordinatedSearcher(ConcurrencyLimiter(_sequential([]), 3), window=2)
    assert searcher._max_concurrent == 3 and searcher.searcher.max_concurrent == 3 + 2 - 1
    with pytest.raises(ConfigError, match="max_concurrent=2 and the ConcurrencyLimiter's max_concurrent=3"):
        CoordinatedSearcher(ConcurrencyLimiter(_sequential([]), 3), max_concurrent=2)
    with pytest.raises(ConfigError, match="window=0 must be an integer >= 1"):
        CoordinatedSearcher(window=0)
    with pytest.raises(ConfigError, match="keeps its own order"):
        CoordinatedSearcher(SearchGenerator(_sequential([])), window=4)
    assert CoordinatedSearcher(BasicVariantGenerator(max_concurrent=2))._max_concurrent == 2
    with pytest.raises(ConfigError, match="max_concurrent=2 and the BasicVariantGenerator's max_concurrent=8"):
        CoordinatedSearcher(BasicVariantGenerator(max_concurrent=8), max_concurrent=2)


def test_a_searchers_suggestions_held_back_are_saved_with_tunes_checkpoint_and_restored(tmp_path):
    """Optuna's held-back suggestions are in its study as running trials and in this searcher's
    window: a resumed sweep releases each of them once, and Optuna takes their results."""
    from ray import tune
    from ray.tune.search.optuna import OptunaSearch

    from coordinated_prep import CoordinatedSearcher

    def searcher():
        s = CoordinatedSearcher(OptunaSearch(seed=3), max_concurrent=2)
        s.set_search_properties("accuracy", "max", {"lr": tune.loguniform(0.01, 0.1)})
        s.add_configurations({"sweep": {"run": "coordprep_ahead_test", "config": {"lr": tune.loguniform(0.01, 0.1)},
                                        "num_samples": 8}})
        return s

    tune.register_trainable("coordprep_ahead_test", tune.with_resources(lambda config: None, {"cpu": 0.5}))
    first = searcher()
    released = [first._release(), first._release()]
    assert first._release() is None, "two run at once"
    held = [t.config["lr"] for t, _, _ in first._order.waiting()]
    assert len(held) == 3, "a window of 4, one released after each fill"
    first.save_to_dir(str(tmp_path), session_str="s")

    again = searcher()  # as Tuner.restore does, less the registry (restore_from_dir starts it)
    again._inner.restore_from_dir(str(tmp_path))
    again._restore_order(str(tmp_path))
    assert [t.config["lr"] for t, _, _ in again._order.waiting()] == held
    running, rest = [t.trial_id for t in released], []
    while not again.is_finished():
        trial = again._release()
        if trial is None:
            again.on_trial_complete(running.pop(0), result={"accuracy": 0.5})
            continue
        running.append(trial.trial_id)
        rest.append(trial.config["lr"])
    assert rest[:3] == held and len(rest) == 6, "the held ones first (oldest), then the rest of 8"
    assert len({t.config["lr"] for t in released} | set(rest)) == 8, "no config lost or run twice"


def test_a_completed_trial_keeps_its_group_while_trials_released_or_held_back_will_read_it(tmp_path, monkeypatch):
    """The searcher tells the registry which of a completed trial's groups to keep a while: those of
    the trials still running or held back (coordinated_prep/stream/linger.py), and no other."""
    from coordinated_prep import CoordinatedSearcher, DataSpec
    from coordinated_prep.tune import searcher as searcher_module

    a, b = (DataSpec(dataset=str(tmp_path), pipeline={"size": 8}, seed=s) for s in (1, 2))
    kept: dict[int, list[str]] = {}

    class Registry:
        class trial_done:
            @staticmethod
            def remote(trial_id, keep):
                kept[index[trial_id]] = keep

    monkeypatch.setattr(searcher_module.ray, "get", lambda value, timeout=None: value)
    searcher = CoordinatedSearcher(_sequential([a, a, a, b]), max_concurrent=2)
    searcher._registry = Registry()
    from ray import tune

    tune.register_trainable("coordprep_keep_test", tune.with_resources(lambda config: None, {"cpu": 0.5}))
    searcher.add_configurations({"sweep": {"run": "coordprep_keep_test", "config": {}, "num_samples": 4}})
    index, running = {}, []
    while not searcher.is_finished():
        trial = searcher._release() if len(running) < 2 else None
        if trial is None:
            done = running.pop(0)
            searcher.on_trial_complete(done.trial_id, result={"accuracy": 0.5})
            continue
        index[trial.trial_id] = trial.config["i"]
        running.append(trial)
    for done in running:
        searcher.on_trial_complete(done.trial_id, result={"accuracy": 0.5})
    # A0 and A1 end while another A runs or waits; A2 ends beside B only; B ends last.
    assert kept == {0: [a.group_key], 1: [a.group_key], 2: [], 3: []}, kept
