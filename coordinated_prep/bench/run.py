"""``coordprep bench``: the four loaders side by side, N concurrent Tune trials at a time.

It also compares raw image files with Parquet record files (the dataset converted once into
``<storage_path>/<name>/parquet``): read-only rows, cold and warm (``bench/reads.py``), and the
``record_loaders`` on the record files at ``record_trials`` with the simulated step.

One Ray instance serves the whole benchmark. Each measurement is one Tune run of N trials with
one loader and one step; its aggregate rate is the samples all trials read after their first
batch divided by the window from the first trial's first batch to the last trial's last batch.
Start-up (DataLoader workers forking, DALI building its pipeline, prep actors importing their
libraries) is left out of the rate for every loader alike and reported as ``startup_s``. Ratios
compare loaders measured in the same invocation.
"""

from __future__ import annotations

import logging
import os
import statistics
import time
from typing import Any, Callable, Iterable

from coordinated_prep.bench.config import INDEPENDENT, BenchConfig
from coordinated_prep.bench.cpu import ROLES, ProcessSampler, machine_busy_s
from coordinated_prep.bench.reads import node_cache_rows, read_rows
from coordinated_prep.bench.trials import bench_trial, launch_trial
from coordinated_prep.errors import ConfigError
from coordinated_prep.plan import holdout_split
from coordinated_prep.pool.spec import PoolSpec
from coordinated_prep.tune.searcher import CoordinatedSearcher
from coordinated_prep.pipeline.sources import ImageFolderSource, ParquetSource, open_source
from coordinated_prep.pipeline.sources.tar_shards import TarShardSource
from coordinated_prep.spec import DataSpec

logger = logging.getLogger(__name__)


def data_spec(cfg: BenchConfig, loader: str, dataset: str | None = None) -> DataSpec:
    """The DataSpec of ``loader``: the same data and augmentation for all four (``dataset``: another copy);
    with ``cfg.transform``, that user pipeline in place of the built-in crop and flip."""
    coordinated = loader.startswith("coordinated")
    if cfg.transform is not None:
        return DataSpec(dataset=dataset or cfg.dataset, transform=cfg.transform, seed=0, coordinated=coordinated,
                        segments=4)
    backend = "dali" if loader.endswith("dali") else "torchvision"
    return DataSpec(dataset=dataset or cfg.dataset, pipeline={"size": cfg.size, "backend": backend}, seed=0,
                    coordinated=coordinated, segments=4)


def run_bench(cfg: BenchConfig, progress: Callable[[dict[str, Any]], None] | None = None) -> list[dict[str, Any]]:
    """Run the read-only rows, then every (step, N, loader) of ``cfg``; returns one row each (see :func:`measure`).

    Raises:
        ConfigError: ``cfg.dataset`` is not an ImageFolder (the benchmark needs the raw files).
    """
    import ray

    from coordinated_prep.pool import warm

    if ray.is_initialized():
        warm.release()  # every loader's start-up is measured from cold, and nothing else holds CPUs
    images, records, shards = prepare_records(cfg)  # generates the dataset too, before any trial needs it
    rows: list[dict[str, Any]] = []

    def emit(row: dict[str, Any]) -> None:
        rows.append(row)
        if progress:
            progress(row)

    train_ids, _ = holdout_split(len(images), DataSpec().holdout)
    bound = decode_bound(cfg, images, train_ids)  # what the cores can prepare at best, measured here
    emit(bound)
    for source, files, fmt in ((images, images.paths, "files"), (records, records.shards, "parquet"),
                               (shards, shards.shards, "tar")):
        for row in read_rows(source, files, fmt, train_ids, seed=0):
            emit(row)
    started = not ray.is_initialized()
    if started:
        ray.init(num_cpus=cfg.cores, object_store_memory=cfg.object_store_mb * 2**20, include_dashboard=False,
                 log_to_driver=False)
    try:
        for row in node_cache_rows(images.root, images.paths, train_ids, seed=0):
            emit(row)
        for step in cfg.steps:
            best: dict[int, float | None] = {}  # per N: the best independent loader's rate on the raw files
            for n in cfg.trials if step == "simulated" else cfg.cnn_trials:
                floor = measure_launch(cfg, n) if step == "simulated" else None
                measured = [measure(cfg, loader, n, step) for loader in cfg.step_loaders(step)]
                best[n] = max((r["samples_per_s"] for r in measured if r["loader"] in INDEPENDENT), default=None)
                best_waited = max((r["samples_per_s_with_startup"] for r in measured if r["loader"] in INDEPENDENT),
                                  default=None)
                if floor is not None:
                    emit(with_ceiling(cfg, floor, bound, measured, best_waited))
                for row in measured:
                    emit(dict(row, vs_best_independent=_ratio(row["samples_per_s"], best[n]),
                              vs_best_with_startup=_ratio(row["samples_per_s_with_startup"], best_waited),
                              vs_prep_bound=_ratio(row["unique_samples_per_s"], bound["samples_per_s"])))
            if step == "simulated":
                for n in cfg.record_trials:  # against the raw files' best independent loader at the same N
                    for loader in cfg.record_loaders:
                        row = measure(cfg, loader, n, step, dataset=records.root, fmt="parquet")
                        emit(dict(row, vs_best_independent=_ratio(row["samples_per_s"], best.get(n)),
                                  vs_prep_bound=_ratio(row["unique_samples_per_s"], bound["samples_per_s"])))
    finally:
        if started:
            ray.shutdown()
    return rows


