"""The YAML sweep schema, parsed into frozen dataclasses; nothing below this edge sees raw dicts.

Schema (every key but ``trainable`` and ``search_space`` is optional)::

    name: default                    # experiment name: <storage_path>/<name>
    storage_path: runs               # relative to the working directory
    trainable: small_cnn             # a registered trainable (small_cnn, resnet18) or module:function
    data:                            # DataSpec fields
      dataset: builtin:shapes        # or an ImageFolder or Parquet dataset directory
      seed: 0
      coordinated: true              # false: each trial prepares its own data (the baseline)
      pipeline: {size: 64, scale: [0.35, 1.0], hflip: 0.5}
      # or your own dataset and transforms, by import path (docs/pipelines.md):
      # dataset: {factory: "trainables.data.cifar:make", args: {n: 3000}}
      # transform: {factory: "trainables.data.cifar:train_transform"}   # also target_transform,
      #   transforms (input and target together), eval_transform, eval_transforms, ragged: [1.boxes]
    search_space:                    # constants, or one distribution per key
      lr: {loguniform: [0.01, 0.3]}
      batch_size: {choice: [32, 64]}
      width: {grid: [8, 16]}
      memory: {choice: [none, checkpoint, {budget: 0.3}]}   # or a constant: none, checkpoint, {budget: 0.3}
      echo: {choice: [1, 2, batch:2, auto]}   # data echoing per trial (coordinated_prep.trial.echo); not part of the group
      epochs: 3
      # a place inside `data` by its dotted path (coordinated_prep.sweep.data_space): each trial gets the DataSpec
      # of its values (equal values, one data group); every listable value is checked at load
      data.pipeline.scale: {grid: [[0.08, 1.0], [0.25, 1.0]]}
      data.pipeline.size: {choice: [96, 128]}
      # data.pipeline.scale.0: {uniform: [0.08, 0.5]}      an item of a list by its number (the upper bound stays)
      # data.transform.args.scale_min: {uniform: [0.1, 0.5]}   an argument of a {factory, args} transform
    num_samples: 8
    max_concurrent_trials: 4         # 0 = as many as resources allow
    max_failures: 0                  # retries per trial (Tune's FailureConfig); a retry resumes from its checkpoint
    reuse_actors: false              # Tune's: a finished (or PBT-exploited) trial's process runs the next trial
    resources_per_trial: {cpu: 0.25, gpu: 0}   # or gpu: auto (and gpu_margin: 0.1): each trial gets the GPU
                                               # share its measured peak needs (coordinated_prep.memory.packing)
    metric: accuracy                 # one the trainable reports (a registered one's: checked before Ray starts)
    mode: max
    scheduler: {type: asha, grace_period: 1, reduction_factor: 2}   # default {type: fifo}; the types and keys:
    #   fifo
    #   asha       grace_period: 1, reduction_factor: 2, max_t: <epochs>
    #   hyperband  max_t: <epochs>, reduction_factor: 3   (synchronous: coordinated_prep.tune.schedulers' class)
    #   pbt        hyperparam_mutations: {lr: {loguniform: [0.001, 0.1]}} (search-space keys, no grid, no data keys),
    #              perturbation_interval: 1, quantile_fraction: 0.25, resample_probability: 0.25, synch: false
    #   pb2        hyperparam_bounds: {lr: [0.001, 0.1]}, perturbation_interval: 1, quantile_fraction: 0.25
    #              (extra: pip install 'coordinated-prep[pb2]')
    #   every scheduler counts epochs (training_iteration) and ranks trials by metric and mode; pbt and pb2 take
    #   no searched data keys (a trial they move to another's config would change data group mid-run)
    search: {type: random, seed: 0}  # default random: Tune's generator (samples, and expands grid keys); grid:
                                     # the same, grid keys and constants only; optuna, hyperopt: model-based,
                                     # no grid keys, each needs its extra: pip install 'coordinated-prep[optuna]'
    ray: {num_cpus: 2, object_store_memory: 1073741824}             # passed to ray.init
    cache: {capacity_bytes: 256MiB, partitioned: true}              # a raw-data cache per node (CacheSpec)
    pool: {actors: 2, cpus: 1, staging_fraction: 0.25}              # each node's prep pool and budget (PoolSpec)
    # also include_dashboard, dashboard_host, metrics_export_port (Prometheus endpoint of the node),
    # node_ip_address (default 127.0.0.1: every port Ray opens listens on loopback only)
"""

