"""CoordinatedSearcher: any Tune search algorithm, plus the data groups its trials share."""

from __future__ import annotations

import logging
import operator
import os
from typing import Any, Dict, Mapping, Optional

import ray
from ray import cloudpickle
from ray.tune import PlacementGroupFactory, ResumeConfig
from ray.tune.search import ConcurrencyLimiter, SearchAlgorithm, Searcher, SearchGenerator

from coordinated_prep.cache.spec import CacheSpec
from coordinated_prep.errors import ConfigError
from coordinated_prep.naming import NAMESPACE, registry_name
from coordinated_prep.pool import warm
from coordinated_prep.pool.spec import PoolSpec
from coordinated_prep.tune.groups import group_of
from coordinated_prep.tune.order import GroupOrder
from coordinated_prep.tune.results import save_atomically, write_reports
from coordinated_prep.tune.starting import CALL_TIMEOUT_S as _CALL_TIMEOUT_S, RegistryStart, destroy
from coordinated_prep.tune.wrapping import limit, tune_run_locals, wrap

logger = logging.getLogger(__name__)

_SAVE_TIMEOUT_S = 10.0  # the reports saved with one of Tune's experiment checkpoints
_PENDING_WITHOUT_LIMIT = 200  # what Tune allows a BasicVariantGenerator on a small cluster
ORDER_FILE = "coordprep_order.pkl"  # the suggestions held back, saved with Tune's experiment checkpoints

