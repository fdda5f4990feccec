"""Run a validated SweepConfig with Ray Tune and the CoordinatedSearcher."""

from __future__ import annotations

import logging
import os
from typing import Any

from coordinated_prep.searcher import CoordinatedSearcher
from coordinated_prep.sweep.config import SweepConfig
from coordinated_prep.sweep.summary import build_summary, write_summary

logger = logging.getLogger(__name__)


def run_sweep(cfg: SweepConfig, verbose: int = 1) -> dict[str, Any]:
    """Start Ray if needed, run the sweep through ``tune.Tuner``, and return (and write) its summary."""
    import ray
    from ray import tune

    if not ray.is_initialized():
        init = {"dashboard_host": "127.0.0.1", "include_dashboard": False, **cfg.ray}
        if "metrics_export_port" in init:  # ray.init spells it with a leading underscore
            init["_metrics_export_port"] = init.pop("metrics_export_port")
        ray.init(**init)
    # An unshared sweep (data.coordinated: false) has nothing to coordinate: no searcher, no prep pool.
    searcher = (CoordinatedSearcher(max_concurrent=cfg.max_concurrent_trials, cache=cfg.cache, pool=cfg.pool)
                if cfg.data.coordinated else None)
    storage = os.path.abspath(cfg.storage_path)
    resources = {k: v for k, v in cfg.resources_per_trial.items() if v}
    tuner = tune.Tuner(
        tune.with_resources(cfg.trainable_fn(), resources),
        param_space=cfg.param_space(),
        tune_config=tune.TuneConfig(search_alg=searcher, scheduler=_scheduler(cfg), num_samples=cfg.num_samples,
                                    metric=cfg.metric, mode=cfg.mode,
                                    max_concurrent_trials=None if searcher else cfg.max_concurrent_trials or None),
        run_config=tune.RunConfig(name=cfg.name, storage_path=storage, verbose=verbose,
                                  failure_config=tune.FailureConfig(max_failures=0)),
    )
    groups: dict[str, Any] = {}
    caches: dict[str, Any] = {}
    try:
        results = tuner.fit()
        if searcher is not None:
            groups, caches = searcher.group_reports(), searcher.cache_reports()
    finally:
        if searcher is not None:
            searcher.close()
    trials = [_trial_row(r, cfg.metric) for r in results]
    summary = build_summary(trials, groups, cfg.metric, cfg.mode, caches)
    summary["path"] = write_summary(summary, os.path.join(storage, cfg.name))
    return summary


def _scheduler(cfg: SweepConfig) -> Any:
    from ray.tune.schedulers import ASHAScheduler, FIFOScheduler

    s = cfg.scheduler
    if s.type == "asha":
        epochs = cfg.search_space.get("epochs")
        max_t = s.max_t or (epochs if isinstance(epochs, int) else 100)
        return ASHAScheduler(time_attr="training_iteration", max_t=max_t, grace_period=s.grace_period,
                             reduction_factor=s.reduction_factor)
    return FIFOScheduler()


def _trial_row(result: Any, metric: str) -> dict[str, Any]:
    m = result.metrics or {}
    config = {k: v for k, v in (result.config or {}).items() if k != "data" and not k.startswith("__")}
    return {
        "trial": m.get("trial_id") or os.path.basename(str(result.path)),
        "status": "ERROR" if result.error else "TERMINATED",
        "error": str(result.error).splitlines()[0] if result.error else None,
        "epochs": m.get("epoch"), metric: m.get(metric), "stall_fraction": m.get("stall_fraction"),
        "data_wait_s": m.get("data_wait_s"), "compute_s": m.get("compute_s"),
        "private_samples": m.get("private_samples"),
        "batch_size": config.get("batch_size"), "config": config,
    }
