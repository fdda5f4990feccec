"""Pieces prepared in parallel worker processes for one training process (a private stream).

Outside a sweep (or unshared) a spec's pieces are prepared in the process that reads them. With
``workers`` > 0 a ``torch.utils.data.DataLoader`` prepares whole pieces in that many worker
processes, ``prefetch`` pieces ahead of each; a piece's buffer travels as a tensor, so torch moves
it through shared memory instead of a pipe. Errors raised in a worker (a bad sample under
``on_error="raise"``) are re-raised here, where the piece is read, by the DataLoader.

How the workers start: forked, as a ``DataLoader``'s on Linux, unless gRPC's threads run in this
process (a Ray worker, or a driver that has run Ray, even after ``ray.shutdown()``: nine of them
stay). A forked child inherits no threads but their locks and heap state, and a worker forked
beside them can die with a corrupted heap; there the workers start from a ``forkserver`` that has
imported torch, torchvision and this module once (the process's first such loader waits about 2 s
more for its first piece, later ones 0.4 s), unless the spec does not pickle (a dataset object
holding a lambda; a transform travels by value, lambdas included: :mod:`coordinated_prep.pipeline.carried`),
which keeps ``fork`` and says so in a warning.

Process-global state: the workers prepare with one torch thread (the DataLoader's default, as the
prep actors and in-process preparation do: :mod:`coordinated_prep.pipeline.seeding`), and starting
them draws nothing from the reading process's global generators.

Life cycle of a piece here: a worker prepares it (``prepare_chunk``) into a buffer it owns; torch
copies the buffer into a shared-memory segment for the reading process, which owns the segment
from then on; the segment is freed when the last batch viewing it is collected.
"""

from __future__ import annotations

import itertools
import logging
import multiprocessing
import multiprocessing.connection
import os
import pickle
import time
import warnings
from typing import Any, Iterator

import numpy as np

from coordinated_prep.errors import CoordinatedPrepError, PrepError
from coordinated_prep.pipeline.chunk import PreparedChunk, prepare_chunk
from coordinated_prep.pipeline.structure import Layout

logger = logging.getLogger(__name__)

_LIVENESS_S = 5.0  # how often a wait for a piece checks that the worker processes are alive

#: Name prefixes of the threads gRPC (under Ray) starts, as ``/proc/self/task/*/comm`` shows them.
_GRPC_THREADS = ("grpc_", "event_engine", "gcs_client", "default-executo", "resolver-execut", "timer_manager")


def _grpc_threads() -> int:
    """gRPC's threads running in this process now (0 where ``/proc`` cannot tell)."""
    try:
        tasks = os.listdir("/proc/self/task")
    except OSError:
        return 0
    found = 0
    for task in tasks:
        try:
            with open(f"/proc/self/task/{task}/comm") as f:
                found += f.read().startswith(_GRPC_THREADS)
        except OSError:  # the thread ended meanwhile
            continue
    return found


def worker_context(dataset: Any) -> Any:
    """The multiprocessing context for the workers preparing ``dataset`` (None: the DataLoader's,
    ``fork`` on Linux): see the module's docstring."""
    threads = _grpc_threads()
    if not threads:
        return None
    try:
        pickle.dumps(dataset)
    except Exception as e:  # noqa: BLE001 (any pickling failure: the spec holds something pickle refuses)
        warnings.warn(f"train_loader: the spec does not pickle ({type(e).__name__}: {e}), so its worker processes are "
                      f"forked beside {threads} gRPC threads of Ray, which a forked process may crash on; define "
                      "transforms as functions or classes at module level, or pass num_workers=0", stacklevel=4)
        return None
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(["torch", "torchvision", __name__])  # imported once, in the server
    logger.debug("starting prep workers from a forkserver: %d gRPC threads run in this process", threads)
    return context


class _Pieces:
    """Map-style dataset of pieces: item ``g`` is piece ``g`` of the plan, as a worker ships it."""

    def __init__(self, spec: Any, plan: Any, layout: Layout) -> None:
        self.spec, self.plan, self.layout = spec, plan, layout
        self._pipeline: Any = None  # built in each worker, at its first piece

    def __getitem__(self, g: int) -> tuple:
        from coordinated_prep.pipeline.transforms import make_pipeline

        if self._pipeline is None:
            self._pipeline = make_pipeline(self.spec)
        epoch, _ = self.plan.locate(g)
        shared = _SharedBuffer()
        try:
            chunk, _ = prepare_chunk(self._pipeline, self.layout, self.spec.seed, epoch, self.plan.chunk_samples(g),
                                     self.spec.on_error, self.spec.views, alloc=shared)
        except CoordinatedPrepError as e:  # shipped as a value: the DataLoader would re-raise a RuntimeError
            return (e,)
        return (shared.tensor, chunk.layout, chunk._meta, chunk.indices, chunk.epoch, chunk.views)


