"""The benchmark's configuration: a frozen dataclass read from YAML (``experiments/bench.yaml``)."""

from __future__ import annotations

import os
from dataclasses import dataclass, field, fields
from typing import Any, Mapping

from coordinated_prep.errors import ConfigError
from coordinated_prep.sweep.yaml_loader import load_yaml

#: The loaders compared, in the order the table prints them.
LOADERS = ("dataloader", "dali", "coordinated-torchvision", "coordinated-dali")
INDEPENDENT = ("dataloader", "dali")
STEPS = ("simulated", "cnn")
#: Loaders that read Parquet record files (per-trial DALI reads image files with its own reader).
RECORD_LOADERS = ("dataloader", "coordinated-torchvision", "coordinated-dali")


@dataclass(frozen=True)
class BenchConfig:
    """What ``coordprep bench`` runs; every field has a default.

    Attributes:
        name: Output folder name under ``storage_path``.
        storage_path: Where ``bench.csv`` and ``bench.png`` go (``<storage_path>/<name>/``).
        dataset: JPEG dataset, an ImageFolder or builtin (default: ``builtin:photos``, 4,096 JPEGs of
            500 x 375 px cut from a photograph).
        size: Random-resized-crop output size.
        batch_size: Samples per batch (and per piece for the coordinated loaders).
        epochs: Epochs each trial reads.
        trials: Concurrent trial counts to run.
        loaders: Loaders to compare (see ``LOADERS``).
        steps: ``simulated`` (a fixed sleep per batch standing in for an accelerator) and/or ``cnn``
            (the small CNN trained on the CPU).
        simulated_step_ms: Duration of the simulated step per batch.
        cnn_trials: Trial counts for the CNN step (it is slow on a CPU).
        cnn_loaders: Loaders run for the CNN step, some of ``loaders`` (default: all of them).
        cnn_batches: Batches per trial for the CNN step (0 = whole epochs; else at least 2, since
            the first batch of every trial counts as start-up).
        cnn_width: Channel width of the small CNN.
        record_trials: Trial counts for the loaders reading the dataset as Parquet record files
            (converted once into ``<storage_path>/<name>/parquet``), simulated step only; empty
            for none. The read-only rows (raw files against records, cold and warm) always run.
        record_loaders: Loaders run on the record files (see ``RECORD_LOADERS``).
        cores: CPU cores for preparation (default: the machine's); independent loaders split them
            evenly over the trials (at least one worker each), coordinated ones run one prep actor
            per core.
        pool_actors: The coordinated loaders' prep actors: a number (default: ``cores``, one per core), or
            None for the pool a sweep gets by default (sized by demand: one actor to start with).
        object_store_mb: Ray object store size (the coordinated loaders stage in a quarter of it).
        transform: A user pipeline in place of the built-in crop and flip: a factory mapping
            (``{factory: "pkg.mod:fn", args: {...}}``) or a :class:`~coordinated_prep.pipeline.Factory`
            building a torchvision-style transform of the decoded ``tv_tensors.Image`` uint8 (3, H, W).
            The coordinated loader gets it as ``DataSpec(transform=...)``, the per-trial DataLoader
            builds the same factory over the decoded images; ``size`` is then the transform's business.
            The DALI loaders cannot run it: None (the built-in pipeline) for them.
    """

    name: str = "bench"
    storage_path: str = "runs"
    dataset: str = "builtin:photos"
    size: int = 224
    batch_size: int = 64
    epochs: int = 3
    trials: tuple[int, ...] = (1, 2, 4, 8)
    loaders: tuple[str, ...] = LOADERS
    steps: tuple[str, ...] = STEPS
    simulated_step_ms: float = 5.0
    cnn_trials: tuple[int, ...] = (1, 2)
    cnn_loaders: tuple[str, ...] | None = None
    cnn_batches: int = 4
    cnn_width: int = 8
    record_trials: tuple[int, ...] = (1, 4)
    record_loaders: tuple[str, ...] = ("dataloader", "coordinated-torchvision")
    cores: int = field(default_factory=lambda: os.cpu_count() or 1)
    pool_actors: int | None | str = "cores"
    object_store_mb: int = 2048
    transform: Any = None

    def __post_init__(self) -> None:
        for name in ("size", "batch_size", "epochs", "cores", "object_store_mb"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"bench.{name}={value!r} must be a positive integer")
        if not isinstance(self.cnn_batches, int) or self.cnn_batches < 0 or self.cnn_batches == 1:
            raise ConfigError(f"bench.cnn_batches={self.cnn_batches!r} must be 0 (whole epochs) or at least 2 "
                              "(the first batch counts as start-up, not throughput)")
        for name in ("trials", "cnn_trials"):
            value = getattr(self, name)
            if not value or not all(isinstance(n, int) and not isinstance(n, bool) and n >= 1 for n in value):
                raise ConfigError(f"bench.{name}={list(value)!r} must be a non-empty list of positive integers")
        if not all(isinstance(n, int) and not isinstance(n, bool) and n >= 1 for n in self.record_trials):
            raise ConfigError(f"bench.record_trials={list(self.record_trials)!r} must be a list of positive integers "
                              "([] for no record-file runs)")
        for name, allowed in (("loaders", LOADERS), ("steps", STEPS), ("record_loaders", RECORD_LOADERS)):
            value = getattr(self, name)
            bad = [v for v in value if v not in allowed]
            if not value or bad:
                hint = "; per-trial dali reads image files itself" if "dali" in bad and name == "record_loaders" else ""
                raise ConfigError(f"bench.{name}: {bad or 'empty'} not allowed; choose from {list(allowed)}{hint}")
        if self.cnn_loaders is not None and (not self.cnn_loaders or set(self.cnn_loaders) - set(self.loaders)):
            raise ConfigError(f"bench.cnn_loaders={list(self.cnn_loaders)!r} must be some of bench.loaders "
                              f"{list(self.loaders)} (or unset: all of them)")
        if self.pool_actors == "cores":
            object.__setattr__(self, "pool_actors", self.cores)
        if self.pool_actors is not None and (not isinstance(self.pool_actors, int) or isinstance(self.pool_actors, bool)
                                             or self.pool_actors < 1):
            raise ConfigError(f"bench.pool_actors={self.pool_actors!r} must be a number of prep actors >= 1, or null "
                              "for the pool a sweep gets by default (sized by demand)")
        if not self.simulated_step_ms > 0:
            raise ConfigError(f"bench.simulated_step_ms={self.simulated_step_ms!r} must be positive")
        self._check_transform()

    def step_loaders(self, step: str) -> tuple[str, ...]:
        """The loaders run for ``step``."""
        return self.cnn_loaders or self.loaders if step == "cnn" else self.loaders

    def _check_transform(self) -> None:
        """A factory from its mapping; the DALI loaders, which cannot run a user transform, refused with it."""
        from coordinated_prep.pipeline.datasets import Factory

        if self.transform is None:
            return
        if isinstance(self.transform, Mapping):
            object.__setattr__(self, "transform", Factory.from_mapping(self.transform, "bench.transform"))
        elif not isinstance(self.transform, Factory):
            raise ConfigError(f"bench.transform={self.transform!r} must be {{factory: 'pkg.mod:fn', args: {{...}}}} "
                              "(a Factory in Python), importable in the Ray workers")
        dali = [v for v in (*self.loaders, *(self.record_loaders if self.record_trials else ())) if "dali" in v]
        if dali:
            raise ConfigError(f"bench.transform={self.transform.factory!r} cannot run in the DALI loaders "
                              f"{sorted(set(dali))} (they run DALI's own crop and flip); drop them from loaders and "
                              "record_loaders, or drop transform to compare all four on the built-in pipeline")

    @classmethod
    def from_mapping(cls, values: Mapping[str, Any], where: str = "bench") -> "BenchConfig":
        """Build from YAML values, naming unknown keys."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ConfigError(f"{where}: unknown key(s) {unknown}; allowed: {sorted(known)}")
        converted = {k: tuple(v) if isinstance(v, list) else v for k, v in values.items()}
        return cls(**converted)


def load_bench(path: str) -> BenchConfig:
    """Read ``path``; every error names the file and the key."""
    raw = load_yaml(path)
    if raw is None:
        raw = {}
    if not isinstance(raw, Mapping):
        raise ConfigError(f"{path}: the top level must be a mapping of bench keys")
    try:
        return BenchConfig.from_mapping(raw, where=path)
    except ConfigError as e:
        message = str(e)
        raise ConfigError(message if message.startswith(path) else f"{path}: {message}") from None
