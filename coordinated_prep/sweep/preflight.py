"""What ``coordprep sweep --dry-run`` tries beyond reading the file: every data group the sweep can make.

Loading a sweep checks names and values (:mod:`coordinated_prep.sweep.config`). A dry run also builds
each distinct DataSpec the search space can give (:meth:`~coordinated_prep.sweep.data_space.DataSearch.variants`):
every factory with its arguments (a misspelt argument fails here, not in every trial), then the
pipeline, whose first training and held-out samples are prepared as a group's start prepares them
(:func:`~coordinated_prep.pipeline.probe.probe`: a transform torchvision refuses, one that cannot be
seeded, samples of varying structure; the built-in image pipeline's layout is known without reading).
A ``UserWarning`` that torchvision raises while a factory builds counts as an error here: it is how
torchvision says an argument is out of range (``RandomResizedCrop`` with
``scale=(1.7, 1.0)`` warns "Scale and ratio should be of kind (min, max)" and then crops something
else than asked).
"""

from __future__ import annotations

import os
import warnings
from typing import Any, Mapping

from coordinated_prep.errors import ConfigError, CoordinatedPrepError
from coordinated_prep.pipeline.datasets import Factory
from coordinated_prep.spec import TRANSFORM_FIELDS, DataSpec


def preflight(cfg: Any) -> int:
    """Build and probe every DataSpec of the sweep ``cfg`` (a :class:`~coordinated_prep.sweep.config.SweepConfig`).

    Returns:
        The number of distinct DataSpecs tried.

    Raises:
        ConfigError: A factory fails or warns while building, or a pipeline's first samples cannot be
            prepared, naming the file, the ``data`` key, the searched values that made the spec and the cause.
    """
    variants = data_variants(cfg)
    probed: set[str] = set()  # specs that differ only in their part (fold, fraction, subset) probe once
    for values, spec in variants:
        where = "data" + (f" with {describe_values(values)}" if values else "")
        try:
            try_spec(spec, where, probe_it=spec.group_key not in probed)
            probed.add(spec.group_key)
        except CoordinatedPrepError as e:
            raise ConfigError(f"{cfg.path}: {e}") from None
    return len(variants)


def check_reachable(cfg: Any) -> None:
    """Ask each dataset URL the sweep ``cfg`` can read for one listing or one file's details, here,
    before Ray starts: a URL that cannot be reached from this machine (a server refusing connections,
    credentials missing, no such bucket or file) fails at once, named, instead of in every trial.
    One request or two per URL (over HTTP a file's details may take a HEAD and a GET); local datasets
    were checked when the file was loaded. Skipped under Ray Client (``RAY_ADDRESS=ray://...``), where
    the data is read from the cluster, not from here.

    Raises:
        ConfigError: Naming the file, the dataset, the cause and the fix.
    """
    from coordinated_prep.errors import DatasetError
    from coordinated_prep.pipeline.sources.remote import is_url
    from coordinated_prep.pipeline.sources.remote_folder import reach

    if os.environ.get("RAY_ADDRESS", "").startswith("ray://"):
        return  # Ray Client: the sweep's registry lists the data on the cluster, whose network this machine may lack
    variants = data_variants(cfg)
    urls: dict[str, str] = {}  # URL -> the key that names it
    for values, spec in variants:
        if isinstance(spec.dataset, str) and is_url(spec.dataset) and spec.dataset not in urls:
            searched = [k for k, v in values.items() if v == spec.dataset]
            urls[spec.dataset] = f"search_space.{searched[0]}" if searched else "data.dataset"
    for url, key in sorted(urls.items()):
        try:
            reach(url)
        except DatasetError as e:
            raise ConfigError(f"{cfg.path}: {key}: {e}") from None


def data_variants(cfg: Any) -> list[tuple[dict[str, Any], DataSpec]]:
    """Each distinct DataSpec sweep ``cfg`` can give, with the searched values that built it."""
    return cfg.data_search.variants(cfg.search_space) if cfg.data_search is not None else [({}, cfg.data)]


def try_spec(spec: DataSpec, where: str = "data", probe_it: bool = True) -> None:
    """Build ``spec``'s factories and prepare its first training and held-out samples here (with
    ``probe_it``; without, for a spec whose group was probed already, its part is checked and a fold's
    own evaluation samples probed).

    Raises:
        ConfigError: As :func:`preflight` (``where`` names the spec).
        SampleError, StructureError: From the probe, prefixed with ``where``.
    """
    from coordinated_prep.pipeline.probe import probe, train_indices
    from coordinated_prep.pipeline.transforms import make_pipeline
    from coordinated_prep.pipeline.part import held_out, part_ids

    for name in ("dataset", *TRANSFORM_FIELDS):
        value = getattr(spec, name)
        if isinstance(value, Factory):
            _build(value, f"{where}: {name}")
    try:
        pipeline = make_pipeline(spec)
        n = len(pipeline)
        part_ids(spec, n)  # a subset's indices are in the training split; folds are not empty
        if probe_it:
            probe(pipeline, spec.seed, train_indices(n, spec.holdout), spec.ragged, spec.views, "train", where)
        if probe_it or spec.fold is not None:  # each fold evaluates on samples of its own
            probe(pipeline, spec.seed, held_out(spec, n), spec.ragged, 1, "eval", f"{where} (evaluation)")
    except CoordinatedPrepError as e:
        raise ConfigError(f"{where}: {e}" if not str(e).startswith(where) else str(e)) from None


def _build(factory: Factory, where: str) -> None:
    """``factory.build()`` with its UserWarnings raised (see the module's docstring)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("error", category=UserWarning, module=r"torchvision\.")
        try:
            factory.build()
        except ConfigError as e:
            raise ConfigError(f"{where}: {e}; fix the factory's args (a torchvision warning while building counts as "
                              "an error in a dry run: it is how torchvision refuses an argument)") from None


def describe_values(values: Mapping[str, Any]) -> str:
    """``search_space.k=v, ...`` of a variant's searched values."""
    return ", ".join(f"search_space.{k}={v!r}" for k, v in values.items())
