"""Data echoing: a trial repeats data it already has instead of waiting for fresh data.

Data echoing (Choi, Passos, Shallue, Dahl, "Faster Neural Network Training with Data Echoing",
arXiv 1907.05550) reuses the output of an earlier pipeline stage while the stages before the
accelerator are the bottleneck. Here it is a per-trial stage after the shared stream, so trials that
echo differently still share one data group, and echo can be searched like a learning rate:

``example:e`` (after augmentation)
    Every fresh sample is delivered ``e`` times per epoch, shuffled within windows of ``buffer``
    fresh samples (``e`` rounds, each a new permutation of the window); a batch never holds two
    copies of one sample while a window holds two batches' worth of distinct samples.
``batch:e``
    Every fresh batch is delivered ``e`` times, interleaved with the other batches in the buffer
    (``buffer // batch_size`` batches) so that a repeat does not follow its original directly
    (while the buffer holds two batches).
``auto:c`` (adaptive; cap ``c``, default 4)
    A fresh batch whenever one is at hand; while none is, a batch of repeats drawn at random from
    the last ``buffer`` fresh samples (4 batches' worth), none delivered more than ``c`` times. So a trial whose data is
    ready never echoes, and a trial with a batch's worth of samples under the cap never waits.
``DataSpec.views`` (before augmentation)
    A data-group option, not a trial's: the prep actors decode each sample once and augment it
    ``views`` times (:func:`coordinated_prep.pipeline.chunk.prepare_chunk`).

Epochs stay exact: an epoch is one pass over the fresh samples, each exactly once as without echo
(``Batch.repeats == 0`` marks a sample's first delivery in the epoch); repeats are extra steps
inside the epoch, each with its own positive ``repeats`` label (view x e + copy), and the buffer is
emptied at the epoch's end, so no sample comes more than ``e`` times in it (``views x e``).

Data-parallel ranks: echo acts on each rank's own batches, which every rank has in equal number and
size whatever its node skipped (:mod:`coordinated_prep.trial.shard`), so ``example:e`` (``ceil(e x
rows / batch)`` steps) and ``batch:e`` (``e x batches``) give every rank the same steps
(:func:`~coordinated_prep.trial.shard.rank_steps`); ``auto`` follows each rank's own stalls and is
refused with ranks.

Ownership: the echo buffer holds references into fresh batches (views of pieces in the object
store): ``buffer`` rows plus a batch being cut for ``example``, ``buffer // batch_size + 2``
batches for ``batch``, the last ``buffer`` rows for ``auto``. The pieces they lie in stay mapped
in the trial after the staging buffer has released them (at most ``ceil(buffer / piece) + 2``);
an echoed batch is gathered into memory the trial owns. A repeat is gathered from the fresh batch as
the trial holds it then: a loop that writes into its fresh batches in place (which it may:
:mod:`coordinated_prep.pages`) repeats what it wrote, so with echo on, write out of place or into a
copy. Everything here
is a pure function of the fresh batches, their readiness and a seeded generator: it is tested
without Ray.
"""

from __future__ import annotations

import collections
import math
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Iterator, Literal, Mapping

import numpy as np

from coordinated_prep.errors import ConfigError

if TYPE_CHECKING:  # the setting is parsed where torch is not loaded (a sweep's YAML, the coordinator)
    from coordinated_prep.trial.batching import Batch, Batcher

Mode = Literal["off", "example", "batch", "auto"]
MODES: tuple[str, ...] = ("off", "example", "batch", "auto")
MAX_FACTOR = 16  # echoing pays only up to a few repeats (Choi et al.); more is almost surely a typo
DEFAULT_CAP = 4
_FORMS = ("1 or 'off'; an integer e >= 2 (example echoing); 'example:e', 'batch:e'; 'auto' or 'auto:c' "
          "(c: the cap, default 4); or a mapping {mode, factor, buffer}")
_ECHO_STREAM = 0xEC40  # separates the echo buffer's draws from the plan's and the augmentation's


