"""Configuration of a data group: what to read, how to prepare it, and how to share it."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
from dataclasses import dataclass, field
from typing import Any, Literal, Mapping

from coordinated_prep.errors import ConfigError
from coordinated_prep.plan import piece_size

Backend = Literal["torchvision", "dali"]
OnError = Literal["raise", "skip"]
BACKENDS: tuple[str, ...] = ("torchvision", "dali")
BUILTIN_PREFIX = "builtin:"
MAX_VIEWS = 16


def _pair(name: str, value: Any) -> tuple[float, float]:
    try:
        low, high = (float(v) for v in value)
    except (TypeError, ValueError):
        raise ConfigError(f"{name}={value!r} must be a pair of numbers [low, high]") from None
    if not (0 < low <= high):
        raise ConfigError(f"{name}={value!r} must satisfy 0 < low <= high")
    return low, high


@dataclass(frozen=True)
class PipelineSpec:
    """Declarative preprocessing: decode, then augment for training or resize for evaluation.

    Training: decode -> random resized crop to ``size`` -> horizontal flip with probability
    ``hflip``. Evaluation: decode -> resize the shorter side to ``eval_resize`` -> centre crop
    to ``size``. Outputs are ``uint8`` arrays of shape ``(3, size, size)``; normalisation to
    float is the trial's job, on its own device.

    Args:
        size: Side of the square output, in pixels.
        scale: Range of the crop's area as a fraction of the source image's area.
        ratio: Range of the crop's aspect ratio (width / height).
        hflip: Probability of a horizontal flip.
        eval_resize: Shorter side before the evaluation centre crop; defaults to ``size * 8 / 7``.
        backend: Library that decodes and transforms.
    """

    size: int = 112
    scale: tuple[float, float] = (0.25, 1.0)
    ratio: tuple[float, float] = (3 / 4, 4 / 3)
    hflip: float = 0.5
    eval_resize: int | None = None
    backend: Backend = "torchvision"

    def __post_init__(self) -> None:
        if not isinstance(self.size, int) or isinstance(self.size, bool) or not 8 <= self.size <= 4096:
            raise ConfigError(f"data.pipeline.size={self.size!r} must be an integer in [8, 4096]")
        scale = _pair("data.pipeline.scale", self.scale)
        if scale[1] > 1.0:
            raise ConfigError(f"data.pipeline.scale={self.scale!r}: the upper bound must be at most 1.0")
        object.__setattr__(self, "scale", scale)
        object.__setattr__(self, "ratio", _pair("data.pipeline.ratio", self.ratio))
        if not isinstance(self.hflip, (int, float)) or not 0.0 <= self.hflip <= 1.0:
            raise ConfigError(f"data.pipeline.hflip={self.hflip!r} must be a probability in [0, 1]")
        object.__setattr__(self, "hflip", float(self.hflip))
        if self.eval_resize is None:
            object.__setattr__(self, "eval_resize", math.ceil(self.size * 8 / 7))
        elif not isinstance(self.eval_resize, int) or self.eval_resize < self.size:
            raise ConfigError(
                f"data.pipeline.eval_resize={self.eval_resize!r} must be an integer >= size={self.size} "
                "(the centre crop must fit inside the resized image)"
            )
        if self.backend not in BACKENDS:
            raise ConfigError(f"data.pipeline.backend={self.backend!r} is not one of {list(BACKENDS)}")

    @property
    def sample_bytes(self) -> int:
        """Bytes of one prepared sample (uint8, 3 x size x size)."""
        return 3 * self.size * self.size

    @classmethod
    def from_mapping(cls, values: Mapping[str, Any], where: str = "pipeline") -> "PipelineSpec":
        """Build from a plain mapping (YAML or a Python dict), rejecting unknown keys by name."""
        return cls(**known_keys(cls, values, where))


@dataclass(frozen=True)
class DataSpec:
    """What a trial trains on and whether its preparation is shared.

    Trials whose specs are equal (dataset, pipeline, seed, sharing options) form one data group
    and share one coordinator; any difference forms another group.

    Args:
        dataset: ``"builtin:shapes"``, or the path of an ImageFolder or Parquet dataset directory;
            a relative path is made absolute here (Tune runs each trial in its own directory).
        pipeline: A :class:`PipelineSpec` or a mapping of its fields.
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
            group key, unlike a trial's ``echo`` (:mod:`coordinated_prep.echo`).
        lease_s: Longest time production waits for the trials holding the oldest staged piece
            when the byte budget is full and another trial waits for a piece; after it those trials
            (stragglers) are detached and prepare their own pieces from then on, byte-identical and
            still exact per epoch. Trials whose process ended are released within seconds instead.
    """

    dataset: str = "builtin:shapes"
    pipeline: PipelineSpec | Mapping[str, Any] = field(default_factory=PipelineSpec)
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

    def __post_init__(self) -> None:
        if isinstance(self.pipeline, Mapping):
            object.__setattr__(self, "pipeline", PipelineSpec.from_mapping(self.pipeline))
        elif not isinstance(self.pipeline, PipelineSpec):
            raise ConfigError(f"data.pipeline={self.pipeline!r} must be a PipelineSpec or a mapping")
        if not isinstance(self.dataset, str) or not self.dataset:
            raise ConfigError(f"data.dataset={self.dataset!r} must be 'builtin:<name>' or a directory path")
        if not self.dataset.startswith(BUILTIN_PREFIX):  # one group and cache key per directory, anywhere
            object.__setattr__(self, "dataset", os.path.abspath(os.path.expanduser(self.dataset)))
        _check_int("data.seed", self.seed, 0)
        if not isinstance(self.coordinated, bool):
            raise ConfigError(f"data.coordinated={self.coordinated!r} must be true or false")
        if not isinstance(self.holdout, (int, float)) or not 0.0 <= self.holdout < 1.0:
            raise ConfigError(f"data.holdout={self.holdout!r} must be a fraction in [0, 1)")
        if self.chunk_size is not None:
            _check_int("data.chunk_size", self.chunk_size, 1)
        _check_int("data.segments", self.segments, 1)
        _check_int("data.views", self.views, 1)
        if self.views > MAX_VIEWS:
            raise ConfigError(f"data.views={self.views} is more than {MAX_VIEWS}: echoing helps only up to a few "
                              "repeats (Choi et al.); use views of 2-4")
        if self.staging_bytes is not None:
            _check_int("data.staging_bytes", self.staging_bytes, 1)
            if self.staging_bytes < self.chunk_bytes:
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
            if not isinstance(value, (int, float)) or isinstance(value, bool) or value <= 0:
                raise ConfigError(f"data.{name}={value!r} must be a positive number of seconds")

    def __repr__(self) -> str:  # only what differs from the defaults: Tune prints configs in tables
        changed = [f"{f.name}={getattr(self, f.name)!r}" for f in dataclasses.fields(self)
                   if f.name != "pipeline" and getattr(self, f.name) != _DATA_DEFAULTS[f.name]]
        if self.pipeline != PipelineSpec():
            changed.append(f"pipeline={self.pipeline!r}")
        return f"DataSpec({', '.join(changed)})"

    @property
    def sample_bytes(self) -> int:
        """Bytes one training sample takes in a piece: all its views."""
        return self.views * self.pipeline.sample_bytes  # type: ignore[union-attr]

    @property
    def chunk_bytes(self) -> int:
        """Bytes of one full prepared piece (of the smallest automatic size when ``chunk_size`` is None)."""
        return piece_size(self.chunk_size, 0) * self.sample_bytes

    @property
    def group_key(self) -> str:
        """Stable identifier of this spec's data group (equal specs, equal keys)."""
        fields = dataclasses.asdict(self)
        blob = json.dumps(fields, sort_keys=True, default=str).encode()
        return hashlib.sha256(blob).hexdigest()[:12]

    @classmethod
    def from_mapping(cls, values: Mapping[str, Any], where: str = "data") -> "DataSpec":
        """Build from a plain mapping (YAML or a Python dict), rejecting unknown keys by name."""
        known = known_keys(cls, values, where)
        if isinstance(known.get("pipeline"), Mapping):
            known["pipeline"] = PipelineSpec.from_mapping(known["pipeline"], f"{where}.pipeline")
        return cls(**known)


