"""``coordprep analyze``: measure an experiment's input pipeline and predict what would help.

The steps, all on the experiment's own dataset, pipeline and trainable:

1. bandwidths: the disk's (sequential, cold), the dataset's files read cold, and memory's;
2. per-sample costs on one core: reading from the page cache, decoding and augmenting;
3. the trainable's training step on synthetic in-memory batches (its maximum ingestion rate);
4. the three DS-Analyzer runs, end to end with a ``DataLoader``: synthetic, cold cache, warm cache;
   their differences are the prep stall (warm - synthetic) and fetch stall (cold - warm) per epoch;
5. measured coordinated runs: N = 1, 4, 8 concurrent Tune trials sharing the experiment's own
   pipeline, one epoch each, with a simulated step; the fewest trials' process CPU per batch is
   the model's trial-side cost (:mod:`coordinated_prep.analyze.coordinated`);
6. the model of :mod:`coordinated_prep.analyze.model` fed with 1-3 and 5, checked against 4 and 5
   and asked what-if questions: cache size, CPU cores, and N concurrent trials with and without
   coordination.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import time
from typing import Any, Mapping, Sequence

from coordinated_prep.analyze import measure
from coordinated_prep.analyze.coordinated import RUN_SAMPLES, coordinated_runs, run_length, summarize
from coordinated_prep.analyze.coordinated import TRIALS as MEASURED_TRIALS
from coordinated_prep.analyze.model import Rates, against_measured, predict, stalls
from coordinated_prep.pipeline.backends import make_preprocessor
from coordinated_prep.errors import ConfigError
from coordinated_prep.plan import holdout_split
from coordinated_prep.pipeline.sources import open_source
from coordinated_prep.sweep.config import Dimension, SweepConfig

logger = logging.getLogger(__name__)

CACHE_FRACTIONS = tuple(i / 10 for i in range(11))
CORES = (1, 2, 4, 8, 16, 32)
TRIALS = (1, 2, 4, 8, 16)


def representative_config(cfg: SweepConfig) -> dict[str, Any]:
    """One concrete trial config: the first choice or grid value, the middle of a range; its ``data`` is
    the DataSpec of those values when the sweep searches data keys."""
    config: dict[str, Any] = {}
    for key, value in cfg.search_space.items():
        if isinstance(value, Dimension):
            low, *rest = value.args
            if value.kind in ("choice", "grid"):
                value = low
            elif value.kind == "loguniform":
                value = math.sqrt(low * rest[0])
            elif value.kind == "uniform":
                value = (low + rest[0]) / 2
            else:  # randint: [low, high)
                value = (low + rest[0] - 1) // 2
        config[key] = value
    config["data"] = cfg.data if cfg.data_search is None else cfg.data_search.spec(config)
    return config


def analyze(cfg: SweepConfig, *, samples: int = 512, cores: int | None = None, step_ms: float | None = None,
            disk_probe_bytes: int = 128 * 2**20, disk_probe_dir: str | None = None,
            trials: Sequence[int] = MEASURED_TRIALS, run_samples: int = RUN_SAMPLES) -> dict[str, Any]:
    """Run the analysis of ``cfg``; returns the report (see :func:`write_report` for the files).

    Args:
        cfg: The experiment, as ``coordprep sweep`` would run it.
        samples: Training samples measured (a fixed random subset; all if the split is smaller).
        cores: CPU cores available for preparation (default: this machine's).
        step_ms: Replace the trainable's step with a simulated accelerator taking this long per
            batch without using the CPU; required for trainables without a registered model.
        disk_probe_bytes: Bytes read (of the dataset's files, or of the scratch file) for the disk's
            sequential bandwidth.
        disk_probe_dir: Measure the disk with a scratch file written (and removed) in this directory,
            which must lie outside the dataset (and should be on its filesystem). Default: read the
            dataset's own largest files; nothing is written anywhere near the dataset.
        trials: Concurrent trial counts of the measured coordinated runs (Ray and Tune, one epoch
            each); empty for none, and then the model has no trial-side cost.
        run_samples: About how many samples each trial of those runs reads (whole epochs up to it).

    Raises:
        ConfigError: A trainable without a model and no ``step_ms``, a ``disk_probe_dir`` that is
            missing, not writable or inside the dataset, or bad arguments.
    """
    if samples < 2:
        raise ConfigError(f"analyze: --samples={samples} must be at least 2")
    if run_samples < 2:
        raise ConfigError(f"analyze: --run-samples={run_samples} must be at least 2 (the first batch is start-up)")
    cores = cores or os.cpu_count() or 1
    config = representative_config(cfg)
    spec = config["data"]  # the base data, or the representative trial's when data keys are searched
    if spec.user_transforms:
        raise ConfigError(f"analyze: {cfg.path} brings its own dataset or transforms; analyze models the built-in image "
                          "pipeline (read, decode, crop) of a builtin or directory dataset: run it on such a sweep")
    source = open_source(spec.dataset)
    paths = getattr(source, "paths", None)
    if paths is None:
        raise ConfigError(f"analyze: dataset {spec.dataset!r} is not file-backed, so its cache cannot be evicted")
    batch_size = int(config.get("batch_size", 64))
    step = _step(cfg, config, len(source.classes), step_ms)
    preprocessor = make_preprocessor(spec.pipeline)  # type: ignore[arg-type]
    train_ids, _ = holdout_split(len(source), spec.holdout)
    ids = measure.sample_ids(train_ids, samples, spec.seed)
    if len(ids) < 2 * batch_size:  # the runs time every batch after the first: with one, nothing
        raise ConfigError(f"analyze: --samples={samples} gives {len(ids)} samples, fewer than two batches of "
                          f"{batch_size} (search_space.batch_size); raise --samples to at least {2 * batch_size}"
                          + (" or use a dataset with more training samples" if len(ids) < samples else ""))
    size = spec.pipeline.size  # type: ignore[union-attr]
    logger.info("analyze: measuring bandwidths")
    if disk_probe_dir is None:
        disk_seq, nbytes = measure.files_bandwidth(paths, disk_probe_bytes, spec.seed)
        disk_on = f"the dataset's own files ({nbytes / 2**20:.0f} MiB read)"
    else:
        _check_probe_dir(disk_probe_dir, source.root)
        disk_seq = measure.disk_bandwidth(disk_probe_dir, disk_probe_bytes)
        disk_on = f"a scratch file in {disk_probe_dir}"
    memory = measure.memory_bandwidth()
    logger.info("analyze: measuring per-sample costs on %d samples", len(ids))
    reads = measure.read_costs(source, paths, ids)
    prep_s = measure.prep_cost(source, preprocessor, ids, spec.seed)
    logger.info("analyze: the three runs (synthetic, cold cache, warm cache) with %d DataLoader workers", cores)
    runs, dataloader_batch_s = measure.end_to_end_rates(step, source, preprocessor, paths, ids, spec.seed, size,
                                                        batch_size, cores)
    # The runs' simulated step: --step-ms, or the trainable's measured step time as a sleep, so that
    # each trial computes as if on its own accelerator, as the model assumes.
    run_step_ms = step_ms or 1000 * batch_size / runs["synthetic"]
    measured = coordinated_runs(spec, trials=trials, batch_size=batch_size, step_ms=run_step_ms, cores=cores,
                                storage_path=cfg.storage_path, name=os.path.join(cfg.name, "analysis"),
                                epoch_samples=len(train_ids), run_samples=run_samples) if trials else []
    rows = [summarize(r) for r in measured]
    trial_batch_s = (rows[0]["trial_cpu_ms_per_batch"] or 0.0) / 1000 if rows else 0.0
    pool_ms = rows[0]["pool_cpu_ms_per_sample"] if rows else None
    n = len(ids)
    sample_bytes = reads["bytes"] / n
    rates = Rates(
        samples=len(train_ids), sample_bytes=sample_bytes, compute_rate=runs["synthetic"], read_s=reads["warm_s"] / n,
        cold_read_s=max(0.0, reads["cold_s"] - reads["warm_s"]) / n, prep_s=prep_s, disk_bandwidth=disk_seq,
        batch_size=batch_size, trial_batch_s=trial_batch_s, dataloader_batch_s=dataloader_batch_s,
        pool_sample_s=max(0.0, (pool_ms or 0.0) / 1000 - reads["warm_s"] / n - prep_s) if pool_ms else 0.0,
    )
    epoch = len(train_ids)
    measured_epoch = {mode: epoch / rate for mode, rate in runs.items()}
    predicted = stalls(rates, cores)
    report = {
        "experiment": cfg.path, "trainable": cfg.trainable, "dataset": spec.dataset,
        "config": measure.describe_config(config), "batch_size": batch_size, "cores": cores,
        "samples_measured": n, "samples_per_epoch": epoch, "disk_measured_on": disk_on, "step": f"simulated {step_ms} ms" if step_ms else "model",
        "bandwidth": {"disk_sequential_bytes_s": disk_seq, "dataset_cold_read_bytes_s": reads["bytes"] / max(reads["cold_s"], 1e-9),
                      "page_cache_read_bytes_s": reads["bytes"] / max(reads["warm_s"], 1e-9),
                      "memory_copy_bytes_s": memory},
        "per_sample": {"encoded_bytes": sample_bytes, "read_warm_s": rates.read_s, "read_cold_s": reads["cold_s"] / n,
                       "decode_augment_s": prep_s},
        "per_batch": {"coordinated_trial_cpu_s": trial_batch_s, "dataloader_main_cpu_s": dataloader_batch_s},
        "pool_overhead_per_sample_s": rates.pool_sample_s,
        "rates": dataclasses.asdict(rates),
        "runs": {mode: {"measured_samples_s": runs[mode], "measured_epoch_s": measured_epoch[mode],
                        "predicted_epoch_s": predicted[f"{mode}_s"]} for mode in ("synthetic", "warm", "cold")},
        "stalls_per_epoch": {
            "measured": {"prep_stall_s": max(0.0, measured_epoch["warm"] - measured_epoch["synthetic"]),
                         "fetch_stall_s": max(0.0, measured_epoch["cold"] - measured_epoch["warm"])},
            "predicted": {"prep_stall_s": predicted["prep_stall_s"], "fetch_stall_s": predicted["fetch_stall_s"]},
        },
        "whatif": {
            "cache": [_row(predict(rates, cores=cores, cache_fraction=f)) for f in CACHE_FRACTIONS],
            "cores": [_row(predict(rates, cores=c, cache_fraction=1.0)) for c in CORES],
            "trials": [_row(predict(rates, trials=t, cores=cores, cache_fraction=1.0, coordinated=co))
                       for t in TRIALS for co in (False, True)],
        },
        "coordinated_runs": {
            "step_ms": run_step_ms, "batch_size": batch_size, "run_samples": run_samples,
            "epochs": run_length(len(train_ids), batch_size, run_samples)[0], "measured": rows,
            "model_vs_measured": against_measured(rates, cores, {r["trials"]: r["samples_per_s"] for r in rows})
            if rows else [],
        },
        "created": time.strftime("%Y-%m-%d %H:%M:%S"),
    }
    return report


def _check_probe_dir(directory: str, dataset_root: str) -> None:
    """A scratch-file directory the user named: it exists, is writable, and is not in the dataset."""
    real, root = os.path.realpath(directory), os.path.realpath(dataset_root)
    if not os.path.isdir(real) or not os.access(real, os.W_OK):
        raise ConfigError(f"analyze: --disk-probe-dir={directory!r} is not a writable directory")
    if os.path.commonpath([real, root]) == root:
        raise ConfigError(f"analyze: --disk-probe-dir={directory!r} lies inside the dataset {dataset_root}; choose a "
                          "directory outside it on the same filesystem (or leave it out to read the dataset's files)")
    if os.stat(real).st_dev != os.stat(root).st_dev:
        logger.warning("analyze: --disk-probe-dir=%s is on another filesystem than the dataset %s; the disk "
                       "bandwidth measured is that filesystem's", directory, dataset_root)


def _row(p: Any) -> dict[str, Any]:
    return dataclasses.asdict(p)


def _step(cfg: SweepConfig, config: Mapping[str, Any], num_classes: int, step_ms: float | None):
    """The per-batch training step: the trainable's model, or a simulated accelerator."""
    if step_ms is not None:
        if not step_ms > 0:
            raise ConfigError(f"analyze: --step-ms={step_ms} must be positive")

        def simulated(images: Any, labels: Any) -> None:
            time.sleep(step_ms / 1000)  # a stand-in for an accelerator step: no CPU used

        return simulated
    try:
        from trainables import MODELS
    except ImportError:  # trainables/ is not importable from here
        MODELS = {}
    if cfg.trainable not in MODELS:
        raise ConfigError(f"analyze: {cfg.path}: trainable {cfg.trainable!r} has no registered model "
                          f"({sorted(MODELS)}); pass --step-ms to time a simulated accelerator step instead")
    import torch

    from trainables.common import make_optimizer, train_step

    torch.set_num_threads(int(config.get("torch_threads", 1)))
    torch.manual_seed(0)
    model = MODELS[cfg.trainable](num_classes, config)
    optimizer = make_optimizer(model, config)
    loss_fn = torch.nn.CrossEntropyLoss()
    device = torch.device("cpu")
    return lambda images, labels: train_step(model, optimizer, loss_fn, images, labels, device)
