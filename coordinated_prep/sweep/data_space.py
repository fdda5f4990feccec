"""Data keys of a sweep's search space (``data.pipeline.scale.0: {uniform: [0.2, 0.6]}``) and each trial's DataSpec.

A search-space key ``data.<path>`` addresses one place inside the sweep's top-level ``data`` mapping:
a DataSpec field (``data.seed``), a PipelineSpec field (``data.pipeline.size``), an item of a list by
its number (``data.pipeline.scale.0``: the pair's lower bound, the upper as ``data`` gives it), or
what a factory mapping passes (``data.transform.args.scale_min``). Tune samples each such key as an
ordinary top-level config key; ``param_space["data"]`` is a ``tune.sample_from`` of a
:class:`DataSearch`, which Tune calls with the trial's resolved config when it adds the trial (after
every search algorithm has chosen, so Optuna and HyperOpt see only the data keys). Each trial's
``config["data"]`` is thus the DataSpec of its own values: trials with equal values share one data
group, and a continuous distribution gives each trial a group of its own.
"""

from __future__ import annotations

import copy
import dataclasses
import itertools
import math
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

from coordinated_prep.errors import ConfigError
from coordinated_prep.spec import TRANSFORM_FIELDS, DataSpec, PipelineSpec
from coordinated_prep.sweep.syntax import Dimension

PREFIX = "data."
#: DataSpec fields no search may vary: the sweep starts one prep pool, or none, for every trial.
FIXED = {"coordinated": "it decides for the whole sweep whether a prep pool runs; run two sweeps to compare"}
#: Most value combinations checked together at load; beyond it each key is checked with the others at their first value.
MAX_COMBINATIONS = 1024
_FACTORY_KEYS = ("factory", "args")


def data_keys(space: Mapping[str, Any]) -> tuple[str, ...]:
    """The search-space keys that address the data mapping (``data.…``), in the file's order."""
    return tuple(k for k in space if isinstance(k, str) and k.startswith(PREFIX))


def check_data_search(space: Mapping[str, Any], search: DataSearch | None, scheduler: Any) -> list[DataSpec]:
    """A SweepConfig's data search: the search space's data keys are its keys, every value they can take
    that can be listed builds a valid DataSpec (:meth:`DataSearch.check`, whose distinct specs are
    returned), and the scheduler keeps every trial in one data group (:func:`check_scheduler`)."""
    keys = data_keys(space)
    if keys != (search.keys if search is not None else ()):
        searched = list(search.keys) if search is not None else None
        raise ConfigError(f"SweepConfig: the data keys of search_space {list(keys)} must be those of data_search "
                          f"({searched}); build it as DataSearch(<the data mapping>, data_keys(search_space))")
    if search is None:
        return []
    check_scheduler(space, scheduler)
    return search.check(space)


