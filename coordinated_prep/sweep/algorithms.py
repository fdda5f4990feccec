"""A sweep's Tune scheduler and search algorithm: frozen specs, validated at construction, building Tune's."""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass, field, fields
from typing import Any, ClassVar, Literal, Mapping, Sequence

from coordinated_prep.errors import ConfigError
from coordinated_prep.sweep.syntax import Dimension, check_keys, is_int, is_number, parse_dimension

#: Progress, as every scheduler here counts it: results reported (the trainables report once per epoch).
TIME_ATTR = "training_iteration"
#: The optional packages a ``search.type`` imports, installed by the extra of the same name.
SEARCH_MODULES = {"random": (), "grid": (), "optuna": ("optuna",), "hyperopt": ("hyperopt",)}
_PIP_NAMES = {"sklearn": "scikit-learn"}  # pip's name where it is not the module's


def require_extra(extra: str, modules: Sequence[str], what: str) -> None:
    """Raise a ConfigError naming ``what`` and the pip extra to install when a module of ``modules`` is missing."""
    missing = [_PIP_NAMES.get(m, m) for m in modules if importlib.util.find_spec(m) is None]
    if missing:
        raise ConfigError(f"{what} needs {' and '.join(missing)}, not installed: "
                          f"pip install 'coordinated-prep[{extra}]'")


@dataclass(frozen=True)
class SchedulerSpec:
    """A ``scheduler:`` entry; one subclass per ``type``.

    No spec carries the sweep's ``metric`` and ``mode``: the runner sets them once, in ``tune.TuneConfig``,
    and Tune hands them to the scheduler and the searcher.
    """

    type: ClassVar[str] = ""

    def check_space(self, space: Mapping[str, Any]) -> None:
        """Reject a search space this scheduler cannot use, naming the key (most schedulers take any)."""

    def to_tune(self, default_max_t: int) -> Any:
        """The Tune scheduler; ``default_max_t`` is the epochs a trial trains unless the spec says."""
        raise NotImplementedError


def default_max_t(space: Mapping[str, Any]) -> int:
    """A trial's length where a scheduler's ``max_t`` is not set: the search space's ``epochs``, the
    largest it can take where it is searched over integers, else 100."""
    epochs = space.get("epochs")
    if isinstance(epochs, Dimension) and epochs.kind in ("choice", "grid", "randint"):
        values = list(epochs.args) if epochs.kind != "randint" else [epochs.args[1] - 1]
        if all(isinstance(v, int) and not isinstance(v, bool) for v in values):
            return max(values)
    return epochs if isinstance(epochs, int) and not isinstance(epochs, bool) else 100


@dataclass(frozen=True)
class FifoSpec(SchedulerSpec):
    """Every trial runs to its end, in the order the searcher suggested it."""

    type: ClassVar[str] = "fifo"

    def to_tune(self, default_max_t: int) -> Any:
        """Tune's ``FIFOScheduler``."""
        from ray.tune.schedulers import FIFOScheduler

        return FIFOScheduler()


@dataclass(frozen=True)
class AshaSpec(SchedulerSpec):
    """Asynchronous successive halving: at epochs ``grace_period * reduction_factor**k`` a trial outside the
    top ``1 / reduction_factor`` of the trials that reached that rung stops."""

    type: ClassVar[str] = "asha"
    grace_period: int = 1
    reduction_factor: float = 2.0
    max_t: int | None = None

    def __post_init__(self) -> None:
        _at_least("grace_period", self.grace_period, 1)
        _factor(self.reduction_factor)
        _max_t(self.max_t)

    def check_space(self, space: Mapping[str, Any]) -> None:
        """The first rung (``grace_period``) lies within a trial's length (Tune's ASHA asserts it)."""
        max_t = self.max_t or default_max_t(space)
        if self.grace_period > max_t:
            raise ConfigError(f"scheduler.grace_period={self.grace_period} is past a trial's length, max_t={max_t} "
                              f"({'scheduler.max_t' if self.max_t else 'search_space.epochs'}): ASHA's first rung "
                              "would never be reached; lower grace_period or raise max_t")

    def to_tune(self, default_max_t: int) -> Any:
        """Tune's ``ASHAScheduler``."""
        from ray.tune.schedulers import ASHAScheduler

        return ASHAScheduler(time_attr=TIME_ATTR, max_t=self.max_t or default_max_t, grace_period=self.grace_period,
                             reduction_factor=self.reduction_factor)


