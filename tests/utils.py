"""Fakes and small datasets shared by the tests."""

from __future__ import annotations

import os

import numpy as np
from PIL import Image


def make_imagefolder(root: str, classes: int = 3, per_class: int = 10, size: tuple[int, int] = (48, 40),
                     png_every: int = 4, seed: int = 0) -> str:
    """Write a small ImageFolder of random JPEGs (and some PNGs, some in subfolders) under ``root``."""
    rng = np.random.default_rng(seed)
    for c in range(classes):
        folder = os.path.join(root, f"class_{c}")
        os.makedirs(os.path.join(folder, "nested"), exist_ok=True)
        for i in range(per_class):
            pixels = rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)
            pixels[:, :, c % 3] = 40 * c  # a learnable hint, not needed by these tests
            sub = "nested" if i % 5 == 4 else ""
            ext = "png" if i % png_every == 0 else "jpg"
            Image.fromarray(pixels).save(os.path.join(folder, sub, f"img_{i:03d}.{ext}"))
    with open(os.path.join(root, "class_0", "notes.txt"), "w") as f:
        f.write("not an image: must be ignored\n")
    return root


class FileOpens:
    """Counts opens of the files under ``root`` with Linux inotify: a count of storage reads that
    does not trust the library's own counters. Use as a context manager; read ``counts`` (files)
    and ``dir_opens`` (folders opened to be listed: directory scans) after.

    Args:
        root: The directory tree to watch (every folder in it, as inotify does not recurse).
    """

    _IN_OPEN, _IN_Q_OVERFLOW, _IN_ISDIR = 0x20, 0x4000, 0x40000000

    def __init__(self, root: str) -> None:
        import collections
        import ctypes

        self._libc = ctypes.CDLL(None, use_errno=True)
        self._fd = self._libc.inotify_init1(os.O_NONBLOCK | os.O_CLOEXEC)
        if self._fd < 0:
            raise OSError(ctypes.get_errno(), "inotify_init1 failed")
        self._dirs: dict[int, str] = {}
        for dirpath, _, _ in os.walk(root, followlinks=True):
            wd = self._libc.inotify_add_watch(self._fd, dirpath.encode(), self._IN_OPEN)
            if wd < 0:
                raise OSError(ctypes.get_errno(), f"inotify_add_watch({dirpath}) failed")
            self._dirs[wd] = dirpath
        self.counts: collections.Counter[str] = collections.Counter()
        self.dir_opens: collections.Counter[str] = collections.Counter()  # a folder opened to list it (a walk)
        self.overflowed = False
        self._stop = False
        import threading

        self._thread = threading.Thread(target=self._drain, daemon=True)

    def __enter__(self) -> "FileOpens":
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop = True
        self._thread.join(timeout=10)
        self._read_all()
        os.close(self._fd)

    def _drain(self) -> None:
        import select

        while not self._stop:
            select.select([self._fd], [], [], 0.2)  # wakes on events, or to notice the stop flag
            self._read_all()

    def _read_all(self) -> None:
        import struct

        while True:
            try:
                buf = os.read(self._fd, 1 << 16)
            except BlockingIOError:
                return
            pos = 0
            while pos < len(buf):
                wd, mask, _, length = struct.unpack_from("iIII", buf, pos)
                name = buf[pos + 16 : pos + 16 + length].rstrip(b"\0").decode()
                pos += 16 + length
                if mask & self._IN_Q_OVERFLOW:
                    self.overflowed = True
                elif name and not mask & self._IN_ISDIR:
                    self.counts[os.path.join(self._dirs[wd], name)] += 1
                elif not name and mask & self._IN_ISDIR:  # the watched folder itself was opened
                    self.dir_opens[self._dirs[wd]] += 1


def image_chunk(source, preprocessor, seed, epoch, indices, size, on_error="raise", views=1):
    """``prepare_chunk`` of the built-in image pipeline over ``source`` with ``preprocessor``."""
    from coordinated_prep.pipeline.chunk import image_layout, prepare_chunk
    from coordinated_prep.pipeline.transforms import ImagePipeline

    return prepare_chunk(ImagePipeline(source, preprocessor, size), image_layout((3, size, size)), seed, epoch,
                         np.asarray(indices), on_error, views)


def listening_on(port: int) -> set[str]:
    """Local addresses listening on TCP ``port`` (IPv4 and IPv6), from /proc/net."""
    import socket

    found = set()
    for table, family in (("/proc/net/tcp", socket.AF_INET), ("/proc/net/tcp6", socket.AF_INET6)):
        try:
            lines = open(table).read().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            local, state = line.split()[1], line.split()[3]
            address, hex_port = local.split(":")
            if state == "0A" and int(hex_port, 16) == port:  # 0A: LISTEN
                raw = bytes.fromhex(address)
                words = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
                found.add(socket.inet_ntop(family, words))
    return found
