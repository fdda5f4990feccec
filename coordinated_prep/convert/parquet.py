"""``coordprep convert``: write an ImageFolder as Parquet record files (shards of encoded samples)."""

from __future__ import annotations

import json
import logging
import os
import re
import time
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import pyarrow as pa
import pyarrow.parquet as pq

from coordinated_prep.contracts import DataSource
from coordinated_prep.errors import ConfigError
from coordinated_prep.pipeline.sources import open_source
from coordinated_prep.pipeline.sources.parquet import FORMAT, FORMAT_VERSION, MANIFEST, SCHEMA

logger = logging.getLogger(__name__)

#: Samples per shard: about 100 MiB of ImageNet-sized JPEGs (110 KiB on average), a common shard size.
DEFAULT_SHARD_SIZE = 1024
#: Rows per row group, the unit a random read fetches: see the README's "Parquet datasets".
DEFAULT_ROW_GROUP_SIZE = 16
_OURS = re.compile(rf"\.?part-\d{{5,}}\.parquet(\.tmp)?|\.?{re.escape(MANIFEST)}(\.tmp)?")


@dataclass(frozen=True)
class ConversionResult:
    """What :func:`convert_imagefolder` wrote.

    Attributes:
        out: The dataset directory (absolute).
        manifest: Path of ``coordprep-parquet.json``.
        shards: Paths of the shards, in sample order.
        samples: Samples written.
        image_bytes: Encoded bytes of the samples (the ``image`` column, as read from the source).
        file_bytes: Bytes on disk, shards and manifest together.
        seconds: Wall-clock time of the conversion.
    """

    out: str
    manifest: str
    shards: tuple[str, ...]
    samples: int
    image_bytes: int
    file_bytes: int
    seconds: float


