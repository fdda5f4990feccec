"""Which training samples a trial reads: its part of the data group's training split.

Trials whose specs differ only in their part (``DataSpec.subset``, ``fraction`` or ``fold``) are
one data group (:attr:`~coordinated_prep.spec.DataSpec.group_key` leaves the part out): the group
prepares its whole training split once per epoch, in one stream, and each trial keeps the rows of
its part from every piece (:mod:`coordinated_prep.trial.subset`). So the k folds of a
cross-validation, or the 10%, 30% and 100% of a data-budget fidelity, prepare each sample once per
epoch instead of once per trial.

- ``subset``: dataset indices, each in the training split, each once.
- ``fraction=f``: the first ``max(1, round(f x m))`` of a fixed permutation of the ``m`` training
  samples. The permutation depends on the dataset's size only (as the held-out split does), so a
  smaller fraction's samples are inside every larger one's, whatever the seed: the budgets of a
  fidelity are nested, and every config at a budget trains on the same samples.
- ``fold=(k, i)``: the training split cut into ``k`` folds by a fixed permutation (sizes differing
  by at most one); the trial trains on every fold but ``i`` and evaluates on fold ``i``
  (:func:`held_out`), as in k-fold cross-validation.

A trial's epoch then holds exactly its part once, in the stream's order, and its bytes equal what
it would prepare alone: an unshared trial walks the same plan and prepares only its part's samples.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from coordinated_prep.errors import ConfigError
from coordinated_prep.plan import holdout_split

_PART_STREAM = 0xFA27  # separates the part's permutation from the holdout's and the sample order's
#: The DataSpec fields that name a trial's part; none of them is part of the group key.
PART_FIELDS = ("subset", "fraction", "fold")


def check_part(subset: Any, fraction: Any, fold: Any) -> tuple[tuple[int, ...] | None, float | None,
                                                                tuple[int, int] | None]:
    """The part fields of a DataSpec, validated and normalised (subset and fold as tuples of ints).

    Raises:
        ConfigError: Two of them given, or a value out of its range; the message names the field.
    """
    given = [name for name, value in zip(PART_FIELDS, (subset, fraction, fold)) if value is not None]
    if len(given) > 1:
        raise ConfigError(f"data: {' and '.join(given)} both name the samples a trial reads; give one of "
                          "subset=, fraction= or fold=")
    if subset is not None:
        subset = _indices(subset)
    if fraction is not None and (not isinstance(fraction, (int, float)) or isinstance(fraction, bool)
                                 or not 0.0 < fraction <= 1.0):
        raise ConfigError(f"data.fraction={fraction!r} must be a fraction of the training split in (0, 1]")
    if fold is not None:
        fold = _fold(fold)
    return subset, (None if fraction is None else float(fraction)), fold


def _indices(subset: Any) -> tuple[int, ...]:
    if isinstance(subset, (str, bytes)) or not hasattr(subset, "__iter__"):
        raise ConfigError(f"data.subset={subset!r} must be a list of dataset indices")
    values = np.asarray(list(subset))
    if values.size == 0:
        raise ConfigError("data.subset=[] holds no sample; leave subset out to read the whole training split")
    if values.ndim != 1 or not np.issubdtype(values.dtype, np.integer) or values.dtype == np.bool_:
        raise ConfigError(f"data.subset must be a flat list of integer dataset indices, not {values.dtype} "
                          f"values of shape {values.shape}")
    if int(values.min()) < 0:
        raise ConfigError(f"data.subset holds index {int(values.min())}: indices count from 0")
    unique, counts = np.unique(values, return_counts=True)
    if (counts > 1).any():
        raise ConfigError(f"data.subset holds index {int(unique[counts > 1][0])} {int(counts.max())} times: an epoch "
                          "holds each sample once; list each index once (echo= repeats samples)")
    return tuple(int(v) for v in values)


def _fold(fold: Any) -> tuple[int, int]:
    try:
        k, i = fold
    except (TypeError, ValueError):
        raise ConfigError(f"data.fold={fold!r} must be a pair (folds, fold): (5, 0) trains on 4 of 5 folds and "
                          "evaluates on fold 0") from None
    for name, value, low in (("folds", k, 2), ("fold", i, 0)):
        if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value < low:
            raise ConfigError(f"data.fold={tuple(fold)!r}: its {name} {value!r} must be an integer >= {low}")
    if i >= k:
        raise ConfigError(f"data.fold={tuple(fold)!r}: fold {i} does not exist among {k} folds (0 to {k - 1})")
    return int(k), int(i)


def _folds(train: np.ndarray, k: int, num_samples: int) -> list[np.ndarray]:
    """The training split in ``k`` folds, each sorted: a fixed permutation per dataset size, cut evenly."""
    if k > train.size:
        raise ConfigError(f"data.fold: {k} folds of {train.size} training samples would leave a fold empty; "
                          "use fewer folds")
    order = np.random.default_rng((_PART_STREAM, num_samples)).permutation(train)
    return [np.sort(f) for f in np.array_split(order, k)]


def part_ids(spec: Any, num_samples: int) -> np.ndarray | None:
    """Sorted dataset indices of ``spec``'s part of the training split of a dataset of
    ``num_samples``; None when the trial reads the whole split.

    Raises:
        ConfigError: A subset index outside the dataset or held out for evaluation (named, with the fix).
    """
    if spec.subset is None and spec.fraction is None and spec.fold is None:
        return None
    train, held = holdout_split(num_samples, spec.holdout)
    if spec.subset is not None:
        ids = np.sort(np.asarray(spec.subset, dtype=np.int64))
        outside = ids[~np.isin(ids, train)]
        if outside.size:
            index = int(outside[0])
            where = (f"is past the dataset's {num_samples} samples" if index >= num_samples else
                     f"is held out for evaluation (data.holdout={spec.holdout})")
            raise ConfigError(f"data.subset: index {index} {where}; a subset lists training samples only "
                              f"({outside.size} of its {ids.size} indices are not), or set data.holdout=0")
        return ids
    if spec.fraction is not None:
        order = np.random.default_rng((_PART_STREAM, num_samples)).permutation(train)
        return np.sort(order[: max(1, int(round(spec.fraction * train.size)))])
    k, i = spec.fold
    return np.sort(np.concatenate([f for j, f in enumerate(_folds(train, k, num_samples)) if j != i]))


def held_out(spec: Any, num_samples: int) -> np.ndarray:
    """Sorted dataset indices ``spec``'s trial evaluates on: its validation fold with ``fold=(k, i)``,
    else the held-out split (:func:`~coordinated_prep.plan.holdout_split`)."""
    train, held = holdout_split(num_samples, spec.holdout)
    if spec.fold is None:
        return held
    k, i = spec.fold
    return _folds(train, k, num_samples)[i]


def part_mask(ids: np.ndarray, num_samples: int) -> np.ndarray:
    """Whether each of a dataset's ``num_samples`` samples is in the part ``ids``: a piece's rows are
    tested by indexing (one byte per sample, made once per part), not by searching the part."""
    mask = np.zeros(num_samples, dtype=bool)
    mask[ids] = True
    return mask


class Part:
    """A trial's part of the training split: its samples (sorted) and their mask over the dataset."""

    def __init__(self, ids: np.ndarray, num_samples: int) -> None:
        self.ids, self.mask = ids, part_mask(ids, num_samples)

    @property
    def size(self) -> int:
        """Samples in the part."""
        return int(self.ids.size)