def decode_bound(cfg: BenchConfig, source: ImageFolderSource, train_ids: Any, samples: int = 256) -> dict[str, Any]:
    """Decode and augment ``samples`` training samples on one thread (read from memory); the row
    ``step="decode"`` holds ``ms_per_sample`` and ``samples_per_s`` = cores / that cost, the most the
    machine's cores can prepare: the coordinated loaders' unique rates are compared with it."""
    import torch

    from coordinated_prep.pipeline.transforms import make_pipeline

    # the prep actors' own path: the built-in backend, or decoding and the user's transform seeded per sample
    pipeline = make_pipeline(data_spec(cfg, "coordinated-torchvision"), source)
    ids = [int(i) for i in train_ids[:samples]]
    blobs = [source.read(i) for i in ids]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for i, blob in zip(ids[:8], blobs):  # warm-up
            pipeline.train(blob, 0, 0, i, 1)
        cpu = time.process_time()
        for i, blob in zip(ids, blobs):
            pipeline.train(blob, 0, 0, i, 1)
        ms = 1000 * (time.process_time() - cpu) / len(ids)
    finally:
        torch.set_num_threads(threads)
    return {"step": "decode", "loader": "torchvision, one core", "format": "files", "cache": "memory",
            "trials": 0, "samples": len(ids), "ms_per_sample": ms, "samples_per_s": cfg.cores * 1000 / ms}


def measure_launch(cfg: BenchConfig, trials: int) -> dict[str, Any]:
    """Tune's launch of ``trials`` trials that import what the bench trial imports and read nothing.

    Row fields: ``launch_s``, from asking Tune to run to the last trial's function starting;
    ``run_s``, to ``tune.run`` returning (the trials' one report and their end added, a fraction
    of a second); and ``launch_cpu_s``, the CPU seconds the whole machine spent over ``run_s``
    (``/proc/stat``; None where it is missing). Tune starts the trials' functions together once
    their processes are up, so every loader's time with start-up includes this launch.
    """
    from ray import tune

    busy0, started = machine_busy_s(), time.time()
    analysis = tune.run(tune.with_resources(launch_trial, {"cpu": 0.01}),
                        config={"trial_index": tune.grid_search(list(range(trials)))}, max_concurrent_trials=trials,
                        verbose=0, raise_on_failed_trial=True, name=f"launch-{trials}",
                        storage_path=os.path.abspath(os.path.join(cfg.storage_path, cfg.name, "tune")))
    busy1, ended = machine_busy_s(), time.time()
    launch = max(t.last_result["t_started"] for t in analysis.trials) - started
    return {"step": "launch", "loader": "none (empty trials)", "format": "-", "trials": trials, "launch_s": launch,
            "run_s": ended - started, "launch_cpu_s": None if busy0 is None or busy1 is None else busy1 - busy0}


