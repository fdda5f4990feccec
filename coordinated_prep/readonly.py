"""Shared pieces mapped read-only in each trial: a write into a batch view cannot reach another trial.

Ray maps its object store writable in every process, and torch has no read-only tensors: without
this, ``batch.images[0] = 0`` in one trial would change the bytes every other trial of the group
reads from the same piece. So a trial's process ``mprotect``\\ s the pages of each shared piece's
images read-only while it holds the piece; a write into them then ends that trial's process with
SIGSEGV (``faulthandler`` prints the Python stack in the trial's log) instead of corrupting its
neighbours. The page protection is per process: other readers and the object store are untouched.

Layout (who owns what): the prep actor lays each piece's images inside a buffer with a page of
padding before and after (:func:`padded_empty`), and :class:`~coordinated_prep.pipeline.chunk.PreparedChunk`
pickles the whole buffer, so the pages around the images belong to the piece's own object and
protecting them never touches another object's bytes. The trial restores the pages' protection
when its last view of the piece is collected (before Ray may reuse the memory), counting
protections per page range because one piece may be mapped more than once (a resident evaluation
piece read at every epoch).

Locking: the release runs as a ``weakref.finalize`` callback, which a garbage collection may start
on any thread at any allocation, also inside this module's own locked code or the ``mprotect``
call. So no lock is held across ``mprotect``, and a release never waits for the lock: it queues its
range and applies it only if it can take the lock at once; otherwise whoever holds the lock applies
it on the way out (it looks at the queue again after letting go). No thread ever waits on itself.
"""

from __future__ import annotations

import ctypes
import faulthandler
import functools
import logging
import mmap
import queue
import threading
import weakref

import numpy as np

logger = logging.getLogger(__name__)

PAGE = mmap.PAGESIZE
_PROT_READ, _PROT_WRITE = 0x1, 0x2
_lock = threading.Lock()  # guards _held; never held across mprotect, never waited on by a release
_held: dict[tuple[int, int], int] = {}  # (page-aligned start, length) -> live mappings of it in this process
_released: queue.SimpleQueue = queue.SimpleQueue()  # ranges whose mapping was collected, not yet counted down
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


def protect(images: np.ndarray) -> bool:
    """Map the pages of ``images`` read-only in this process until its buffer is collected.

    Only a padded piece (:func:`padded_empty`, its pages all its own) is protected; returns whether
    it was. Anything else (no padding, or not Linux) is left as it is.
    """
    found = padded_base(images)
    if found is None or images.nbytes == 0:
        return False
    base, _ = found
    start = images.__array_interface__["data"][0] // PAGE * PAGE
    end = -(-(images.__array_interface__["data"][0] + images.nbytes) // PAGE) * PAGE
    key = (start, end - start)
    with _lock:
        first = _held.get(key, 0) == 0
        _held[key] = _held.get(key, 0) + 1
    _apply_releases()
    # Outside the lock: a collection inside the call may run releases. A release of this range
    # cannot come before ours is registered below, as this function holds the buffer.
    if first and not _mprotect(start, end - start, _PROT_READ):
        _release(key)
        return False
    weakref.finalize(base, _release, key)  # runs before the buffer goes back to Ray
    return True


def _release(key: tuple[int, int]) -> None:
    """A mapping of ``key`` was collected: count it down (now, or by the lock's holder)."""
    _released.put(key)  # SimpleQueue.put is safe inside a finalizer, even re-entered on one thread
    _apply_releases()


def _apply_releases() -> None:
    """Count down the queued releases if the lock is free; restore write access to ranges left unheld."""
    while not _released.empty():
        if not _lock.acquire(blocking=False):
            return  # its holder looks at the queue again after letting go
        writable = []
        try:
            while True:
                try:
                    key = _released.get_nowait()
                except queue.Empty:
                    break
                _held[key] -= 1
                if _held[key] == 0:
                    del _held[key]
                    writable.append(key)
        finally:
            _lock.release()
        for start, length in writable:
            _mprotect(start, length, _PROT_READ | _PROT_WRITE)


def protected_ranges() -> int:
    """Page ranges this process holds read-only now (for tests and diagnostics)."""
    _apply_releases()
    with _lock:
        return len(_held)


def _mprotect(start: int, length: int, prot: int) -> bool:
    global _warned
    libc = _mprotect_call()
    if libc is None or libc.mprotect(start, length, prot) != 0:
        if not _warned:  # once per process: a trial reads thousands of pieces
            _warned = True
            logger.warning("mprotect(%#x, %d) failed (errno %d): shared batches are not protected against writes "
                           "in this process", start, length, ctypes.get_errno())
        return False
    return True


@functools.lru_cache(maxsize=1)
def _mprotect_call() -> ctypes.CDLL | None:
    """libc with ``mprotect`` typed, or None where it is missing; enables faulthandler on first use."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.mprotect.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    except (OSError, AttributeError):
        return None
    if not faulthandler.is_enabled():
        faulthandler.enable()  # a write into a protected batch then prints where it happened
    return libc
