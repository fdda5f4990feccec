"""The evaluation loader: the held-out split in batches, a full pass per ``iter()``."""

from __future__ import annotations

import math
from typing import Any, Callable, Iterator, Mapping

from coordinated_prep.context import whereabouts
from coordinated_prep.errors import ConfigError
from coordinated_prep.pipeline.transforms import make_pipeline
from coordinated_prep.pipeline.part import held_out
from coordinated_prep.spec import DataSpec, resolve_spec
from coordinated_prep.trial.batching import Batch, batched
from coordinated_prep.trial.eval_stream import private_eval_pieces, shared_eval_pieces
from coordinated_prep.trial.calls import has_registry


def check_collate(collate_fn: Any, who: str) -> None:
    if collate_fn is not None and not callable(collate_fn):
        raise ConfigError(f"{who}: collate_fn={collate_fn!r} is not callable; pass a function of the list of a "
                          "batch's samples, as to a DataLoader, or None")


class Samples:
    """A loader's ``dataset``: the samples one pass reads, as ``len(loader.dataset)`` counts a
    ``DataLoader``'s (``test_loss /= len(test_loader.dataset)``). Not indexable: the loaders read
    prepared pieces, not samples by index (the dataset itself is the spec's)."""

    def __init__(self, count: int, what: str) -> None:  # a count, not its loader: a loader is freed by its
        self._count, self._what = count, what          # last reference (a paused trial leaves its group then)

    def __len__(self) -> int:
        return self._count

    def __repr__(self) -> str:
        return f"<{self._what}: {len(self)} samples>"


class EvalLoader:
    """The held-out split in batches, one full pass per ``iter()``, like a ``DataLoader`` over it
    (Lightning iterates validation data every epoch). ``len()`` is the number of batches of a pass;
    ``len(loader.dataset)`` the held-out samples."""

    def __init__(self, spec: DataSpec, batch_size: int,
                 collate_fn: Callable[[list[Any]], Any] | None = None) -> None:
        self.spec, self.batch_size, self.collate_fn = spec, batch_size, collate_fn
        self._held: int | None = None

    def __iter__(self) -> Iterator[Batch]:
        spec = self.spec
        where = whereabouts(spec._trial or None)
        shared = spec.coordinated and where.trial is not None and (not where.train or has_registry())
        batches = batched(shared_eval_pieces(spec, where.trial) if shared else private_eval_pieces(spec),
                          self.batch_size)
        if self.collate_fn is None:
            return batches
        return (batch.collated(self.collate_fn).data for batch in batches)  # what it returned, as a DataLoader

    def __len__(self) -> int:
        return math.ceil(len(self.dataset) / self.batch_size)

    @property
    def dataset(self) -> Samples:
        """The held-out split's samples (``len()`` only; counted once, from the dataset's size)."""
        if self._held is None:
            self._held = len(held_out(self.spec, len(make_pipeline(self.spec))))
        return Samples(self._held, "held-out split")

    def __bool__(self) -> bool:  # ``if loader:`` must not open the dataset to count
        return True


def eval_loader(config: Mapping[str, Any] | DataSpec, batch_size: int, *, key: str = "data",
                collate_fn: Callable[[list[Any]], Any] | None = None) -> EvalLoader:
    """Batches of the held-out split in index order, resized and centre-cropped (``stream_epochs`` -1);
    each ``iter()`` is a full pass.

    In a Tune trial of a :class:`~coordinated_prep.CoordinatedSearcher` sweep with
    ``coordinated=True``, the split is prepared once for the whole sweep per evaluation pipeline
    (dataset, holdout, size, eval_resize, backend) by the node's prep pool and read by every trial
    from the object store (:mod:`coordinated_prep.stream.eval_set`); otherwise this process prepares it.
    The bytes are the same either way. ``collate_fn`` is applied as :func:`train_loader` applies it.

    Raises:
        ConfigError: Bad batch size or no DataSpec in the config (at once).
        PrepError: A held-out sample cannot be prepared (names the trial and the file), while iterating.
    """
    if not isinstance(batch_size, int) or isinstance(batch_size, bool) or batch_size < 1:
        raise ConfigError(f"eval_loader: batch_size={batch_size!r} must be a positive integer")
    check_collate(collate_fn, "eval_loader")
    return EvalLoader(resolve_spec(config, key), batch_size, collate_fn)
