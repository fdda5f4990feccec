"""``coordprep convert --format tar``: write a dataset as WebDataset tar shards.

The shards are what ``webdataset.TarWriter`` writes and what
:class:`~coordinated_prep.pipeline.sources.tar_shards.TarShardSource` reads: ``shard-NNNNNN.tar``,
each holding per sample ``<index>.<ext>`` (the encoded image as the source holds it) and
``<index>.cls`` (its class index), in the source's index order, so sample ``i`` of the shards is
sample ``i`` of the source, byte for byte.

Tar shards have no manifest, so a directory with some shards would open as a smaller dataset: every
shard is written under a hidden temporary name, and all are renamed only once the last one is
complete; an interrupted conversion leaves no ``*.tar`` in ``out``.
"""

from __future__ import annotations

import io
import logging
import os
import re
import tarfile
import time
from typing import Callable

from coordinated_prep.convert.parquet import ConversionResult, _fsync, _inside, _prepare_out
from coordinated_prep.errors import ConfigError
from coordinated_prep.pipeline.sources import open_source

logger = logging.getLogger(__name__)

DEFAULT_SHARD_SIZE = 1024
_OURS = re.compile(r"\.?shard-\d{6,}\.tar(\.tmp)?")
_MAGIC = ((b"\xff\xd8\xff", "jpg"), (b"\x89PNG\r\n\x1a\n", "png"), (b"BM", "bmp"), (b"P6", "ppm"), (b"P5", "pgm"),
          (b"II*\x00", "tif"), (b"MM\x00*", "tif"))


def convert_to_tar(src: str, out: str, *, shard_size: int = DEFAULT_SHARD_SIZE, overwrite: bool = False,
                   progress: Callable[[int, int], None] | None = None) -> ConversionResult:
    """Write the samples of ``src`` into ``out`` as tar shards of ``shard_size`` samples.

    Args:
        src: Any dataset ``DataSpec.dataset`` names (an ImageFolder, Parquet, tar shards, builtin).
        out: The output directory; created if missing.
        shard_size: Samples per shard.
        overwrite: Replace shards this function wrote into ``out`` before.
        progress: Called as ``progress(samples_done, samples_total)`` after every sample.

    Raises:
        ConfigError: A bad size, ``out`` not empty without ``overwrite`` (or holding files it did not
            write), ``out`` inside ``src``, or a sample whose image format is not recognised.
        DatasetError, SampleError: ``src`` cannot be opened or a sample read (named).
    """
    if not isinstance(shard_size, int) or isinstance(shard_size, bool) or shard_size < 1:
        raise ConfigError(f"convert: shard_size={shard_size!r} (--shard-size) must be a positive integer (samples)")
    t0 = time.perf_counter()
    source = open_source.__wrapped__(src)  # uncached: the dataset may have changed since this process opened it
    out = os.path.abspath(os.path.expanduser(out))
    homes = {source.root} if os.path.isdir(source.root) else set()
    homes |= {os.path.dirname(p) for p in getattr(source, "shards", ())}  # tar shards or Parquet read from there
    if any(_inside(out, home) for home in homes):
        raise ConfigError(f"convert: output {out!r} holds or lies inside the source dataset {src!r}, which "
                          "--overwrite would delete before reading it; choose a directory outside it")
    _prepare_out(out, overwrite, _OURS, "shard-*.tar files", first="")
    written: list[tuple[str, str]] = []  # (temporary, final) paths
    image_bytes = 0
    try:
        for k, lo in enumerate(range(0, len(source), shard_size)):
            final = os.path.join(out, f"shard-{k:06d}.tar")
            tmp = os.path.join(out, f".shard-{k:06d}.tar.tmp")
            written.append((tmp, final))
            with tarfile.open(tmp, "w", format=tarfile.USTAR_FORMAT) as tar:
                for i in range(lo, min(len(source), lo + shard_size)):
                    data = source.read(i)
                    image_bytes += len(data)
                    _add(tar, f"{i:08d}.{_extension(data, source.describe(i))}", data)
                    _add(tar, f"{i:08d}.cls", str(int(source.labels[i])).encode("ascii"))
                    if progress is not None:
                        progress(i + 1, len(source))
            _fsync(tmp)
    except BaseException:
        for tmp, _ in written:
            if os.path.exists(tmp):
                os.remove(tmp)
        raise
    for tmp, final in written:
        os.replace(tmp, final)
    shards = tuple(final for _, final in written)
    logger.info("converted %s: %d samples into %d tar shard(s) in %s", source.root, len(source), len(shards), out)
    return ConversionResult(out=out, manifest="", shards=shards, samples=len(source), image_bytes=image_bytes,
                            file_bytes=sum(os.path.getsize(p) for p in shards), seconds=time.perf_counter() - t0)


def _add(tar: tarfile.TarFile, name: str, data: bytes) -> None:
    info = tarfile.TarInfo(name)
    info.size, info.mode, info.mtime = len(data), 0o444, 0  # no clock in the bytes: the same input, the same shards
    tar.addfile(info, io.BytesIO(data))


def _extension(data: bytes, where: str) -> str:
    """The image member's extension, from the file's own name where it has one, else its bytes."""
    from coordinated_prep.pipeline.sources.tar_shards import IMAGE_EXTENSIONS

    ext = os.path.splitext(where)[1].lstrip(".").lower()
    if ext in IMAGE_EXTENSIONS:
        return ext
    if data[:4] == b"RIFF" and data[8:12] == b"WEBP":
        return "webp"
    for magic, name in _MAGIC:
        if data.startswith(magic):
            return name
    raise ConfigError(f"convert: sample {where} is no image format tar shards can name (JPEG, PNG, WebP, BMP, "
                      "PPM/PGM, TIFF)")
