"""Measurements for ``coordprep analyze``: bandwidths, per-stage costs and the three DS-Analyzer runs.

Everything here runs in the calling process (and, for the end-to-end runs, in the worker processes
of a ``torch.utils.data.DataLoader``, the loader a user would otherwise pick); nothing needs Ray or
root. A cold page cache is made with ``posix_fadvise(POSIX_FADV_DONTNEED)`` on the dataset's own
files, which drops their clean cached pages for every process. Nothing is written into the dataset:
the disk's bandwidth is measured by reading the dataset's own files, or, only in a directory the user
names, with a scratch file.
"""

from __future__ import annotations

import math
import os
import secrets
import time
from typing import Any, Callable, Iterable, Mapping, Sequence

import numpy as np
import torch

from coordinated_prep.contracts import DataSource, Preprocessor
from coordinated_prep.errors import ConfigError

_BLOCK = 8 * 2**20


def evict(paths: Iterable[str]) -> int:
    """Drop the page-cache pages of ``paths``; returns how many files were advised.

    Raises:
        ConfigError: The platform has no ``posix_fadvise`` (the cold-cache run cannot be made).
    """
    if not hasattr(os, "posix_fadvise"):
        raise ConfigError("analyze: this platform has no posix_fadvise, so the cold-cache run cannot be made; "
                          "run analyze on Linux")
    done = 0
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            done += 1
        finally:
            os.close(fd)
    return done


def files_bandwidth(paths: Sequence[str], nbytes: int = 128 * 2**20, seed: int = 0) -> tuple[float, int]:
    """Cold read bandwidth (bytes/s) of the dataset's own files, and the bytes read; nothing is written.

    Reads whole files, the largest first among a fixed random sample of at most 4,096 (so that a
    dataset of millions of files costs no more stats than that), until about ``nbytes``, after
    evicting them from the page cache. With large files (Parquet shards, big images) this is the
    disk's sequential bandwidth; with small ones it includes the cost of opening each file, as a
    reader of those files would pay.
    """
    sample = sample_ids(np.arange(len(paths)), 4096, seed)
    sized = sorted(((os.path.getsize(paths[i]), paths[i]) for i in sample), reverse=True)
    chosen: list[str] = []
    total = 0
    for size, path in sized:
        if total >= nbytes:
            break
        chosen.append(path)
        total += size
    chosen.sort()  # in directory order, as a sequential pass reads them
    evict(chosen)
    t0 = time.perf_counter()
    read = 0
    for path in chosen:
        with open(path, "rb", buffering=0) as f:
            while chunk := f.read(_BLOCK):
                read += len(chunk)
    return read / max(time.perf_counter() - t0, 1e-9), read