from __future__ import annotations

import difflib
import importlib
import math
import os
from dataclasses import dataclass, field
from typing import Any, Callable, Literal, Mapping

from coordinated_prep.cache.spec import CacheSpec
from coordinated_prep.errors import ConfigError
from coordinated_prep.trial.echo import EchoSpec
from coordinated_prep.memory.packing import GpuAuto
from coordinated_prep.memory.spec import parse_memory
from coordinated_prep.pool.spec import PoolSpec
from coordinated_prep.spec import DataSpec
from coordinated_prep.sweep.algorithms import (FifoSpec, PB2Spec, PBTSpec, SchedulerSpec, SearchSpec, parse_scheduler,
                                               parse_search)
from coordinated_prep.sweep.data_space import DataSearch, candidates_of, check_data_search, data_keys
from coordinated_prep.sweep.syntax import DISTRIBUTIONS, Dimension, check_keys, parse_dimension
from coordinated_prep.sweep.yaml_loader import load_yaml

__all__ = ["DISTRIBUTIONS", "Dimension", "SweepConfig", "load_sweep", "resolve_trainable"]

TOP_KEYS = ("name", "storage_path", "trainable", "data", "search_space", "num_samples", "max_concurrent_trials",
            "max_failures", "reuse_actors", "resources_per_trial", "metric", "mode", "scheduler", "search", "ray", "cache", "pool")
#: What the registered trainables need of their search space: (integer?, lowest value, required?).
TRAINABLE_KEYS = {"lr": (False, 0.0, True), "batch_size": (True, 1, True), "epochs": (True, 1, True),
                  "width": (True, 1, False), "workers": (True, 1, False), "worker_failures": (True, 0, False)}
#: Every key the registered trainables read from a trial's config (``trainables/``), besides ``data.*``.
READ_KEYS = (*TRAINABLE_KEYS, "memory", "echo", "model_seed", "momentum", "weight_decay", "eval_batch_size",
             "torch_threads", "cpu_per_worker", "gpu_per_worker", "gpu_memory_fraction", "depth", "num_classes")
#: The other numbers the registered trainables read: integer or not, the values allowed, and what they are.
NUMBERS = {"eval_batch_size": (True, lambda v: v >= 1, ">= 1"), "torch_threads": (True, lambda v: v >= 1, ">= 1"),
           "model_seed": (True, lambda v: v >= 0, ">= 0"), "depth": (True, lambda v: v >= 1, ">= 1"),
           "num_classes": (True, lambda v: v >= 1, ">= 1"), "weight_decay": (False, lambda v: v >= 0, ">= 0"),
           "momentum": (False, lambda v: 0 < v < 1, "in (0, 1), as SGD's Nesterov momentum needs")}
#: Keys a checkpoint fixes (the model's shape, the schedule's length): PBT and PB2 cannot move them.
FIXED_BY_CHECKPOINT = ("batch_size", "epochs", "width", "depth", "workers", "num_classes")
RAY_KEYS = ("num_cpus", "object_store_memory", "include_dashboard", "dashboard_host", "metrics_export_port",
            "node_ip_address")


