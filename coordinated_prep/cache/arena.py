"""An append-only byte arena in shared memory: how a node's cache holds encoded samples.

MinIO never evicts, so the cache only ever appends: the writer (the node's cache actor, the owner)
copies a sample in at the end and then publishes its (offset, length); readers on the node map the
same file read-only and slice it, zero-copy. A region is published only after it is written and is
never written again, so readers need no lock. The file lives in ``/dev/shm`` (RAM) where there is
one, else in the temporary directory; the owner deletes it in :meth:`Arena.close` (also at process
exit). A reader's mapping stays valid after the file is deleted, until the reader closes it.
A file's name ends with its owner's process id, so an owner that was killed before it could delete
its file (SIGKILL, a crash) has it deleted by the next arena created on the machine.
"""

from __future__ import annotations

import atexit
import glob
import logging
import mmap
import os
import tempfile

from coordinated_prep.errors import ConfigError

logger = logging.getLogger(__name__)

PREFIX = "coordprep-"


def arena_dir() -> str:
    """Where arenas are created: ``/dev/shm`` if it exists, else the temporary directory."""
    return "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()


class Arena:
    """The writer's side: a file of ``capacity`` bytes, filled from the start.

    Args:
        name: File name, unique per cache actor (session and node); the owner's pid is appended.
        capacity: Bytes reserved, all at once (in the temporary directory if ``/dev/shm`` lacks room).
    """

    def __init__(self, name: str, capacity: int) -> None:
        remove_stale()
        self.capacity = capacity
        self.used = 0
        for directory in dict.fromkeys((arena_dir(), tempfile.gettempdir())):
            self.path = os.path.join(directory, f"{name}.{os.getpid()}")
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
            try:
                # Reserve every page now: a sparse file on a full tmpfs would kill this process with
                # SIGBUS at the first write past the space left, instead of failing here, cleanly.
                os.posix_fallocate(fd, 0, capacity)
                self._map = mmap.mmap(fd, capacity)
                break
            except OSError as e:
                os.unlink(self.path)
                logger.warning("arena %s: cannot reserve %d bytes in %s (%s)", name, capacity, directory, e)
            finally:
                os.close(fd)
        else:
            raise ConfigError(f"cache: cannot reserve cache.capacity_bytes={capacity} bytes in {arena_dir()} or "
                              f"{tempfile.gettempdir()}; lower cache.capacity_bytes or free memory there")
        atexit.register(self.close)

    def append(self, data: memoryview | bytes) -> tuple[int, int]:
        """Copy ``data`` in after the last sample; returns its (offset, length). The caller checks room."""
        n = len(data)
        if self.used + n > self.capacity:
            raise ValueError(f"arena {self.path}: {n} bytes do not fit ({self.used} of {self.capacity} used)")
        offset = self.used
        self._map[offset : offset + n] = data
        self.used += n
        return offset, n

    def view(self, offset: int, length: int) -> memoryview:
        """The bytes of a published region (zero-copy)."""
        return memoryview(self._map)[offset : offset + length]

    def close(self) -> None:
        """Delete the file (idempotent); mappings readers hold stay valid until they close them."""
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass


def remove_stale() -> list[str]:
    """Delete the arena files on this machine whose owner process is gone; returns their paths."""
    removed = []
    for path in glob.glob(os.path.join(arena_dir(), PREFIX + "*")):
        pid = path.rsplit(".", 1)[-1]
        if not pid.isdigit() or os.path.exists(f"/proc/{pid}") or not os.path.isdir("/proc"):
            continue
        try:
            os.unlink(path)
            removed.append(path)
        except OSError:
            continue
    if removed:
        logger.warning("removed %d arena file(s) left by killed cache actors, e.g. %s", len(removed), removed[0])
    return removed


class ArenaReader:
    """A read-only mapping of another process's arena on the same node.

    Args:
        path: The arena's file.
    """

    def __init__(self, path: str) -> None:
        fd = os.open(path, os.O_RDONLY)
        try:
            self._map = mmap.mmap(fd, os.fstat(fd).st_size, prot=mmap.PROT_READ)
        finally:
            os.close(fd)

    def view(self, offset: int, length: int) -> memoryview:
        """Bytes ``[offset, offset + length)``: a read-only view into shared memory, no copy."""
        return memoryview(self._map)[offset : offset + length]
