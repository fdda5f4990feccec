"""Configuration of a data group: what to read, how to prepare it, and how to share it."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
from dataclasses import dataclass, field
from typing import Any, Literal, Mapping

from coordinated_prep.errors import ConfigError, known_keys
from coordinated_prep.pipeline.carried import Carried, Packed, raw
from coordinated_prep.pipeline.part import PART_FIELDS, check_part
from coordinated_prep.pipeline.backends.spec import BACKENDS, Backend, PipelineSpec  # noqa: F401  (re-exported)
from coordinated_prep.plan import piece_size

OnError = Literal["raise", "skip"]
BUILTIN_PREFIX = "builtin:"
MAX_VIEWS = 16


@dataclass(frozen=True)
class DataSpec:
    """What a trial trains on and whether its preparation is shared.

    Trials whose specs are equal (dataset, pipeline, seed, sharing options) form one data group
    and share one coordinator; any difference forms another group.

    Args:
        dataset: ``"builtin:shapes"``, the path of an ImageFolder or Parquet dataset directory, or
            WebDataset tar shards by path, pattern or URL (``s3://bucket/train-{0000..0063}.tar``)
            (a relative path is made absolute here: Tune runs each trial in its own directory); or
            any map-style dataset (``__len__`` and ``__getitem__``: a torchvision dataset, your own
            ``Dataset``, arrays in :class:`~coordinated_prep.pipeline.ArrayDataset`); or a
            :class:`~coordinated_prep.pipeline.Factory` / ``{"factory": "pkg.mod:make", "args":
            {...}}`` that builds one in each process (only the name travels). An object enters the
            group key by the hash of its pickle (:mod:`coordinated_prep.pipeline.datasets`).
        pipeline: The built-in transform of a built-in or directory dataset (random resized crop
            and flip): a :class:`PipelineSpec` or a mapping of its fields. Replaced by the
            transforms below when any is given.
        transform: torchvision's convention: a callable applied to the input of each training
            sample ``(input, target)`` (to the whole sample if it is not a pair): a
            ``transforms.v2`` pipeline, albumentations, a function; or a factory mapping. Its
            randomness must come from Python's ``random``, NumPy's global generator or torch's,
            which are seeded from (seed, epoch, sample, view) around each call, so shared and
            unshared bytes are equal; a transform with a generator of its own is refused at the
            group's start. A built-in or directory dataset's samples are then
            ``(tv_tensors.Image uint8 (3, H, W), int label)``.
        target_transform: A callable applied to the target, in training and evaluation.
        transforms: A callable taking and returning ``(input, target)`` together (masks and boxes as
            ``tv_tensors``, cropped with the image); not with ``transform``/``target_transform``.
        eval_transform: A callable applied to the input of each held-out sample (seeded by the
            sample); None: the input as the dataset gives it.
        eval_transforms: ``(input, target) -> (input, target)`` for held-out samples; not with
            ``eval_transform``.
        ragged: Names of leaves whose shape varies between samples (``"1.boxes"``: key ``boxes``
            of the sample's second item), batched as per-sample lists. A leaf whose shape already
            varies among the first training samples is ragged without being named.
        seed: Seed of the sample order and of every random augmentation.
        coordinated: Share preparation between trials; ``False`` runs the same pipeline
            inside each trial (the baseline, byte-identical for the same seed).
        holdout: Fraction of the dataset held out for evaluation (split fixed per dataset).
        chunk_size: Samples per prepared piece, the unit of work, staging and freeing; ``None``
            picks 256 (fewer for a training split under 2,048 samples, so that an epoch keeps 8
            pieces: :func:`coordinated_prep.plan.piece_size`). A trial's batch that lies inside one
            piece is a view of it, not a copy: batch sizes that divide the piece size never copy.
        segments: Join points per epoch; a trial joining mid-epoch starts at the next one.
        staging_bytes: Most bytes this group may stage on a node; ``None``: its even share of the
            node's staging budget (``PoolSpec``). The node's prep actors and budget are the pool's.
        lookahead: Pieces prepared beyond the furthest piece any trial asked for; ``None`` picks
            ``max(8, 4 x the node's prep actors)``.
        fetch_timeout_s: How long a trial waits for one piece before failing with an error.
        on_error: What a broken sample (unreadable, truncated, not an image) does: ``raise`` fails
            the trials that read it, naming the file and index; ``skip`` leaves it out for every
            trial of the group alike, logged once with its path and counted in the summary.
        views: Augmented views of each sample per epoch (echoing before augmentation): a prep actor
            reads and decodes a sample once (the DALI backend decodes each view's crop window) and
            augments it ``views`` times, each view's crop drawn
            from (seed, epoch, sample, view); view 0 is the draw of ``views=1``. A trial's epoch
            then holds every sample ``views`` times, and the staged bytes grow with it. Part of the
            group key, unlike a trial's ``echo`` (:mod:`coordinated_prep.trial.echo`).
        subset: Dataset indices of the training samples this trial reads (each once), instead of
            the whole training split. Not part of the group key: trials that differ only in
            ``subset``, ``fraction`` or ``fold`` share one stream, prepared once per epoch, and each
            keeps its part of every piece (:mod:`coordinated_prep.pipeline.part`).
        fraction: Read the first ``fraction`` of a fixed permutation of the training split (a
            data-budget fidelity: a smaller fraction's samples are inside every larger one's).
        fold: ``(k, i)``: train on every fold but ``i`` of the training split cut into ``k``, and
            evaluate on fold ``i`` (k-fold cross-validation).
        lease_s: Longest time production waits for the trials holding the oldest staged piece
            when the byte budget is full and another trial waits for a piece; after it those trials
            (stragglers) are detached and prepare their own pieces from then on, byte-identical and
            still exact per epoch. Trials whose process ended are released within seconds instead.
    """

    dataset: Any = "builtin:shapes"
    pipeline: PipelineSpec | Mapping[str, Any] = field(default_factory=PipelineSpec)
    # A transform travels pickled and is unpickled where it is read (pipeline/carried.py).
    transform: Any = Carried()
    target_transform: Any = Carried()
    transforms: Any = Carried()
    eval_transform: Any = Carried()
    eval_transforms: Any = Carried()
    ragged: tuple[str, ...] = ()
    seed: int = 0
    coordinated: bool = True
    holdout: float = 0.1
    chunk_size: int | None = None
    segments: int = 16
    staging_bytes: int | None = None
    lookahead: int | None = None
    fetch_timeout_s: float = 300.0
    lease_s: float = 30.0
    on_error: OnError = "raise"
    views: int = 1
    subset: tuple[int, ...] | None = None
    fraction: float | None = None
    fold: tuple[int, int] | None = None
    _key: str = field(init=False, repr=False, compare=False, default="")
    _group: str = field(init=False, repr=False, compare=False, default="")
    #: The Tune trial whose process pickled this spec, so that its Ray Train workers find their trial
    #: (:mod:`coordinated_prep.context`); not part of the group, nor of equality.
    _trial: str = field(init=False, repr=False, compare=False, default="")

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        for name in TRANSFORM_FIELDS:
            state[name] = Packed.of(state[name])
        if not state.get("_trial"):
            from coordinated_prep.context import stamp

            state["_trial"] = stamp() or ""
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        """A spec pickled before the part fields existed (an experiment to restore) reads the whole split,
        and its key is then its group key, as a spec built now without a part."""
        self.__dict__.update({name: None for name in PART_FIELDS if name not in state})
        self.__dict__.update(state)
        if "_group" not in state:  # its key then had no part fields: the group key is that key
            self.__dict__["_group"] = state.get("_key", "")

    def __post_init__(self) -> None:
        self._check_dataset_and_transforms()
        if isinstance(self.pipeline, Mapping):
            object.__setattr__(self, "pipeline", PipelineSpec.from_mapping(self.pipeline))
        elif not isinstance(self.pipeline, PipelineSpec):
            raise ConfigError(f"data.pipeline={self.pipeline!r} must be a PipelineSpec or a mapping")
        if self.user_transforms and self.pipeline != PipelineSpec():
            raise ConfigError(
                f"data.pipeline={self.pipeline!r} configures the built-in crop and flip, which transform=/transforms= "
                "replace; leave pipeline out, or drop the transforms to use it")
        if isinstance(self.dataset, str) and not self.dataset.startswith(BUILTIN_PREFIX) and "://" not in self.dataset:
            object.__setattr__(self, "dataset", os.path.abspath(os.path.expanduser(self.dataset)))  # one key per dir
        _check_int("data.seed", self.seed, 0)
        if not isinstance(self.coordinated, bool):
            raise ConfigError(f"data.coordinated={self.coordinated!r} must be true or false")
        if not isinstance(self.holdout, (int, float)) or isinstance(self.holdout, bool) or not 0.0 <= self.holdout < 1.0:
            raise ConfigError(f"data.holdout={self.holdout!r} must be a fraction in [0, 1)")
        if self.chunk_size is not None:
            _check_int("data.chunk_size", self.chunk_size, 1)
        _check_int("data.segments", self.segments, 1)
        _check_int("data.views", self.views, 1)
        if self.views > MAX_VIEWS:
            raise ConfigError(f"data.views={self.views} is more than {MAX_VIEWS}: echoing helps only up to a few "
                              "repeats (Choi et al.); use views of 2-4")
        if self.staging_bytes is not None:
            if isinstance(self.staging_bytes, str):  # '64MiB', as pool.staging_bytes takes it
                from coordinated_prep.cache.spec import parse_bytes

                object.__setattr__(self, "staging_bytes", parse_bytes(self.staging_bytes, "data.staging_bytes"))
            _check_int("data.staging_bytes", self.staging_bytes, 1)
            if not self.user_transforms and isinstance(self.dataset, str) and self.staging_bytes < self.chunk_bytes:
                raise ConfigError(
                    f"data.staging_bytes={self.staging_bytes} is smaller than one piece "
                    f"({self.chunk_bytes} bytes = chunk_size x views x 3 x size x size); raise it or lower chunk_size"
                )
        if self.lookahead is not None:
            _check_int("data.lookahead", self.lookahead, 1)
        if self.on_error not in ("raise", "skip"):
            raise ConfigError(f"data.on_error={self.on_error!r} must be 'raise' or 'skip'")
        for name in ("fetch_timeout_s", "lease_s"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value) or value <= 0:
                raise ConfigError(f"data.{name}={value!r} must be a positive, finite number of seconds")
        for name, value in zip(PART_FIELDS, check_part(self.subset, self.fraction, self.fold)):
            object.__setattr__(self, name, value)
        object.__setattr__(self, "_key", self._make_key())
        object.__setattr__(self, "_group", self._make_key(PART_FIELDS))

    def _check_dataset_and_transforms(self) -> None:
        """Factories from mappings, map-style datasets, callables, and torchvision's exclusions."""
        from coordinated_prep.pipeline.datasets import Factory, check_map_style
        from coordinated_prep.pipeline.streamed import as_streamed

        for name in ("dataset", *TRANSFORM_FIELDS):
            value = getattr(self, name)
            if isinstance(value, Mapping) and type(value).__module__.startswith("datasets"):  # DatasetDict
                raise ConfigError(f"data.{name} is a Hugging Face {type(value).__name__} of the splits {list(value)}: "
                                  "give one split (dataset['train'])")
            if isinstance(value, Mapping):
                object.__setattr__(self, name, Factory.from_mapping(value, f"data.{name}"))
        if isinstance(self.dataset, str):
            if not self.dataset:
                raise ConfigError("data.dataset='' must be 'builtin:<name>', a directory path, a map-style dataset or "
                                  "{factory: 'pkg.mod:make', args: {...}}")
        elif not isinstance(self.dataset, Factory):
            streamed = as_streamed(self.dataset)  # an iterable read by shard, spilled once per node
            if streamed is not None:
                object.__setattr__(self, "dataset", streamed)
            check_map_style(self.dataset, "data.dataset")
        for name in TRANSFORM_FIELDS:
            value = getattr(self, name)
            if value is not None and not isinstance(value, Factory) and not callable(value):
                raise ConfigError(f"data.{name}={value!r} must be a callable (a transforms.v2 transform, a function) "
                                  "or {factory: 'pkg.mod:make', args: {...}}")
        for joint, alone in (("transforms", ("transform", "target_transform")), ("eval_transforms", ("eval_transform",))):
            if getattr(self, joint) is not None and any(getattr(self, a) is not None for a in alone):
                raise ConfigError(f"data: only {joint} or {'/'.join(alone)} can be given, not both (as torchvision's "
                                  f"VisionDataset): fold {'/'.join(alone)} into {joint}")
        if isinstance(self.ragged, str) or not all(isinstance(r, str) for r in self.ragged):
            raise ConfigError(f"data.ragged={self.ragged!r} must be a list of leaf names such as ['1.boxes']")
        object.__setattr__(self, "ragged", tuple(self.ragged))

    def _make_key(self, leave_out: tuple[str, ...] = ()) -> str:
        from coordinated_prep.pipeline.datasets import object_key

        fields = {}
        for f in dataclasses.fields(self):
            if f.name in ("_key", "_group", "_trial") or f.name in leave_out:
                continue
            if f.name in PART_FIELDS and getattr(self, f.name) is None:
                continue  # a spec without a part has the key it had before parts existed: its group key
            value = getattr(self, f.name)
            if f.name == "dataset" or f.name in TRANSFORM_FIELDS:
                value = object_key(value, f"data.{f.name}")
            elif f.name == "pipeline":
                value = dataclasses.asdict(value)
            fields[f.name] = value
        blob = json.dumps(fields, sort_keys=True, default=str).encode()
        return hashlib.sha256(blob).hexdigest()[:12]

    def __eq__(self, other: object) -> bool:  # by key: datasets and transforms compare by their keys
        return isinstance(other, DataSpec) and other._key == self._key

    def __hash__(self) -> int:
        return hash(self._key)

    def __deepcopy__(self, memo: dict) -> "DataSpec":  # a frozen value: Tune deep-copies configs per trial
        return self

    @property
    def user_transforms(self) -> bool:
        """Whether the samples come from the user's dataset or transforms rather than the built-in crop."""
        return not isinstance(self.dataset, str) or any(raw(self, n) is not None for n in TRANSFORM_FIELDS)

    @property
    def dataset_name(self) -> str:
        """The dataset, short, for messages."""
        if isinstance(self.dataset, str):
            return repr(self.dataset)
        from coordinated_prep.pipeline.datasets import Factory

        if isinstance(self.dataset, Factory):
            return f"Factory({self.dataset.factory!r})"
        from coordinated_prep.pipeline.streamed import StreamedShards

        return self.dataset.name if isinstance(self.dataset, StreamedShards) else type(self.dataset).__name__

    def __repr__(self) -> str:  # only what differs from the defaults: Tune prints configs in tables
        changed = [f"{f.name}={_short(getattr(self, f.name))}" for f in dataclasses.fields(self)
                   if f.name not in ("pipeline", "_key", "_group", "_trial") and getattr(self, f.name) is not _DATA_DEFAULTS[f.name]
                   and not _same(getattr(self, f.name), _DATA_DEFAULTS[f.name])]
        if self.pipeline != PipelineSpec():
            changed.append(f"pipeline={self.pipeline!r}")
        return f"DataSpec({', '.join(changed)})"

    @property
    def sample_bytes(self) -> int:
        """Bytes one training sample of the built-in pipeline takes in a piece: all its views (a user
        pipeline's are measured at the group's start: :mod:`coordinated_prep.pipeline.probe`)."""
        return self.views * self.pipeline.sample_bytes  # type: ignore[union-attr]

    @property
    def chunk_bytes(self) -> int:
        """Bytes of one full prepared piece (of the smallest automatic size when ``chunk_size`` is None)."""
        return piece_size(self.chunk_size, 0) * self.sample_bytes

    @property
    def group_key(self) -> str:
        """Stable identifier of this spec's data group: a hash of its fields, a dataset or transform
        entering by its key (:mod:`coordinated_prep.pipeline.datasets`), the trial's part
        (``subset``, ``fraction``, ``fold``) left out. Equal specs have equal keys."""
        return self._group

    @property
    def part(self) -> str | None:
        """The trial's part of the training split, short, for messages; None for the whole split."""
        if self.subset is not None:
            return f"subset of {len(self.subset)} samples"
        if self.fraction is not None:
            return f"fraction {self.fraction:g}"
        return None if self.fold is None else f"fold {self.fold[1]} of {self.fold[0]} held out"

    @classmethod
    def from_mapping(cls, values: Mapping[str, Any], where: str = "data") -> "DataSpec":
        """Build from a plain mapping (YAML or a Python dict), rejecting unknown keys by name."""
        moved = sorted(set(values) & set(_MOVED)) if isinstance(values, Mapping) else []
        if moved:
            raise ConfigError(f"{where}.{moved[0]} belongs to the node's prep pool now, shared by every data group: "
                              f"set pool.{_MOVED[moved[0]]} (YAML) or CoordinatedSearcher(pool=PoolSpec("
                              f"{_MOVED[moved[0]]}=...))")
        known = known_keys(cls, values, where)
        if isinstance(known.get("pipeline"), Mapping):
            known["pipeline"] = PipelineSpec.from_mapping(known["pipeline"], f"{where}.pipeline")
        return cls(**known)


_DATA_DEFAULTS = {f.name: f.default for f in dataclasses.fields(DataSpec) if f.init and f.name != "pipeline"}
#: The torchvision-style transform fields of a DataSpec.
TRANSFORM_FIELDS = ("transform", "target_transform", "transforms", "eval_transform", "eval_transforms")


def _same(a: Any, b: Any) -> bool:
    try:
        return bool(a == b)
    except Exception:  # an object whose == is not a bool (arrays)
        return False


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _check_int(name: str, value: Any, minimum: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ConfigError(f"{name}={value!r} must be an integer >= {minimum}")


#: Keys that moved from the data group to the node's prep pool, and where they went.
_MOVED = {"prep_actors": "actors", "staging_fraction": "staging_fraction"}


def resolve_spec(config: Mapping[str, Any] | DataSpec, key: str = "data") -> DataSpec:
    """The DataSpec of a trial config (``config[key]``), or ``config`` itself if it is one."""
    if isinstance(config, DataSpec):
        return config
    if not isinstance(config, Mapping) or key not in config:
        raise ConfigError(f"train_loader: the trial config has no {key!r} entry; put a DataSpec under config[{key!r}]")
    value = config[key]
    if isinstance(value, DataSpec):
        return value
    if isinstance(value, Mapping):
        return DataSpec.from_mapping(value, where=key)
    raise ConfigError(f"config[{key!r}] is a {type(value).__name__}; expected a DataSpec or a mapping of its fields")