@dataclass(frozen=True)
class SweepConfig:
    """A whole experiment sweep, validated; at construction, the scheduler and the search algorithm check
    that they can work with the search space."""

    path: str
    trainable: str
    data: DataSpec
    search_space: Mapping[str, Any]
    name: str = "default"
    storage_path: str = "runs"
    num_samples: int = 1
    max_concurrent_trials: int = 0
    max_failures: int = 0
    reuse_actors: bool = False  # Tune's TuneConfig.reuse_actors: a finished trial's process runs the next one
    resources_per_trial: Mapping[str, float] = field(default_factory=lambda: {"cpu": 1.0})
    gpu_auto: GpuAuto | None = None  # resources_per_trial.gpu: auto (the runner measures and packs)
    metric: str = "accuracy"
    mode: Literal["min", "max"] = "max"
    scheduler: SchedulerSpec = field(default_factory=FifoSpec)
    search: SearchSpec = field(default_factory=SearchSpec)
    ray: Mapping[str, Any] = field(default_factory=dict)
    cache: CacheSpec | None = None
    pool: PoolSpec = field(default_factory=PoolSpec)
    data_search: DataSearch | None = None  # the search-space keys data.<path>, set inside ``data`` per trial

    def __post_init__(self) -> None:
        self.scheduler.check_space(self.search_space)
        self.search.check_space(self.search_space)
        for spec in check_data_search(self.search_space, self.data_search, self.scheduler):
            if isinstance(spec.dataset, str) and spec.dataset != self.data.dataset:
                _check_dataset(spec.dataset, "search_space.data.dataset")
        trials = self.num_samples * math.prod(len(v.args) for v in self.search_space.values()
                                              if isinstance(v, Dimension) and v.kind == "grid")
        if self.scheduler.type == "hyperband" and 0 < self.max_concurrent_trials < trials:
            # The searcher creates a trial only when a slot frees; HyperBand puts each trial in a
            # bracket when it is created, so a bracket is halved before its late trials exist, and
            # they are never compared with the others (measured: 6 trials, 4 at a time, none halved).
            raise ConfigError(
                f"max_concurrent_trials={self.max_concurrent_trials} with scheduler hyperband and {trials} trials: "
                "synchronous HyperBand needs every trial of a bracket created up front, or its brackets are halved "
                "before their last trials start; set max_concurrent_trials: 0 and let resources_per_trial bound "
                "how many run at once")

    def trainable_fn(self) -> Callable[[dict], None]:
        """The trainable function this sweep names."""
        return resolve_trainable(self.trainable, self.path)

    def param_space(self) -> dict[str, Any]:
        """The Tune config: the search space plus the DataSpec under ``data``; with data keys in the search
        space, ``data`` is a ``tune.sample_from`` that builds each trial's DataSpec from its values."""
        space = {k: v.to_tune() if isinstance(v, Dimension) else v for k, v in self.search_space.items()}
        space["data"] = self.data if self.data_search is None else self.data_search.to_tune()
        return space


def load_sweep(path: str) -> SweepConfig:
    """Read and validate a sweep file; every error names the file, the key path and what is allowed."""
    raw = load_yaml(path)
    try:
        return _parse(path, raw)
    except ConfigError as e:
        raise ConfigError(f"{path}: {e}") from None


def _parse(path: str, raw: Any) -> SweepConfig:
    if not isinstance(raw, Mapping):
        raise ConfigError(f"the file must hold a mapping with keys {list(TOP_KEYS)}")
    check_keys(raw, TOP_KEYS, "top level")
    for key in ("trainable", "search_space"):
        if key not in raw:
            raise ConfigError(f"missing required key {key!r}")
    trainable = _typed(raw, "trainable", str, "a registered trainable name or module:function")
    resolve_trainable(trainable, path)
    data = DataSpec.from_mapping(raw.get("data") or {}, where="data")
    if isinstance(data.dataset, str):
        _check_dataset(data.dataset)
    space = raw["search_space"]
    if not isinstance(space, Mapping) or not space:
        raise ConfigError("search_space must be a non-empty mapping of config keys to constants or distributions")
    for key in space:
        if not isinstance(key, str):
            raise ConfigError(f"search_space: the key {key!r} is not a name (YAML reads yes/no as booleans and digits "
                              "as numbers); quote it, e.g. 'yes':")
    if "data" in space:
        raise ConfigError("search_space.data: the data spec belongs under the top-level 'data' key; search a value "
                          "inside it with a dotted key, e.g. search_space: {data.pipeline.size: {choice: [96, 128]}}")
    kwargs: dict[str, Any] = {"path": path, "trainable": trainable, "data": data,
                              "search_space": {k: parse_dimension(f"search_space.{k}", v) for k, v in space.items()}}
    if data_keys(space):
        kwargs["data_search"] = DataSearch(raw.get("data") or {}, data_keys(space))
    if "scheduler" in raw:
        kwargs["scheduler"] = parse_scheduler(raw["scheduler"])
    if "search" in raw:
        kwargs["search"] = parse_search(raw["search"])
    if ":" not in trainable:
        _check_trainable_keys(kwargs["search_space"], trainable, kwargs.get("scheduler", FifoSpec()))
    for key, typ, what in (("name", str, "a name"), ("storage_path", str, "a directory"),
                           ("metric", str, "a reported metric name")):
        if key in raw:
            kwargs[key] = _typed(raw, key, typ, what)
    if "storage_path" in kwargs:
        kwargs["storage_path"] = os.path.expanduser(kwargs["storage_path"])
    if ":" not in trainable:
        _check_metric(kwargs.get("metric", SweepConfig.metric), trainable)
    for key, low in (("num_samples", 1), ("max_concurrent_trials", 0), ("max_failures", 0)):
        if key in raw:
            value = raw[key]
            if not isinstance(value, int) or isinstance(value, bool) or value < low:
                raise ConfigError(f"{key}={value!r} must be an integer >= {low}")
            kwargs[key] = value
    if "reuse_actors" in raw:
        if not isinstance(raw["reuse_actors"], bool):
            raise ConfigError(f"reuse_actors={raw['reuse_actors']!r} must be true or false (Tune's "
                              "TuneConfig.reuse_actors: a finished trial's process runs the next trial)")
        kwargs["reuse_actors"] = raw["reuse_actors"]
    if "mode" in raw:
        if raw["mode"] not in ("min", "max"):
            raise ConfigError(f"mode={raw['mode']!r} must be 'min' or 'max'")
        kwargs["mode"] = raw["mode"]
    if "resources_per_trial" in raw:
        kwargs["resources_per_trial"], kwargs["gpu_auto"] = _resources(raw["resources_per_trial"])
    if "ray" in raw:
        kwargs["ray"] = _ray_options(raw["ray"])
    if raw.get("cache") is not None:
        kwargs["cache"] = CacheSpec.from_mapping(raw["cache"], "cache")
    if raw.get("pool") is not None:
        kwargs["pool"] = PoolSpec.from_mapping(raw["pool"], "pool")
    return SweepConfig(**kwargs)