def disk_bandwidth(directory: str, nbytes: int = 128 * 2**20) -> float:
    """Sequential read bandwidth (bytes/s) of the disk holding ``directory``, with a cold cache.

    Writes a private scratch file of ``nbytes`` there (a new file under a random name: never one
    that exists, never through a symlink), flushes it, evicts it, reads it back, and removes it.
    Only for a directory the user named (``--disk-probe-dir``).
    """
    path = os.path.join(directory, f".coordprep-disk-probe-{secrets.token_hex(8)}")
    block = np.random.default_rng(0).integers(0, 256, _BLOCK, dtype=np.uint8).tobytes()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        with open(fd, "wb") as f:
            for _ in range(max(1, nbytes // _BLOCK)):
                f.write(block)
            f.flush()
            os.fsync(f.fileno())
        evict([path])
        t0 = time.perf_counter()
        read = 0
        with open(path, "rb", buffering=0) as f:
            while chunk := f.read(_BLOCK):
                read += len(chunk)
        return read / (time.perf_counter() - t0)
    finally:
        os.remove(path)


def memory_bandwidth(nbytes: int = 256 * 2**20, repeats: int = 3) -> float:
    """Memory copy bandwidth (bytes copied per second, best of ``repeats``)."""
    src = np.ones(nbytes, dtype=np.uint8)
    dst = np.empty_like(src)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        np.copyto(dst, src)
        best = min(best, time.perf_counter() - t0)
    return nbytes / best


def read_costs(source: DataSource, paths: Sequence[str], ids: Sequence[int]) -> dict[str, float]:
    """Read ``ids`` cold (after eviction) and then warm; bytes and seconds of each pass."""
    evict(paths[i] for i in ids)
    t0 = time.perf_counter()
    nbytes = sum(len(source.read(i)) for i in ids)
    cold = time.perf_counter() - t0
    t0 = time.perf_counter()
    for i in ids:
        source.read(i)
    warm = time.perf_counter() - t0
    return {"bytes": float(nbytes), "cold_s": cold, "warm_s": warm}


def prep_cost(source: DataSource, preprocessor: Preprocessor, ids: Sequence[int], seed: int) -> float:
    """CPU seconds to decode and augment one sample on one thread (bytes already in memory).

    CPU time, not wall time: the model divides CPU work over the cores, and other processes on a
    shared machine would otherwise inflate the cost by the share of the core they took.
    """
    blobs = [(i, source.read(i)) for i in ids]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # one core's cost, as one prep worker pays it
    try:
        preprocessor.train(blobs[0][1], seed, 0, blobs[0][0])  # warm-up (lazy imports, first allocations)
        t0 = time.process_time()
        for i, data in blobs:
            preprocessor.train(data, seed, 0, i)
        return (time.process_time() - t0) / len(blobs)
    finally:
        torch.set_num_threads(threads)


class _SampleDataset(torch.utils.data.Dataset):
    """The sampled ids, read and prepared in DataLoader workers as a private pipeline would."""

    def __init__(self, source: DataSource, preprocessor: Preprocessor, ids: Sequence[int], seed: int) -> None:
        self.source, self.preprocessor, self.ids, self.seed = source, preprocessor, list(ids), seed

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, k: int) -> tuple[torch.Tensor, int]:
        i = self.ids[k]
        image = self.preprocessor.train(self.source.read(i), self.seed, 0, i)
        return torch.from_numpy(image), int(self.source.labels[i])


def end_to_end_rates(
    step: Callable[[torch.Tensor, torch.Tensor], Any], source: DataSource, preprocessor: Preprocessor,
    paths: Sequence[str], ids: Sequence[int], seed: int, size: int, batch_size: int, workers: int,
) -> tuple[dict[str, float], float]:
    """Samples per second of ``step`` fed three ways: synthetic in-memory data, cold and warm cache.

    ``step(images, labels)`` is one training step on a uint8 batch. The cold and warm runs use a
    ``DataLoader`` with ``workers`` processes over ``ids`` (at least two batches of them); each rate
    is timed from the first batch on, so worker start-up is left out.

    Returns:
        The three rates by mode, and the CPU seconds per batch the DataLoader costs the trial's own
        process (the warm run's process CPU per batch less the synthetic run's, which is the step's).
    """
    n = len(ids)
    images = torch.randint(0, 256, (batch_size, 3, size, size), dtype=torch.uint8)
    labels = torch.zeros(batch_size, dtype=torch.int64)
    step(images, labels)  # warm-up
    t0, cpu0 = time.perf_counter(), time.process_time()
    for lo in range(0, n, batch_size):
        k = min(batch_size, n - lo)
        step(images[:k], labels[:k])
    rates = {"synthetic": n / (time.perf_counter() - t0)}
    step_cpu = (time.process_time() - cpu0) / math.ceil(n / batch_size)
    loader_cpu = 0.0
    dataset = _SampleDataset(source, preprocessor, ids, seed)
    for mode in ("cold", "warm"):
        if mode == "cold":
            evict(paths[i] for i in ids)
        loader = torch.utils.data.DataLoader(dataset, batch_size=batch_size, num_workers=workers,
                                             persistent_workers=False)
        batches = iter(loader)
        first_images, first_labels = next(batches)  # worker start-up is not part of the rate
        step(first_images, first_labels)
        t0, cpu0, count = time.perf_counter(), time.process_time(), 0
        for batch_images, batch_labels in batches:
            step(batch_images, batch_labels)
            count += 1
        rates[mode] = (n - len(first_labels)) / (time.perf_counter() - t0)
        if mode == "warm":
            loader_cpu = max(0.0, (time.process_time() - cpu0) / max(count, 1) - step_cpu)
    return rates, loader_cpu


def sample_ids(total: Sequence[int] | np.ndarray, count: int, seed: int) -> list[int]:
    """A fixed random sample of ``count`` ids (all of them if fewer)."""
    total = np.asarray(total)
    if count >= len(total):
        return [int(i) for i in total]
    return sorted(int(i) for i in np.random.default_rng(seed).choice(total, size=count, replace=False))


def describe_config(config: Mapping[str, Any]) -> dict[str, Any]:
    """The config values worth printing (no DataSpec, no private keys)."""
    return {k: v for k, v in config.items() if k != "data" and not k.startswith("__")}
