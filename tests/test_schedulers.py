"""The fixed HyperBand: the sequence that leaves Ray's own with a trial paused forever, driven directly."""

from __future__ import annotations

from typing import Any

import pytest
from ray.tune.experiment import Trial
from ray.tune.schedulers import HyperBandScheduler as RayHyperBand
from ray.tune.schedulers import TrialScheduler

from coordinated_prep.tune.schedulers import HyperBandScheduler


class _Controller:
    """What HyperBand calls on Tune's controller: stopping a trial, and listing the trials."""

    def __init__(self) -> None:
        self.stopped: list[Trial] = []
        self.trials: list[Trial] = []

    def get_trials(self) -> list[Trial]:
        return self.trials

    def stop_trial(self, trial: Trial) -> None:
        self.stopped.append(trial)
        trial.set_status(Trial.TERMINATED)


def _running(cls: type, n: int) -> tuple[Any, _Controller, list[Trial]]:
    """HyperBand (max_t 4, factor 2) with ``n`` trials added and running."""
    scheduler = cls(time_attr="training_iteration", max_t=4, reduction_factor=2, metric="score", mode="max")
    controller = _Controller()
    trials = [Trial("__fake", stub=True, trial_id=f"t{i}") for i in range(n)]
    controller.trials = trials
    for t in trials:
        scheduler.on_trial_add(controller, t)
        t.set_status(Trial.RUNNING)
    return scheduler, controller, trials


def _first_bracket(cls: type) -> tuple[Any, _Controller, list[Trial]]:
    """HyperBand and its first bracket's three trials, running (no halving there)."""
    return _running(cls, 3)


def _end_of_first_bracket(cls: type) -> tuple[_Controller, Trial]:
    """The first trial to reach 4 is paused; the other two then end by completing (their last
    result arrives as they end)."""
    scheduler, controller, trials = _first_bracket(cls)
    first, *others = trials
    for t in trials:
        scheduler.on_trial_result(controller, t, {"training_iteration": 3, "score": 1.0})
    assert scheduler.on_trial_result(controller, first, {"training_iteration": 4, "score": 1.0}) == TrialScheduler.PAUSE
    first.set_status(Trial.PAUSED)
    for t in others:
        t.set_status(Trial.TERMINATED)
        scheduler.on_trial_complete(controller, t, {"training_iteration": 4, "score": 1.0})
    return controller, first


def test_rays_hyperband_leaves_the_paused_trial_paused():
    controller, paused = _end_of_first_bracket(RayHyperBand)
    assert controller.stopped == [] and paused.status == Trial.PAUSED, "Ray fixed it: drop our subclass"


def test_the_fixed_hyperband_stops_it():
    controller, paused = _end_of_first_bracket(HyperBandScheduler)
    assert controller.stopped == [paused] and paused.status == Trial.TERMINATED


@pytest.mark.parametrize("cls", [RayHyperBand, HyperBandScheduler])
def test_a_last_result_through_on_trial_result_stops_it_in_both(cls):
    scheduler, controller, trials = _first_bracket(cls)
    scheduler.on_trial_result(controller, trials[0], {"training_iteration": 4, "score": 1.0})
    trials[0].set_status(Trial.PAUSED)
    scheduler.on_trial_result(controller, trials[1], {"training_iteration": 4, "score": 1.0})
    trials[1].set_status(Trial.PAUSED)
    assert scheduler.on_trial_result(controller, trials[2], {"training_iteration": 4, "score": 1.0}) == TrialScheduler.STOP
    assert set(controller.stopped) == set(trials[:2])


def _end_of_a_halved_bracket(cls: type) -> tuple[_Controller, Trial]:
    """A bracket that halved once (three trials at 2, the best two go on to 4): the first of the two
    to reach 4 is paused, the other then ends by completing (its last result arrives as it ends)."""
    scheduler, controller, trials = _running(cls, 6)
    halving = [t for t in trials if scheduler._trial_info[t][0]._halves == 1]  # noqa: SLF001 - the bracket
    assert len(halving) == 3, "max_t 4 and factor 2 put three trials in a bracket that halves at 2"
    a, b, c = halving
    for t, score in ((a, 3.0), (b, 2.0)):
        assert scheduler.on_trial_result(controller, t, {"training_iteration": 2, "score": score}) == TrialScheduler.PAUSE
        t.set_status(Trial.PAUSED)
    assert scheduler.on_trial_result(controller, c, {"training_iteration": 2, "score": 1.0}) == TrialScheduler.STOP
    c.set_status(Trial.TERMINATED)
    for t in (a, b):  # the good two: Tune starts them again
        t.set_status(Trial.RUNNING)
    assert scheduler.on_trial_result(controller, a, {"training_iteration": 4, "score": 3.0}) == TrialScheduler.PAUSE
    a.set_status(Trial.PAUSED)
    b.set_status(Trial.TERMINATED)
    scheduler.on_trial_complete(controller, b, {"training_iteration": 4, "score": 2.0})
    return controller, a


def test_rays_hyperband_leaves_a_trial_paused_after_a_halving_too():
    controller, paused = _end_of_a_halved_bracket(RayHyperBand)
    assert paused not in controller.stopped and paused.status == Trial.PAUSED, "Ray fixed it: drop our subclass"


def test_the_fixed_hyperband_stops_it_after_a_halving():
    controller, paused = _end_of_a_halved_bracket(HyperBandScheduler)
    assert paused in controller.stopped and paused.status == Trial.TERMINATED


def _ends_while_the_first_is_still_saving(cls: type) -> tuple[Any, _Controller, Trial]:
    """As ``_end_of_first_bracket``, but the others complete while the first is still saving the
    checkpoint it pauses with (RUNNING, ``is_saving``): it turns PAUSED only after the bracket was
    looked at for the last time."""
    scheduler, controller, trials = _first_bracket(cls)
    first, *others = trials
    for t in trials:
        scheduler.on_trial_result(controller, t, {"training_iteration": 3, "score": 1.0})
    assert scheduler.on_trial_result(controller, first, {"training_iteration": 4, "score": 1.0}) == TrialScheduler.PAUSE
    first.temporary_state.saving_to = object()  # Tune saves before it pauses
    for t in others:
        t.set_status(Trial.TERMINATED)
        scheduler.on_trial_complete(controller, t, {"training_iteration": 4, "score": 1.0})
    first.temporary_state.saving_to = None
    first.set_status(Trial.PAUSED)
    return scheduler, controller, first


@pytest.mark.parametrize("cls", [RayHyperBand, HyperBandScheduler])
def test_a_trial_paused_after_its_bracket_ended_is_stopped_at_the_next_choice(cls):
    scheduler, controller, first = _ends_while_the_first_is_still_saving(cls)
    assert controller.stopped == [], "nothing could stop it yet: it was saving"
    assert scheduler.choose_trial_to_run(controller) is None  # Tune's loop asks, finds nothing to run
    if cls is RayHyperBand:
        assert controller.stopped == [] and first.status == Trial.PAUSED, "Ray fixed it: drop the safety net"
    else:
        assert controller.stopped == [first] and first.status == Trial.TERMINATED


def test_the_safety_net_waits_while_any_trial_runs():
    scheduler, controller, first = _ends_while_the_first_is_still_saving(HyperBandScheduler)
    other = Trial("__fake", stub=True, trial_id="elsewhere")
    other.set_status(Trial.RUNNING)  # a trial of another bracket still runs: it may yet move things
    controller.trials = controller.trials + [other]
    scheduler.choose_trial_to_run(controller)
    assert controller.stopped == [] and first.status == Trial.PAUSED
