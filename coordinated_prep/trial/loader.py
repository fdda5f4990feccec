"""The trial-side loaders: turn a stream of prepared pieces into torch batches of the trial's size."""

from __future__ import annotations

import collections
import logging
import math
import os
import time
import warnings
import weakref
from typing import Any, Callable, Generator, Iterator, Mapping

from coordinated_prep import metrics
from coordinated_prep.context import whereabouts
from coordinated_prep.errors import ConfigError
from coordinated_prep.spec import DataSpec, resolve_spec  # noqa: F401  (re-exported)
from coordinated_prep.trial.batching import Batch, Batcher, BatchStats
from coordinated_prep.trial.echo import EchoCounts, EchoSpec, echoed, epoch_rng
from coordinated_prep.trial.eval_loader import EvalLoader, Samples, check_collate, eval_loader  # noqa: F401
from coordinated_prep.trial.pinning import _accelerator, pinned
from coordinated_prep.trial.calls import find_registry, has_registry
from coordinated_prep.pipeline.part import Part
from coordinated_prep.trial.subset import part_of, restricted
from coordinated_prep.trial.shard import Shard, ShardBatcher, check_data_parallel, rank_batches, rank_steps
from coordinated_prep.trial.streams import PieceStream, PrivateStream, SharedStream

logger = logging.getLogger(__name__)

_OUTSIDE_TUNE = "local"
#: Loaders created per trial id in this process (a retry runs in a new process and counts afresh).
_LOADERS: collections.Counter[str] = collections.Counter()
#: Why sharing was off for a coordinated loader here, each said once per process (a loader per epoch is common).
_WARNED: set[str] = set()