def resolve_trainable(name: str, where: str = "trainable") -> Callable[[dict], None]:
    """A registered trainable by name, or an explicit ``module:function``; nothing else is imported."""
    from trainables import REGISTRY

    if name in REGISTRY:
        return REGISTRY[name]
    if ":" not in name:
        raise ConfigError(f"trainable={name!r} is not registered ({sorted(REGISTRY)}); "
                          "name one of those or give an explicit module:function")
    module, _, attr = name.partition(":")
    try:
        fn = getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError) as e:
        raise ConfigError(f"trainable={name!r}: cannot import it ({e})") from None
    if not callable(fn):
        raise ConfigError(f"trainable={name!r} is not callable")
    return fn


def _check_dataset(dataset: str, name: str = "data.dataset") -> None:
    from coordinated_prep.pipeline.sources import BUILTIN_DATASETS, PARQUET_MANIFEST
    from coordinated_prep.pipeline.sources.remote import is_url
    from coordinated_prep.pipeline.sources.remote_folder import is_remote_folder
    from coordinated_prep.pipeline.sources.shard_index import is_shard_index
    from coordinated_prep.pipeline.sources.tar_shards import is_tar_dataset

    if dataset.startswith("builtin:"):
        if dataset not in BUILTIN_DATASETS:
            raise ConfigError(f"{name}={dataset!r} is not a builtin dataset; choose one of {list(BUILTIN_DATASETS)}")
    elif not os.path.isdir(dataset) and not is_tar_dataset(dataset) and not is_remote_folder(dataset) and not (
            is_url(dataset) and dataset.endswith("/" + PARQUET_MANIFEST)) and not (
            is_shard_index(dataset) and (is_url(dataset) or os.path.isfile(os.path.expanduser(dataset)))):
        raise ConfigError(f"{name}={dataset!r}: no such directory; give an ImageFolder root (local or a URL), a "
                          f"Parquet dataset directory (coordprep convert) or the URL of its {PARQUET_MANIFEST}, WebDataset "
                          "tar shards (a folder of *.tar, a .tar file, a pattern such as 'shards-{0000..0063}.tar' or "
                          f"a shard index's .json, local or a URL) or one of {list(BUILTIN_DATASETS)}")


#: What Tune adds to every result: a sweep may rank by these whatever its trainable reports.
TUNE_RESULT_KEYS = ("training_iteration", "time_total_s", "time_this_iter_s", "time_since_restore",
                    "iterations_since_restore", "timestamp")


