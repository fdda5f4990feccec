"""The benchmark's read-only rows: raw image files against Parquet record files and tar shards, cold and warm.

Each row reads the training split once, in a shuffled order, through a :class:`DataSource` in this
process, without decoding: what storage and the format cost before any preparation starts. The
cold pass follows an eviction of the format's files from the page cache (``posix_fadvise``), the
warm pass follows the cold one. Where Linux reports it, ``storage_mb`` is what the pass fetched
from storage (``/proc/self/io``), which shows a record format's read amplification.
"""

from __future__ import annotations

import logging
import os
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
        fmt: The format's name in the rows (``files``, ``parquet``, ``tar``).
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


def node_cache_rows(dataset: str, files: Sequence[str], ids: Sequence[int] | np.ndarray,
                    seed: int) -> list[dict[str, Any]]:
    """Read-only rows through a node cache big enough for the split, in a Ray task on this node.

    The first pass follows an eviction of ``files`` and fills the cache (every sample goes through
    the cache actor, which reads it from storage); the second is served from the cache, as every
    epoch after the first is. Needs Ray initialised.

    Args:
        dataset: The dataset's name (``DataSpec.dataset``).
        files: Its image files: they size the cache and are evicted before the first pass.
        ids: The sample indices to read (the training split).
        seed: Seed of the shuffled order (the same order as :func:`read_rows`).
    """
    import ray

    from coordinated_prep.cache import CacheLayout, CacheSpec
    from coordinated_prep.cache.actor import RawCache
    from coordinated_prep.naming import NAMESPACE

    order = [int(i) for i in np.random.default_rng(seed).permutation(np.asarray(ids))]
    node = ray.get_runtime_context().get_node_id()
    layout = CacheLayout(f"bench{os.getpid()}", (node,))
    spec = CacheSpec(capacity_bytes=int(sum(os.path.getsize(f) for f in files) * 1.1) + 1)
    name = layout.actor_name(node)
    cache = RawCache.options(name=name, namespace=NAMESPACE).remote(spec, node, name)
    try:
        try:
            evict(files)
            first = "cold"
        except ConfigError as e:
            logger.warning("bench: the node cache's first pass reads warm files: %s", e)
            first = "warm"
        passes = ray.get(ray.remote(num_cpus=1)(_cached_passes).remote(dataset, layout, spec, order), timeout=900)
    finally:
        ray.get(cache.clear.remote(), timeout=60)
        ray.kill(cache)
    rows = []
    for cache_state, (seconds, nbytes) in zip((f"{first}, filling", "cached"), passes):
        rows.append({"step": "read", "loader": "read-only", "format": "files+node cache", "cache": cache_state,
                     "trials": 1, "samples": len(order), "samples_read": len(order), "window_s": seconds,
                     "samples_per_s": len(order) / seconds, "mb_per_s": nbytes / seconds / 1e6, "storage_mb": None,
                     "peak_staging_bytes": 0})
    return rows


def _cached_passes(dataset: str, layout: Any, spec: Any, order: list[int]) -> list[tuple[float, int]]:
    """Two passes over ``order`` through a :class:`CachedSource`, read a piece (64 samples) at a time."""
    from coordinated_prep.cache.reader import CachedSource
    from coordinated_prep.pipeline.sources import open_source

    reader = CachedSource(open_source(dataset), dataset, layout, spec)
    out = []
    for _ in range(2):
        t0, nbytes = time.perf_counter(), 0
        for lo in range(0, len(order), 64):
            nbytes += sum(len(d) for d in reader.read_many(order[lo : lo + 64]))
        out.append((time.perf_counter() - t0, nbytes))
    return out


def _storage_bytes() -> int | None:
    """Bytes this process has caused to be fetched from storage so far (Linux only)."""
    try:
        with open("/proc/self/io", encoding="ascii") as f:
            fields = dict(line.split(": ") for line in f.read().splitlines())
        return int(fields["read_bytes"])
    except (OSError, KeyError, ValueError):
        return None


def main(argv: list[str] | None = None) -> int:
    """``python -m coordinated_prep.bench.reads [bench.yaml] [--rounds K]``: the read-only rows alone,
    for the raw files, their Parquet copy and their tar shards, K rounds in turn (the copies written
    first, as the benchmark writes them; a round's order is shuffled by its number)."""
    import argparse
    import sys

    from coordinated_prep.bench.config import load_bench
    from coordinated_prep.bench.run import prepare_records
    from coordinated_prep.plan import holdout_split
    from coordinated_prep.spec import DataSpec

    parser = argparse.ArgumentParser(description=main.__doc__.splitlines()[0])
    parser.add_argument("bench", nargs="?", default="experiments/bench.yaml")
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args(argv)
    images, records, shards = prepare_records(load_bench(args.bench))
    ids, _ = holdout_split(len(images), DataSpec().holdout)
    for k in range(args.rounds):
        for source, files, fmt in ((images, images.paths, "files"), (records, records.shards, "parquet"),
                                   (shards, shards.shards, "tar")):
            for row in read_rows(source, files, fmt, ids, seed=k):
                fetched = "n/a" if row["storage_mb"] is None else f"{row['storage_mb']:.0f} MB"
                sys.stdout.write(f"round {k}  {fmt:8s} {row['cache']:5s} {row['samples_per_s']:8.0f} samples/s "
                                 f"{row['mb_per_s']:7.1f} MB/s  from storage {fetched}\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