@dataclass(frozen=True)
class HyperBandSpec(SchedulerSpec):
    """Synchronous HyperBand: brackets of trials halved together (``coordinated_prep.tune.schedulers.HyperBandScheduler``,
    Ray's with its end-of-bracket hang fixed)."""

    type: ClassVar[str] = "hyperband"
    max_t: int | None = None
    reduction_factor: float = 3.0

    def __post_init__(self) -> None:
        _max_t(self.max_t)
        _factor(self.reduction_factor)

    def to_tune(self, default_max_t: int) -> Any:
        """Our ``HyperBandScheduler``."""
        from coordinated_prep.tune.schedulers import HyperBandScheduler

        return HyperBandScheduler(time_attr=TIME_ATTR, max_t=self.max_t or default_max_t,
                                  reduction_factor=self.reduction_factor)


@dataclass(frozen=True)
class PBTSpec(SchedulerSpec):
    """Population based training: every ``perturbation_interval`` epochs a trial in the bottom
    ``quantile_fraction`` takes the checkpoint and config of one in the top, then each key of
    ``hyperparam_mutations`` is resampled from its distribution (probability ``resample_probability``)
    or moved (x0.8 or x1.2; a neighbouring choice). ``synch``: all trials perturb at once. The trainable
    must save and restore checkpoints."""

    type: ClassVar[str] = "pbt"
    hyperparam_mutations: Mapping[str, Dimension] = field(default_factory=dict)
    perturbation_interval: int = 1
    quantile_fraction: float = 0.25
    resample_probability: float = 0.25
    synch: bool = False

    def __post_init__(self) -> None:
        _population(self.perturbation_interval, self.quantile_fraction)
        if not is_number(self.resample_probability) or not 0 <= self.resample_probability <= 1:
            raise ConfigError(f"scheduler.resample_probability={self.resample_probability!r} must be a number "
                              "from 0 to 1")
        if not isinstance(self.synch, bool):
            raise ConfigError(f"scheduler.synch={self.synch!r} must be true or false")
        _non_empty("hyperparam_mutations", self.hyperparam_mutations, "{lr: {loguniform: [0.001, 0.1]}}")
        for key, value in self.hyperparam_mutations.items():
            if not isinstance(value, Dimension) or value.kind == "grid":
                raise ConfigError(f"scheduler.hyperparam_mutations.{key}: {value!r} must be a distribution, one of "
                                  "{choice: [...]}, {uniform: [a, b]}, {loguniform: [a, b]}, {randint: [a, b]} "
                                  "(grid is not one: PBT samples new values)")

    def check_space(self, space: Mapping[str, Any]) -> None:
        """Every mutated key is a key of the search space."""
        _in_space("hyperparam_mutations", self.hyperparam_mutations, space)

    def to_tune(self, default_max_t: int) -> Any:
        """Tune's ``PopulationBasedTraining``, its mutations as Tune sample domains."""
        from ray.tune.schedulers import PopulationBasedTraining

        return PopulationBasedTraining(
            time_attr=TIME_ATTR, perturbation_interval=self.perturbation_interval,
            hyperparam_mutations={k: v.to_tune() for k, v in self.hyperparam_mutations.items()},
            quantile_fraction=self.quantile_fraction, resample_probability=self.resample_probability,
            synch=self.synch)