_DATA_DEFAULTS = {f.name: f.default for f in dataclasses.fields(DataSpec) if f.name != "pipeline"}


def _check_int(name: str, value: Any, minimum: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ConfigError(f"{name}={value!r} must be an integer >= {minimum}")


#: Keys that moved from the data group to the node's prep pool, and where they went.
_MOVED = {"prep_actors": "actors", "staging_fraction": "staging_fraction"}


def known_keys(cls: type, values: Mapping[str, Any], where: str) -> dict[str, Any]:
    """``values`` as keyword arguments of dataclass ``cls``; an unknown or moved key is a ConfigError naming it."""
    if not isinstance(values, Mapping):
        raise ConfigError(f"{where} must be a mapping, got {type(values).__name__}")
    moved = sorted(set(values) & set(_MOVED)) if cls is DataSpec else []
    if moved:
        raise ConfigError(f"{where}.{moved[0]} belongs to the node's prep pool now, shared by every data group: "
                          f"set pool.{_MOVED[moved[0]]} (YAML) or CoordinatedSearcher(pool=PoolSpec("
                          f"{_MOVED[moved[0]]}=...))")
    allowed = [f.name for f in dataclasses.fields(cls)]
    unknown = sorted(set(values) - set(allowed))
    if unknown:
        raise ConfigError(f"{where}: unknown key(s) {unknown}; allowed keys are {allowed}")
    return dict(values)
