"""Batch-norm layers and their running statistics, which a checkpointed stage must update only once.

Both :mod:`coordinated_prep.memory.modes` (each recomputation) and :mod:`coordinated_prep.memory.budget`
(the profiled forward) put the statistics back after running a stage: the rule lives here, so the
two import it from one place and neither imports the other for it.
"""

from __future__ import annotations

import contextlib
from typing import Iterator, Sequence

import torch
from torch import nn
from torch.utils._python_dispatch import _disable_current_modes


def batch_norms(modules: Sequence[nn.Module]) -> list[nn.Module]:
    """The batch-norm layers in ``modules`` (and their children)."""
    return [m for top in modules for m in top.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]


@contextlib.contextmanager
def kept_batch_norm_stats(norms: Sequence[nn.Module]) -> Iterator[None]:
    """Run the body, then put the running statistics of ``norms`` back as they were before it.

    The copies run outside any dispatch mode: inside a recomputation, selective checkpointing's mode
    would otherwise take them for ops of the region (and find no saved result for them).
    """
    with _disable_current_modes():
        saved = [(b, {k: v.clone() for k, v in b._buffers.items() if v is not None}) for b in norms]
    try:
        yield
    finally:
        with _disable_current_modes(), torch.no_grad():
            for b, buffers in saved:
                for k, v in buffers.items():
                    b._buffers[k].copy_(v)


__all__ = ["batch_norms", "kept_batch_norm_stats"]
