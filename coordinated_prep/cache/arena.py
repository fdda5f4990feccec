"""An append-only byte arena in shared memory: how a node's cache holds encoded samples.

MinIO never evicts, so the cache only ever appends: the writer (the node's cache actor, the owner)
copies a sample in at the end and then publishes its (offset, length); readers on the node map the
same file read-only and slice it, zero-copy. A region is published only after it is written and is
never written again, so readers need no lock. The file lives in ``/dev/shm`` (RAM) where there is
one, else in the temporary directory. A reader's mapping stays valid after the file is deleted,
until the reader closes it.

Who may touch the file, and how:

- **Creation.** The owner creates the file under an unpredictable name (the cache's name and 128
  random bits) with ``O_CREAT | O_EXCL | O_NOFOLLOW`` and mode 0600, so a file or symlink planted in
  advance is never opened, and no other user can read or write the samples. It publishes an
  :class:`ArenaId` (path, device, inode, owner, size); a reader opens the path with ``O_NOFOLLOW``
  and refuses a file that is not that one (:class:`ArenaReader`).
- **Liveness.** The owner holds an exclusive ``flock`` on the file from before it reserves the
  capacity until :meth:`Arena.close`. The kernel drops the lock when the owner dies, however it dies
  (SIGKILL included), and the lock is the same across PID namespaces (containers sharing
  ``/dev/shm``), where process ids are not. Readers take no lock.
- **Deletion.** The owner deletes its file in :meth:`Arena.close` (also at process exit).
  :func:`remove_stale` (run by every new arena, by ``coordprep sweep`` and by ``coordprep clean``)
  deletes, in both locations, the arenas whose lock it can take: their owner is gone. An empty file
  younger than a minute is left alone: its owner may be between creating and locking it.
"""

from __future__ import annotations

import atexit
import fcntl
import logging
import mmap
import os
import re
import secrets
import stat
import tempfile
import time
from typing import NamedTuple

from coordinated_prep.errors import CacheError

logger = logging.getLogger(__name__)

PREFIX = "coordprep-"
_NAME = re.compile(r"^coordprep-.*\.[0-9a-f]{32}$")  # what Arena creates: <name>.<128 random bits>
_CREATING_GRACE_S = 60.0  # an empty arena this young may be between O_CREAT and flock


class ArenaId(NamedTuple):
    """What a reader needs to map an arena, and to check that the file it opened is that arena."""

    path: str
    device: int
    inode: int
    owner: int  # uid of the owner process
    size: int  # the capacity: bytes a reader maps


def arena_dir() -> str:
    """Where arenas are created first: ``/dev/shm`` if it exists, else the temporary directory."""
    return "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()


def arena_dirs() -> tuple[str, ...]:
    """Every place an arena may lie: ``/dev/shm`` (if any), then the temporary directory (the fallback)."""
    return tuple(dict.fromkeys((arena_dir(), tempfile.gettempdir())))


class Arena:
    """The writer's side: a file of ``capacity`` bytes, filled from the start.

    Args:
        name: The cache's name (it starts with ``coordprep-``); 32 random hex digits are appended.
        capacity: Bytes reserved, all at once (in the temporary directory if ``/dev/shm`` lacks room).

    Raises:
        CacheError: ``capacity`` cannot be reserved in either place, or the new file is not private.
    """

    def __init__(self, name: str, capacity: int) -> None:
        remove_stale()
        self.capacity = capacity
        self.used = 0
        reasons = []
        for directory in arena_dirs():
            try:
                fd, path = _create(directory, name)
            except OSError as e:  # no such directory, no permission, no inode left
                reasons.append(f"{directory}: {e.strerror or e}")
                continue
            try:
                # The lock comes first: a file with a nonzero size is always one whose owner locked it,
                # so remove_stale never takes a file that is being set up for a live one.
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                # Reserve every page now: a sparse file on a full tmpfs would kill this process with
                # SIGBUS at the first write past the space left, instead of failing here, cleanly.
                os.posix_fallocate(fd, 0, capacity)
                self._map = mmap.mmap(fd, capacity)
            except OSError as e:
                os.unlink(path)
                os.close(fd)
                reasons.append(f"{directory}: {e.strerror or e}")
                logger.warning("arena %s: cannot reserve %d bytes in %s (%s)", name, capacity, directory, e)
                continue
            self._fd, self.path = fd, path  # the fd stays open, and locked, until close()
            break
        else:
            raise CacheError(f"cache: cannot reserve cache.capacity_bytes={capacity} bytes ({'; '.join(reasons)}); "
                             "lower cache.capacity_bytes or free memory there")
        st = os.fstat(self._fd)
        self.id = ArenaId(self.path, st.st_dev, st.st_ino, st.st_uid, capacity)
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
        """Delete the file, then release the lock (idempotent); readers' mappings stay valid until closed."""
        if self._fd < 0:
            return
        try:
            os.unlink(self.path)  # before unlocking: nobody ever sees this file unlocked under its name
        except FileNotFoundError:
            pass
        os.close(self._fd)
        self._fd = -1