@dataclass(frozen=True)
class DataSearch:
    """The sweep's ``data`` mapping, as written, and the search-space keys that set values inside it.

    Validated at construction: every key addresses a place the DataSpec schema has (errors name
    ``search_space.<key>`` and what is allowed there). Called with a trial's config, it returns that
    trial's DataSpec (the ``tune.sample_from`` function of ``param_space["data"]``).

    Args:
        base: The top-level ``data`` mapping (plain YAML values: mappings, lists, numbers, strings).
        keys: The search-space keys starting with ``data.``.
    """

    base: Mapping[str, Any]
    keys: tuple[str, ...]

    def __post_init__(self) -> None:
        if not isinstance(self.base, Mapping):
            raise ConfigError(f"data={self.base!r} must be a mapping of DataSpec fields to search keys inside it")
        object.__setattr__(self, "base", copy.deepcopy(dict(self.base)))
        object.__setattr__(self, "keys", tuple(self.keys))
        for key in self.keys:
            _place(copy.deepcopy(self.base), key)
        for a, b in itertools.permutations(self.keys, 2):
            if b.startswith(a + "."):
                raise ConfigError(f"search_space.{b} lies inside search_space.{a}: both would set it; keep one")

    def spec(self, values: Mapping[str, Any]) -> DataSpec:
        """The DataSpec of the base mapping with ``values`` (search-space key -> value) put in place."""
        data = copy.deepcopy(self.base)
        for key in self.keys:
            if key not in values:
                raise ConfigError(f"the trial config has no {key!r}: the data search needs a value for every data key "
                                  f"({list(self.keys)}); pass SweepConfig.param_space() to Tune unchanged")
            container, slot = _place(data, key)
            container[slot] = copy.deepcopy(values[key])
        return DataSpec.from_mapping(data, where="data")

    def __call__(self, config: Mapping[str, Any]) -> DataSpec:
        """The trial's DataSpec from its resolved config (what Tune calls a ``sample_from`` function with)."""
        return self.spec(config)

    def to_tune(self) -> Any:
        """``param_space["data"]``: Tune calls this search with each trial's resolved config."""
        from ray import tune

        return tune.sample_from(self)

    def check(self, space: Mapping[str, Any]) -> list[DataSpec]:
        """Build the DataSpec of every value of the data keys that can be listed (each ``choice`` and
        ``grid`` value, a continuous range's low and high ends): each key's values with the other keys at
        their first, then every combination when there are at most :data:`MAX_COMBINATIONS`.

        Returns:
            The distinct DataSpecs built.

        Raises:
            ConfigError: A value makes an invalid DataSpec, naming the search-space key, the value, the
                other data keys' values and the DataSpec's own complaint.
        """
        return [spec for _, spec in self.variants(space)]

    def variants(self, space: Mapping[str, Any]) -> list[tuple[dict[str, Any], DataSpec]]:
        """:meth:`check`'s distinct DataSpecs, each with the first data-key values that built it."""
        candidates = {key: candidates_of(space[key]) for key in self.keys}
        first = {key: values[0] for key, values in candidates.items()}
        specs: dict[str, tuple[dict[str, Any], DataSpec]] = {}
        for key, values in candidates.items():  # one key at a time first: an error names the one at fault
            for value in values:
                self._checked({**first, key: value}, [key], specs)
        if math.prod(len(v) for v in candidates.values()) <= MAX_COMBINATIONS:
            for combo in itertools.product(*candidates.values()):
                self._checked(dict(zip(self.keys, combo)), list(self.keys), specs)
        return list(specs.values())

    def _checked(self, values: Mapping[str, Any], named: Sequence[str],
                 specs: dict[str, tuple[dict[str, Any], DataSpec]]) -> None:
        try:
            spec = self.spec(values)
        except ConfigError as e:
            blame = " with ".join(f"search_space.{k}={values[k]!r}" for k in named)
            others = [f"{k}={values[k]!r}" for k in self.keys if k not in named]
            context = f" (with {', '.join(others)})" if others else ""
            raise ConfigError(f"{blame}{context}: {e}; change the values searched, or the base value under data") \
                from None
        specs.setdefault(spec._key, (dict(values), spec))  # each part too: a subset or fold may not fit the data


def candidates_of(value: Any) -> list[Any]:
    """The values of one search-space entry that load-time checks try: a constant itself, every ``choice``
    or ``grid`` value, the low and high ends of a range as Tune draws them (floats for ``uniform`` and
    ``loguniform``, even from integer bounds; ``randint``'s high end is exclusive)."""
    if not isinstance(value, Dimension):
        return [value]
    if value.kind in ("choice", "grid"):
        return list(value.args)
    low, high = value.args
    return [low, high - 1] if value.kind == "randint" else [float(low), float(high)]


def check_scheduler(space: Mapping[str, Any], scheduler: Any) -> None:
    """PBT and PB2 move trials between configs mid-run; a trial cannot change its data group mid-run.

    Raises:
        ConfigError: A mutated or bounded key is a data key, or PBT/PB2 with a data key that is searched
            (exploitation copies a better trial's config, its data included, into a worse trial).
    """
    from coordinated_prep.sweep.algorithms import PB2Spec, PBTSpec

    if not isinstance(scheduler, (PBTSpec, PB2Spec)):
        return
    moved = "hyperparam_mutations" if isinstance(scheduler, PBTSpec) else "hyperparam_bounds"
    for key in getattr(scheduler, moved):
        if key.startswith(PREFIX):
            raise ConfigError(f"scheduler.{moved}.{key}: {scheduler.type} would change a running trial's data, and a "
                              f"trial cannot change data group mid-run; remove it from {moved} (search it in "
                              "search_space with scheduler fifo, asha or hyperband)")
    for key in data_keys(space):
        if isinstance(space[key], Dimension):
            raise ConfigError(f"search_space.{key}: scheduler {scheduler.type} copies a better trial's config, its "
                              "data included, into a worse trial mid-run, and a trial cannot change data group "
                              "mid-run; make the data keys constants, or use scheduler fifo, asha or hyperband")


