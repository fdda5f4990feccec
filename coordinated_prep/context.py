"""Where a loader runs: a Tune trial, a Ray Train worker (rank ``r`` of ``k``), or neither.

A loader shares its group's stream only when it knows whose it is. Three places are told apart:

- **A Tune trial** (a function trainable): ``ray.tune.get_context()`` names the trial.
- **A Ray Train worker.** ``ray.train.get_context()`` gives its rank and world size. Its trial:
  Train V2 starts the workers outside the Tune session, so the trial id travels with the data
  spec itself: a :class:`~coordinated_prep.spec.DataSpec` pickled inside a Tune trial (as
  ``TorchTrainer(train_loop_config=config)`` does) carries that trial's id (:func:`stamp`), and
  the workers read it back; nothing is plumbed by hand. Train V1's workers run in a Tune session
  of their own, whose trial id the ranks share. A run of Ray Train alone is named by its run
  (``train:<experiment name>:<run id>``), so concurrent ``fit()`` calls are told apart while a
  worker group restarted by Ray Train keeps its name.
- **Neither** (a script, a notebook, the best config trained again): nothing to share with.
"""

from __future__ import annotations

import sys
import warnings
from dataclasses import dataclass


@dataclass(frozen=True)
class Whereabouts:
    """Who a loader reads for.

    Attributes:
        trial: The Tune trial id, ``train:<name>:<run>`` for a run of Ray Train alone, or None.
        rank: This worker's rank among the trial's data-parallel workers (0 when not data-parallel).
        world: The trial's data-parallel workers (1 when not data-parallel).
        train: Whether this is a Ray Train worker.
        why: When ``trial`` is None, why (for the warning that sharing is off).
    """

    trial: str | None
    rank: int = 0
    world: int = 1
    train: bool = False
    why: str = ""


def whereabouts(stamped: str | None = None) -> Whereabouts:
    """Where the calling process runs; ``stamped`` is the trial id its data spec carries, if any."""
    tune_trial = tune_trial_id()
    worker = _train_worker()
    if worker is None:
        if tune_trial:
            return Whereabouts(tune_trial)
        return Whereabouts(None, why="this process is neither a Tune trial nor a Ray Train worker")
    rank, world, run = worker
    trial = stamped or tune_trial or run
    if trial is None:
        return Whereabouts(None, rank, world, True, why="this Ray Train worker's run has no name")
    return Whereabouts(trial, rank, world, True)


def tune_trial_id() -> str | None:
    """The id of the Tune trial this process runs, or None."""
    if "ray.tune" not in sys.modules:  # nothing imported Tune: no trial here (and none imported for asking)
        return None
    try:
        from ray import tune

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "meant to only be called inside a Tuner"
            return tune.get_context().get_trial_id() or None
    except Exception:  # outside a trial the context raises or returns None, depending on the version
        return None


def stamp() -> str | None:
    """The trial id a DataSpec pickled here carries to the processes it reaches (Train workers)."""
    return tune_trial_id() if _train_worker() is None else None


def _train_worker() -> tuple[int, int, str | None] | None:
    """(rank, world size, run name) of a Ray Train worker; None elsewhere."""
    if "ray.train" not in sys.modules:
        return None
    try:
        import ray.train

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            context = ray.train.get_context()
            rank, world = int(context.get_world_rank()), int(context.get_world_size())
    except Exception:  # V2 raises outside a worker and inside a Tune session; V1 has no rank outside Train
        return None
    if world < 1:
        return None
    return rank, world, _run_name(context)


def worker_group() -> str | None:
    """An id of this Ray Train worker's group, the same on its ranks and new when Ray Train restarts
    the group (Train V2: its synchronization actor); None where Ray Train gives none."""
    try:
        from ray.train.v2._internal.execution.context import get_train_context  # no public id of a worker group

        return get_train_context().execution_context.synchronization_actor._actor_id.hex()
    except Exception:
        return None


def _run_name(context: object) -> str | None:
    """``train:<experiment name>:<run id>`` of a Train V2 run (one per ``fit()``, kept across restarts)."""
    try:
        name = context.get_experiment_name()  # type: ignore[attr-defined]
    except Exception:
        name = None
    run = ""
    try:
        from ray.train.v2._internal.execution.context import get_train_context  # no public run id yet

        run = get_train_context().train_run_context.run_id[:8]
    except Exception:
        pass
    if not name and not run:
        return None
    name = (name or "-").replace("@", "_").replace("#", "_")  # they separate a consumer's loader and rank
    return f"train:{name}:{run or '-'}"