class TrainLoader:
    """Iterate once per epoch: ``for batch in loader`` yields the batches of the trial's next epoch.

    Each epoch holds every training sample exactly once as a fresh sample (``Batch.repeats == 0``);
    with echo or views it also holds repeats (:mod:`coordinated_prep.trial.echo`). The last batch may be
    smaller, unless ``drop_last`` leaves it out (then each epoch holds every sample at most once).

    Args:
        stream: Where the pieces come from (shared or private).
        batch_size: Samples per batch.
        epochs: Epochs the trial will read, or None for no limit.
        tags: Metric tags (``group``, ``trial``) for the data-wait metrics.
        echo: How this trial echoes its data (:class:`~coordinated_prep.trial.echo.EchoSpec`).
        views: Augmented views per sample in the stream (``DataSpec.views``).
        seed: Seed of the echo buffer's draws (the data seed).
        pin_memory: Pin each batch one ahead in a background thread (see :func:`train_loader`).
        shard: This rank's share of each epoch in a data-parallel trial
            (:mod:`coordinated_prep.trial.shard`); None: the whole epoch.
        collate_fn: Builds each batch's :attr:`~Batch.data` from its samples (see :func:`train_loader`).
        part: The trial's part of the training split (:mod:`coordinated_prep.trial.subset`); None:
            the whole split.
        drop_last: Without ``shard``, a ``DataLoader``'s: leave out a short last batch (before echo).
    """

    def __init__(self, stream: PieceStream, batch_size: int, epochs: int | None = None,
                 tags: Mapping[str, str] | None = None, echo: EchoSpec | None = None, views: int = 1,
                 seed: int = 0, pin_memory: bool = False, shard: Shard | None = None,
                 collate_fn: Callable[[list[Any]], Any] | None = None, part: Part | None = None,
                 drop_last: bool = False) -> None:
        self._stream = stream
        self.drop_last = drop_last and shard is None  # a rank's drop_last is its Shard's
        self._part = part
        # samples of an epoch: the trial's part of the split (its rows of every piece), or the whole split
        self._epoch_samples = stream.samples_per_epoch if part is None else int(part.size)
        self.shard = shard
        self.batch_size = batch_size
        self.epochs = epochs
        self.data_wait_s = 0.0  # seconds spent blocked in this loader, all epochs together
        self._tags = dict(tags or {"group": "-", "trial": "-"})
        self._trial = self._tags.get("trial", "-").split("@", 1)[0]
        metrics.declare_trial(self._tags.get("group", "-"), self._tags.get("trial", "-"))  # at 0 from the start
        self.epoch = 0
        # fresh samples per epoch (this rank's share, its pads included, in a data-parallel trial)
        self.samples_per_epoch = shard.samples(self._epoch_samples) if shard else self._epoch_samples
        self.dataset = Samples(self._epoch_samples, "training split")  # as len(DataLoader.dataset)
        self.echo = echo or EchoSpec()
        self.views = views
        self._seed = seed
        self._pin = pin_memory and _accelerator("train_loader")
        self.collate_fn = collate_fn
        # epochs read to their end; the seconds from each one's first request to its end, and blocked, summed
        self.epochs_read, self.epoch_wall_s, self.read_wait_s = 0, 0.0, 0.0
        self.sink: Any = None  # the sweep's registry, told what this loader measured after each epoch
        self.stats = BatchStats()  # batches cut, how many were copies, and the CPU they cost this trial
        self.echo_counts = EchoCounts()  # fresh and repeated samples, all epochs together
        self.epoch_counts = EchoCounts()  # the same, for the epoch being read (or the last one read)
        # The current epoch's iterator, weakly: a `for` loop that breaks drops it, and then it is gone.
        self._live: weakref.ref[Generator[Batch, None, None]] | None = None

    @property
    def start_piece(self) -> int:
        """The stream piece at which this trial's first epoch started (0 when unshared)."""
        return self._stream.start

    @property
    def private_samples(self) -> int:
        """Samples this trial prepared itself (all of them unshared; after a lease detachment otherwise)."""
        return self._stream.private_samples

    @property
    def private_reason(self) -> str | None:
        """Why a shared trial prepared samples itself (the lease detached it, a late rank); else None."""
        return getattr(self._stream, "private_reason", None)

    @property
    def trial(self) -> str:
        """The trial this loader reads for: the Tune trial id, ``train:<name>:<run>`` for a run of Ray
        Train alone, or ``local`` (:mod:`coordinated_prep.context`)."""
        return self._trial

    @property
    def rank(self) -> int:
        """This worker's rank in a data-parallel trial (0 otherwise)."""
        return self.shard.rank if self.shard else 0

    @property
    def world(self) -> int:
        """The data-parallel trial's ranks (1 otherwise)."""
        return self.shard.world if self.shard else 1

    @property
    def coordinator(self) -> str | None:
        """Actor name of the coordinator serving this trial (None when unshared)."""
        return self._stream.coordinator

    @property
    def fresh_batches_per_epoch(self) -> int:
        """Batches an epoch would hold without echo or views: the unit of a learning-rate schedule."""
        n = self.samples_per_epoch
        return n // self.batch_size if self.drop_last else math.ceil(n / self.batch_size)

    def __bool__(self) -> bool:  # ``if loader:`` must not call __len__ (which raises for echo="auto")
        return True

    def __len__(self) -> int:
        """Batches per epoch, echoes included.

        Raises:
            TypeError: With ``echo="auto"`` the number varies with the stalls; use
                ``fresh_batches_per_epoch`` to size a schedule.
        """
        if self.shard is not None:  # the rank's rows of the epoch's rows (samples x views), then echo
            n = rank_steps(self._epoch_samples, self.views, self.batch_size, self.shard, self.echo)
        else:
            rows = self.views * self.samples_per_epoch
            n = self.echo.batches_per_epoch(rows - rows % self.batch_size if self.drop_last else rows, self.batch_size)
        if n is None:
            raise TypeError("len() of a train_loader with echo='auto' is not fixed (it echoes only while fresh data "
                            "is not ready); size schedules with loader.fresh_batches_per_epoch")
        return n

    def __iter__(self) -> Iterator[Batch]:
        """The batches of the trial's next epoch, as each ``iter()`` of a ``DataLoader`` is a new epoch.

        A new ``iter()`` while the previous epoch's iterator is still live (Lightning holds one while
        it asks for the next; a loop that broke out early) ends that iterator: its next ``next()``
        raises ``StopIteration``. The samples it had not yielded are passed over, as a ``for`` loop
        that breaks passes them over: the new epoch is again exactly one pass over the training split.
        An iterator made and never read (Lightning makes one to check that the loader is iterable)
        takes no epoch: the epoch is claimed at its first ``next()``.

        Raises:
            ConfigError: Past the declared epochs.
        """
        live = self._live() if self._live is not None else None
        if live is not None and live.gi_frame is not None:  # started or not, but neither finished nor closed
            live.close()
        if self.epochs is not None and self.epoch >= self.epochs:
            raise ConfigError(f"train_loader: epoch {self.epoch + 1} requested, but the loader was created with "
                              f"epochs={self.epochs}; raise epochs or leave it unset")
        batches = self._timed(pinned(self._batches()) if self._pin else self._batches())
        if self.collate_fn is not None:  # on the loop's thread (a collate that draws, as mixup, draws between steps)
            batches = (batch.collated(self.collate_fn).data for batch in batches)  # the loop gets what it returned
        self._live = weakref.ref(batches)
        return batches

    def _timed(self, batches: Iterator[Batch]) -> Generator[Batch, None, None]:
        began = last = time.perf_counter()
        wait = 0.0
        try:
            expected: int | None = len(self)
        except TypeError:  # echo="auto": the count varies
            expected = None
        yielded, read = 0, False
        try:
            while True:
                t0 = time.perf_counter()
                batch = next(batches, None)
                last = time.perf_counter()
                waited = last - t0
                self.data_wait_s += waited
                wait += waited
                metrics.inc("data_wait_seconds", waited, **self._tags)
                if batch is None:
                    read = True
                    self._epoch_read(last - began, wait)
                    return
                metrics.inc("batches", 1, **self._tags)
                fresh = self.epoch_counts.add(batch)
                self.echo_counts.add_counts(fresh, len(batch))
                metrics.inc("fresh_samples", fresh, **self._tags)
                metrics.inc("echoed_samples", len(batch) - fresh, **self._tags)
                yielded += 1
                yield batch
        finally:  # a loop that stops after len(loader) batches (Lightning) has read the epoch too
            if not read and yielded and yielded == expected:
                self._epoch_read(last - began, wait)

    def _epoch_read(self, wall_s: float, wait_s: float) -> None:
        """An epoch was read to its end, ``wall_s`` after its first request, ``wait_s`` of it waiting:
        counted, and told to the sweep."""
        self.epochs_read += 1
        self.epoch_wall_s += wall_s
        self.read_wait_s += wait_s
        self._tell_sink()
        if self.epochs is not None and self.epoch >= self.epochs and isinstance(self._stream, PrivateStream):
            self._stream.close()  # the last declared epoch: its worker processes prepare nothing more

    @property
    def stall_fraction(self) -> float | None:
        """Share of the epochs read to their end spent waiting for batches (None before the first ends)."""
        return self.read_wait_s / self.epoch_wall_s if self.epoch_wall_s > 0 else None

    def _tell_sink(self) -> None:
        """Send the sweep what this loader measured, unawaited: the summary fills the columns a
        trainable of the user's does not report from it (``coordprep sweep``)."""
        if self.sink is None:
            return
        try:  # also from a generator's finally, at any time (collected, interpreter exit): never raises
            self.sink.loader_stats.remote(self._tags["trial"], id(self), {
                "epochs": self.epochs_read, "data_wait_s": self.read_wait_s, "stall_fraction": self.stall_fraction,
                "private_samples": self.private_samples, "private_reason": self.private_reason})
        except Exception as e:  # noqa: BLE001 - Ray shut down, or the registry is gone: only a summary column lost
            logger.debug("trial %s: loader figures not sent: %r", self._trial, e)

    def _batches(self) -> Iterator[Batch]:
        # The epoch is claimed when the iterator first runs: an iterator made and dropped unread
        # (Lightning's check that a loader is iterable) takes no epoch.
        epoch, self.epoch = self.epoch, self.epoch + 1
        first = self._stream.start + epoch * self._stream.chunks_per_epoch
        self._stream.begin_epoch(epoch)
        if self._stream.position < first:  # the previous epoch was cut short (break, max steps)
            self._stream.skip_to(first)  # its rest is passed over, so this epoch is again exactly one pass
        self.epoch_counts = EchoCounts()
        if self.shard is None:
            pieces = restricted((self._stream.next_piece() for _ in range(self._stream.chunks_per_epoch)), self._part)
            fresh = Batcher(pieces, self.batch_size, self.stats, self._stream.ready, self._stream.chunks_per_epoch,
                            self.drop_last)
        else:
            fresh = self._rank_batches(self.shard)  # type: ignore[assignment]
        # echo acts on the rank's batches, equal in number and size on every rank: equal steps (shard.rank_steps)
        yield from echoed(fresh, self.echo, epoch_rng(self._seed, self._stream.start, epoch))

    def _rank_batches(self, shard: Shard) -> ShardBatcher:
        """This rank's batches of the epoch (:func:`~coordinated_prep.trial.shard.rank_batches`)."""
        return rank_batches(self._stream, self.batch_size, self.views * self._epoch_samples, shard, self._part,
                            self.stats, f"rank {shard.rank} of {shard.world} (trial {self._trial})")

    def close(self) -> None:
        """Leave the data group now instead of when Tune reports the trial finished."""
        self._stream.close()

    def __enter__(self) -> "TrainLoader":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def train_loader(
    config: Mapping[str, Any] | DataSpec, batch_size: int, *, epochs: int | None = None, key: str = "data",
    prefetch: int | None = None, echo: Any = None, num_workers: int | None = None, pin_memory: bool = False,
    drop_last: bool = False, collate_fn: Callable[[list[Any]], Any] | None = None,
) -> TrainLoader:
    """The training loader of a Tune trial, or of one rank of a data-parallel trial.

    With ``coordinated=True`` the batches come from the trial's data group, prepared once for
    all of its trials (requires ``search_alg=CoordinatedSearcher(...)``); otherwise the trial
    prepares them itself, byte-identical for the same seed.

    Args:
        config: The trial's config (the DataSpec under ``config[key]``); a bare DataSpec only
            with ``coordinated=False``.
        batch_size: Samples per batch; trials of one group may differ.
        epochs: Epochs the trial will read, if known (a trial stopped early may leave sooner); None
            (Lightning, early stopping): it reads epoch after epoch, each ``iter()`` the next. Either
            way the group prepares nothing past the last epoch its trials read: without it, an
            epoch's pieces are asked for when the trial begins that epoch, so its first batch waits
            for them unless another trial of the group is ahead (:mod:`coordinated_prep.stream.staging`).
        key: Config key of the DataSpec.
        prefetch: Pieces requested ahead; defaults to two batches' worth, at least two pieces.
        echo: Data echoing for this trial (:mod:`coordinated_prep.trial.echo`): ``1``/``"off"`` (default),
            ``e`` or ``"example:e"``, ``"batch:e"``, ``"auto"`` or ``"auto:c"``, or an
            :class:`~coordinated_prep.trial.echo.EchoSpec`. Not part of the data group: trials echoing
            differently share one stream. The ready trainables read it from ``config["echo"]``.
        num_workers: Where this process prepares its own pieces (unshared, or outside Tune): worker
            processes, as a ``DataLoader``'s; 0: on the reading thread. None: 0 in a Tune trial (its
            CPUs are the trial's), else ``min(8, os.cpu_count())``. Shared trials prepare nothing.
            Forked, or started from a forkserver where Ray's gRPC threads run in this process
            (:mod:`coordinated_prep.trial.workers`).
        pin_memory: Copy each batch's tensors into page-locked memory in a background thread, one
            batch ahead, so that ``.to(device, non_blocking=True)`` overlaps the next step (as a
            ``DataLoader``'s ``pin_memory``); pieces this process prepares itself are still prepared on
            the loop's thread, between its own draws (:func:`pinned`). Without an accelerator it warns
            and does nothing.
        drop_last: As a ``DataLoader``'s: leave out an epoch's last batch if it is smaller than
            ``batch_size`` (``len()`` counts the full batches). In a data-parallel trial, as
            ``DistributedSampler``'s: leave out the end of an epoch that does not split evenly over the
            ranks instead of padding it with repeats (:mod:`coordinated_prep.trial.shard`).
        collate_fn: As a ``DataLoader``'s: called in this process with the list of a batch's samples,
            each in the structure and types the dataset and transform gave (a ``tv_tensors.BoundingBoxes``
            with its format and canvas size, an int label as an int; :meth:`Batch.samples`), and its
            result is what the loop gets, whatever its type, as from a ``DataLoader`` (a dict for
            ``model(**batch)``; detection's ``lambda b: tuple(zip(*b))``). None: a :class:`Batch`, which
            unpacks and indexes as ``default_collate``'s structure (stacked leaves as views of the shared
            pieces) and also says where each sample came from (``indices``, ``repeats``). It runs on
            the loop's thread, after pinning (so a collate that draws, as mixup does, draws between the
            loop's steps): the leaves it gets are pinned, and what it stacks itself is not.

    In a Ray Train worker (``TorchTrainer`` inside a Tune trial, or a run of Ray Train alone),
    rank ``r`` of ``k`` reads its disjoint share of each of the trial's epochs, the same number of
    batches on every rank; ``batch_size`` is per rank. The trial is found without plumbing
    (:mod:`coordinated_prep.context`). Outside a Tune trial or Train worker (a sweep's best config
    trained again, say) a coordinated spec is prepared in this process, as with
    ``coordinated=False``, and a warning says why. A trial may create several loaders (other
    datasets, a second view, the same spec twice): each is its own consumer of its group.

    Raises:
        ConfigError: Bad batch size, no DataSpec in the config, or a Tune trial sharing without the
            searcher.
    """
    if not isinstance(batch_size, int) or isinstance(batch_size, bool) or batch_size < 1:
        raise ConfigError(f"train_loader: batch_size={batch_size!r} must be a positive integer")
    if num_workers is not None and (not isinstance(num_workers, int) or isinstance(num_workers, bool)
                                    or num_workers < 0):
        raise ConfigError(f"train_loader: num_workers={num_workers!r} must be an integer >= 0 or None")
    if epochs is not None and (not isinstance(epochs, int) or isinstance(epochs, bool) or epochs < 1):
        raise ConfigError(f"train_loader: epochs={epochs!r} must be a positive integer or None")
    spec = resolve_spec(config, key)
    check_collate(collate_fn, "train_loader")
    if echo is None and isinstance(config, Mapping) and config.get("echo") not in (None, 1, "off"):
        warnings.warn(f"train_loader: the trial config has echo={config['echo']!r}, but echo= was not passed, so "
                      "this loader does not echo; pass train_loader(..., echo=config['echo'])", stacklevel=2)
    if not isinstance(drop_last, bool):
        raise ConfigError(f"train_loader: drop_last={drop_last!r} must be true or false")
    echo_spec = EchoSpec.parse(echo, "train_loader(echo=...)")
    where = whereabouts(spec._trial or None)
    shard = Shard(where.rank, where.world, drop_last) if where.world > 1 else None
    if shard is not None:
        check_data_parallel(spec, echo_spec, shard, where.trial or _OUTSIDE_TUNE)
    trial = where.trial or _OUTSIDE_TUNE
    options = {"echo": echo_spec, "views": spec.views, "seed": spec.seed, "pin_memory": pin_memory, "shard": shard,
               "collate_fn": collate_fn, "drop_last": drop_last}
    tags = {"group": spec.group_key, "trial": trial if shard is None else f"{trial}@{shard.rank}"}
    shared = spec.coordinated and where.trial is not None
    if shared and where.train and not has_registry():
        shared = False
        _warn_unshared(f"this Ray Train worker's trial ({trial}) finds no coordinated_prep registry in its Ray job: "
                       "run it in a Tune sweep with search_alg=CoordinatedSearcher(), or run Ray Train alone inside "
                       "`with coordinated_prep.PrepService(): trainer.fit()`")
    elif spec.coordinated and where.trial is None:
        _warn_unshared(where.why)
    if not shared:
        if num_workers is None:
            num_workers = 0 if where.trial is not None else min(8, os.cpu_count() or 1)
        stream = PrivateStream(spec, workers=num_workers, prefetch=prefetch or 2)
        return _checked(TrainLoader(stream, batch_size, epochs, tags, part=part_of(spec, stream), **options))
    _LOADERS[trial] += 1  # a trial's k-th loader is its own consumer: several loaders per trial work
    consumer = trial if _LOADERS[trial] == 1 else f"{trial}#{_LOADERS[trial]}"
    rank = None if shard is None else (shard.rank, shard.world)
    cut = batch_size * where.world  # a rank cuts global batches: prefetch covers those
    stream = SharedStream(spec, trial, consumer, cut, prefetch, epochs, rank)
    return _checked(TrainLoader(stream, batch_size, epochs, tags, part=part_of(spec, stream), **options))


def _checked(loader: TrainLoader) -> TrainLoader:
    """``loader``, unless its rank's share of an epoch is empty (drop_last with fewer samples than ranks);
    in a Tune trial or Train worker of a sweep, it tells the sweep's registry what it measures."""
    if loader.trial != _OUTSIDE_TUNE and has_registry():
        loader.sink = find_registry(loader.trial)
    if loader.samples_per_epoch == 0:
        loader.close()
        part = " (the spec's part of the split)" if loader._part is not None else ""
        raise ConfigError(f"train_loader: an epoch of {loader._epoch_samples} samples{part} over {loader.world} ranks "
                          "with drop_last=True leaves each rank nothing; use drop_last=False or fewer ranks"
                          + (", or a larger subset or fraction" if part else ""))
    return loader


def _warn_unshared(why: str) -> None:
    """Warn once per process and reason that a coordinated loader prepares its own data here."""
    if why not in _WARNED:
        _WARNED.add(why)
        warnings.warn(f"train_loader: coordinated=True, but sharing is off: {why}. This process prepares every "
                      "sample itself (the same bytes a shared trial starting at piece 0 reads)", stacklevel=3)