def _check_metric(metric: str, trainable: str) -> None:
    """A registered trainable's ``metric`` is one it reports (Tune would fail its first result, after Ray's start)."""
    from trainables import REPORTS

    reported = REPORTS.get(trainable)
    if reported is None or metric in reported or metric in TUNE_RESULT_KEYS:
        return
    known = sorted(reported) + list(TUNE_RESULT_KEYS)
    near = difflib.get_close_matches(metric, known, n=1, cutoff=0.6)
    hint = f"did you mean {near[0]!r}? " if near else ""
    raise ConfigError(f"metric={metric!r}: trainable {trainable!r} reports no such metric; {hint}(it reports "
                      f"{sorted(reported)}, and Tune adds {list(TUNE_RESULT_KEYS)})")


def _check_trainable_keys(space: Mapping[str, Any], trainable: str, scheduler: SchedulerSpec) -> None:
    """Every value a registered trainable's key can take must be usable (batch_size 0 is not), the values
    PBT and PB2 move a trial to included; and PBT and PB2 do not move data-parallel trials (``workers``
    above 1), whose checkpoints stay with their Ray Train runs."""
    for key, (_, _, required) in TRAINABLE_KEYS.items():
        if key not in space:
            if required:
                raise ConfigError(f"search_space.{key} is required by trainable {trainable!r}")
            continue
        _check_trainable_values(f"search_space.{key}", key, space[key], trainable)
    for key, (integer, allowed, what) in NUMBERS.items():
        for v in (space[key].args if isinstance(space[key], Dimension) else [space[key]]) if key in space else ():
            ok = isinstance(v, int) if integer else isinstance(v, (int, float))
            if isinstance(v, bool) or not ok or not math.isfinite(v) or not allowed(v):
                raise ConfigError(f"search_space.{key}: {v!r} must be {'an integer' if integer else 'a number'} "
                                  f"{what} (trainable {trainable!r})")
    for key in space:  # a misspelt key would reach the trials unread, leaving the default in its place
        near = difflib.get_close_matches(key, READ_KEYS, n=1, cutoff=0.8)
        if key not in READ_KEYS and not key.startswith("data.") and near:
            raise ConfigError(f"search_space.{key}: trainable {trainable!r} reads no such key; did you mean "
                              f"{near[0]!r}? (it reads {sorted(READ_KEYS)} and data.* keys)")
    if "memory" in space:
        _check_memory("search_space.memory", space["memory"])
    if "echo" in space:
        _check_echo("search_space.echo", space["echo"])
    if isinstance(scheduler, (PBTSpec, PB2Spec)) and any(
            isinstance(k, int) and k > 1 for k in candidates_of(space.get("workers", 1))):
        raise ConfigError(f"search_space.workers: scheduler {scheduler.type} copies a better trial's checkpoint into "
                          "a worse trial, and a data-parallel trial's checkpoints stay with its Ray Train run (Tune "
                          "never receives them); use workers: 1, or scheduler fifo, asha or hyperband")
    moves: Mapping[str, Any] = {}
    if isinstance(scheduler, PBTSpec):
        moves = {f"hyperparam_mutations.{k}": (k, v) for k, v in scheduler.hyperparam_mutations.items()}
    elif isinstance(scheduler, PB2Spec):
        moves = {f"hyperparam_bounds.{k}": (k, Dimension("uniform", tuple(v)))
                 for k, v in scheduler.hyperparam_bounds.items()}
    for where, (key, value) in moves.items():
        if key in FIXED_BY_CHECKPOINT:
            raise ConfigError(f"scheduler.{where}: trainable {trainable!r} cannot change {key} in a running trial (a "
                              "checkpoint holds the model's shape and the schedule's length); search it in "
                              "search_space and let PBT move lr, momentum or weight_decay")
        if key in TRAINABLE_KEYS:
            _check_trainable_values(f"scheduler.{where}", key, value, trainable)
        elif key == "memory":
            _check_memory(f"scheduler.{where}", value)
        elif key == "echo":
            _check_echo(f"scheduler.{where}", value)