class CoordinatedSearcher(RegistryStart, SearchAlgorithm):
    """Wraps a Tune search algorithm and shares data preparation among the trials it suggests.

    It owns a group registry actor, on the driver's node and outside every trial's placement group.
    Before Tune places the first trial, the registry starts a prep pool on every node and waits
    until it is ready (a warm start; the pool's CPUs are reserved before trials can take them). A
    trial whose loader has ``coordinated=True`` joins the coordinator of its data group through the
    registry, which starts that coordinator on first use. When Tune reports a trial complete
    (finished, stopped by a scheduler, errored), the trial leaves its groups; when a group's last
    trial leaves, its coordinator and staged pieces are destroyed. Paused trials, whose process
    Tune ends without telling a search algorithm, are released by the coordinators themselves.
    Call :meth:`close` after the sweep. Trials find the registry by their Ray job (the driver's),
    so nothing is added to their configs, and a restored sweep (``Tuner.restore``, also from a new
    driver) starts or finds the registry before its restored trials run. One CoordinatedSearcher
    per driver process runs at a time.

    It also chooses *when* each suggested trial runs, so that a data group's trials run together: it
    holds a window of suggestions and releases first those whose group has a trial running (Tune's
    grid order A, B, A, B runs as A, A, B, B). The window is 32 suggestions of Tune's grid and random
    variants, and a bounded look-ahead of 4 for a model-based Searcher (Optuna, HyperOpt); this
    searcher then applies ``max_concurrent`` around the window (:mod:`coordinated_prep.tune.wrapping`).
    Which configs are tried never changes, and no suggestion waits more than a written bound
    (:mod:`coordinated_prep.tune.order`). Another SearchAlgorithm keeps its own order.

    Args:
        searcher: A Tune ``Searcher`` (e.g. OptunaSearch) or ``SearchAlgorithm``; default is Tune's
            random/grid variant generation (``BasicVariantGenerator``).
        max_concurrent: Most trials running at once (0 = no limit). ``TuneConfig(max_concurrent_trials=n)``
            works too (Tune itself drops it for a SearchAlgorithm; this searcher applies it).
        cache: A raw-data cache on every node (a :class:`CacheSpec` or a mapping of its fields),
            shared by every data group of the sweep; None (default): samples are read from storage.
        pool: The prep pool and staging budget of every node (a :class:`PoolSpec` or a mapping of
            its fields); default ``PoolSpec()``: one prep actor, growing to one per CPU (half the CPUs) while trials wait.
        order: ``"group"`` (default): trials run group by group, as above; ``"tune"``: in the
            search algorithm's own order.
        window: Most suggestions held back (None: 32 for Tune's variants, 4 for a Searcher; 1: none).
    """

    def __init__(self, searcher: Searcher | SearchAlgorithm | None = None, *, max_concurrent: int = 0,
                 cache: CacheSpec | Mapping[str, Any] | None = None,
                 pool: PoolSpec | Mapping[str, Any] | None = None, order: str = "group",
                 window: int | None = None) -> None:
        if order not in ("group", "tune"):
            raise ConfigError(f"CoordinatedSearcher: order={order!r} must be 'group' (a data group's trials run "
                              "together) or 'tune' (Tune's own order)")
        if not isinstance(max_concurrent, int) or max_concurrent < 0:
            raise ConfigError(f"CoordinatedSearcher: max_concurrent={max_concurrent!r} must be an integer >= 0")
        if isinstance(cache, Mapping):
            cache = CacheSpec.from_mapping(cache)
        elif cache is not None and not isinstance(cache, CacheSpec):
            raise ConfigError(f"CoordinatedSearcher: cache={cache!r} must be a CacheSpec, a mapping or None, "
                              "e.g. cache=CacheSpec(capacity_bytes='4GiB')")
        self._cache = cache
        if isinstance(pool, Mapping):
            pool = PoolSpec.from_mapping(pool)
        elif pool is not None and not isinstance(pool, PoolSpec):
            raise ConfigError(f"CoordinatedSearcher: pool={pool!r} must be a PoolSpec, a mapping or None, "
                              "e.g. pool=PoolSpec(actors=4, cpus=2)")
        self._pool = pool or PoolSpec()
        wrapped = wrap(searcher, max_concurrent, order, window)
        self._inner, self._base, self._max_concurrent = wrapped.inner, wrapped.base, wrapped.max_concurrent
        self._lookahead = wrapped.ahead  # holds suggestions back and limits running trials itself
        self._order = GroupOrder(window=wrapped.window, patience=wrapped.window, key=operator.attrgetter("trial_id"))
        self._resolvers: Any = None  # tune.run's placeholder resolvers, read in _read_run
        self._objective: tuple[str | None, str | None] = (None, None)  # Tune's metric and mode
        # Tune lets only ONE trial be pending at a time for a SearchAlgorithm that is not a
        # BasicVariantGenerator, unless it finds a ConcurrencyLimiter along `search_alg.searcher`
        # (tune_controller._get_max_pending_trials): trials would start one by one, about a second
        # apart, and short trials would miss each other. So a limiter is on that chain wherever trials
        # may run at once (a limit set, or Tune's own generator, where it is a marker that only
        # carries the number). A model-based Searcher with no limit keeps Tune's one pending trial:
        # each of its suggestions is made from the results so far, as Tune runs it alone.
        self.searcher = getattr(self._inner, "searcher", None) or ConcurrencyLimiter(
            Searcher(), max_concurrent=self._max_concurrent or _PENDING_WITHOUT_LIMIT)
        self._registry: Any = None
        self._starting: ray.ObjectRef | None = None  # the registry's start, until it answered (see _ensure_registry)
        self._start_error: BaseException | None = None  # why that start failed, raised at Tune's next request
        self._lent: dict[str, list[Any]] = {}  # per node, prep actors kept warm and lent to the registry
        self.session: str | None = None  # the Ray job id naming the registry, once started

    def __getstate__(self) -> dict[str, Any]:
        # Tune pickles the search algorithm with the Tuner (Tuner.restore): the registry is not kept.
        return {**self.__dict__, "_registry": None, "_starting": None, "_start_error": None, "_resolvers": None,
                "_lent": {}}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update({"_starting": None, "_start_error": None, **state})  # pickled before these existed
        if "_order" not in state:  # a searcher pickled before suggestions were ordered (Tuner.restore)
            self._lookahead = False
            self._order = GroupOrder(window=1, key=operator.attrgetter("trial_id"))

    # -- Tune's SearchAlgorithm hooks, delegated ---------------------------------------------
    @property
    def metric(self) -> Optional[str]:
        return self._inner.metric

    def set_search_properties(self, metric: Optional[str], mode: Optional[str], config: Dict, **spec) -> bool:
        self._read_run(metric, mode)
        return self._inner.set_search_properties(metric, mode, config, **spec)

    def _read_run(self, metric: Optional[str], mode: Optional[str]) -> None:
        """What ``tune.run`` tells no search algorithm: its ``max_concurrent_trials`` and placeholder
        resolvers, and the objective the reports are written with (``coordprep best`` ranks by it; else
        the inner searcher's own). Read where Tune calls :meth:`set_search_properties` (only when the
        ``param_space`` is not empty) and :meth:`add_configurations` (always, but on a restore)."""
        run = tune_run_locals()
        if not run:
            return
        limit = run.get("max_concurrent_trials")
        self._limit(limit if isinstance(limit, int) and limit > 0 else None)
        self._resolvers = run.get("placeholder_resolvers")
        inner = getattr(self._inner, "searcher", self._inner)  # a Searcher's mode: Tune's SearchGenerator has none
        self._objective = (metric or run.get("metric") or self._inner.metric,
                           mode or run.get("mode") or getattr(inner, "mode", None))

    def _limit(self, n: int | None) -> None:
        """Honour ``TuneConfig(max_concurrent_trials=n)``, which Tune drops for a SearchAlgorithm.

        Raises:
            ConfigError: ``n`` differs from the ``max_concurrent`` given here, or the inner search
                algorithm is the user's own (whose concurrency only it can limit).
        """
        if not n:
            return
        if not hasattr(self, "_max_concurrent"):  # a searcher pickled before this attribute (Tuner.restore)
            self._max_concurrent = 0
        if self._max_concurrent and self._max_concurrent != n:
            raise ConfigError(f"max_concurrent_trials={n} (TuneConfig) and CoordinatedSearcher(max_concurrent="
                              f"{self._max_concurrent}) disagree; set one of them")
        if isinstance(self._inner, SearchGenerator):  # limited around the window (coordinated_prep.tune.wrapping)
            if not self._max_concurrent:
                base = getattr(self, "_base", None) or self._inner.searcher
                self.searcher = limit(self._inner, base, n, self._order.window)
        elif self._lookahead:  # Tune's variants: applied in next_trial
            self.searcher.max_concurrent = n  # the marker Tune sizes its pending trials by
        else:
            raise ConfigError(f"max_concurrent_trials={n}: Tune cannot limit the {type(self._inner).__name__} "
                              "wrapped by the CoordinatedSearcher; set its own limit and leave max_concurrent_trials "
                              "unset")
        self._max_concurrent = n

    @property
    def total_samples(self) -> int:
        return self._inner.total_samples

    def add_configurations(self, experiments) -> None:
        self._read_run(None, None)  # again: a searcher with a space of its own gets no set_search_properties
        self._inner.add_configurations(experiments)

    def next_trial(self):
        # Before Tune places any trial, restored ones included. Tune hides non-primitive config
        # values (a DataSpec) behind placeholders until the trial is added, so each trial finds its
        # group later, itself, through the registry.
        self._ensure_registry(wait=False)
        return self._release()

    def _release(self):
        """The next suggestion by the group order, or None (the limit is reached, or none comes)."""
        if self._lookahead and self._max_concurrent and self._order.running() >= self._max_concurrent:
            return None
        self._pull()
        return self._order.release()

    def _pull(self) -> None:
        """Fill the window with the inner search algorithm's next suggestions, each with its data group."""
        while self._order.room():
            trial = self._inner.next_trial()
            if trial is None:
                return
            self._order.offer(trial, group_of(trial.config, self._resolvers) if self._lookahead else None)

    def on_trial_result(self, trial_id: str, result: Dict) -> None:
        self._note_start(block=False)  # a start that failed ends the sweep (see _ensure_registry)
        self._order.adopt(trial_id)  # one a restored sweep runs again, not released here: it holds a place
        self._inner.on_trial_result(trial_id, result)

    def on_trial_complete(self, trial_id: str, result: Optional[Dict] = None, error: bool = False) -> None:
        self._note_start(block=error)  # a trial that failed may have failed for want of its pool
        group = self._order.complete(trial_id)
        self._inner.on_trial_complete(trial_id, result=result, error=error)
        if self._registry is None:
            return
        # Its data groups that trials released or held back will read: kept for them a while, not
        # destroyed and started again (coordinated_prep/stream/linger.py).
        wanted = self._order.wanted()
        keep = sorted({k for k in group or () if any(k in g for g in wanted)})
        try:  # synchronous, so what only this trial held is freed before the next trial starts
            ray.get(self._registry.trial_done.remote(trial_id, keep), timeout=_CALL_TIMEOUT_S)
        except (ray.exceptions.RayError, ray.exceptions.GetTimeoutError) as e:
            logger.warning("coordinated_prep: trial %s did not leave its data group cleanly: %s", trial_id, e)

    def is_finished(self) -> bool:
        # Not while the registry's start is pending or failed: Tune then asks for a trial again, and
        # learns why the start failed, even when every trial has ended.
        starting = self._starting is not None or self._start_error is not None
        return self._inner.is_finished() and not len(self._order) and not starting

    def set_finished(self) -> None:
        for trial, _, _ in self._order.waiting():  # held back, never given to Tune: the sweep ends without them
            self._inner.on_trial_complete(trial.trial_id, error=True)
        self._order.clear()
        self._inner.set_finished()

    def has_checkpoint(self, dirpath: str) -> bool:
        # Tune asks this first when it restores an experiment, before restored trials start.
        self._ensure_registry()
        return self._inner.has_checkpoint(dirpath)

    def save_to_dir(self, dirpath: str, **kwargs) -> None:
        # Tune calls this at each experiment checkpoint, last when the sweep ends; what it writes to
        # ``dirpath`` lands in the sweep's directory (``coordinated_prep.tune.results``).
        self._inner.save_to_dir(dirpath, **kwargs)
        if self._lookahead:  # what was pulled ahead of the inner generator's saved state
            for trial, _, _ in self._order.waiting():
                # A Trial pickles only with resources, which Tune computes when it adds the trial
                # (it computes them again then): a stand-in until that.
                if trial.placement_group_factory is None:
                    trial.placement_group_factory = PlacementGroupFactory([{"CPU": 1}])
            save_atomically(self._order, os.path.join(dirpath, ORDER_FILE))
        if self._registry is None:
            return
        names = {"groups": "reports", "caches": "cache_reports", "evals": "eval_reports", "decoded": "decoded_reports",
                 "loaders": "loader_reports", "pools": "pools"}
        refs = {key: getattr(self._registry, method).remote() for key, method in names.items()}
        try:  # one wait for all, short: this runs on Tune's controller thread
            answers = ray.get(list(refs.values()), timeout=_SAVE_TIMEOUT_S)
            metric, mode = getattr(self, "_objective", (None, None))
            write_reports(dirpath, {"metric": metric, "mode": mode, **dict(zip(refs, answers))})
        except (ray.exceptions.RayError, ray.exceptions.GetTimeoutError, OSError) as e:
            logger.warning("coordinated_prep: the data-group reports were not saved with this checkpoint: %s", e)

    def restore_from_dir(self, dirpath: str) -> None:
        self._ensure_registry()
        # A registry that outlived the interrupted run (same driver, searcher not closed) still holds
        # its completions; the restored run reruns errored trials under their ids (resume_errored).
        ray.get(self._registry.restored.remote(), timeout=_CALL_TIMEOUT_S)
        self._inner.restore_from_dir(dirpath)
        self._restore_order(dirpath, tune_run_locals().get("resume_config"))

    def _restore_order(self, dirpath: str, resume: Any = None) -> None:
        """Take back the suggestions that were held back when Tune saved ``dirpath``, and the trials
        then running, as running again where Tune resumes them under their ids (``resume``: the
        restore's ``ResumeConfig``, None for Tune's default, which does). Where it ends them or
        restarts them under new ids, their ids are over: for the order (a restarted one keeps its place
        until its new id reports) and for the inner search algorithm and its limiter."""
        path = os.path.join(dirpath, ORDER_FILE)
        if self._lookahead and os.path.exists(path):
            with open(path, "rb") as f:
                self._order = cloudpickle.load(f)
            unfinished = getattr(resume, "unfinished", ResumeConfig.ResumeType.RESUME)
            if unfinished == ResumeConfig.ResumeType.RESUME:
                return
            ended = self._order.forget_running(restarted=unfinished == ResumeConfig.ResumeType.RESTART)
            for trial_id in ended:  # over under these ids: the inner limiter's places and its searcher learn it
                self._inner.on_trial_complete(trial_id, error=True)
            if ended:
                logger.info("coordinated_prep: the restored sweep's %d unfinished trials were %s under their ids",
                            len(ended), getattr(unfinished, "value", unfinished))

    # -- data groups ------------------------------------------------------------------------
    def start(self) -> None:
        """Start the registry and every node's prep pool now and wait until they are ready.

        Tune's first request for a trial does this anyway; call it earlier to start the pool while
        the driver does other work, or to time it apart. Idempotent.

        Raises:
            PrepError: A node's pool did not start (names the node and the fix).
        """
        self._ensure_registry()

    def group_reports(self) -> dict[str, dict[str, Any]]:
        """Per data group: samples prepared and served, prep seconds, peak staged bytes, and more."""
        return self._ask("reports")

    def group_reports_ref(self) -> ray.ObjectRef | None:
        """A reference to :meth:`group_reports`' answer, without waiting for it (None before the registry exists)."""
        return self._registry.reports.remote() if self._registry is not None else None

    def pool_reports(self) -> dict[str, dict[str, Any]]:
        """Per node: prep actors, reserved CPUs, staging budget and each live group's share of it."""
        return self._ask("pools")

    def eval_reports(self) -> dict[str, dict[str, Any]]:
        """Per evaluation pipeline: held-out samples prepared (once, when resident) against served."""
        return self._ask("eval_reports")

    def cache_reports(self) -> dict[str, dict[str, Any]]:
        """Per node: the raw-data cache's hits (local, remote), misses, storage reads and bytes held."""
        return self._ask("cache_reports") if self._cache is not None else {}

    def loader_reports(self) -> dict[str, dict[str, Any]]:
        """Per trial: what its loader measured (epochs read, data wait, stall), for any trainable."""
        return self._ask("loader_reports")

    def decoded_reports(self) -> dict[str, dict[str, Any]]:
        """Per node: the decoded tier's hits, misses, waits, samples and bytes kept (:mod:`coordinated_prep.tier`)."""
        return self._ask("decoded_reports")

    def _ask(self, method: str) -> dict[str, dict[str, Any]]:
        """The answer of the registry's ``method`` (what a ``*_reports`` method reads); ``{}`` before the registry."""
        if self._registry is None:
            return {}
        return ray.get(getattr(self._registry, method).remote(), timeout=_CALL_TIMEOUT_S)

    def attach(self) -> bool:
        """Take over this driver's running registry, if there is one; returns whether there was.

        ``Tuner.restore`` rebuilds the searcher it saved, and that copy starts or finds the registry.
        A twin created with the same arguments attaches to it to read its reports and close it.
        """
        if self._registry is None:
            job = ray.get_runtime_context().get_job_id()
            try:
                self._registry = ray.get_actor(registry_name(job), namespace=NAMESPACE)
                self.session = job
            except ValueError:
                return False
        return True

    def close(self) -> None:
        """Destroy every data group and the registry (idempotent; call after the sweep). With
        ``PoolSpec(keep_warm=True)`` the prep actors stay for the driver's next sweep
        (:mod:`coordinated_prep.pool.warm`)."""
        if self._registry is None:
            return
        try:
            self._await_start()
        except Exception as e:  # it shut down already, and gave its lent actors back
            logger.warning("coordinated_prep: the sweep's prep pools had not started: %s", e)
            return
        destroy(self._registry)
        self._registry = None
        warm.give_back(getattr(self, "_lent", {}), self._pool)
        self._lent = {}