@dataclass(frozen=True)
class EchoSpec:
    """How a trial echoes its data.

    Args:
        mode: ``off``, ``example``, ``batch`` or ``auto``.
        factor: Deliveries of each fresh sample per epoch for ``example`` and ``batch`` (e); the
            most for ``auto`` (its cap); 1 for ``off``.
        buffer: Fresh samples the echo buffer holds; None: 4 batches' worth (2 for ``batch``).
    """

    mode: Mode = "off"
    factor: int = 1
    buffer: int | None = None

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ConfigError(f"echo mode {self.mode!r} is not one of {list(MODES)}")
        if not isinstance(self.factor, int) or isinstance(self.factor, bool) or not 1 <= self.factor <= MAX_FACTOR:
            raise ConfigError(f"echo factor={self.factor!r} must be an integer in [1, {MAX_FACTOR}]")
        if self.mode == "off" and self.factor != 1:
            raise ConfigError(f"echo mode 'off' takes factor 1, not {self.factor}")
        if self.mode != "off" and self.factor < 2:
            what = "a cap" if self.mode == "auto" else "a factor"
            raise ConfigError(f"echo {self.mode}:{self.factor} repeats nothing: use {what} >= 2, or echo 'off'")
        if self.buffer is not None and (not isinstance(self.buffer, int) or isinstance(self.buffer, bool)
                                        or self.buffer < 1):
            raise ConfigError(f"echo buffer={self.buffer!r} must be a positive number of samples")

    @classmethod
    def parse(cls, value: Any, where: str = "echo") -> "EchoSpec":
        """An EchoSpec from a trial-config or YAML value (see the module docstring for the forms).

        Raises:
            ConfigError: Names ``where``, the value and the accepted forms.
        """
        if isinstance(value, EchoSpec):
            return value
        try:
            if value is None or value is False:
                return cls()
            if isinstance(value, bool):  # True: no factor given
                raise ConfigError("true has no factor")
            if isinstance(value, int):
                return cls() if value == 1 else cls("example", value)
            if isinstance(value, float) and value.is_integer():
                return cls.parse(int(value), where)
            if isinstance(value, Mapping):
                unknown = sorted(set(value) - {"mode", "factor", "buffer"})
                if unknown:
                    raise ConfigError(f"unknown key(s) {unknown}")
                mode = value.get("mode", "example")
                factor = value.get("factor", 1 if mode == "off" else DEFAULT_CAP if mode == "auto" else 2)
                return cls(mode, factor, value.get("buffer"))
            if isinstance(value, str):
                text = value.strip().lower()
                if text in ("off", "none", "1"):
                    return cls()
                if text.isdigit():
                    return cls.parse(int(text), where)
                match = re.fullmatch(r"(example|batch|auto)(?::(\d+))?", text)
                if match:
                    mode, factor = match.group(1), match.group(2)
                    default = DEFAULT_CAP if mode == "auto" else 2
                    return cls(mode, int(factor) if factor else default)  # type: ignore[arg-type]
            raise ConfigError("not a form of echo")
        except ConfigError as e:
            raise ConfigError(f"{where}={value!r} is not a valid echo setting ({e}); use {_FORMS}") from None

    @property
    def name(self) -> str:
        """Short name: ``off``, ``example:2``, ``batch:2``, ``auto:4``."""
        return "off" if self.mode == "off" else f"{self.mode}:{self.factor}"

    def buffer_for(self, batch_size: int) -> int:
        """Fresh samples held for a trial of ``batch_size``: 4 batches' worth by default (``example``:
        a round's head then has 3 batches to draw from besides the tail it avoids; ``auto``: a piece
        arrives as several batches at once, and the wait for the next must be bridged), 2 for ``batch``."""
        if self.buffer is not None:
            return self.buffer
        return (2 if self.mode == "batch" else 4) * batch_size

    def batches_per_epoch(self, samples: int, batch_size: int) -> int | None:
        """Batches in an epoch of ``samples`` rows (fresh samples x views); None for ``auto`` (it varies)."""
        if self.mode == "auto":
            return None
        if self.mode == "batch":
            return self.factor * math.ceil(samples / batch_size)
        return math.ceil(self.factor * samples / batch_size)


@dataclass
class EchoCounts:
    """Samples a trial was handed: fresh (``repeats == 0``) and repeats (echoes and extra views)."""

    fresh: int = 0
    echoed: int = 0
    batches: int = 0

    def add(self, batch: Batch) -> int:
        """Count ``batch``; returns its fresh samples."""
        fresh = int((batch.repeats == 0).sum())
        self.add_counts(fresh, len(batch))
        return fresh

    def add_counts(self, fresh: int, samples: int) -> None:
        """Count a batch of ``samples`` of which ``fresh`` are fresh."""
        self.fresh += fresh
        self.echoed += samples - fresh
        self.batches += 1


def echoed(fresh: Batcher, spec: EchoSpec, rng: np.random.Generator) -> Iterator[Batch]:
    """The batches of one epoch: ``fresh``'s batches, with echoes per ``spec``.

    Args:
        fresh: The epoch's fresh batches (a :class:`~coordinated_prep.trial.batching.Batcher` whose
            ``ready`` says whether the next one is at hand).
        spec: How to echo.
        rng: The epoch's generator (seeded by the loader: a trial's epoch is reproducible).
    """
    buffer = spec.buffer_for(fresh.batch_size)
    if spec.mode == "example":
        return _example(fresh, spec.factor, buffer, rng)
    if spec.mode == "batch":
        return _batch(fresh, spec.factor, buffer, rng)
    if spec.mode == "auto":
        return _auto(fresh, spec.factor, buffer, rng)
    return iter(fresh)


