"""The cache's shared-memory arena: private creation, checked readers, owned deletion, reclaimed leftovers."""

from __future__ import annotations

import os
import signal
import stat
import subprocess
import sys
import tempfile

import pytest

from coordinated_prep.cache import arena as arena_module
from coordinated_prep.cache.arena import Arena, ArenaReader, arena_dir, remove_stale
from coordinated_prep.cli import main
from coordinated_prep.errors import CacheError
from tests.conftest import REPO

# A process that owns an arena (in /dev/shm, or in the temporary directory with "tmp") until killed.
_OWNER = """
import sys, tempfile, time
from coordinated_prep.cache import arena
if sys.argv[1] == "tmp":
    arena.arena_dir = tempfile.gettempdir
a = arena.Arena("coordprep-test-owner", 4096)
print(a.path, flush=True)
time.sleep(600)
"""


def _start_owner(where: str = "shm") -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen([sys.executable, "-c", _OWNER, where], stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": REPO})
    path = proc.stdout.readline().strip()
    assert path and os.path.exists(path), proc.poll()
    return proc, path


def _kill(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)
    proc.stdout.close()


def test_a_reader_sees_published_regions_without_copying_and_the_owner_deletes_the_file():
    arena = Arena(f"coordprep-test-{os.getpid()}", 1000)
    regions = [arena.append(b"\xff\xd8jpeg-one"), arena.append(memoryview(b"second"))]
    assert regions == [(0, 10), (10, 6)] and arena.used == 16
    reader = ArenaReader(arena.id)
    view = reader.view(*regions[0])
    assert bytes(view) == b"\xff\xd8jpeg-one" and view.readonly
    with pytest.raises(ValueError, match="do not fit"):
        arena.append(b"x" * 985)
    arena.close()
    assert not os.path.exists(arena.path)
    assert bytes(reader.view(*regions[1])) == b"second"  # a mapping outlives the file's name
    arena.close()  # idempotent


def test_the_arena_is_private_and_its_name_unpredictable():
    a, b = Arena("coordprep-test-private", 100), Arena("coordprep-test-private", 100)
    try:
        assert a.path != b.path and os.path.dirname(a.path) == arena_dir()
        st = os.stat(a.path)
        assert stat.S_IMODE(st.st_mode) == 0o600 and st.st_uid == os.geteuid()
    finally:
        a.close()
        b.close()


@pytest.mark.parametrize("planted", ["file", "symlink"])
def test_a_file_or_symlink_planted_under_the_arenas_name_is_refused_and_left_untouched(planted, tmp_path,
                                                                                        monkeypatch):
    monkeypatch.setattr(arena_module.secrets, "token_hex", lambda n: "0" * 2 * n)  # a name the attacker guessed
    path = os.path.join(arena_dir(), "coordprep-test-planted." + "0" * 32)
    target = tmp_path / "victim"
    target.write_bytes(b"the attacker reads or writes through this")
    if planted == "file":
        fd = os.open(path, os.O_CREAT | os.O_WRONLY, 0o666)
        os.write(fd, b"planted")
        os.close(fd)
        os.chmod(path, 0o666)
    else:
        os.symlink(target, path)
    if os.geteuid() == 0:  # as another user would have planted it (remove_stale skips others' files)
        os.chown(path, 65534, 65534, follow_symlinks=False)
    else:  # this user's own file would look like a stale arena to the clean-up that runs first
        monkeypatch.setattr(arena_module, "remove_stale", dict)
    try:
        with pytest.raises(CacheError, match="did not create it"):
            Arena("coordprep-test-planted", 4096)
        assert os.path.lexists(path)  # left alone, for the user to inspect
        if planted == "file":
            assert open(path, "rb").read() == b"planted" and stat.S_IMODE(os.lstat(path).st_mode) == 0o666
        assert target.read_bytes() == b"the attacker reads or writes through this"
    finally:
        os.unlink(path)


@pytest.mark.parametrize("planted", ["file", "symlink"])
def test_a_reader_refuses_a_file_that_replaced_the_arena(planted, tmp_path):
    arena = Arena("coordprep-test-replaced", 4096)
    decoy = tmp_path / "decoy"
    decoy.write_bytes(b"\0" * 4096)
    os.unlink(arena.path)  # what another user cannot do in sticky /dev/shm, but a test can
    if planted == "file":
        decoy_fd = os.open(arena.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
        os.write(decoy_fd, b"\0" * 4096)
        os.close(decoy_fd)
    else:
        os.symlink(decoy, arena.path)
    try:
        with pytest.raises(CacheError, match="not the arena the node cache created" if planted == "file" else "symlink"):
            ArenaReader(arena.id)
    finally:
        os.unlink(arena.path)
        arena.close()


@pytest.mark.parametrize("where", ["shm", "tmp"])
def test_a_sigkilled_owners_arena_is_reclaimed_and_a_live_ones_left_alone(where):
    dead, dead_path = _start_owner(where)
    live, live_path = _start_owner(where)
    try:
        _kill(dead)
        assert os.path.exists(dead_path)  # SIGKILL: no clean-up ran
        assert os.path.dirname(dead_path) == (arena_dir() if where == "shm" else tempfile.gettempdir())
        removed = remove_stale()
        assert dead_path in removed and removed[dead_path] == 4096 and not os.path.exists(dead_path)
        assert os.path.exists(live_path) and live_path not in removed  # its owner holds the lock
    finally:
        _kill(live)
    assert live_path in remove_stale()  # and once its owner is killed too, it goes


def test_the_next_arena_reclaims_what_a_killed_owner_left():
    dead, dead_path = _start_owner()
    _kill(dead)
    arena = Arena("coordprep-test-next", 100)
    arena.close()
    assert not os.path.exists(dead_path)


def test_coordprep_clean_removes_what_a_killed_sweep_left_and_nothing_live(capsys):
    dead, dead_path = _start_owner("tmp")
    live, live_path = _start_owner()
    try:
        _kill(dead)
        assert main(["clean"]) == 0
        out = capsys.readouterr().out
        assert dead_path in out and not os.path.exists(dead_path)
        assert os.path.exists(live_path) and live_path not in out
    finally:
        _kill(live)
    assert main(["clean"]) == 0 and not os.path.exists(live_path)


def test_other_files_are_never_touched(tmp_path):
    fifo = os.path.join(arena_dir(), "coordprep-test-fifo." + "1" * 32)
    young = os.path.join(arena_dir(), "coordprep-test-young." + "2" * 32)  # empty: being created
    other = os.path.join(arena_dir(), "coordprep-test-other.12345")  # not an arena's name
    os.mkfifo(fifo)
    open(young, "wb").close()
    open(other, "wb").close()
    try:
        removed = remove_stale()  # and returns: the FIFO does not block it
        assert not {fifo, young, other} & set(removed)
        assert all(os.path.lexists(p) for p in (fifo, young, other))
    finally:
        for p in (fifo, young, other):
            os.unlink(p)