def convert_imagefolder(
    src: str, out: str, *, shard_size: int = DEFAULT_SHARD_SIZE, row_group_size: int = DEFAULT_ROW_GROUP_SIZE,
    overwrite: bool = False, progress: Callable[[int, int], None] | None = None,
) -> ConversionResult:
    """Write the samples of ``src`` into ``out`` as Parquet shards, in the source's index order.

    Each shard ``part-NNNNN.parquet`` holds ``shard_size`` samples (the last one fewer) in row
    groups of ``row_group_size``, with columns ``image`` (the encoded bytes, uncompressed: JPEGs do
    not compress), ``label`` and ``index``. Every shard is written under a temporary name and
    renamed when complete, and the manifest is written last, so an interrupted conversion leaves
    no directory that opens as a dataset.

    Args:
        src: An ImageFolder directory or a builtin dataset (``builtin:shapes``), as ``DataSpec.dataset``.
        out: The output directory; created if missing.
        shard_size: Samples per shard.
        row_group_size: Samples per row group (at most ``shard_size``).
        overwrite: Replace a dataset this function wrote into ``out`` before.
        progress: Called as ``progress(samples_done, samples_total)`` after every sample.

    Raises:
        ConfigError: A bad size, ``out`` not empty without ``overwrite``, or ``out`` inside ``src``.
        DatasetError: ``src`` cannot be opened.
        SampleError: A sample of ``src`` cannot be read; names the index and the file.
    """
    for name, value in (("shard_size", shard_size), ("row_group_size", row_group_size)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            option = "--" + name.replace("_", "-")
            raise ConfigError(f"convert: {name}={value!r} ({option}) must be a positive integer (samples)")
    if row_group_size > shard_size:
        raise ConfigError(f"convert: row_group_size={row_group_size} is larger than shard_size={shard_size}; "
                          "a row group lies within one shard, so lower row_group_size or raise shard_size")
    t0 = time.perf_counter()
    source = open_source.__wrapped__(src)  # uncached: the directory may have changed since this process opened it
    out = os.path.abspath(os.path.expanduser(out))
    if _inside(out, source.root):
        raise ConfigError(f"convert: output {out!r} lies inside the source dataset {source.root!r}, where it would "
                          "be read as a class folder; choose a directory outside it")
    _prepare_out(out, overwrite)
    entries: list[dict[str, Any]] = []
    done = 0
    for k, lo in enumerate(range(0, len(source), shard_size)):
        ids = range(lo, min(len(source), lo + shard_size))
        name = f"part-{k:05d}.parquet"
        nbytes = _write_shard(source, ids, os.path.join(out, name), row_group_size, progress, done)
        entries.append({"file": name, "rows": len(ids), "image_bytes": nbytes})
        done += len(ids)
    manifest = _write_manifest(out, source, entries, shard_size, row_group_size)
    shards = tuple(os.path.join(out, e["file"]) for e in entries)
    result = ConversionResult(out=out, manifest=manifest, shards=shards, samples=done,
                              image_bytes=sum(e["image_bytes"] for e in entries),
                              file_bytes=sum(os.path.getsize(p) for p in (*shards, manifest)),
                              seconds=time.perf_counter() - t0)
    logger.info("converted %s: %d samples into %d shard(s) in %s", source.root, done, len(shards), out)
    return result


def _inside(out: str, home: str) -> bool:
    """Whether ``out`` is ``home`` or lies inside it, through symbolic links too (a link to the source
    would have --overwrite delete the source)."""
    out, home = os.path.realpath(out), os.path.realpath(home)
    return out == home or out.startswith(home.rstrip(os.sep) + os.sep)


def _prepare_out(out: str, overwrite: bool, ours: re.Pattern = _OURS,
                 what: str = "the manifest and part-*.parquet shards", first: str = MANIFEST) -> None:
    """Make ``out`` an empty directory, removing only files an earlier conversion wrote there (those
    ``ours`` matches, described as ``what``; ``first`` is removed before the others)."""
    if os.path.exists(out) and not os.path.isdir(out):
        raise ConfigError(f"convert: output {out!r} exists and is not a directory; choose a directory path")
    os.makedirs(out, exist_ok=True)
    entries = sorted(os.listdir(out))
    if not entries:
        return
    if not overwrite:
        raise ConfigError(f"convert: output directory {out!r} is not empty ({len(entries)} entries, e.g. "
                          f"{entries[0]!r}); choose a new or empty directory, or pass --overwrite "
                          "(overwrite=True) to replace a dataset converted there before")
    foreign = [e for e in entries if not ours.fullmatch(e) or not os.path.isfile(os.path.join(out, e))]
    if foreign:
        raise ConfigError(f"convert: output directory {out!r} holds {foreign[:3]}, which coordprep convert did not "
                          f"write; --overwrite removes only {what}, so choose another directory or remove them "
                          "yourself")
    # The manifest goes first: from here until the new one is written the directory is no dataset.
    for name in sorted(entries, key=lambda e: e != first):
        os.remove(os.path.join(out, name))


def _write_shard(source: DataSource, ids: Sequence[int], path: str, row_group_size: int,
                 progress: Callable[[int, int], None] | None, done: int) -> int:
    """Write samples ``ids`` to ``path`` via a temporary name; returns their encoded bytes."""
    tmp = os.path.join(os.path.dirname(path), f".{os.path.basename(path)}.tmp")
    nbytes = 0
    try:
        # Images uncompressed and without dictionary or statistics: JPEG bytes gain nothing from them,
        # and min/max statistics of large blobs would bloat the footer every reader parses.
        with pq.ParquetWriter(tmp, SCHEMA, compression="none", use_dictionary=["label"],
                              write_statistics=["label", "index"]) as writer:
            for lo in range(0, len(ids), row_group_size):
                group = ids[lo : lo + row_group_size]
                blobs = []
                for i in group:
                    blobs.append(source.read(i))
                    if progress:
                        progress(done + lo + len(blobs), len(source))
                nbytes += sum(len(b) for b in blobs)
                table = pa.table([pa.array(blobs, pa.binary()), pa.array(source.labels[list(group)], pa.int64()),
                                  pa.array(list(group), pa.int64())], schema=SCHEMA)
                writer.write_table(table, row_group_size=row_group_size)
        _fsync(tmp)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
    return nbytes


def _write_manifest(out: str, source: DataSource, entries: list[dict[str, Any]], shard_size: int,
                    row_group_size: int) -> str:
    from coordinated_prep import __version__

    manifest = {"format": FORMAT, "version": FORMAT_VERSION, "classes": list(source.classes),
                "rows": sum(e["rows"] for e in entries), "shard_size": shard_size, "row_group_size": row_group_size,
                "shards": entries, "source": source.root, "written_by": f"coordinated_prep {__version__}"}
    path = os.path.join(out, MANIFEST)
    tmp = os.path.join(out, f".{MANIFEST}.tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(manifest, f, indent=1)
        f.write("\n")
    _fsync(tmp)
    os.replace(tmp, path)
    return path


def _fsync(path: str) -> None:
    """Flush ``path`` to disk, so the rename that publishes it never points at lost data after a crash."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
