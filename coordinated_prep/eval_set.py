"""Evaluation sets: the held-out split prepared once per sweep and evaluation pipeline, for every trial.

Evaluation is deterministic (decode, resize the shorter side, centre crop): its bytes depend on the
dataset, the held-out fraction and the pipeline's ``size``, ``eval_resize`` and ``backend``, never on
the seed or the augmentation. Every trial whose spec agrees on those reads the same prepared pieces,
whatever its data group.

Life cycle of an evaluation piece (the registry keeps it, :mod:`coordinated_prep.registry`):

1. The first trial that evaluates with a pipeline asks the registry for its plan. The registry cuts
   the held-out indices into pieces (:func:`eval_pieces`), chooses how many of them stay resident
   (:func:`resident_prefix`: the longest prefix that fits in the node's evaluation allowance) and
   submits those to the node's prep pool at once. The registry owns the resulting objects.
2. Every trial (the first included) gets the resident pieces' references and reads them in order;
   each read is a zero-copy view of the object store. Resident pieces stay until the sweep ends
   (the registry's shutdown), so later trials and epochs prepare nothing. A resident piece whose
   preparation failed (an actor lost for good; a bad sample under ``on_error="raise"``) is not kept:
   the registry prepares it again for the next evaluation that asks.
3. A piece past the resident prefix is streamed: prepared on request, in order, a bounded number
   ahead of the reader, and freed when the reading trial drops it.
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
                     for n in ("eval_transform", "eval_transforms", "target_transform")}}
        return "eval-" + hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()[:12]
    pipeline = spec.pipeline
    fields = {"dataset": spec.dataset, "holdout": spec.holdout, "size": pipeline.size,  # type: ignore[union-attr]
              "eval_resize": pipeline.eval_resize, "backend": pipeline.backend}  # type: ignore[union-attr]
    digest = hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()[:12]
    return f"eval-{pipeline.size}px-{digest}"  # type: ignore[union-attr]


def eval_pieces(held: np.ndarray, chunk_size: int) -> list[np.ndarray]:
    """The held-out indices (:func:`~coordinated_prep.plan.holdout_split`), in index order, cut into pieces."""
    return [held[lo : lo + chunk_size] for lo in range(0, len(held), chunk_size)]


def resident_prefix(piece_bytes: list[int], allowance: int) -> int:
    """How many leading pieces fit in ``allowance`` bytes together (the rest are streamed)."""
    total = 0
    for i, nbytes in enumerate(piece_bytes):
        total += nbytes
        if total > allowance:
            return i
    return len(piece_bytes)


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
    sample_bytes: int = 1  # bytes of one prepared held-out sample (probed)
    spec_box: list = field(default_factory=list)  # [the spec in the object store]: sent once per prep actor

    @property
    def resident_bytes(self) -> int:
        """Bytes its resident pieces hold in the node's object store."""
        return sum(len(p) for p in self.pieces[: len(self.refs)]) * self.sample_bytes

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
