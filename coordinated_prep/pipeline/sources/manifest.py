"""The Parquet dataset's manifest, ``coordprep-parquet.json``: read and checked field by field, trusting nothing.

A manifest is data from the dataset's directory, which may come from anyone (a download, a shared
folder), so every field is checked before use: counts are integers in range, class names are
strings, and every shard path stays inside the dataset directory (no absolute path, no ``..``,
no symlink out of it). A bad field is a :class:`DatasetError` naming the file, the field and the
value. No pyarrow here: the manifest is read by processes that never open a shard.
"""

from __future__ import annotations

import json
import os
from typing import Any

from coordinated_prep.errors import DatasetError
from coordinated_prep.pipeline.sources import PARQUET_MANIFEST

MANIFEST = PARQUET_MANIFEST
FORMAT = "coordprep-parquet"
#: Bumped whenever the layout changes in a way older readers would misread.
FORMAT_VERSION = 1
CONVERT_HINT = "re-create it with `coordprep convert <imagefolder> <dir> --overwrite`"
_MAX_BYTES = 64 * 2**20  # ImageNet's manifest is about 100 KiB; a bigger one is not ours


def read_manifest(root: str) -> dict[str, Any]:
    """The manifest of the Parquet dataset ``root``, every field checked.

    Returns:
        The manifest, with ``shards`` entries whose ``file`` is a path relative to ``root`` that
        stays inside it.

    Raises:
        DatasetError: The manifest is missing, unreadable, not JSON, of another format or version,
            lacks a field, or has a field of the wrong type, out of range, or (for a shard's
            ``file``) pointing outside ``root``; the message names the file, the field and the value.
    """
    path = os.path.join(root, MANIFEST)
    try:
        with open(path, "rb") as f:
            raw = f.read(_MAX_BYTES + 1)
        if len(raw) > _MAX_BYTES:
            raise ValueError(f"larger than {_MAX_BYTES} bytes")
        manifest = json.loads(raw)
    except FileNotFoundError:
        raise DatasetError(f"dataset {root!r}: no {MANIFEST} manifest, so it is not a Parquet dataset; "
                           "convert an ImageFolder with `coordprep convert <imagefolder> <dir>`") from None
    except (OSError, ValueError) as e:
        raise DatasetError(f"dataset {root!r}: cannot read the manifest {path}: {e}; {CONVERT_HINT}") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise DatasetError(f"dataset {root!r}: {path} is not a {FORMAT} manifest; {CONVERT_HINT}")
    if manifest.get("version") != FORMAT_VERSION:
        raise DatasetError(f"dataset {root!r}: {path} has format version {manifest.get('version')!r}, but this "
                           f"coordinated_prep reads version {FORMAT_VERSION}; {CONVERT_HINT}")
    missing = [k for k in ("classes", "shards", "rows", "row_group_size") if k not in manifest]
    if missing:
        raise DatasetError(f"dataset {root!r}: {path} lacks {missing}; {CONVERT_HINT}")
    check = _Checker(root, path)
    classes = manifest["classes"]
    if not isinstance(classes, list) or not classes or not all(isinstance(c, str) and c for c in classes):
        raise check.bad("classes", classes, "must be a non-empty list of class names (strings)")
    check.count("rows", manifest["rows"], 0)
    check.count("row_group_size", manifest["row_group_size"], 1)
    if "shard_size" in manifest:
        check.count("shard_size", manifest["shard_size"], 1)
    shards = manifest["shards"]
    if not isinstance(shards, list):
        raise check.bad("shards", shards, "must be a list of {file, rows} entries")
    seen: set[str] = set()
    for k, entry in enumerate(shards):
        if not isinstance(entry, dict) or not {"file", "rows"} <= set(entry):
            raise check.bad(f"shards[{k}]", entry, "must be a mapping with keys file and rows")
        check.count(f"shards[{k}].rows", entry["rows"], 0)
        check.shard_file(f"shards[{k}].file", entry["file"], seen)
    total = sum(entry["rows"] for entry in shards)
    if total != manifest["rows"]:
        raise DatasetError(f"dataset {root!r}: {path} says rows={manifest['rows']}, but its shards add up to "
                           f"{total}; {CONVERT_HINT}")
    return manifest


class _Checker:
    """Checks of one manifest's fields, each failing with the file, the field and the value."""

    def __init__(self, root: str, path: str) -> None:
        self.root, self.path = root, path
        self.real_root = os.path.realpath(root)

    def bad(self, field: str, value: Any, problem: str) -> DatasetError:
        shown = repr(value)
        shown = shown if len(shown) <= 80 else shown[:77] + "..."
        return DatasetError(f"dataset {self.root!r}: {self.path}: {field}={shown} {problem}; {CONVERT_HINT}")

    def count(self, field: str, value: Any, low: int) -> None:
        if not isinstance(value, int) or isinstance(value, bool) or value < low:
            raise self.bad(field, value, f"must be an integer >= {low}")

    def shard_file(self, field: str, value: Any, seen: set[str]) -> None:
        if not isinstance(value, str) or not value or "\0" in value:
            raise self.bad(field, value, "must be a file name inside the dataset directory")
        if os.path.isabs(value) or value.startswith(("/", "\\")):
            raise self.bad(field, value, "is an absolute path; a shard must lie inside the dataset directory")
        parts = value.replace("\\", "/").split("/")
        if ".." in parts:
            raise self.bad(field, value, "leaves the dataset directory (..); a shard must lie inside it")
        real = os.path.realpath(os.path.join(self.root, value))
        if os.path.commonpath([self.real_root, real]) != self.real_root or real == self.real_root:
            raise self.bad(field, value, f"resolves to {real}, outside the dataset directory (a symlink?); a "
                           "shard must lie inside it")
        if real in seen:
            raise self.bad(field, value, "names a shard listed before it; each shard is listed once")
        seen.add(real)
