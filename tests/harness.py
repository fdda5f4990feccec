"""The central invariant, checked the same way everywhere: each trial epoch holds each sample once."""

from __future__ import annotations

from typing import Iterable, Sequence

import numpy as np


def assert_exactly_once(epochs: Sequence[np.ndarray], expected: Iterable[int], who: str = "trial") -> None:
    """Every epoch in ``epochs`` (arrays of dataset indices) is a permutation of ``expected``."""
    want = np.sort(np.fromiter(expected, dtype=np.int64))
    assert len(epochs) > 0, f"{who}: no epochs recorded"
    for k, got in enumerate(epochs):
        got = np.sort(np.asarray(got, dtype=np.int64))
        if got.shape != want.shape or not np.array_equal(got, want):
            dup = np.unique(got[1:][got[1:] == got[:-1]])
            missing = np.setdiff1d(want, got)
            raise AssertionError(
                f"{who} epoch {k}: {len(got)} samples for {len(want)} expected; "
                f"duplicates {dup[:10].tolist()}, missing {missing[:10].tolist()}"
            )