def _place(data: dict[str, Any], key: str) -> tuple[Any, Any]:
    """The container inside ``data`` and the key or index in it that search-space ``key`` addresses.

    ``data`` is a copy of the data mapping: what lies on the way is made mutable (a tuple becomes a
    list), and a PipelineSpec field or a factory's ``args`` that the mapping leaves out is filled in
    from its default, so that an item of a default pair (``data.pipeline.scale.0``) can be set.

    Raises:
        ConfigError: The place does not exist in the DataSpec schema, naming ``search_space.<key>``.
    """
    parts = key.split(".")[1:]
    if not parts or not all(parts):
        raise ConfigError(f"search_space.{key}: a data key is data.<field>[.<field or index>...], e.g. "
                          "data.pipeline.scale or data.pipeline.scale.0")
    node: Any = data
    allowed: tuple[str, ...] | None = _fields(DataSpec)
    defaults: Mapping[str, Any] = {**_defaults(DataSpec), "pipeline": {}}
    here = "data"
    for depth, part in enumerate(parts):
        last = depth == len(parts) - 1
        if isinstance(node, list):
            if not part.isdigit() or int(part) >= len(node):
                which = f"by its number, 0 to {len(node) - 1}" if node else "(it has none)"
                raise ConfigError(f"search_space.{key}: {here}={node!r} is a list of {len(node)} item(s); address "
                                  f"an item {which}")
            slot: Any = int(part)
        else:
            if allowed is not None and part not in allowed:
                raise ConfigError(f"search_space.{key}: {here} has no key {part!r}; allowed: {list(allowed)}")
            if here == "data" and part in FIXED:
                raise ConfigError(f"search_space.{key}: data.{part} cannot be searched: {FIXED[part]}")
            if allowed is None and not last and part not in node:
                raise ConfigError(f"search_space.{key}: {here} has no key {part!r} ({sorted(node)}); only the last "
                                  "part of a data key may add a new argument")
            slot = part
        if last:
            return node, slot
        child = node[slot] if isinstance(node, list) or slot in node else copy.deepcopy(defaults.get(slot))
        child, allowed, defaults = _descend(here, slot, child, allowed, key)
        node[slot] = child
        node, here = child, f"{here}.{slot}"
    raise AssertionError("unreachable: the loop returns at the last part")


def _descend(here: str, slot: Any, child: Any, allowed: tuple[str, ...] | None,
             key: str) -> tuple[Any, tuple[str, ...] | None, Mapping[str, Any]]:
    """One level down a data key's path: the value there, mutable, the keys it allows (None: any) and their defaults."""
    where = f"{here}.{slot}"
    if here == "data" and slot == "pipeline":
        if not isinstance(child, Mapping):
            raise ConfigError(f"search_space.{key}: data.pipeline={child!r} must be a mapping under data to search "
                              "inside it")
        return dict(child), _fields(PipelineSpec), _defaults(PipelineSpec)
    if here == "data" and slot in ("dataset", *TRANSFORM_FIELDS):
        if not isinstance(child, Mapping) or "factory" not in child:
            raise ConfigError(f"search_space.{key}: {where}={child!r} is not a factory mapping; only a factory's "
                              f"args can be searched inside it: give {where} under data as "
                              "{factory: 'pkg.mod:make', args: {...}}")
        return dict(child), _FACTORY_KEYS, {"args": {}}
    if isinstance(child, (list, tuple)):
        return list(child), None, {}
    if isinstance(child, Mapping) and (allowed is None or slot == "args"):
        return dict(child), None, {}
    raise ConfigError(f"search_space.{key}: {where}={child!r} is a single value with nothing inside to address; "
                      f"search_space.{where} sets it whole")


def _fields(cls: type) -> tuple[str, ...]:
    return tuple(f.name for f in dataclasses.fields(cls) if f.init)


def _defaults(cls: type) -> dict[str, Any]:
    """Each field's default as a YAML value would give it (a tuple as a list)."""
    out = {}
    for f in dataclasses.fields(cls):
        if f.init and f.default is not dataclasses.MISSING:
            out[f.name] = list(f.default) if isinstance(f.default, tuple) else f.default
    return out
