"""Pinned batches for a loader: every tensor copied into page-locked memory, one batch ahead in a thread."""

from __future__ import annotations

import warnings
from typing import Generator, Iterator

from coordinated_prep.pipeline.seeding import Handoff, serving
from coordinated_prep.trial.batching import Batch


def _accelerator(who: str) -> bool:
    """Whether pinned memory helps here (CUDA is available); warns as a DataLoader does if not."""
    import torch

    if torch.cuda.is_available():
        return True
    warnings.warn(f"{who}: pin_memory=True, but no accelerator is found, so pinned memory is not used", stacklevel=3)
    return False


def pinned(batches: Iterator[Batch]) -> Generator[Batch, None, None]:
    """``batches`` with every tensor copied into page-locked memory, one batch ahead in a thread.

    The thread fetches, cuts and pins the next batch while the loop trains on this one. A piece
    this process prepares itself (a private stream with ``num_workers=0``, a detached trial) it
    hands back: the loop's thread prepares it when it next asks for a batch, so that the global
    generators seeded and restored around the preparation are that thread's own, between its draws
    (:mod:`coordinated_prep.pipeline.seeding`, rule 2).
    """
    from concurrent.futures import ThreadPoolExecutor

    def pin(batch: Batch | None) -> Batch | None:
        if batch is None:
            return None
        leaves = [leaf.pin_memory() if hasattr(leaf, "pin_memory") else
                  [x.pin_memory() if hasattr(x, "pin_memory") else x for x in leaf] for leaf in batch.leaves]
        return Batch(batch.layout, leaves, batch.indices, batch.stream_epochs, batch.repeats)

    handoff = Handoff()

    def next_pinned() -> Batch | None:
        with serving(handoff):  # in-process preparation goes to the loop's thread
            return pin(next(batches, None))

    with ThreadPoolExecutor(1, thread_name_prefix="coordprep-pin") as pool:
        try:
            ahead = pool.submit(next_pinned)
            while (batch := handoff.wait(ahead)) is not None:  # runs handed-back preparation meanwhile
                ahead = pool.submit(next_pinned)
                yield batch
        finally:
            handoff.close()  # an epoch cut short: the thread may wait for this one to prepare; it stops instead
