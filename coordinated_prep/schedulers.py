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
    Takes the same arguments as ``ray.tune.schedulers.HyperBandScheduler``.
    """

    def on_trial_remove(self, tune_controller: Any, trial: Any) -> None:
        """Remove ``trial`` from its bracket; if every trial left in it waits paused at the
        milestone, halve the bracket or, at its end, stop them."""
        from ray.tune.experiment import Trial

        bracket, _ = self._trial_info[trial]
        bracket.cleanup_trial(trial)
        waiting = bracket.current_trials()
        if waiting and bracket.cur_iter_done() and all(t.status == Trial.PAUSED for t in waiting):
            logger.debug("trial %s left; every other trial of its bracket waits at the milestone", trial)
            self._process_bracket(tune_controller, bracket)
        elif not bracket.finished() and not bracket.is_being_processed:  # Ray's own behaviour
            self._process_bracket(tune_controller, bracket)
