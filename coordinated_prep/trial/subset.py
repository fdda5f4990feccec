"""A trial's part of each piece: the rows of the samples it reads (``DataSpec.subset``, ``fraction``, ``fold``).

The group's stream holds the whole training split (:mod:`coordinated_prep.pipeline.part`). A trial
that reads a part keeps, from every piece of its epoch, the rows whose sample is in its part, in the
piece's order (all views of each, view-major as pieces are). Its epoch is then exactly its part,
once, in the stream's order, whatever piece it joined at: the pieces of one epoch hold the whole
split once (:mod:`coordinated_prep.plan`). A piece whose rows are all in the part (an unshared trial
prepares only its part's samples) is passed on as it is, so its batches stay views; otherwise the
kept rows are copied into memory the trial owns, and the shared piece is released with it.
"""

from __future__ import annotations

from typing import Any, Iterable, Iterator

import numpy as np

from coordinated_prep.errors import ConfigError
from coordinated_prep.pipeline.part import part_ids


class PartPiece:
    """Rows of a piece, copied into memory the trial owns; a Batcher reads it as a
    :class:`~coordinated_prep.pipeline.chunk.PreparedChunk` (its ``row_labels``: each row's stream
    epoch and view, or a data-parallel pad, as the piece labelled it)."""

    __slots__ = ("layout", "leaves", "indices", "epoch", "views", "row_labels")

    def __init__(self, piece: Any, rows: np.ndarray) -> None:
        self.layout, self.epoch, self.views = piece.layout, piece.epoch, piece.views
        leaves: list[Any] = []
        for j, spec in enumerate(piece.layout.leaves):
            leaf = piece.leaves[j]
            leaves.append(np.ascontiguousarray(leaf[rows]) if spec.kind == "dense" else [leaf[r] for r in rows])
        self.leaves = tuple(leaves)
        self.indices = np.asarray(piece.indices)[rows]
        own = getattr(piece, "row_labels", None)
        if own is not None:
            self.row_labels = (own[0][rows], own[1][rows])
        else:  # a piece of k views lays them view-major: row r is view r // (rows per view)
            per = max(len(piece) // piece.views, 1)
            self.row_labels = (np.full(rows.size, piece.epoch, dtype=np.int64), (rows // per).astype(np.int64))

    def __len__(self) -> int:
        return len(self.indices)


def kept(piece: Any, part: np.ndarray) -> Any:
    """``piece`` itself when every row's sample is in ``part`` (sorted indices), else its rows that
    are, as a :class:`PartPiece` (possibly empty)."""
    inside = np.isin(np.asarray(piece.indices), part, assume_unique=False)
    if inside.all():
        return piece
    return PartPiece(piece, np.flatnonzero(inside))


def restricted(pieces: Iterable[Any], part: np.ndarray | None) -> Iterator[Any]:
    """Each of ``pieces`` cut to the rows of ``part`` (:func:`kept`); ``part`` None: the pieces as they are."""
    if part is None:
        yield from pieces
        return
    for piece in pieces:
        yield kept(piece, part)


def planned_in_part(planned: np.ndarray, part: np.ndarray | None) -> np.ndarray:
    """The samples of ``planned`` (a piece's planned indices, in order) that ``part`` reads, in order."""
    return planned if part is None else planned[np.isin(planned, part)]


def part_of(spec: Any, stream: Any) -> np.ndarray | None:
    """Sorted samples of ``spec``'s part of the training split of ``stream``'s dataset (None: the whole
    split); a part the dataset cannot hold closes the stream (the trial leaves its group) and raises
    :class:`~coordinated_prep.errors.ConfigError` naming it."""
    try:
        return part_ids(spec, stream.dataset_samples)
    except ConfigError:
        stream.close()
        raise