@dataclass(frozen=True)
class PB2Spec(SchedulerSpec):
    """Population based bandits: PBT whose new values come from a Gaussian-process bandit over
    ``hyperparam_bounds`` (continuous keys, key -> [low, high]). Needs the ``pb2`` extra and a
    trainable that checkpoints."""

    type: ClassVar[str] = "pb2"
    hyperparam_bounds: Mapping[str, Sequence[float]] = field(default_factory=dict)
    perturbation_interval: int = 1
    quantile_fraction: float = 0.25

    def __post_init__(self) -> None:
        _population(self.perturbation_interval, self.quantile_fraction)
        _non_empty("hyperparam_bounds", self.hyperparam_bounds, "{lr: [0.001, 0.1]}")
        for key, bounds in self.hyperparam_bounds.items():
            if (not isinstance(bounds, (list, tuple)) or len(bounds) != 2 or not all(is_number(b) for b in bounds)
                    or not bounds[0] < bounds[1]):
                raise ConfigError(f"scheduler.hyperparam_bounds.{key}={bounds!r} must be [low, high] numbers, "
                                  "low < high")
        require_extra("pb2", pb2_modules(), "scheduler.type=pb2")

    def check_space(self, space: Mapping[str, Any]) -> None:
        """Every bounded key is a key of the search space."""
        _in_space("hyperparam_bounds", self.hyperparam_bounds, space)

    def to_tune(self, default_max_t: int) -> Any:
        """Tune's ``PB2``."""
        require_extra("pb2", pb2_modules(), "scheduler.type=pb2")
        from ray.tune.schedulers.pb2 import PB2

        return PB2(time_attr=TIME_ATTR, perturbation_interval=self.perturbation_interval,
                   hyperparam_bounds={k: list(v) for k, v in self.hyperparam_bounds.items()},
                   quantile_fraction=self.quantile_fraction)


SCHEDULERS: dict[str, type[SchedulerSpec]] = {c.type: c for c in (FifoSpec, AshaSpec, HyperBandSpec, PBTSpec,
                                                                   PB2Spec)}


def pb2_modules() -> tuple[str, ...]:
    """What the installed Ray's PB2 imports: scikit-learn, and GPy too in Ray releases before GPy was
    replaced by scikit-learn's Gaussian process (ray-project/ray#59152; their ``pb2`` module has a ``GPy`` name)."""
    from ray.tune.schedulers import pb2

    return ("GPy", "sklearn") if hasattr(pb2, "GPy") else ("sklearn",)


@dataclass(frozen=True)
class SearchSpec:
    """How trial configs are chosen (``search:``).

    ``random`` (the default) and ``grid`` are Tune's ``BasicVariantGenerator``: every ``grid`` key is
    expanded and every distribution sampled, ``num_samples`` times over; ``grid`` only insists that
    the search space holds ``grid`` keys and constants, so that nothing is left to chance.
    ``optuna`` (Optuna's TPE sampler) and ``hyperopt`` (TPE) suggest each config from the results so
    far; they need their extra and take no ``grid`` keys. ``seed`` makes the suggestions repeatable.
    ``order``: ``group`` (default) runs the trials data group by data group, so that trials sharing a
    group run together; ``tune`` keeps the searcher's order (:class:`~coordinated_prep.CoordinatedSearcher`).
    ``window``: most suggestions held back to reorder (default 32 for ``random`` and ``grid``, 4 for
    ``optuna`` and ``hyperopt``, which suggest each one ahead from the results so far; 1: none).
    """

    type: Literal["random", "grid", "optuna", "hyperopt"] = "random"
    seed: int | None = None
    order: Literal["group", "tune"] = "group"
    window: int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.type, str) or self.type not in SEARCH_MODULES:
            raise ConfigError(f"search.type={self.type!r} must be one of {list(SEARCH_MODULES)}")
        if self.seed is not None and (not is_int(self.seed) or self.seed < 0):
            raise ConfigError(f"search.seed={self.seed!r} must be an integer >= 0 (or left out)")
        if self.order not in ("group", "tune"):
            raise ConfigError(f"search.order={self.order!r} must be 'group' (a data group's trials run together) "
                              "or 'tune' (Tune's own order)")
        if self.window is not None and (not is_int(self.window) or self.window < 1):
            raise ConfigError(f"search.window={self.window!r} must be an integer >= 1 (1: no look-ahead), or left out")
        require_extra(self.type, SEARCH_MODULES[self.type], f"search.type={self.type}")

    def check_space(self, space: Mapping[str, Any]) -> None:
        """Reject a ``grid`` key for a model-based searcher, and a distribution for ``grid``, naming the key."""
        for key, value in space.items():
            if not isinstance(value, Dimension):
                continue
            if self.type in ("optuna", "hyperopt") and value.kind == "grid":
                raise ConfigError(f"search_space.{key}: search.type={self.type} cannot search a grid; write "
                                  f"{{choice: {list(value.args)}}}, or use search: {{type: random}}")
            if self.type == "grid" and value.kind != "grid":
                raise ConfigError(f"search_space.{key}: search.type=grid takes only grid keys and constants, not "
                                  f"{value.kind}; write {{grid: [...]}}, or use search: {{type: random}}")

    def to_tune(self, max_concurrent: int) -> Any:
        """A Tune ``Searcher`` (optuna, hyperopt; not limited yet), or a ``BasicVariantGenerator`` running at
        most ``max_concurrent`` trials (0: no limit)."""
        if self.type == "optuna":
            from ray.tune.search.optuna import OptunaSearch

            return OptunaSearch(seed=self.seed)  # Ray seeds its default sampler, TPESampler(seed=seed)
        if self.type == "hyperopt":
            from ray.tune.search.hyperopt import HyperOptSearch

            return HyperOptSearch(random_state_seed=self.seed)
        from ray.tune.search import BasicVariantGenerator

        return BasicVariantGenerator(max_concurrent=max_concurrent, random_state=self.seed)


