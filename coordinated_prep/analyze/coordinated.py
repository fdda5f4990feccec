"""Measured coordinated runs for ``coordprep analyze``: N concurrent Tune trials sharing one pipeline.

Each run is one of ``coordprep bench``'s measurements (:func:`coordinated_prep.bench.run.measure`)
on the experiment's own DataSpec (dataset, pipeline, seed), about ``RUN_SAMPLES`` samples per
trial, with a simulated accelerator step that sleeps, so that a trial's process CPU per batch is what reading costs it.
The run with the fewest trials gives the model's ``trial_batch_s``; all of them are the measured
side of the model-vs-measured table.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
from typing import Any, Sequence

from coordinated_prep.errors import ConfigError
from coordinated_prep.spec import DataSpec

logger = logging.getLogger(__name__)

#: Concurrent trial counts measured by default.
TRIALS = (1, 4, 8)
#: Samples each trial reads by default: whole epochs up to this, so that the prep pool's read-ahead
#: during start-up (up to ``lookahead`` pieces, before the timed window opens) is a small part of it.
RUN_SAMPLES = 8192


def parse_trials(text: str) -> tuple[int, ...]:
    """``"1,4,8"`` as ``(1, 4, 8)``.

    Raises:
        ConfigError: Not comma-separated positive integers.
    """
    try:
        counts = tuple(sorted({int(part) for part in text.split(",")}))
    except ValueError:
        counts = ()
    if not counts or counts[0] < 1:
        raise ConfigError(f"analyze: --trials={text!r} must be comma-separated positive integers, e.g. 1,4,8")
    return counts


def run_length(epoch_samples: int, batch_size: int, run_samples: int) -> tuple[int, int]:
    """``(epochs, max_batches per epoch)`` for a trial to read about ``run_samples`` samples.

    Whole epochs (``max_batches`` 0) when an epoch is shorter than ``run_samples``; else part of one.
    """
    if epoch_samples >= run_samples:
        return 1, max(2, math.ceil(run_samples / batch_size))  # the first batch is start-up, not rate
    return math.ceil(run_samples / epoch_samples), 0


def coordinated_runs(spec: DataSpec, *, trials: Sequence[int], batch_size: int, step_ms: float, cores: int,
                     storage_path: str, name: str, epoch_samples: int,
                     run_samples: int = RUN_SAMPLES) -> list[dict[str, Any]]:
    """Run ``len(trials)`` Tune runs of N coordinated trials each; returns bench's rows, by ascending N.

    Starts a local Ray instance of ``cores`` CPUs unless one is running (then uses it and leaves it up).

    Args:
        spec: The experiment's DataSpec (sharing is switched on if it was off).
        trials: Concurrent trial counts.
        batch_size: Samples per batch each trial reads.
        step_ms: The simulated step per batch (a sleep: no CPU).
        cores: Prep actors in the pool, and Ray's CPUs if Ray is started here.
        storage_path: Tune's results go to ``<storage_path>/<name>/tune``.
        name: See ``storage_path``.
        epoch_samples: Samples in the training split.
        run_samples: About how many samples each trial reads (see :func:`run_length`).
    """
    import ray

    from coordinated_prep.bench.config import BenchConfig
    from coordinated_prep.bench.run import measure

    epochs, max_batches = run_length(epoch_samples, batch_size, run_samples)
    size = spec.pipeline.size  # type: ignore[union-attr]
    bench = BenchConfig(name=name, storage_path=storage_path, dataset=spec.dataset, size=size, batch_size=batch_size,
                        epochs=epochs, trials=tuple(trials), loaders=("coordinated-torchvision",),
                        steps=("simulated",), simulated_step_ms=step_ms, cores=cores, object_store_mb=1024)
    spec = dataclasses.replace(spec, coordinated=True)
    os.environ.setdefault("RAY_AIR_NEW_OUTPUT", "0")  # Tune's per-run banner would bury the tables
    started = not ray.is_initialized()
    if started:
        # Ray's workers inherit this environment (PYTHONPATH included) from the local cluster started here.
        ray.init(num_cpus=cores, object_store_memory=bench.object_store_mb * 2**20, include_dashboard=False,
                 log_to_driver=False)
    try:
        rows = []
        for n in sorted(trials):
            logger.info("analyze: %d coordinated trial(s), %d epoch(s) each, simulated %.1f ms step", n, epochs,
                        step_ms)
            rows.append(measure(bench, "coordinated-torchvision", n, "simulated", spec=spec, max_batches=max_batches))
    finally:
        if started:
            ray.shutdown()
    return rows


def summarize(row: dict[str, Any]) -> dict[str, Any]:
    """The fields of a bench row the analysis keeps."""
    keys = ("trials", "samples", "window_s", "samples_per_s", "unique_samples_per_s", "trial_cpu_ms_per_batch",
            "copied_fraction", "stall_fraction", "startup_s", "prep_work_x", "prep_cpu_s")
    out = {k: row.get(k) for k in keys}
    # prep_work_x = prepared x trials / read, so the pool's CPU per sample it prepared is:
    per_read, work = row.get("prep_cpu_ms_per_sample_read"), row.get("prep_work_x")
    out["pool_cpu_ms_per_sample"] = per_read * row["trials"] / work if per_read is not None and work else None
    return out