def _check_echo(where: str, value: Any) -> None:
    """``echo`` is a constant or a choice or grid of echo settings (1, 2, batch:2, auto...)."""
    if isinstance(value, Dimension) and value.kind not in ("choice", "grid"):
        raise ConfigError(f"{where}: a {value.kind} distribution cannot pick echo settings; "
                          "use a constant or {choice: [1, 2, auto]}")
    for i, v in enumerate(value.args if isinstance(value, Dimension) else [value]):
        EchoSpec.parse(v, f"{where}.{value.kind}[{i}]" if isinstance(value, Dimension) else where)


def _check_memory(where: str, value: Any) -> None:
    """``memory`` is a constant or a choice or grid of memory modes (none, checkpoint, {budget: f})."""
    if isinstance(value, Dimension) and value.kind not in ("choice", "grid"):
        raise ConfigError(f"{where}: a {value.kind} distribution cannot pick memory modes; "
                          "use a constant or {choice: [none, checkpoint, {budget: 0.3}]}")
    for i, v in enumerate(value.args if isinstance(value, Dimension) else [value]):
        parse_memory(v, f"{where}.{value.kind}[{i}]" if isinstance(value, Dimension) else where)


def _check_trainable_values(where: str, key: str, value: Any, trainable: str) -> None:
    integer, low, _ = TRAINABLE_KEYS[key]
    values = list(value.args) if isinstance(value, Dimension) else [value]
    kind = "an integer" if integer else "a number"
    for v in values:
        ok = isinstance(v, int) if integer else isinstance(v, (int, float))
        if isinstance(v, bool) or not ok or not math.isfinite(v) or v < low or (not integer and v <= 0):
            bound = f">= {low}" if integer else "> 0 and finite"
            raise ConfigError(f"{where}: {v!r} must be {kind} {bound} (trainable {trainable!r})")


def _resources(value: Any) -> tuple[dict[str, float], GpuAuto | None]:
    if not isinstance(value, Mapping):
        raise ConfigError(f"resources_per_trial={value!r} must be a mapping like {{cpu: 1, gpu: 0}}")
    check_keys(value, ("cpu", "gpu", "gpu_margin"), "resources_per_trial")
    value = dict(value)
    auto = None
    if value.get("gpu") == "auto":
        auto = GpuAuto(value.pop("gpu_margin", 0.1))
        del value["gpu"]
    elif "gpu_margin" in value:
        raise ConfigError("resources_per_trial.gpu_margin applies to gpu: auto only; set gpu: auto or remove it")
    for k, v in value.items():
        if not isinstance(v, (int, float)) or isinstance(v, bool) or v < 0:
            allowed = " or 'auto'" if k == "gpu" else ""
            raise ConfigError(f"resources_per_trial.{k}={v!r} must be a number >= 0{allowed}")
    if auto is None and value and not any(value.values()):  # Tune would reserve its default, 1 CPU, instead
        raise ConfigError(f"resources_per_trial={dict(value)}: a trial needs some resource (Tune would give it 1 CPU "
                          "instead); give cpu a fraction such as 0.25")
    return {k: float(v) for k, v in value.items()}, auto


def _ray_options(value: Any) -> dict[str, Any]:
    """The ``ray:`` keys, each of the type ``ray.init`` takes (a byte size may have a unit: 2GiB)."""
    from coordinated_prep.cache.spec import parse_bytes

    check_keys(value, RAY_KEYS, "ray")
    options = dict(value)
    for key, v in options.items():
        if key == "object_store_memory":
            options[key] = parse_bytes(v, "ray.object_store_memory")
        elif key in ("num_cpus", "metrics_export_port") and (not isinstance(v, int) or isinstance(v, bool) or v < 1):
            raise ConfigError(f"ray.{key}={v!r} must be an integer >= 1")
        elif key == "include_dashboard" and not isinstance(v, bool):
            raise ConfigError(f"ray.include_dashboard={v!r} must be true or false")
        elif key in ("dashboard_host", "node_ip_address") and not isinstance(v, str):
            raise ConfigError(f"ray.{key}={v!r} must be an address such as 127.0.0.1")
    return options


def _typed(raw: Mapping[str, Any], key: str, typ: type, what: str) -> Any:
    value = raw[key]
    if not isinstance(value, typ):
        raise ConfigError(f"{key}={value!r} must be {what}")
    return value