def parse_scheduler(value: Any) -> SchedulerSpec:
    """The ``scheduler:`` mapping as its spec; errors name the key and the keys its type allows."""
    if not isinstance(value, Mapping) or not isinstance(value.get("type"), str) or value["type"] not in SCHEDULERS:
        raise ConfigError(f"scheduler must be a mapping with type one of {list(SCHEDULERS)}, got {value!r}")
    cls = SCHEDULERS[value["type"]]
    check_keys(value, ("type",) + tuple(f.name for f in fields(cls)), f"scheduler ({cls.type})")
    kwargs = {k: v for k, v in value.items() if k != "type"}
    if "hyperparam_mutations" in kwargs:
        mutations = kwargs["hyperparam_mutations"]
        if not isinstance(mutations, Mapping):
            raise ConfigError(f"scheduler.hyperparam_mutations={mutations!r} must be a mapping of search-space "
                              "keys to distributions, e.g. {lr: {loguniform: [0.001, 0.1]}}")
        kwargs["hyperparam_mutations"] = {
            k: parse_dimension(f"scheduler.hyperparam_mutations.{k}", v) for k, v in mutations.items()}
    return cls(**kwargs)


def parse_search(value: Any) -> SearchSpec:
    """The ``search:`` mapping as a SearchSpec."""
    check_keys(value, ("type", "seed", "order", "window"), "search")
    return SearchSpec(**value)


def _at_least(key: str, value: Any, low: int) -> None:
    if not is_int(value) or value < low:
        raise ConfigError(f"scheduler.{key}={value!r} must be an integer >= {low}")


def _factor(value: Any) -> None:
    if not is_number(value) or value <= 1:
        raise ConfigError(f"scheduler.reduction_factor={value!r} must be a number > 1")


def _max_t(value: Any) -> None:
    if value is not None:
        _at_least("max_t", value, 1)


def _population(interval: Any, quantile: Any) -> None:
    _at_least("perturbation_interval", interval, 1)
    if not is_number(quantile) or not 0 < quantile <= 0.5:
        raise ConfigError(f"scheduler.quantile_fraction={quantile!r} must be a number in (0, 0.5]")


def _non_empty(key: str, value: Any, example: str) -> None:
    if not isinstance(value, Mapping) or not value:
        raise ConfigError(f"scheduler.{key} is required: a non-empty mapping, e.g. {example}")


def _in_space(key: str, keys: Mapping[str, Any], space: Mapping[str, Any]) -> None:
    for k in keys:
        if k not in space:
            raise ConfigError(f"scheduler.{key}.{k}: {k!r} is not a search_space key ({sorted(space)}); "
                              f"add it to search_space or remove it here")
