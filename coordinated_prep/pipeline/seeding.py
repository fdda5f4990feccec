"""Randomness as a pure function of (seed, epoch, sample, view), for transforms that draw from the
global generators.

torchvision's ``transforms.v2`` draws from torch's global generator, many user transforms from
Python's ``random`` or NumPy's global ``np.random``. :func:`seeded` seeds all three from one key
around a call and restores them after, so a sample is byte-identical whichever process prepares it,
and the caller's own random state is untouched. A transform that draws from a generator of its own
(``np.random.default_rng()``, a ``torch.Generator``) cannot be seeded this way: the group's start
prepares a few samples twice and refuses it (:mod:`coordinated_prep.pipeline.probe`).
"""

from __future__ import annotations

import contextlib
import random
import threading
from typing import Iterator

import numpy as np

_TRANSFORM_STREAM = 0x7A5F  # separates these draws from the plan's sample order and the built-in crops
_FETCH, _VIEW = 0, 1  # the dataset's own __getitem__, and each view's transforms


def key_seed(seed: int, epoch: int, index: int, view: int = 0, stage: int = _VIEW) -> int:
    """A 63-bit seed that is a pure function of its arguments (``epoch`` -1: evaluation)."""
    words = np.random.SeedSequence([_TRANSFORM_STREAM, stage, seed, epoch + 1, index, view]).generate_state(2)
    return (int(words[0]) << 31 ^ int(words[1])) & (2**63 - 1)


def reseed(seed: int) -> None:
    """Seed Python's ``random``, NumPy's global generator and torch's from ``seed`` (inside :func:`preserved`)."""
    import torch

    random.seed(seed)
    np.random.seed(seed & 0xFFFFFFFF)
    torch.random.default_generator.manual_seed(seed)  # (torch.manual_seed also seeds accelerators: 100x slower)


@contextlib.contextmanager
def preserved() -> Iterator[None]:
    """Restore the three global generators after the block, whatever it seeded.

    Nested blocks save nothing: saving NumPy's state costs ~70 us and reseeding ~7 us, so a piece
    is prepared inside one block and its samples' calls reuse it."""
    import torch

    if getattr(_depth, "n", 0):
        yield
        return
    generator = torch.random.default_generator
    saved = random.getstate(), np.random.get_state(legacy=False), generator.get_state()
    _depth.n = 1
    try:
        yield
    finally:
        _depth.n = 0
        random.setstate(saved[0])
        np.random.set_state(saved[1])
        generator.set_state(saved[2])


_depth = threading.local()  # inside a preserved() block on this thread
