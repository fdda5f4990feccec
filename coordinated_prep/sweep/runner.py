"""Run a validated SweepConfig with Ray Tune and the CoordinatedSearcher."""

from __future__ import annotations

import contextlib
import logging
import os
from typing import Any, Iterator, Mapping, Sequence, TextIO

from coordinated_prep.cache.arena import remove_stale
from coordinated_prep.errors import ConfigError
from coordinated_prep.tune.results import saved_reports
from coordinated_prep.tune.searcher import CoordinatedSearcher
from coordinated_prep.sweep.algorithms import default_max_t
from coordinated_prep.sweep.config import SweepConfig
from coordinated_prep.sweep.preflight import check_reachable
from coordinated_prep.sweep.summary import build_summary, write_summary

logger = logging.getLogger(__name__)

#: The node address a sweep's own single-node Ray instance uses unless ``ray.node_ip_address`` says otherwise.
LOOPBACK = "127.0.0.1"


def run_sweep(cfg: SweepConfig, verbose: int = 1, resume: bool = False,
              callbacks: Sequence[Any] = (), progress: TextIO | None = None,
              progress_every_s: float = 5.0) -> dict[str, Any]:
    """Start Ray if needed, run the sweep through ``tune.Tuner``, and return (and write) its summary.

    Args:
        cfg: The validated sweep.
        verbose: Tune's progress verbosity.
        resume: Resume the interrupted sweep saved under ``<storage_path>/<name>`` (``Tuner.restore``):
            unfinished and errored trials go on from their last checkpoints, and the summary covers
            every trial of the sweep.
        callbacks: Tune callbacks added to the run (a new run only: a resumed run keeps its own).
        progress: Where to write a progress line (each group's sharing factor and stall fraction)
            every ``progress_every_s`` seconds and at the end; None for none.

    Raises:
        ConfigError: ``resume`` with no saved sweep to resume, or a dataset URL this machine cannot
            read (:func:`~coordinated_prep.sweep.preflight.check_reachable`), before Ray starts.
    """
    import ray
    from ray import tune

    remove_stale()  # node-cache memory that killed sweeps left on this machine
    storage = os.path.abspath(cfg.storage_path)
    path = os.path.join(storage, cfg.name)
    if resume and not tune.Tuner.can_restore(path):
        raise ConfigError(f"{cfg.path}: no interrupted sweep to resume in {path} (no experiment state there); "
                          "run it without --resume, or check name and storage_path")
    check_reachable(cfg)  # a dataset URL this machine cannot read fails here, not in every trial
    if not ray.is_initialized():
        start_ray(cfg.ray)
    # An unshared sweep (data.coordinated: false) has nothing to coordinate: no CoordinatedSearcher, no prep pool.
    search_alg, searcher = _search_algorithm(cfg)
    resources, param_space = trial_resources(cfg)
    trainable = tune.with_resources(cfg.trainable_fn(), resources)
    callbacks = list(callbacks)
    if progress is not None and searcher is not None:
        from coordinated_prep.sweep.progress import ProgressLine

        callbacks.append(ProgressLine(searcher.group_reports_ref, progress, progress_every_s))
    if resume:  # Tune restores its own copy of the searcher, which finds or starts this job's registry
        tuner = tune.Tuner.restore(path, trainable=trainable, param_space=param_space,
                                   resume_unfinished=True, resume_errored=True)
    else:
        tuner = tune.Tuner(
            trainable,
            param_space=param_space,
            # The sweep's metric and mode are set here only: Tune hands them to the searcher and the scheduler.
            tune_config=tune.TuneConfig(search_alg=search_alg, scheduler=_scheduler(cfg), num_samples=cfg.num_samples,
                                        metric=cfg.metric, mode=cfg.mode, reuse_actors=cfg.reuse_actors),
            run_config=tune.RunConfig(name=cfg.name, storage_path=storage, verbose=verbose, callbacks=list(callbacks),
                                      failure_config=tune.FailureConfig(max_failures=cfg.max_failures)),
        )
    reports: dict[str, Any] = {}
    try:
        results = tuner.fit()
        if searcher is not None and (not resume or searcher.attach()):
            reports = {"groups": searcher.group_reports(), "caches": searcher.cache_reports(),
                       "evals": searcher.eval_reports(), "decoded": searcher.decoded_reports(),
                       "loaders": searcher.loader_reports(), "pools": searcher.pool_reports()}
        elif searcher is not None:  # Tune's restored copy of the searcher wrote them at its last checkpoint
            reports = saved_reports(path)
    finally:
        if searcher is not None:
            searcher.close()
    trials = [_measured(_trial_row(r, cfg.metric), reports.get("loaders") or {}) for r in results]
    # Tune stops the trials it was running when interrupted (Ctrl-C): the grid then calls them
    # TERMINATED, but the state it saved for a resume has them RUNNING or PENDING (and those a
    # scheduler paused, PAUSED). A sweep that ended by itself has none running or pending; its saved
    # state may still call a trial PAUSED that HyperBand stopped while paused (Ray 2.60).
    saved = _saved_statuses(path)
    unfinished: dict[str, str] = {}
    if any(status in ("RUNNING", "PENDING") for status in saved.values()):
        for row in trials:
            if row["status"] == "TERMINATED" and saved.get(row["trial"], "TERMINATED") != "TERMINATED":
                row["status"] = "UNFINISHED"
                unfinished[row["trial"]] = saved[row["trial"]]
    summary = build_summary(trials, reports.get("groups", {}), cfg.metric, cfg.mode, reports.get("caches"),
                            reports.get("evals"), reports.get("decoded"), coordinated=searcher is not None,
                            pools=reports.get("pools"))
    summary["interrupted"] = bool(unfinished)
    if unfinished:
        logger.warning("the sweep was interrupted with %d trials unfinished (saved as %s); resume it with: "
                       "coordprep sweep %s --resume", len(unfinished), unfinished, cfg.path)
    if resume:  # the data-group figures are this run's; the trials are the whole sweep's
        summary["resumed"] = True
    summary["path"] = write_summary(summary, path)
    return summary


