"""Evaluation sets: the held-out split prepared once per sweep and evaluation pipeline, for every trial.

Evaluation is deterministic (decode, resize the shorter side, centre crop): its bytes depend on the
dataset, the held-out fraction and the pipeline's ``size``, ``eval_resize`` and ``backend``, never on
the seed or the augmentation. Every trial whose spec agrees on those reads the same prepared pieces,
whatever its data group.

Life cycle of an evaluation piece (the registry keeps it, :mod:`coordinated_prep.stream.registry`):

1. The first trial that evaluates with a pipeline asks the registry for its plan. The registry cuts
   the held-out indices into pieces (:func:`eval_pieces`) and makes a prefix of them resident: in
   order, at most one per prep actor in flight, each while its estimate fits the node's evaluation
   allowance (:meth:`EvalSet.admits`). The registry owns the resulting objects.
2. A resident piece is charged its estimate while in flight and its real bytes once it lands
   (:meth:`EvalSet.land`); then the trailing resident pieces are dropped while the charged bytes
   exceed the allowance (:meth:`EvalSet.shed`), and more become resident while they fit, each
   estimated at the largest bytes per sample seen (:meth:`EvalSet.estimate`). The bound: after
   every landing the resident pieces' charged bytes (real once landed) are within the allowance,
   whatever the real sizes (the held-out split is in index order, so a length-sorted dataset's
   pieces grow); the node holds more only while trials still read a piece dropped since.
3. Every trial gets the resident pieces' references and reads them in order; each read is a
   zero-copy view of the object store. Resident pieces stay until the sweep ends (the registry's
   shutdown), so later trials and epochs prepare nothing. A resident piece whose preparation
   failed (an actor lost for good; a bad sample under ``on_error="raise"``) is not kept: the
   registry prepares it again for the next evaluation that asks.
4. A piece past the resident prefix is streamed: prepared on request, in order, a bounded number
   ahead of the reader, and freed when the reading trial drops it; a piece that became resident
   after the reader's plan (the next one in order, if it fits) is handed out as the resident one.
   A dropped resident piece lives on only while the trials that were handed it read it.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from coordinated_prep.spec import DataSpec

#: Evaluation pieces requested ahead of the one being read, when they are streamed.
STREAM_AHEAD = 2


def eval_key(spec: DataSpec) -> str:
    """Identifies the prepared evaluation bytes of ``spec``: equal keys, equal bytes."""
    if spec.user_transforms:  # the dataset, the split and the evaluation transforms (seeded by the data seed)
        from coordinated_prep.pipeline.datasets import object_key

        fields = {"dataset": object_key(spec.dataset, "data.dataset"), "holdout": spec.holdout, "seed": spec.seed,
                  **{n: object_key(getattr(spec, n), f"data.{n}")
                     for n in ("eval_transform", "eval_transforms", "target_transform")}, **_fold(spec)}
        return "eval-" + hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()[:12]
    pipeline = spec.pipeline
    fields = {"dataset": spec.dataset, "holdout": spec.holdout, "size": pipeline.size,  # type: ignore[union-attr]
              "eval_resize": pipeline.eval_resize, "backend": pipeline.backend,  # type: ignore[union-attr]
              **_fold(spec)}
    digest = hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()[:12]
    return f"eval-{pipeline.size}px-{digest}"  # type: ignore[union-attr]


def _fold(spec: DataSpec) -> dict[str, Any]:
    """A cross-validation trial evaluates on its fold (:func:`~coordinated_prep.pipeline.part.held_out`)."""
    return {} if spec.fold is None else {"fold": list(spec.fold)}


def eval_pieces(held: np.ndarray, chunk_size: int) -> list[np.ndarray]:
    """The held-out indices (:func:`~coordinated_prep.plan.holdout_split`), in index order, cut into pieces."""
    return [held[lo : lo + chunk_size] for lo in range(0, len(held), chunk_size)]


@dataclass
class EvalSet:
    """One evaluation pipeline's pieces on one node, and what they cost and served.

    Attributes:
        key: :func:`eval_key` of the specs it serves.
        spec: The spec of the trial that asked first (any spec with the same key prepares the same bytes).
        node: The node whose prep pool prepares it and whose budget holds its resident pieces.
        pieces: Held-out indices of each piece.
        refs: The resident pieces' objects (owned by the registry), the first ``len(refs)`` pieces.
        samples_prepared: Samples prepared so far (resident once, streamed ones at every read).
        samples_served: Samples handed to trials (the whole split per evaluation).
        evaluations: Evaluations served (one per ``eval_loader`` pass of a trial).
        skipped: Held-out samples left out under ``on_error="skip"``: index -> path.
        failed: Resident pieces whose preparation failed, to prepare again at the next plan.
        real: Real bytes of each resident piece that has landed (the others are charged their estimate).
        sample_bytes: Bytes of one prepared held-out sample: the probe's, raised to the largest real
            bytes per sample of any landed piece.
    """

    key: str
    spec: DataSpec
    node: str
    pieces: list[np.ndarray]
    refs: list[Any] = field(default_factory=list)
    samples_prepared: int = 0
    samples_served: int = 0
    evaluations: int = 0
    skipped: dict[int, str] = field(default_factory=dict)
    failed: set[int] = field(default_factory=set)
    layout: Any = None  # the held-out samples' Layout (probed at the start)
    sample_bytes: int = 1
    spec_box: list = field(default_factory=list)  # [the spec in the object store]: sent once per prep actor
    real: dict[int, int] = field(default_factory=dict)

    @property
    def resident_bytes(self) -> int:
        """Bytes its resident pieces hold in the node's object store: real once landed, else estimated."""
        return sum(self.real.get(i, self.estimate(i)) for i in range(len(self.refs)))

    def estimate(self, i: int) -> int:
        """Bytes piece ``i`` is expected to take: its samples times the largest bytes per sample seen."""
        return len(self.pieces[i]) * self.sample_bytes

    def in_flight(self) -> int:
        """Resident pieces being prepared (neither landed nor failed)."""
        return sum(1 for i in range(len(self.refs)) if i not in self.real and i not in self.failed)

    def admits(self, allowance: int, most_in_flight: int | None) -> bool:
        """Whether the next piece may become resident: its estimate fits ``allowance`` beside the
        resident pieces, and fewer than ``most_in_flight`` are in flight (None: no limit)."""
        i = len(self.refs)
        return (i < len(self.pieces) and self.resident_bytes + self.estimate(i) <= allowance
                and (most_in_flight is None or self.in_flight() < most_in_flight))

    def land(self, i: int, nbytes: int, samples: int) -> None:
        """Resident piece ``i`` landed holding ``nbytes`` real bytes of ``samples`` samples: charge them."""
        if i < len(self.refs):  # not dropped meanwhile
            self.real[i] = nbytes
        if samples > 0:
            self.sample_bytes = max(self.sample_bytes, -(-nbytes // samples))

    def shed(self, allowance: int) -> list[int]:
        """Drop the trailing resident pieces while their charged bytes exceed ``allowance``; returns them
        (they are streamed from now on)."""
        dropped: list[int] = []
        while self.refs and self.resident_bytes > allowance:
            i = len(self.refs) - 1
            self.refs.pop()
            self.real.pop(i, None)
            self.failed.discard(i)
            dropped.append(i)
        return dropped

    def plan(self) -> dict[str, Any]:
        """What a trial needs to read one evaluation: the resident references, how many pieces in all."""
        return {"key": self.key, "refs": list(self.refs), "pieces": len(self.pieces),
                "samples": int(sum(len(p) for p in self.pieces))}

    def report(self) -> dict[str, Any]:
        """Counters for the summary and the metrics."""
        return {"pipeline": self.key, "dataset": self.spec.dataset if isinstance(self.spec.dataset, str) else self.spec.dataset_name,
                "size": None if self.spec.user_transforms else self.spec.pipeline.size,  # type: ignore[union-attr]
                "samples": int(sum(len(p) for p in self.pieces)), "pieces": len(self.pieces),
                "resident_pieces": len(self.refs), "resident_bytes": self.resident_bytes,
                "evaluations": self.evaluations, "samples_prepared": self.samples_prepared,
                "samples_served": self.samples_served, "samples_skipped": len(self.skipped),
                "skipped_files": sorted(self.skipped.values())}