class PartPlan:
    """A stream plan whose pieces hold only a part's samples, in the plan's order: what an unshared
    trial prepares (:class:`~coordinated_prep.trial.streams.PrivateStream`), so that it prepares its
    part alone and its pieces equal a shared piece's rows of that part."""

    def __init__(self, plan: Any, part: Part) -> None:
        self.plan, self.mask = plan, part.mask

    def locate(self, g: int) -> tuple[int, int]:
        """``(epoch, chunk within epoch)`` of piece ``g``, as the whole plan's."""
        return self.plan.locate(g)

    def chunk_samples(self, g: int) -> np.ndarray:
        """The samples of the whole plan's piece ``g`` that the part reads, in order."""
        planned = self.plan.chunk_samples(g)
        return planned[self.mask[planned]]


def prepared_plan(plan: Any, spec: Any, num_samples: int) -> Any:
    """What a trial of ``spec`` prepares alone: ``plan``, or its :class:`PartPlan` for a trial reading a part."""
    part = part_ids(spec, num_samples)
    return plan if part is None else PartPlan(plan, Part(part, num_samples))


def part_fields(spec: Any) -> dict[str, Any] | None:
    """``spec``'s part fields, for its coordinator to count what the trial reads; None: the whole split."""
    return {name: getattr(spec, name) for name in PART_FIELDS} if spec.part else None