def _create(directory: str, name: str) -> tuple[int, str]:
    """Create a new private file for an arena; its fd (O_CLOEXEC) and path."""
    path = os.path.join(directory, f"{name}.{secrets.token_hex(16)}")
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    except FileExistsError:  # 128 random bits do not collide by chance: someone planted it
        raise CacheError(f"cache: the arena file {path} exists already, and this cache did not create it (a file "
                         "or symlink planted there?); it was left untouched; remove it and find who created it") from None
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid() or stat.S_IMODE(st.st_mode) & 0o077:
        os.unlink(path)
        os.close(fd)
        raise CacheError(f"cache: the new arena file {path} has mode {stat.S_IMODE(st.st_mode):o} and owner "
                         f"{st.st_uid}, not 600 and {os.geteuid()}; check the filesystem's mount options")
    return fd, path


class ArenaReader:
    """A read-only mapping of another process's arena on the same node.

    Args:
        arena: The arena's :class:`ArenaId`, as its owner published it.

    Raises:
        CacheError: The path is missing, is a symlink, or is another file than the owner created.
    """

    def __init__(self, arena: ArenaId) -> None:
        try:
            fd = os.open(arena.path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError as e:
            raise CacheError(f"cache: cannot open the node cache's arena {arena.path}: {e.strerror or e} (a symlink "
                             "is refused); its samples are not read from it") from None
        try:
            st = os.fstat(fd)
            found = (st.st_dev, st.st_ino, st.st_uid)
            if found != (arena.device, arena.inode, arena.owner) or not stat.S_ISREG(st.st_mode) \
                    or st.st_size < arena.size:
                raise CacheError(f"cache: {arena.path} is not the arena the node cache created (device, inode, owner "
                                 f"{found}, expected {(arena.device, arena.inode, arena.owner)}; size {st.st_size}, "
                                 f"expected {arena.size}): it was replaced; not reading from it")
            self._map = mmap.mmap(fd, arena.size, prot=mmap.PROT_READ)
        finally:
            os.close(fd)

    def view(self, offset: int, length: int) -> memoryview:
        """Bytes ``[offset, offset + length)``: a read-only view into shared memory, no copy."""
        return memoryview(self._map)[offset : offset + length]


def remove_stale() -> dict[str, int]:
    """Delete the arenas on this machine whose owner is gone, in every location; their paths and sizes.

    An arena is stale when its owner's lock can be taken: the kernel released it when the owner
    died. Files of other users, symlinks, and arenas whose owner still holds its lock (another live
    sweep, in this PID namespace or another) are left alone.
    """
    removed: dict[str, int] = {}
    for directory in arena_dirs():
        try:
            names = [e.name for e in os.scandir(directory) if _NAME.match(e.name)]
        except OSError:
            continue
        for name in names:
            path = os.path.join(directory, name)
            size = _reclaim(path)
            if size is not None:
                removed[path] = size
    if removed:
        logger.warning("removed %d arena file(s) (%d bytes) left by cache actors that were killed, e.g. %s",
                       len(removed), sum(removed.values()), next(iter(removed)))
    return removed


def _reclaim(path: str) -> int | None:
    """Delete ``path`` if it is our arena and its owner is gone; its size, or None if kept."""
    try:  # O_NONBLOCK: a FIFO planted under an arena's name must not block the opener
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:  # gone already, another user's, or a symlink
        return None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid():
            return None
        if st.st_size == 0 and time.time() - st.st_mtime < _CREATING_GRACE_S:
            return None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return None  # its owner is alive
        now = os.lstat(path)
        if (now.st_dev, now.st_ino) != (st.st_dev, st.st_ino):
            return None
        os.unlink(path)
        return st.st_size
    except OSError:
        return None
    finally:
        os.close(fd)
