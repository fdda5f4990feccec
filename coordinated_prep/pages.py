"""Shared pieces' pages: padded by the prep side, copy-on-write in each trial.

A trial writes into its batches as into a ``DataLoader``'s (``x.sub_(0.5)``, ``x[mask] = 0``,
in-place mixup), and the write reaches no other trial, rank or later epoch, while a batch that is
only read stays a zero-copy view of the object store.

Ray maps its object store writable in every process, and torch has no read-only tensors, so a
trial's process holds each shared piece it reads copy-on-write (:func:`guard`): the piece's pages
are mapped read-only here, and the first write into them gives this process a private copy of the
piece's pages at the same addresses (``coordinated_prep/_cow.c``, a fault handler; its header has the
steps). Other readers and the object store are untouched. A piece that is never written costs two
``mprotect`` calls; a written one costs one copy of the piece, about what a ``DataLoader``'s
collate costs per batch.

Layout and ownership: the prep actor lays each piece's bytes inside a buffer with a page of padding
before and after (:func:`padded_empty`), and :class:`~coordinated_prep.pipeline.chunk.PreparedChunk`
pickles the whole buffer, so the pages around the bytes belong to the piece's own object and
remapping them never touches another object's bytes. Life cycle of a piece's pages in a trial:

1. the trial fetches the piece (``ray.get``: a numpy buffer over the store's pages) and guards it:
   held, its pages read-only here;
2. its batches are views of it; the first write into any of them copies the piece's pages privately
   (once for the piece, whichever batch or thread wrote);
3. when the trial's last view of the piece is collected (``weakref.finalize`` on the buffer, which
   runs before Ray may reuse the memory), the store's pages go back to their addresses, writable as
   Ray left them, and the private copy is freed.

A second reader of one object in the same process (a resident evaluation piece read again while a
batch of the last pass is still alive) gets its own private copy of the original bytes, so its
writes and the first reader's never meet. Where the handler cannot be built or run (no C compiler at
install, not Linux, 8,192 pieces held at once), a piece is copied into the trial instead: writable
and isolated, at the cost of one copy per piece (a warning says so once per process).
"""

from __future__ import annotations

import logging
import mmap
import warnings
import weakref

import numpy as np

try:
    from coordinated_prep import _cow
except ImportError:  # built at install where a C compiler is present (pyproject.toml: ext-modules)
    _cow = None

logger = logging.getLogger(__name__)

PAGE = mmap.PAGESIZE
_warned = False


def padded_empty(shape: tuple[int, ...]) -> np.ndarray:
    """An uninitialised uint8 array of ``shape`` inside a buffer with a page of padding on each side."""
    nbytes = int(np.prod(shape))
    return np.empty(nbytes + 2 * PAGE, dtype=np.uint8)[PAGE : PAGE + nbytes].reshape(shape)


def padded_base(images: np.ndarray) -> tuple[np.ndarray, int] | None:
    """``(buffer, offset)`` if ``images`` lies in a buffer with at least a page of padding on each side."""
    base = images.base
    if not isinstance(base, np.ndarray) or base.ndim != 1 or base.dtype != np.uint8 or not images.flags.c_contiguous:
        return None
    offset = images.__array_interface__["data"][0] - base.__array_interface__["data"][0]
    if offset < PAGE or base.nbytes - offset - images.nbytes < PAGE:
        return None
    return base, offset


def guard(buffer: np.ndarray) -> np.ndarray:
    """``buffer`` (a shared piece's padded bytes), copy-on-write in this process until it is collected;
    or, where it cannot be guarded, a private copy of its original bytes. Use what comes back."""
    found = padded_base(buffer)
    if found is None or buffer.nbytes == 0:
        return _copied(buffer, "it is not in a padded buffer")
    base, _ = found
    address = buffer.__array_interface__["data"][0]
    start = address // PAGE * PAGE
    length = -(-(address + buffer.nbytes) // PAGE) * PAGE - start
    if _cow is None:
        return _copied(buffer, "coordinated_prep._cow was not built (reinstall where a C compiler is present)")
    while True:
        status = _cow.hold(start, length)
        if status == 0:
            # Runs before the buffer goes back to Ray; not at exit, where a thread may still write.
            weakref.finalize(base, _release, start, length).atexit = False
            return buffer
        if status == 2:  # no slot left: nobody in this process writes into it, so a copy as it is
            return _copied(buffer, "8,192 pieces are held in this process")
        # Held already here: the bytes as prepared, copied away from the first reader's writes.
        out = np.empty(buffer.nbytes, dtype=np.uint8)
        if _cow.original(start, length, address - start, out):
            return out
        # released between the two calls: hold it now


def _release(start: int, length: int) -> None:
    if not _cow.release(start, length):
        logger.error("could not give the pages at %#x (+%d) back to Ray's object store", start, length)


def _copied(buffer: np.ndarray, why: str) -> np.ndarray:
    global _warned
    if not _warned and _cow is None:  # once per process: a trial reads thousands of pieces
        _warned = True
        warnings.warn(f"shared pieces are copied into this trial ({why}): writable and isolated, at the cost "
                      "of one copy per piece", RuntimeWarning, stacklevel=3)
    return np.array(buffer, copy=True)


def guarded() -> int:
    """Pieces this process holds copy-on-write now (for tests and diagnostics)."""
    return _cow.held() if _cow is not None else 0


def copied_on_write() -> int:
    """Pieces this process has copied on a first write since it started."""
    return _cow.copied() if _cow is not None else 0
