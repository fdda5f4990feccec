"""A trial's part of each piece: the rows of the samples it reads (``DataSpec.subset``, ``fraction``, ``fold``).

The group's stream holds the whole training split (:mod:`coordinated_prep.pipeline.part`). A trial
that reads a part keeps, from every piece of its epoch, the rows whose sample is in its part, in the
piece's order (all views of each, view-major as pieces are). Its epoch is then exactly its part,
once, in the stream's order, whatever piece it joined at: the pieces of one epoch hold the whole
split once (:mod:`coordinated_prep.plan`). A piece whose rows are all in the part (an unshared trial
prepares only its part's samples) is passed on as it is, so its batches stay views; otherwise the
kept rows are copied into memory the trial owns (ragged rows too), and the shared piece is dropped
at once: nothing of it stays mapped.
"""

from __future__ import annotations

from typing import Any, Iterable, Iterator

import numpy as np

from coordinated_prep.errors import ConfigError
from coordinated_prep.pipeline.part import Part, part_ids


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
            if spec.kind == "dense":
                leaves.append(np.ascontiguousarray(leaf[rows]))
            else:  # a ragged row is a view of the piece: copied, so that no row keeps the piece mapped
                leaves.append([np.array(leaf[r]) if isinstance(leaf[r], np.ndarray) else leaf[r] for r in rows])
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


def kept(piece: Any, part: Part) -> Any:
    """``piece`` itself when every row's sample is in ``part``, else its rows that are, as a
    :class:`PartPiece` (possibly empty)."""
    inside = part.mask[np.asarray(piece.indices)]
    if inside.all():
        return piece
    return PartPiece(piece, np.flatnonzero(inside))


def restricted(pieces: Iterable[Any], part: Part | None) -> Iterator[Any]:
    """Each of ``pieces`` cut to the rows of ``part`` (:func:`kept`); ``part`` None: the pieces as they are."""
    if part is None:
        yield from pieces
        return
    it = iter(pieces)
    while (piece := next(it, None)) is not None:
        out = kept(piece, part)
        del piece  # the next piece is pulled while this one is read: only its kept rows stay
        yield out


def numbered_kept(numbered: Iterable[tuple[Any, Any]], part: Part) -> Iterator[tuple[Any, Any]]:
    """``(g, piece)`` pairs with each piece cut to ``part``; a shared piece is not held past its cut."""
    it = iter(numbered)
    while (item := next(it, None)) is not None:
        g, piece = item
        item = None
        out = kept(piece, part)
        del piece  # the next piece is pulled while this one is read: only its kept rows stay
        yield g, out


def planned_in_part(planned: np.ndarray, part: Part | None) -> np.ndarray:
    """The samples of ``planned`` (a piece's planned indices, in order) that ``part`` reads, in order."""
    return planned if part is None else planned[part.mask[planned]]


def part_of(spec: Any, stream: Any) -> Part | None:
    """``spec``'s part of the training split of ``stream``'s dataset (None: the whole split); a part
    the dataset cannot hold closes the stream (the trial leaves its group) and raises
    :class:`~coordinated_prep.errors.ConfigError` naming it. A shared stream then reads further ahead:
    a batch of the part takes more pieces than a batch of the whole split."""
    try:
        ids = part_ids(spec, stream.dataset_samples)
    except ConfigError:
        stream.close()
        raise
    if ids is None:
        return None
    widen = getattr(stream, "widen", None)
    if widen is not None:
        widen(stream.samples_per_epoch / max(ids.size, 1))
    return Part(ids, stream.dataset_samples)
