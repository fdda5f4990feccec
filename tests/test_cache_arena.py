"""The cache's shared-memory arena: append-only writes, zero-copy reads elsewhere, owned deletion."""

from __future__ import annotations

import os

import pytest

from coordinated_prep.cache.arena import Arena, ArenaReader, arena_dir, remove_stale


def test_a_reader_sees_published_regions_without_copying_and_the_owner_deletes_the_file():
    arena = Arena(f"coordprep-test-{os.getpid()}", 1000)
    regions = [arena.append(b"\xff\xd8jpeg-one"), arena.append(memoryview(b"second"))]
    assert regions == [(0, 10), (10, 6)] and arena.used == 16
    reader = ArenaReader(arena.path)
    view = reader.view(*regions[0])
    assert bytes(view) == b"\xff\xd8jpeg-one" and view.readonly
    with pytest.raises(ValueError, match="do not fit"):
        arena.append(b"x" * 985)
    arena.close()
    assert not os.path.exists(arena.path)
    assert bytes(reader.view(*regions[1])) == b"second"  # a mapping outlives the file's name
    arena.close()  # idempotent


def test_files_of_dead_owners_are_removed_and_live_ones_kept():
    dead = os.path.join(arena_dir(), "coordprep-test-stale.999999999")  # above any pid_max
    with open(dead, "wb") as f:
        f.write(b"left by a killed cache actor")
    live = os.path.join(arena_dir(), f"coordprep-test-live.{os.getpid()}")
    open(live, "wb").close()
    try:
        assert dead in remove_stale() and not os.path.exists(dead)
        assert os.path.exists(live)  # its owner (this process) is alive
    finally:
        os.unlink(live)