def trial_resources(cfg: SweepConfig) -> tuple[dict[str, float], dict[str, Any]]:
    """Each trial's resources and the Tune param space; with ``gpu: auto``, the GPU share its measured
    peak needs, and ``gpu_memory_fraction`` in every trial's config for the trial to cap itself to."""
    resources = {k: v for k, v in cfg.resources_per_trial.items() if v}
    param_space = cfg.param_space()
    if cfg.gpu_auto is not None:
        from coordinated_prep.memory_tool.auto import gpu_bytes, plan_gpu

        packing = plan_gpu(cfg, gpu_bytes())
        if packing is not None:
            resources["gpu"] = packing.fraction
            param_space["gpu_memory_fraction"] = packing.memory_fraction
    return resources, param_space


def init_kwargs(ray_options: Mapping[str, Any]) -> dict[str, Any]:
    """``ray.init``'s arguments for the YAML's ``ray`` section: dashboard off and on loopback, and the
    node's address loopback unless ``node_ip_address`` names another."""
    init = {"dashboard_host": LOOPBACK, "include_dashboard": False, **ray_options}
    for key in ("metrics_export_port", "node_ip_address"):  # ray.init spells them with a leading underscore
        if key in init:
            init[f"_{key}"] = init.pop(key)
    init.setdefault("_node_ip_address", LOOPBACK)
    return init


def start_ray(ray_options: Mapping[str, Any]) -> None:
    """Start the sweep's own single-node Ray instance (or join ``RAY_ADDRESS``'s cluster).

    With a loopback node address, every port Ray opens (GCS, raylets, object manager, the metrics
    exporter of ``metrics_export_port``) listens on 127.0.0.1 only; with any other address they
    listen on all interfaces, and Ray's token authentication guards the control plane.
    """
    import ray

    if os.environ.get("RAY_ADDRESS"):  # an existing cluster: its nodes' addresses are its own
        ray.init(**{k: v for k, v in init_kwargs(ray_options).items() if k != "_node_ip_address"})
        return
    init = init_kwargs(ray_options)
    with _loopback_allowed(init["_node_ip_address"]):
        ray.init(**init)
    address = ray.util.get_node_ip_address()
    logger.info("Ray's node address is %s: %s", address, "its ports listen on loopback only"
                if address == LOOPBACK else "its ports listen on every interface")


@contextlib.contextmanager
def _loopback_allowed(address: str) -> Iterator[None]:
    """Let Ray keep a loopback node address (it swaps 127.0.0.1 for the host's IP on Linux otherwise).

    Ray (2.x, ``ray._private.services.resolve_ip_for_localhost``) replaces a loopback address with
    the host's routable one unless ``ray_constants.ENABLE_RAY_CLUSTER`` is false, the setting Ray
    itself uses on macOS and Windows for the same purpose: a local instance reachable only locally.
    """
    from ray._private import ray_constants

    if address != LOOPBACK or not hasattr(ray_constants, "ENABLE_RAY_CLUSTER"):
        yield
        return
    saved = ray_constants.ENABLE_RAY_CLUSTER
    ray_constants.ENABLE_RAY_CLUSTER = False
    try:
        yield
    finally:
        ray_constants.ENABLE_RAY_CLUSTER = saved


def _scheduler(cfg: SweepConfig) -> Any:
    """The Tune scheduler of ``cfg.scheduler``; a trial's length (``max_t``) defaults to the search
    space's ``epochs`` (:func:`~coordinated_prep.sweep.algorithms.default_max_t`)."""
    return cfg.scheduler.to_tune(default_max_t=default_max_t(cfg.search_space))