class _SharedBuffer:
    """Allocates a piece's buffer in shared memory, so that shipping it copies nothing."""

    tensor: Any = None

    def __call__(self, nbytes: int) -> np.ndarray:
        import torch

        self.tensor = torch.empty(nbytes, dtype=torch.uint8).share_memory_()
        return self.tensor.numpy()


def _land(shipped: tuple) -> PreparedChunk:
    buffer, layout, meta, indices, epoch, views = shipped
    return PreparedChunk(layout, buffer.numpy(), meta, np.asarray(indices), int(epoch), int(views))


def _identity(item: Any) -> Any:
    return item


class WorkerPieces:
    """Pieces ``first, first + 1, ...`` of ``plan`` from ``workers`` processes, in order.

    Args:
        spec: The DataSpec.
        plan: Its stream plan.
        layout: Its training samples' layout.
        workers: Worker processes (> 0).
        prefetch: Pieces each worker prepares ahead.
    """

    def __init__(self, spec: Any, plan: Any, layout: Layout, workers: int, prefetch: int = 2) -> None:
        self._dataset = _Pieces(spec, plan, layout)
        self._workers, self._prefetch = workers, prefetch
        self._timeout_s = float(spec.fetch_timeout_s)
        self._context = worker_context(self._dataset)
        self._it: Iterator[Any] | None = None
        self._next = 0

    def start(self, g: int) -> None:
        """Prepare from piece ``g`` on (drops what was prefetched before it)."""
        import torch
        from torch.utils.data import DataLoader

        self.close()
        # The workers' base seed comes from a generator of their own: by default a DataLoader draws it
        # from torch's global generator, the trainer's (a draw taken from its loop at every start).
        # Its value does not matter: every draw of a preparation is seeded per sample (seeding).
        loader = DataLoader(self._dataset, batch_size=None, sampler=itertools.count(g), num_workers=self._workers,
                            prefetch_factor=self._prefetch, collate_fn=_identity, persistent_workers=False,
                            multiprocessing_context=self._context, generator=torch.Generator(),
                            timeout=min(self._timeout_s, _LIVENESS_S))
        self._it, self._next = iter(loader), g

    def next(self, g: int) -> PreparedChunk:
        """Piece ``g``: the next in order, or a restart at ``g`` after a skip."""
        if self._it is None or g != self._next:
            self.start(g)
        self._next += 1
        asked = time.monotonic()
        while True:  # each wait short: a DataLoader checks its workers are alive only when one times out (off
            # its main thread, where Tune runs a trainable, no SIGCHLD handler does it); the last one ends
            # at fetch_timeout_s (torch's iterator reads its ``_timeout`` at every wait)
            left = self._timeout_s - (time.monotonic() - asked)
            if hasattr(self._it, "_timeout"):
                self._it._timeout = max(0.01, min(left, _LIVENESS_S))  # type: ignore[union-attr]
            try:
                shipped = next(self._it)  # type: ignore[arg-type]
                break
            except (RuntimeError, OSError, EOFError) as e:  # a dead worker's pipe may reset, or end, mid-message
                waited = time.monotonic() - asked
                timed_out = isinstance(e, RuntimeError) and "timed out" in str(e)
                if timed_out and waited < self._timeout_s:
                    continue  # the iterator resumes where it was
                if "in DataLoader worker process" in str(e):  # the dataset's own error, raised in a worker
                    self.close()
                    raise
                workers = getattr(self._it, "_workers", [])
                if not timed_out and workers:  # a broken pipe: its worker is ending (its files close first)
                    multiprocessing.connection.wait([w.sentinel for w in workers], timeout=_LIVENESS_S)
                dead = [w.pid for w in workers if not w.is_alive()]
                self.close()
                if not timed_out and not dead:
                    raise
                if dead:
                    raise PrepError(f"piece {g}: worker process(es) {dead} preparing it died ({e!r}); one may have run "
                                    "out of memory: lower the loader's num_workers or the pieces' size "
                                    "(data.chunk_size)") from None
                raise PrepError(f"piece {g}: no worker process had it ready within data.fetch_timeout_s="
                                f"{self._timeout_s:g} s (waited {waited:.1f} s); its storage may hang (check that it "
                                "answers), or raise fetch_timeout_s if one piece takes that long to prepare") from None
        if len(shipped) == 1:
            self.close()
            raise shipped[0]  # the SampleError or StructureError, as the reading process would raise it
        return _land(shipped)

    def close(self) -> None:
        """Stop the workers (the DataLoader's iterator shuts them down when dropped)."""
        it, self._it = self._it, None
        if it is not None and hasattr(it, "_shutdown_workers"):
            it._shutdown_workers()
