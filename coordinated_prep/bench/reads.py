"""The benchmark's read-only rows: raw image files against Parquet record files, cold and warm.

Each row reads the training split once, in a shuffled order, through a :class:`DataSource` in this
process, without decoding: what storage and the format cost before any preparation starts. The
cold pass follows an eviction of the format's files from the page cache (``posix_fadvise``), the
warm pass follows the cold one. Where Linux reports it, ``storage_mb`` is what the pass fetched
from storage (``/proc/self/io``), which shows a record format's read amplification.
"""

from __future__ import annotations

import logging
import pickle
import time
from typing import Any, Sequence

import numpy as np

from coordinated_prep.analyze.measure import evict
from coordinated_prep.contracts import DataSource
from coordinated_prep.errors import ConfigError

logger = logging.getLogger(__name__)


def read_rows(source: DataSource, files: Sequence[str], fmt: str, ids: Sequence[int] | np.ndarray,
              seed: int) -> list[dict[str, Any]]:
    """A cold and a warm row for one format (the cold one left out where pages cannot be evicted).

    Args:
        source: The format's data source.
        files: The files holding its samples (image files or shards), evicted for the cold pass.
        fmt: The format's name in the rows (``files``, ``parquet``).
        ids: The sample indices to read (the training split).
        seed: Seed of the shuffled order (the same order for every format).
    """
    order = [int(i) for i in np.random.default_rng(seed).permutation(np.asarray(ids))]
    rows = []
    for cache in ("cold", "warm"):
        if cache == "cold":
            try:
                evict(files)
            except ConfigError as e:
                logger.warning("bench: no cold read for %s: %s", fmt, e)
                continue
        # A fresh copy for each pass: no open handles or cached row groups carry over from the last one.
        fresh = pickle.loads(pickle.dumps(source))
        io0, t0 = _storage_bytes(), time.perf_counter()
        nbytes = sum(len(fresh.read(i)) for i in order)
        seconds, io1 = time.perf_counter() - t0, _storage_bytes()
        rows.append({"step": "read", "loader": "read-only", "format": fmt, "cache": cache, "trials": 1,
                     "samples": len(order), "samples_read": len(order), "window_s": seconds,
                     "samples_per_s": len(order) / seconds, "mb_per_s": nbytes / seconds / 1e6,
                     "storage_mb": None if io0 is None or io1 is None else (io1 - io0) / 1e6,
                     "peak_staging_bytes": 0})
    return rows


def _storage_bytes() -> int | None:
    """Bytes this process has caused to be fetched from storage so far (Linux only)."""
    try:
        with open("/proc/self/io", encoding="ascii") as f:
            fields = dict(line.split(": ") for line in f.read().splitlines())
        return int(fields["read_bytes"])
    except (OSError, KeyError, ValueError):
        return None