def _search_algorithm(cfg: SweepConfig) -> tuple[Any, CoordinatedSearcher | None]:
    """Tune's search algorithm for ``cfg.search``, at most ``max_concurrent_trials`` trials at once, and
    the CoordinatedSearcher wrapping it (None for an unshared sweep, ``data.coordinated: false``)."""
    from ray.tune.search import ConcurrencyLimiter, SearchAlgorithm

    algorithm = cfg.search.to_tune(max_concurrent=cfg.max_concurrent_trials)
    # A BasicVariantGenerator (random, grid) limits itself; a Searcher (optuna, hyperopt) is limited here.
    limit = 0 if isinstance(algorithm, SearchAlgorithm) else cfg.max_concurrent_trials
    if not cfg.data.coordinated:  # nothing to coordinate: Tune's searcher alone, no prep pool
        return (ConcurrencyLimiter(algorithm, limit) if limit else algorithm), None
    searcher = CoordinatedSearcher(algorithm, max_concurrent=limit, cache=cfg.cache, pool=cfg.pool,
                                   order=cfg.search.order, window=cfg.search.window)
    return searcher, searcher


def _saved_statuses(path: str) -> dict[str, str]:
    """Each trial's status in the experiment state Tune saved under ``path`` (what a resume goes on from)."""
    from ray.tune import ExperimentAnalysis

    try:
        return {t.trial_id: t.status for t in ExperimentAnalysis(path).trials}
    except Exception as e:  # noqa: BLE001 - no saved state to compare with: keep the grid's statuses
        logger.warning("could not read the saved sweep state in %s: %r", path, e)
        return {}


def _echo_name(value: Any) -> str:
    """The trial's echo setting by its short name (``off``, ``example:2``, ``auto:4``)."""
    from coordinated_prep.trial.echo import EchoSpec

    try:
        return EchoSpec.parse(value).name
    except ConfigError:
        return str(value)


def error_kind(error: BaseException | None) -> str | None:
    """``"config"`` for a trial that failed on its configuration or data (a :class:`ConfigError`, a
    sample's structure, a broken sample, a dataset: what ``coordprep`` exits 2 for), ``"other"`` for
    any other error (a prep actor or node lost, a timeout: a ``PrepError`` counts by its cause), None
    for none.

    Tune hands back a trial's error as Ray wrapped it (``RayTaskError``, ``TuneError``): the cause is
    found along ``cause`` and ``__cause__``.
    """
    from coordinated_prep.errors import ConfigError, DatasetError, SampleError, StructureError

    seen = 0
    while error is not None and seen < 16:
        if isinstance(error, (ConfigError, StructureError, SampleError, DatasetError)):
            return "config"
        error, seen = getattr(error, "cause", None) or error.__cause__, seen + 1
    return None if seen == 0 else "other"


def _measured(row: dict[str, Any], loaders: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """``row`` with the columns its trainable did not report (epochs, data wait, stall) filled from
    what the trial's loader measured itself (rank 0's for a data-parallel trial)."""
    measured = loaders.get(row["trial"]) or loaders.get(f"{row['trial']}@0")
    if measured:
        for column in ("epochs", "data_wait_s", "stall_fraction", "private_samples"):
            if row.get(column) is None:
                row[column] = measured.get(column)
    # Why it (or a rank of it) prepared samples itself, where it did, and how many (all its ranks'):
    # the summary's notes say so.
    mine = {key: stats for key, stats in loaders.items() if key.split("@", 1)[0] == row["trial"]}
    reasons = sorted(f"{'rank ' + key.split('@', 1)[1] + ': ' if '@' in key else ''}{stats['private_reason']}"
                     for key, stats in mine.items() if stats.get("private_reason"))
    row["private_reason"] = "; ".join(reasons) or None
    if reasons:
        row["private_samples"] = sum(stats.get("private_samples") or 0 for stats in mine.values())
    return row


def _trial_row(result: Any, metric: str) -> dict[str, Any]:
    from coordinated_prep.spec import DataSpec

    m = result.metrics or {}
    config = {k: v for k, v in (result.config or {}).items() if k != "data" and not k.startswith("__")}
    spec = (result.config or {}).get("data")
    return {
        "trial": m.get("trial_id") or os.path.basename(str(result.path)),
        "group": spec.group_key if isinstance(spec, DataSpec) else None,
        "status": "ERROR" if result.error else "TERMINATED",
        "error": str(result.error).splitlines()[0] if result.error else None,
        "error_kind": error_kind(result.error),
        "epochs": m.get("epoch"), metric: m.get(metric), "stall_fraction": m.get("stall_fraction"),
        "data_wait_s": m.get("data_wait_s"), "compute_s": m.get("compute_s"),
        "private_samples": m.get("private_samples"),
        "fresh_samples": m.get("fresh_samples_total"), "echoed_samples": m.get("echoed_samples_total"),
        "echo": _echo_name(config.get("echo")),
        "batch_size": config.get("batch_size"), "config": config,
    }