def epoch_rng(seed: int, start: int, epoch: int) -> np.random.Generator:
    """The echo buffer's generator for a loader's ``epoch`` (data seed, first piece of the trial).

    ``epoch`` counts the loader's epochs: a trial resumed from a checkpoint starts a new loader at
    a new piece, so its echo order differs from the uninterrupted run's (its fresh samples do not).
    """
    return np.random.default_rng((_ECHO_STREAM, seed, start, epoch))


# One entry of an echo buffer: (fresh batch, row, dataset index, the row's repeat number so far).
_Entry = tuple["Batch", int, int, int]


def _rows(batch: Batch) -> list[tuple[int, int, int]]:
    """(row, dataset index, repeat number) of each row of a fresh batch."""
    return list(zip(range(len(batch)), batch.indices.tolist(), batch.repeats.tolist()))


def _example(fresh: Batcher, e: int, buffer: int, rng: np.random.Generator) -> Iterator[Batch]:
    """Example echoing: each row delivered ``e`` times, mixed within windows of ``buffer`` fresh rows.

    A window's rows go out in ``e`` rounds, each a fresh permutation of the window, and batches are
    cut from the rounds in order; the head of each round avoids the samples at the tail of the one
    before, so no batch holds one sample twice while a window holds two batches' worth of distinct
    samples. A window's fresh batches are dropped once its rounds have gone out: the buffer holds
    at most ``buffer`` rows (plus a batch being cut).
    """
    size = fresh.batch_size
    pending: list[_Entry] = []  # entries to deliver, in order
    while True:
        window: list[_Entry] = []
        while len(window) < buffer and (batch := fresh.next()) is not None:
            window += [(batch, row, index, base) for row, index, base in _rows(batch)]
        for k in range(e):
            order = rng.permutation(len(window)).tolist()
            recent = {entry[2] for entry in pending[-size:]}
            if recent:  # keep the round's head clear of the samples just delivered
                head = [i for i in order if window[i][2] not in recent][:size]
                taken = set(head)
                order = head + [i for i in order if i not in taken]
            pending += [(window[i][0], window[i][1], window[i][2], window[i][3] * e + k) for i in order]
        while len(pending) >= size or (pending and not window):
            yield gather(pending[:size])
            pending = pending[size:]
        if not window:
            return


def _batch(fresh: Batcher, e: int, buffer: int, rng: np.random.Generator) -> Iterator[Batch]:
    """Batch echoing: each fresh batch delivered ``e`` times, in rounds over ``buffer // size`` batches.

    A lone batch left at the epoch's end joins the group before it, so that no batch is delivered
    twice in a row while the buffer holds two batches (``buffer >= 2 x batch_size``).
    """
    width = max(1, buffer // fresh.batch_size)
    ahead: list[Batch] = []
    while True:
        while len(ahead) < width + 2 and (batch := fresh.next()) is not None:
            ahead.append(batch)  # two past the group: is the epoch's last batch alone after it?
        if len(ahead) == width + 1:  # one batch left past the group, and the epoch is spent: it joins
            group, ahead = ahead, []
        else:
            group, ahead = ahead[:width], ahead[width:]
        if not group:
            return
        last = -1
        for k in range(e):
            order = rng.permutation(len(group)).tolist()
            if len(order) > 1 and order[0] == last:  # not the same batch twice in a row
                order.append(order.pop(0))
            for i in order:
                yield group[i].replace(repeats=group[i].repeats * e + k)
                last = i


def _auto(fresh: Batcher, cap: int, buffer: int, rng: np.random.Generator) -> Iterator[Batch]:
    """Adaptive echoing: fresh when at hand, else repeats of recent fresh rows, each at most ``cap`` times."""
    size = fresh.batch_size
    recent: collections.deque[list[Any]] = collections.deque(maxlen=buffer)  # [batch, row, index, base, used]
    while True:
        usable = [x for x in recent if x[4] < cap - 1]
        if len(usable) >= size and not fresh.ready():
            picks = [usable[i] for i in rng.choice(len(usable), size=size, replace=False).tolist()]
            for x in picks:
                x[4] += 1
            yield gather([(x[0], x[1], x[2], x[3] * cap + x[4]) for x in picks])
            continue
        batch = fresh.next()
        if batch is None:
            return
        rows = _rows(batch)
        recent.extend([batch, row, index, base, 0] for row, index, base in rows)
        yield batch.replace(repeats=batch.repeats * cap) if any(r[2] for r in rows) else batch


def gather(entries: list[_Entry]) -> Batch:
    """One batch of the given rows, copied into memory the trial owns."""
    from coordinated_prep.trial.batching import select

    return select([(batch, row) for batch, row, _, _ in entries], [repeat for _, _, _, repeat in entries])
