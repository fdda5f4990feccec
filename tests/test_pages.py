"""Shared pieces copy-on-write in a trial: its writes into a batch stay in its own process.

The object store is stood in for by a ``MAP_SHARED`` mapping of one file, as Ray's is, and "another
process" by a second mapping of the same file: both see the same pages, as two processes on a node
do. A piece lands there the way Ray lands it, unpickled from out-of-band buffers placed in the store.
"""

from __future__ import annotations

import gc
import mmap
import os
import pickle
import subprocess
import sys
import threading

import numpy as np
import pytest
import torch

from coordinated_prep import pages
from coordinated_prep.pages import PAGE, padded_base, padded_empty
from coordinated_prep.pipeline.chunk import PreparedChunk, image_layout, image_piece
from coordinated_prep.trial.batching import batched

pytestmark = pytest.mark.skipif(pages._cow is None, reason="coordinated_prep._cow was not built")


def _piece(n: int = 64, size: int = 32) -> PreparedChunk:
    images = padded_empty((n, 3, size, size))
    images[...] = (np.arange(n, dtype=np.uint8) * 3)[:, None, None, None]
    ids = np.arange(n, dtype=np.int64)
    return image_piece(images, ids % 5, ids, 0)


class _Store:
    """A shared file mapped twice: ``mine`` (this trial's mapping) and ``theirs`` (another process's)."""

    def __init__(self, nbytes: int = 1024 * PAGE) -> None:
        fd = os.memfd_create("store")
        os.ftruncate(fd, nbytes)
        self.mine = mmap.mmap(fd, nbytes)
        self.theirs = np.frombuffer(mmap.mmap(fd, nbytes), dtype=np.uint8)
        os.close(fd)
        self._used = 0

    def put(self, piece: PreparedChunk) -> tuple[PreparedChunk, int]:
        """The piece as a reader unpickles it from the store, and its bytes' offset in the store."""
        buffers: list[pickle.PickleBuffer] = []
        data = pickle.dumps(piece, protocol=5, buffer_callback=buffers.append)
        views = []
        for b in buffers:
            raw = b.raw()
            at, self._used = self._used, self._used + -(-raw.nbytes // PAGE) * PAGE
            view = np.frombuffer(self.mine, dtype=np.uint8, count=raw.nbytes, offset=at)
            view[...] = np.frombuffer(raw, dtype=np.uint8)
            views.append(view)
        read = pickle.loads(data, buffers=views)
        store_at = read.buffer.__array_interface__["data"][0] - np.frombuffer(self.mine, np.uint8).ctypes.data
        return read, store_at


def _writable(address: int) -> bool:
    """Whether this process maps ``address`` writable (from /proc/self/maps)."""
    with open("/proc/self/maps") as f:
        for line in f:
            lo, hi = (int(x, 16) for x in line.split()[0].split("-"))
            if lo <= address < hi:
                return line.split()[1][1] == "w"
    raise AssertionError(f"{address:#x} is not mapped")


def test_pieces_keep_their_padding_through_pickling():
    piece = _piece()
    again = pickle.loads(pickle.dumps(piece, protocol=5))
    base, offset = padded_base(again.images)
    assert offset >= PAGE and base.nbytes - offset - again.images.nbytes >= PAGE
    assert np.array_equal(again.images, piece.images) and again.epoch == piece.epoch
    plain = PreparedChunk(image_layout((3, 4, 4)), np.zeros(2 * (48 + 8), np.uint8), ((0, 96), (96, 16)),
                          piece.indices[:2], 1)
    assert padded_base(plain.buffer) is None and pickle.loads(pickle.dumps(plain)).epoch == 1


def test_in_place_writes_into_every_leaf_stay_in_the_writer_and_leave_with_the_piece():
    store, prepared = _Store(), _piece()
    read, at = store.put(prepared)
    piece = read.guarded()
    assert piece is read and pages.guarded() == 1, "a shared piece is held zero-copy"
    inside = (piece.buffer.__array_interface__["data"][0] // PAGE + 1) * PAGE
    before = pages.copied_on_write()
    batches = list(batched(iter([piece]), 16))
    assert all(np.shares_memory(b.images.numpy(), piece.images) for b in batches), "unwritten batches are views"
    images, labels = batches[1]
    images.sub_(1)                       # in-place normalisation
    images[images > 100] = 0             # a masked write
    labels.mul_(0).add_(7)               # every leaf is writable
    mixed = batches[2].images
    mixed.mul_(0.5 if mixed.is_floating_point() else 1).add_(mixed.flip(0))  # in-place mixup
    assert pages.copied_on_write() == before + 1, "one copy of the piece, whichever batch wrote"
    want = prepared.images[16:32].astype(np.int16) - 1
    assert torch.equal(images, torch.from_numpy(np.where(want > 100, 0, want).astype(np.uint8)))
    assert torch.equal(labels, torch.full((16,), 7)) and torch.equal(batches[0].images, torch.from_numpy(prepared.images[:16]))
    theirs = store.theirs[at : at + piece.buffer.nbytes]
    assert np.array_equal(theirs, prepared.buffer), "another process still reads the prepared bytes"
    del piece, read, batches, images, labels, mixed
    gc.collect()
    assert pages.guarded() == 0 and _writable(inside), "released once the last view was collected"
    again, _ = store.put(prepared)  # the store's own pages are back at the piece's addresses
    assert np.array_equal(again.buffer, prepared.buffer)
    np.frombuffer(store.mine, np.uint8)[at] = 99  # a write there now reaches the store, as Ray left it
    assert store.theirs[at] == 99


def test_a_piece_in_private_memory_is_written_where_it_is_and_restored_when_released():
    """Ray keeps a small object (under 100 KiB) in the reading process's own memory: its pages are not
    shared, and a later reader of the object in this process must still see the prepared bytes."""
    prepared = _piece(n=8)
    buffers: list[pickle.PickleBuffer] = []
    data = pickle.dumps(prepared, protocol=5, buffer_callback=buffers.append)
    memory = [bytearray(b.raw()) for b in buffers]  # the process's own memory, as Ray inlines the object
    piece = pickle.loads(data, buffers=[np.frombuffer(m, dtype=np.uint8) for m in memory]).guarded()
    assert pages.guarded() == 1
    before = pages.copied_on_write()
    piece.images[...] = 0
    assert pages.copied_on_write() == before + 1 and int(piece.images.max()) == 0
    del piece
    gc.collect()
    assert pages.guarded() == 0
    assert bytes(memory[0][PAGE : PAGE + prepared.buffer.nbytes]) == prepared.buffer.tobytes(), "restored"


def test_a_second_reader_of_a_held_piece_gets_the_prepared_bytes_not_the_first_readers_writes():
    store, prepared = _Store(), _piece()
    first = store.put(prepared)[0].guarded()
    first.images[...] = 0
    # A second ray.get of the object in this process: the same bytes, a new reader.
    second = PreparedChunk(first.layout, first.buffer, first._meta, first.indices, 0).guarded()
    assert not np.shares_memory(second.buffer, first.buffer)
    assert np.array_equal(second.images, prepared.images), "the second reader sees the bytes as prepared"
    second.images[...] = 1
    assert int(first.images.max()) == 0 and pages.guarded() == 1


def test_a_second_reader_of_an_unwritten_piece_is_isolated_from_the_first_readers_later_writes():
    store, prepared = _Store(), _piece()
    first = store.put(prepared)[0].guarded()
    second = PreparedChunk(first.layout, first.buffer, first._meta, first.indices, 0).guarded()
    assert not np.shares_memory(second.buffer, first.buffer)
    first.images[...] = 0  # the first reader's pages went private as the second copied: no fault-time copy
    assert np.array_equal(second.images, prepared.images) and int(first.images.max()) == 0


def test_threads_writing_at_once_get_one_copy():
    store, prepared = _Store(), _piece(n=256)
    piece = store.put(prepared)[0].guarded()
    before = pages.copied_on_write()
    tensor = torch.from_numpy(piece.images)
    threads = [threading.Thread(target=lambda k=k: tensor[k::4].add_(1)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert pages.copied_on_write() == before + 1
    assert np.array_equal(piece.images, prepared.images + 1)


def test_an_unpadded_or_unguardable_piece_is_copied():
    images = np.zeros((8, 3, 32, 32), np.uint8)
    piece = image_piece(images, np.zeros(8), np.arange(8), 0)
    plain = PreparedChunk(piece.layout, np.array(piece.buffer), piece._meta, piece.indices, 0)
    assert padded_base(plain.buffer) is None
    owned = plain.guarded()
    assert owned is not plain and not np.shares_memory(owned.buffer, plain.buffer) and pages.guarded() == 0


def test_a_fault_outside_every_piece_still_reaches_faulthandler():
    code = ("import ctypes, faulthandler; faulthandler.enable()\n"
            "from coordinated_prep.pages import guard, padded_empty\n"
            "guard(padded_empty((4, 4096)))  # installs the handler above faulthandler's\n"
            "ctypes.string_at(0)\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == -11 and "Segmentation fault" in done.stderr, (done.returncode, done.stderr[-500:])


def _write_into_every_batch(refs: list) -> int:
    import ray

    piece = ray.get(refs[0]).guarded()  # as a trial's stream holds a shared piece
    total = 0
    for images, labels in batched(iter([piece]), 16):
        images.sub_(1)
        labels[labels > 2] = -1
        total += int(images.sum())
    return total


def test_a_write_into_a_shared_batch_stays_in_the_writer(ray_session):
    ray = ray_session
    piece = _piece()  # 196 KiB: in the object store, shared by every reader of the node
    ref = ray.put(piece)
    writer = ray.remote(max_retries=0)(_write_into_every_batch)
    written = int((piece.images - np.uint8(1)).astype(np.int64).sum())  # uint8 wraps, as torch's does
    assert ray.get(writer.remote([ref]), timeout=60) == written
    assert np.array_equal(ray.get(ref).images, piece.images), "another reader still sees the prepared bytes"
    assert ray.get(writer.remote([ref]), timeout=60) == written, \
        "the same process reading the piece again (a later epoch's reader) sees the prepared bytes"
