"""Shared pieces are read-only in a trial's process: a write into a batch view cannot reach another trial."""

from __future__ import annotations

import gc
import pickle
import threading

import numpy as np
import pytest

from coordinated_prep.trial.batching import batched
from coordinated_prep.pipeline.chunk import PreparedChunk, image_layout, image_piece
from coordinated_prep import readonly
from coordinated_prep.readonly import PAGE, padded_base, padded_empty, protect, protected_ranges


def _piece(n: int = 64, size: int = 32) -> PreparedChunk:
    images = padded_empty((n, 3, size, size))
    images[...] = (np.arange(n, dtype=np.uint8) * 3)[:, None, None, None]
    ids = np.arange(n, dtype=np.int64)
    return image_piece(images, ids % 5, ids, 0)


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


def test_protect_maps_the_pages_read_only_until_the_last_view_is_gone():
    piece = _piece()
    address = piece.images.__array_interface__["data"][0]
    inside = (address // PAGE + 1) * PAGE  # a page wholly inside the images
    assert _writable(inside)
    assert protect(piece.images) and protect(piece.images)  # the same piece mapped twice: counted
    assert not _writable(inside) and protected_ranges() == 1
    views = list(batched(iter([piece]), 16))  # batches inside the piece are views of it
    assert all(np.shares_memory(b.images.numpy(), piece.images) for b in views)
    del piece
    gc.collect()
    assert not _writable(inside), "the batch views still hold the piece"
    del views
    gc.collect()
    assert _writable(inside) and protected_ranges() == 0, "released once the last view was collected"


def test_a_collection_inside_mprotect_releases_a_piece_and_returns(monkeypatch):
    """A garbage collection starting inside the ctypes call frees a protected piece held in a cycle:
    its release runs on the same thread, inside protect(). It must count down and return, not hang."""
    real = readonly._mprotect_call()
    collected: list[int] = []

    class _CollectingLibc:
        def mprotect(self, start: int, length: int, prot: int) -> int:
            collected.append(gc.collect())  # as if the allocator had started a collection here
            return real.mprotect(start, length, prot)

    before = protected_ranges()
    old = _piece()
    assert protect(old.images)
    cycle: list = [old.images.base]
    cycle.append(cycle)  # only the cycle collector frees it
    old_address = old.images.__array_interface__["data"][0]
    del old
    monkeypatch.setattr(readonly, "_mprotect_call", lambda: _CollectingLibc())
    new = _piece()
    worker = threading.Thread(target=protect, args=(new.images,), daemon=True)
    gc.disable()  # the only collection is the one inside mprotect
    try:
        cycle = None  # noqa: F841 (the cycle is now garbage, freed by the collection inside mprotect)
        worker.start()
        worker.join(timeout=60)
    finally:
        gc.enable()
    assert not worker.is_alive(), "protect() deadlocked on a release run by a collection inside mprotect"
    # Two calls: protecting the new piece, whose collection freed the old one, and (nested inside it,
    # so listed first) restoring the old piece's pages, where a collection already running finds nothing.
    assert len(collected) == 2 and collected[1] > 0, collected
    assert protected_ranges() == before + 1, "the old piece was counted down, the new one is held"
    assert not _writable(new.images.__array_interface__["data"][0])
    assert old_address not in {start for start, _ in readonly._held}


def test_an_unpadded_array_is_left_alone():
    images = np.zeros((8, 3, 32, 32), np.uint8)
    assert not protect(images) and protected_ranges() == 0


def _write_into_first_batch(refs: list, protected: bool) -> None:
    import ray

    piece = ray.get(refs[0])
    if protected:
        protect(piece.images)
    batch = next(batched(iter([piece]), 16))
    batch.images[0, 0, 0, 0] = 255  # a trial writing into its batch in place


def test_a_write_into_a_shared_batch_kills_the_writer_not_the_neighbours(ray_session):
    ray = ray_session
    piece = _piece()  # 196 KiB: in the object store, shared by every reader of the node
    ref = ray.put(piece)
    writer = ray.remote(max_retries=0)(_write_into_first_batch)
    with pytest.raises((ray.exceptions.WorkerCrashedError, ray.exceptions.RayTaskError)):
        ray.get(writer.remote([ref], True), timeout=60)
    assert int(ray.get(ref).images[0, 0, 0, 0]) == 0, "another reader still sees the prepared bytes"
    # Without the protection the same write lands in the store: what the protection prevents.
    ray.get(writer.remote([ref], False), timeout=60)
    assert int(ray.get(ref).images[0, 0, 0, 0]) == 255