def with_ceiling(cfg: BenchConfig, floor: dict[str, Any], bound: dict[str, Any], measured: list[dict[str, Any]],
                 best_waited: float | None) -> dict[str, Any]:
    """``floor`` with the best time with start-up that any loader preparing each sample once can reach.

    ``ideal_with_startup_s`` = (launch CPU + the epochs' unique samples at the measured single-core
    decode-and-augment cost) / cores: the launch keeps every core busy (``launch_cpu_s`` close to
    ``launch_s`` x cores), so preparation cannot hide in it, and nothing a trial does per batch is
    counted. ``vs_best_with_startup`` is the ceiling this puts on a loader's ratio with start-up.
    """
    reads = [r["samples_read"] for r in measured if r.get("samples_read")]
    if floor["launch_cpu_s"] is None or not reads:
        return dict(floor, ideal_with_startup_s=None, vs_best_with_startup=None)
    unique = reads[0] / floor["trials"]
    ideal = (floor["launch_cpu_s"] + unique * bound["ms_per_sample"] / 1000) / cfg.cores
    return dict(floor, ideal_with_startup_s=ideal, samples_read=reads[0],
                vs_best_with_startup=_ratio(reads[0] / ideal, best_waited))


def _ratio(rate: float, best: float | None) -> float | None:
    return rate / best if best else None


def prepare_records(cfg: BenchConfig) -> tuple[ImageFolderSource, ParquetSource, TarShardSource]:
    """The dataset's raw files, its Parquet copy converted into ``<storage_path>/<name>/parquet``, and
    its WebDataset tar shards in ``<storage_path>/<name>/tar``.

    The copies are written anew on every run (replacing the last ones), so they always match the files.

    Raises:
        ConfigError: ``cfg.dataset`` is not an ImageFolder or builtin dataset.
    """
    from coordinated_prep.convert import convert_imagefolder, convert_to_tar

    images = open_source(cfg.dataset)
    if not isinstance(images, ImageFolderSource):
        raise ConfigError(f"bench.dataset={cfg.dataset!r} must be an ImageFolder directory or a builtin dataset: the "
                          "benchmark reads its raw files and converts them to Parquet itself")
    out = os.path.abspath(os.path.join(cfg.storage_path, cfg.name, "parquet"))
    result = convert_imagefolder(cfg.dataset, out, overwrite=True)
    logger.info("bench: %s converted to %d Parquet shard(s) in %s (%.1f s)", cfg.dataset, len(result.shards), out,
                result.seconds)
    tar = convert_to_tar(cfg.dataset, os.path.join(os.path.dirname(out), "tar"), overwrite=True).out
    return images, ParquetSource(out), TarShardSource(tar)


