"""Tune schedulers, fixed where Ray's own hang a sweep."""

from __future__ import annotations

import logging
from typing import Any

from ray.tune.schedulers import HyperBandScheduler as _RayHyperBand

logger = logging.getLogger(__name__)


class HyperBandScheduler(_RayHyperBand):
    """Ray Tune's synchronous HyperBand, without its hangs when a trial ends by completing.

    Ray's scheduler (2.60) pauses a trial that reaches its bracket's milestone before the others,
    and moves the bracket on (halving it, or stopping it at its end) when the last trial reports the
    milestone through ``on_trial_result``. When that last trial instead ends by completing (its
    final result arrives as the trial ends, through ``on_trial_complete``), ``on_trial_remove``
    passes over a finished bracket, and over every bracket it halved once (its
    ``is_being_processed`` flag is set at the first halving and never cleared): the paused trials
    are never stopped or resumed, and Tune's loop spins forever. Seen here in 3 of 6 runs of a
    6-trial sweep with ``max_t=4, reduction_factor=2`` at a bracket's end, and in 1 of 8 after a
    halving; ``tests/test_schedulers.py`` drives both sequences against Ray's class and this one.

    This subclass moves the bracket on whenever a trial leaves it and every trial still in it is
    paused at the milestone, as Ray does when the last result comes through ``on_trial_result``.
    And when Tune asks for a trial to run while no trial runs or waits to, a bracket whose trials
    all wait paused at its milestone is moved on then: a safety net for any other order of events,
    such as the last trial ending while another was still saving the checkpoint it pauses with
    (not yet PAUSED when the bracket was looked at). Without it Tune's loop spins for ever; seen
    once in about six runs of the 6-trial pause test before the net existed. Takes the same
    arguments as ``ray.tune.schedulers.HyperBandScheduler``.
    """

    def on_trial_remove(self, tune_controller: Any, trial: Any) -> None:
        """Remove ``trial`` from its bracket; if every trial left in it waits paused at the
        milestone, halve the bracket or, at its end, stop them."""
        bracket, _ = self._trial_info[trial]
        bracket.cleanup_trial(trial)
        if _stuck(bracket):
            logger.debug("trial %s left; every other trial of its bracket waits at the milestone", trial)
            self._process_bracket(tune_controller, bracket)
        elif not bracket.finished() and not bracket.is_being_processed:  # Ray's own behaviour
            self._process_bracket(tune_controller, bracket)

    def choose_trial_to_run(self, tune_controller: Any) -> Any:
        """Ray's choice; if there is none while no trial runs or waits to, first move on every
        bracket whose trials all wait paused at its milestone (nothing else ever would)."""
        from ray.tune.experiment import Trial

        trial = super().choose_trial_to_run(tune_controller)
        if trial is not None or any(t.status in (Trial.RUNNING, Trial.PENDING) for t in tune_controller.get_trials()):
            return trial
        for band in self._hyperbands:
            for bracket in band:
                if bracket is not None and _stuck(bracket):
                    logger.warning("HyperBand: every trial of a bracket waited paused at its milestone with nothing "
                                   "running; moving the bracket on")
                    self._process_bracket(tune_controller, bracket)
        return super().choose_trial_to_run(tune_controller)


def _stuck(bracket: Any) -> bool:
    """Whether every trial left in ``bracket`` waits paused at its milestone, not chosen to resume."""
    from ray.tune.experiment import Trial

    waiting = bracket.current_trials()
    return bool(waiting) and bracket.cur_iter_done() and all(
        t.status == Trial.PAUSED and t not in bracket.trials_to_unpause for t in waiting)
