"""``coordprep bench``: the four loaders side by side, N concurrent Tune trials at a time.

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
from typing import Any, Callable

from coordinated_prep.bench.config import INDEPENDENT, BenchConfig
from coordinated_prep.bench.trials import bench_trial
from coordinated_prep.searcher import CoordinatedSearcher
from coordinated_prep.sources import open_source
from coordinated_prep.spec import DataSpec

logger = logging.getLogger(__name__)


def data_spec(cfg: BenchConfig, loader: str) -> DataSpec:
    """The DataSpec of ``loader``: the same data and augmentation for all four."""
    backend = "dali" if loader.endswith("dali") else "torchvision"
    return DataSpec(dataset=cfg.dataset, pipeline={"size": cfg.size, "backend": backend}, seed=0,
                    coordinated=loader.startswith("coordinated"), chunk_size=cfg.batch_size, segments=4,
                    prep_actors=cfg.cores)


def run_bench(cfg: BenchConfig, progress: Callable[[dict[str, Any]], None] | None = None) -> list[dict[str, Any]]:
    """Run every (step, N, loader) of ``cfg``; returns one row each (see :func:`measure`)."""
    import ray

    open_source(cfg.dataset)  # generate the dataset once, before any trial needs it
    started = not ray.is_initialized()
    if started:
        ray.init(num_cpus=cfg.cores, object_store_memory=cfg.object_store_mb * 2**20, include_dashboard=False,
                 log_to_driver=False)
    rows = []
    try:
        for step in cfg.steps:
            for n in cfg.trials if step == "simulated" else cfg.cnn_trials:
                measured = [measure(cfg, loader, n, step) for loader in cfg.loaders]
                best = max((r["samples_per_s"] for r in measured if r["loader"] in INDEPENDENT), default=None)
                for row in measured:
                    row["vs_best_independent"] = row["samples_per_s"] / best if best else None
                    rows.append(row)
                    if progress:
                        progress(row)
    finally:
        if started:
            ray.shutdown()
    return rows


def measure(cfg: BenchConfig, loader: str, trials: int, step: str) -> dict[str, Any]:
    """One Tune run of ``trials`` concurrent trials reading with ``loader``; returns its row.

    Row fields: ``samples_per_s`` (all trials together), ``prep_cpu_s`` (CPU seconds spent
    preparing: the prep actors', or the trials' DataLoader workers or DALI threads),
    ``prep_work_x`` (samples prepared per sample one trial read: 1.00 when each sample is prepared
    once for all trials, N when every trial prepares its own), ``peak_staging_bytes`` and the
    trials' mean ``stall_fraction``.
    """
    from ray import tune

    spec = data_spec(cfg, loader)
    workers = max(1, round(cfg.cores / trials))  # independent loaders split the cores fairly
    config = {"data": spec, "loader": loader, "step": step, "epochs": cfg.epochs, "batch_size": cfg.batch_size,
              "workers": workers, "step_ms": cfg.simulated_step_ms, "width": cfg.cnn_width,
              "max_batches": cfg.cnn_batches if step == "cnn" else 0,
              "trial_index": tune.grid_search(list(range(trials)))}
    searcher = CoordinatedSearcher(max_concurrent=trials)
    try:
        analysis = tune.run(tune.with_resources(bench_trial, {"cpu": 0.01}), config=config, search_alg=searcher,
                            verbose=0, raise_on_failed_trial=True, storage_path=os.path.abspath(
                                os.path.join(cfg.storage_path, cfg.name, "tune")),
                            name=f"{step}-{loader}-{trials}")
        groups = searcher.group_reports()
    finally:
        searcher.close()
    results = [t.last_result for t in analysis.trials]
    samples = sum(r["samples"] for r in results)
    read = sum(r["samples_read"] for r in results)
    window = max(r["t_end"] for r in results) - min(r["t_first"] for r in results)
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
        "step": step, "loader": loader, "trials": trials, "samples": samples, "window_s": window,
        "samples_per_s": samples / window, "prep_cpu_s": prep_cpu,
        "prep_cpu_ms_per_sample_read": None if prep_cpu is None else 1000 * prep_cpu / read,
        "samples_read": read, "prep_work_x": prepared * trials / read,
        "peak_staging_bytes": peak,
        "stall_fraction": statistics.mean(r["stall_fraction"] for r in results),
        "startup_s": statistics.mean(r["startup_s"] for r in results),
        "workers_per_trial": workers if loader in INDEPENDENT else 0,
    }