def measure(cfg: BenchConfig, loader: str, trials: int, step: str, dataset: str | None = None,
            fmt: str = "files", spec: DataSpec | None = None, max_batches: int | None = None) -> dict[str, Any]:
    """One Tune run of ``trials`` concurrent trials reading with ``loader``; returns its row.

    ``dataset`` replaces ``cfg.dataset`` (the Parquet copy, named ``fmt`` in the row); ``spec``
    replaces the whole DataSpec (``coordprep analyze`` runs an experiment's own data and pipeline);
    ``max_batches`` caps the batches each trial reads per epoch (default: ``cfg.cnn_batches`` with
    the CNN step, whole epochs with the simulated one).

    Row fields: ``samples_per_s`` (all trials together), ``prep_cpu_s`` (CPU seconds spent
    preparing: the prep actors', or the trials' DataLoader workers or DALI threads),
    ``prep_work_x`` (samples prepared per sample one trial read: 1.00 when each sample is prepared
    once for all trials, N when every trial prepares its own), ``peak_staging_bytes``, the
    trials' mean ``stall_fraction`` and, for the coordinated loaders, ``cpu_<role>_share``: the
    share of the machine's CPU that the prep actors, the trials' processes, the coordinators and
    everything else used while all trials read (:mod:`coordinated_prep.bench.cpu`).
    """
    from ray import tune

    spec = spec or data_spec(cfg, loader, dataset)
    workers = max(1, round(cfg.cores / trials))  # independent loaders split the cores fairly
    config = {"data": spec, "loader": loader, "step": step, "epochs": cfg.epochs, "batch_size": cfg.batch_size,
              "workers": workers, "step_ms": cfg.simulated_step_ms, "width": cfg.cnn_width,
              "max_batches": max_batches if max_batches is not None else cfg.cnn_batches if step == "cnn" else 0,
              "trial_index": tune.grid_search(list(range(trials)))}
    # Independent loaders run without the searcher: no prep pool sits beside them.
    searcher = CoordinatedSearcher(max_concurrent=trials, pool=PoolSpec(actors=cfg.pool_actors)) if spec.coordinated else None
    started = time.time()
    sampler = ProcessSampler() if searcher else None  # where a coordinated run's CPU goes, by role
    try:
        if searcher:
            searcher.start()  # the prep pool (timed apart; Tune would start it at its first trial)
        pool_start = time.time() - started
        if sampler:
            sampler.start()
        analysis = tune.run(tune.with_resources(bench_trial, {"cpu": 0.01}), config=config, search_alg=searcher,
                            max_concurrent_trials=None if searcher else trials,
                            verbose=0, raise_on_failed_trial=True, storage_path=os.path.abspath(
                                os.path.join(cfg.storage_path, cfg.name, "tune")),
                            name=f"{step}-{loader}-{trials}" + ("" if fmt == "files" else f"-{fmt}"))
        groups = searcher.group_reports() if searcher else {}
    finally:
        if sampler:
            sampler.stop()
        if searcher:
            searcher.close()
    results = [t.last_result for t in analysis.trials]
    # CPU shares while every trial reads (after the last first batch, before the first trial ends)
    shares = sampler.shares(max(r["t_first"] for r in results), min(r["t_end"] for r in results),
                            cfg.cores) if sampler else None
    samples = sum(r["samples"] for r in results)
    read = sum(r["samples_read"] for r in results)
    window = max(r["t_end"] for r in results) - min(r["t_first"] for r in results)
    # What a user waits for: from asking Tune to run (the prep pool's start, trials' processes,
    # loaders' start-up) to the last trial's last batch.
    waited = max(r["t_end"] for r in results) - started
    if groups:
        [group] = groups.values()
        prep_cpu = group["prep_cpu_s"]
        prepared = group["samples_prepared"]
        peak = group["peak_staged_bytes"]
    else:
        cpus = [r["private_prep_cpu_s"] for r in results]
        prep_cpu = None if None in cpus else sum(cpus)
        prepared = read  # each trial prepared what it read (and what its loader fetched ahead)
        peak = 0
    return {
        "step": step, "loader": loader, "format": fmt, "trials": trials, "samples": samples, "window_s": window,
        "samples_per_s": samples / window, "prep_cpu_s": prep_cpu,
        "prep_cpu_ms_per_sample_read": None if prep_cpu is None else 1000 * prep_cpu / read,
        "samples_read": read, "prep_work_x": prepared * trials / read,
        "peak_staging_bytes": peak,
        "stall_fraction": statistics.mean(r["stall_fraction"] for r in results),
        "startup_s": statistics.mean(r["startup_s"] for r in results),
        "startup_max_s": max(r["startup_s"] for r in results),
        "samples_per_s_with_startup": read / waited, "waited_s": waited, "pool_start_s": pool_start,
        "trials_started_s": max(r["t_created"] for r in results) - started,  # the last trial's loader created
        "unique_samples_per_s": samples / window * prepared / read,  # samples prepared per second
        "trial_cpu_ms_per_batch": _mean(r.get("trial_cpu_ms_per_batch") for r in results),
        "copied_fraction": _mean(r.get("copied_fraction") for r in results),
        "loader_cpu_ms_per_batch": _mean(r.get("loader_cpu_ms_per_batch") for r in results),
        "workers_per_trial": workers if loader in INDEPENDENT else 0,
        **{f"cpu_{role}_share": shares[role] if shares else None for role in ROLES},
    }


def _mean(values: Iterable[float | None]) -> float | None:
    known = [v for v in values if v is not None]
    return statistics.mean(known) if known else None

