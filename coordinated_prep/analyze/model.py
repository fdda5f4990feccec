"""The what-if model of ``coordprep analyze``: pure functions of measured rates, testable alone.

A trial's input pipeline has three stages that run concurrently (fetch, prepare, compute), so an
epoch takes as long as its slowest stage:

- **compute**: ``S / compute_rate`` per trial, each trial on its own accelerator;
- **disk**: the bytes not in the cache, read at the disk's sequential bandwidth (its ceiling);
- **workers**: one prep worker per core reads every sample (``read_s`` from the page cache, plus
  ``cold_read_s`` blocked on the disk when it is not cached) and decodes and augments it
  (``prep_s``); a worker blocked on a read prepares nothing meanwhile, as in a DataLoader.

``N`` independent trials do the disk and CPU work ``N`` times (each trial reads the uncached part:
an LRU page cache smaller than the dataset is thrashed by concurrent readers, the behaviour the
VLDB 2021 paper measured). Coordinated trials do it once, in a pool of prep actors that pays
``pool_sample_s`` more per sample than a bare decode (Ray tasks, staging in the object store:
measured as the pool's CPU per sample prepared, less ``read_s + prep_s``). Every trial also spends CPU in its own
process per batch, on the same cores as preparation: a coordinated trial receiving pieces and
assembling batches (``trial_batch_s``, measured as a coordinated trial's process CPU per batch),
an independent one its DataLoader's main-process work (``dataloader_batch_s``). So with ``N``
trials the workers stage holds ``passes * S * (read + prep) + N * (S / batch) * per_batch``
CPU-seconds over the cores: coordinated throughput per trial falls as ``N`` grows.

More cache or more cores never predicts less throughput, and no prediction exceeds what the
trials' compute can ingest; ``tests/test_analyze_model.py`` checks both over random rates.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Rates:
    """What ``analyze`` measured, per sample unless named otherwise.

    Attributes:
        samples: Samples in one epoch (the training split).
        sample_bytes: Mean encoded size of a sample.
        compute_rate: Samples per second one trial's training step consumes with data in memory.
        read_s: Seconds to read one sample's bytes from the page cache.
        cold_read_s: Further seconds a reader waits for one sample that is not cached.
        prep_s: CPU seconds to decode and augment one sample (one core).
        disk_bandwidth: Bytes per second read from the disk with a cold cache.
        batch_size: Samples per batch a trial reads.
        trial_batch_s: CPU seconds a coordinated trial's own process spends per batch (fetching
            pieces, assembling and copying batches).
        dataloader_batch_s: CPU seconds an independent trial's DataLoader spends per batch in the
            trial's main process (receiving batches from its workers).
        pool_sample_s: CPU seconds the coordinated prep pool spends per sample beyond reading,
            decoding and augmenting it.
    """

    samples: int
    sample_bytes: float
    compute_rate: float
    read_s: float
    cold_read_s: float
    prep_s: float
    disk_bandwidth: float
    batch_size: int
    trial_batch_s: float = 0.0
    dataloader_batch_s: float = 0.0
    pool_sample_s: float = 0.0

    def __post_init__(self) -> None:
        for name in ("samples", "sample_bytes", "compute_rate", "disk_bandwidth", "batch_size"):
            if not getattr(self, name) > 0:
                raise ValueError(f"Rates.{name}={getattr(self, name)!r} must be positive")
        for name in ("read_s", "cold_read_s", "prep_s", "trial_batch_s", "dataloader_batch_s", "pool_sample_s"):
            if getattr(self, name) < 0:
                raise ValueError(f"Rates.{name}={getattr(self, name)!r} must not be negative")


@dataclass(frozen=True)
class Prediction:
    """One predicted configuration: seconds per epoch by stage, and the result."""

    trials: int
    cores: float
    cache_fraction: float
    coordinated: bool
    compute_s: float
    disk_s: float
    workers_s: float
    epoch_s: float
    throughput: float  # samples per second over all trials
    bottleneck: str  # "compute", "disk" or "workers"


def predict(rates: Rates, *, trials: int = 1, cores: float = 1.0, cache_fraction: float = 1.0,
            coordinated: bool = False) -> Prediction:
    """Epoch time and aggregate throughput of ``trials`` concurrent trials.

    Args:
        rates: The measured rates.
        trials: Concurrent trials on the node.
        cores: CPU cores preparing data.
        cache_fraction: Share of the dataset's bytes served from memory (0 to 1).
        coordinated: Whether the trials share one pipeline.
    """
    if trials < 1 or cores <= 0 or not 0.0 <= cache_fraction <= 1.0:
        raise ValueError(f"trials={trials}, cores={cores}, cache_fraction={cache_fraction} out of range")
    passes = 1 if coordinated else trials
    s = rates.samples
    compute_s = s / rates.compute_rate
    disk_s = passes * s * (1.0 - cache_fraction) * rates.sample_bytes / rates.disk_bandwidth
    work = passes * s * (rates.read_s + (1.0 - cache_fraction) * rates.cold_read_s + rates.prep_s)
    if coordinated:
        work += s * rates.pool_sample_s
    # Each trial's own per-batch work runs on the cores that prepare (why it adds to the workers stage).
    work += trials * s / rates.batch_size * (rates.trial_batch_s if coordinated else rates.dataloader_batch_s)
    workers_s = work / cores
    stages = {"compute": compute_s, "disk": disk_s, "workers": workers_s}
    bottleneck = max(stages, key=stages.__getitem__)
    epoch_s = stages[bottleneck]
    return Prediction(trials, cores, cache_fraction, coordinated, compute_s, disk_s, workers_s, epoch_s,
                      trials * s / epoch_s, bottleneck)


def stalls(rates: Rates, cores: float) -> dict[str, float]:
    """DS-Analyzer's differential stalls per epoch for one trial on ``cores`` cores.

    Returns seconds per epoch: ``synthetic`` (no fetch, no prep), ``warm`` (all cached), ``cold``
    (nothing cached), ``prep_stall`` (warm - synthetic) and ``fetch_stall`` (cold - warm).
    """
    synthetic = rates.samples / rates.compute_rate
    warm = predict(rates, cores=cores, cache_fraction=1.0).epoch_s
    cold = predict(rates, cores=cores, cache_fraction=0.0).epoch_s
    return {"synthetic_s": synthetic, "warm_s": warm, "cold_s": cold, "prep_stall_s": warm - synthetic,
            "fetch_stall_s": cold - warm}


def against_measured(rates: Rates, cores: float, measured: dict[int, float]) -> list[dict[str, float]]:
    """The model's coordinated throughput beside measured coordinated runs, one row per trial count.

    Args:
        rates: The measured rates (``trial_batch_s`` included).
        cores: CPU cores the runs had.
        measured: Aggregate samples per second measured, by concurrent trials; the smallest count
            is the base of both speed-ups.

    Returns:
        Rows of ``trials``, ``predicted_samples_s``, ``predicted_speedup``, ``measured_samples_s``,
        ``measured_speedup`` and ``error`` (predicted / measured - 1), in ascending trials.
    """
    if not measured or any(n < 1 or not r > 0 for n, r in measured.items()):
        raise ValueError(f"measured={measured!r} must map trial counts >= 1 to positive samples/s")
    base = min(measured)
    predicted = {n: predict(rates, trials=n, cores=cores, coordinated=True).throughput for n in measured}
    return [{"trials": n, "predicted_samples_s": predicted[n], "predicted_speedup": predicted[n] / predicted[base],
             "measured_samples_s": measured[n], "measured_speedup": measured[n] / measured[base],
             "error": predicted[n] / measured[n] - 1.0} for n in sorted(measured)]
