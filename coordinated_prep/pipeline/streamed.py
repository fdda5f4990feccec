"""Iterable datasets read by shard: their contract, and the map-style view a sweep plans on.

A sweep plans every epoch ahead (which sample goes in which piece, for every trial, joiner and
rank), so it needs random access by index. An iterable dataset gives it if it can be read shard by
shard. **The contract** (Hugging Face's ``datasets.IterableDataset`` meets it as it is, streamed or
not; a team's own ``torch.utils.data.IterableDataset`` adds two members; a materialized
``ray.data.Dataset`` is read as one shard, its rows in order, by :class:`RayDataRows`):

- ``n_shards``: the number of shards, an ``int`` >= 1;
- ``shard(num_shards, index)``: an iterable of the samples of shard ``index`` (called with
  ``num_shards = n_shards``), the same samples in the same order every time it is called, in any
  process (no shuffling of its own: the sweep shuffles, by its seed);
- the object pickles (it travels to the prep actors with the spec), and its samples pickle.

:class:`StreamedShards` is the map-style view. On each node, the first process that needs the data
(the prep actor that starts the group, or an unshared trial) reads every shard once, in order, and
spills its samples (pickled) to the node's shard cache, ``$COORDPREP_CACHE/shards/streamed-<key>/``,
where ``<key>`` is the SHA-256 of the dataset's pickle (the group key's). Every other process of the
node, and every later epoch and sweep, reads those local copies by index. So a remote shard is read
sequentially, once per node for the whole sweep (ray#45042's request), and never at random.
Sample ``i`` is the ``i``-th sample of the shards taken in order, as with tar shards.

Per shard the spill is two files: ``<shard>.samples`` (the pickles, back to back) and
``<shard>.offsets.npy`` (int64, one more than its samples). Each is written to ``.part``, synced and
renamed, the offsets last, so a shard whose offsets exist is whole. A shard whose read fails is read
again, at most 3 times in all with a backoff, as a remote tar shard's fetch is. Writers of one node serialise on
the shard's ``flock`` (:class:`~coordinated_prep.pipeline.sources.remote.node_lock`: the kernel
releases a dead holder's lock; a live holder is waited for while it writes, and at most ``LOCK_WAIT_S``
without writing).

What the contract cannot check, and the docs say: a dataset whose shards change between reads (a
listing of a bucket that grows, say) is read as it was at the first read on each node; delete
``streamed-<key>`` to read it again.
"""

from __future__ import annotations

import hashlib
import logging
import os
import pickle
import sys
import time
from collections import OrderedDict
from typing import Any

import numpy as np

from coordinated_prep.errors import ConfigError, DatasetError

logger = logging.getLogger(__name__)

OPEN = 64  # shards' spills a process keeps open for reading

CONTRACT = ("an iterable dataset is read by shard when it has n_shards (an int >= 1) and shard(num_shards, "
            "index) giving the same samples of one shard on every call, as Hugging Face's IterableDataset has")


def is_sharded(dataset: Any) -> bool:
    """Whether ``dataset`` offers the shard contract's two members (its values are checked by :class:`StreamedShards`)."""
    return hasattr(dataset, "n_shards") and callable(getattr(dataset, "shard", None))


def is_ray_dataset(dataset: Any) -> bool:
    """Whether ``dataset`` is a ``ray.data.Dataset`` (without importing Ray Data)."""
    return type(dataset).__module__.startswith("ray.data") and callable(getattr(dataset, "iter_rows", None))


def as_streamed(dataset: Any, key: str | None = None, name: str | None = None) -> "StreamedShards | None":
    """The map-style view of ``dataset`` if it is iterable and read by shard (the contract, or a
    ``ray.data.Dataset``); None for a map-style dataset or one that offers neither."""
    if is_map_style(dataset):  # a StreamedShards too: it is map-style
        return None
    if is_ray_dataset(dataset):
        if type(dataset).__name__ != "MaterializedDataset":
            raise ConfigError(
                f"data.dataset={name or 'a ray.data.Dataset'} is lazy: its pipeline would run inside the sweep, whose "
                "trials and prep pool may hold every CPU its tasks need; materialize it in the driver before the sweep "
                "(dataset=ds.materialize()), so that it runs once, and every node reads its rows in one order")
        rows = RayDataRows(dataset)
        return StreamedShards(rows, key=key or rows.key, name=name or "ray.data.Dataset")
    return StreamedShards(dataset, key=key, name=name) if is_sharded(dataset) else None


class RayDataRows:
    """A materialized ``ray.data.Dataset`` under the contract: its rows in its blocks' order, as one shard.

    Its pipeline (reads, ``map``, ``map_batches``) ran once, where the driver materialized it, before
    the sweep took the CPUs its tasks need. Reading its rows launches no task: the process that spills
    it on a node fetches its blocks (the driver owns them), in their order (Ray Data's
    ``preserve_order``), so every node spills the same rows in the same order. What must change every
    epoch (random augmentation) belongs in the spec's transforms, which run per (seed, epoch, sample)
    on the rows.
    """

    n_shards = 1

    def __init__(self, dataset: Any) -> None:
        self.dataset = dataset
        # Its identity without pickling it: a pickle taken outside Ray's own serialization would pin
        # its blocks for the driver's life. Its blocks' ids name its rows, in their order, within the
        # Ray cluster that holds them: a fresh cluster numbers a driver's objects from the start again
        # (another run's rows under the same ids), so the key holds the cluster's session name too.
        blocks = "".join(ref.hex() for ref in dataset.get_internal_block_refs())
        self.key = "ray.data:" + hashlib.sha256(f"{_session_name()}\0{blocks}".encode()).hexdigest()

    def shard(self, num_shards: int, index: int):
        dataset = type(self.dataset).copy(self.dataset, _deep_copy=True)  # the user's context is left as it was
        dataset.context.execution_options.preserve_order = True
        dataset.context.enable_progress_bars = False
        yield from dataset.iter_rows()


def _session_name() -> str:
    """The name of the Ray cluster session this process is connected to (unique per cluster start)."""
    import ray

    context = ray.get_runtime_context()
    if hasattr(context, "get_session_name"):
        return context.get_session_name()
    return ray._private.worker.global_worker.node.session_name  # Ray releases before get_session_name


def is_map_style(dataset: Any) -> bool:
    """Whether ``dataset``'s class has ``__len__`` and ``__getitem__``, and it is not a torch
    ``IterableDataset`` (which inherits a ``__getitem__`` that raises, and may define ``__len__``)."""
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(dataset, torch.utils.data.IterableDataset):
        return False
    return all(hasattr(type(dataset), m) for m in ("__len__", "__getitem__"))


class _SourceError(Exception):
    """The source's ``shard()`` raised (its error is the cause): the read is tried again."""


class StreamedShards:
    """A map-style view of a sharded iterable ``source`` (the module's contract), spilled once per node.

    Args:
        source: The iterable dataset.
        key: Its identity (the spill folder's name); None: the SHA-256 of its pickle.
        name: How errors name it.

    Raises:
        ConfigError: ``n_shards`` is not an int >= 1, or the dataset does not pickle.
    """

    def __init__(self, source: Any, key: str | None = None, name: str | None = None) -> None:
        shards = getattr(source, "n_shards", None)
        self.name = name or f"{type(source).__module__}.{type(source).__qualname__}"
        if not isinstance(shards, int) or isinstance(shards, bool) or shards < 1:
            raise ConfigError(f"data.dataset={self.name}: n_shards={shards!r} must be an int >= 1 ({CONTRACT})")
        if key is None:
            from coordinated_prep.pipeline.datasets import object_key

            key = object_key(source, "data.dataset")
        self.source = source
        self.n_shards = shards
        self.key = hashlib.sha256(key.encode()).hexdigest()[:16]
        self._ends: np.ndarray | None = None  # per shard, its last sample's index + 1 (loaded per process)
        self._offsets: list[np.ndarray] = []
        self._files: OrderedDict[int, int] = OrderedDict()  # shard -> its samples' descriptor, the OPEN latest

    def __getstate__(self) -> dict[str, Any]:
        return {"source": self.source, "n_shards": self.n_shards, "key": self.key, "name": self.name}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state, _ends=None, _offsets=[], _files=OrderedDict())

    def __repr__(self) -> str:
        return f"StreamedShards({self.name}, {self.n_shards} shards)"

    @property
    def folder(self) -> str:
        """This node's spill of the dataset."""
        from coordinated_prep.pipeline.sources.remote import shard_cache_dir

        return os.path.join(shard_cache_dir(), f"streamed-{self.key}")

    def __len__(self) -> int:
        return int(self._index()[-1])

    def __getitem__(self, index: int) -> Any:
        ends = self._index()
        if not 0 <= index < ends[-1]:
            raise IndexError(f"{self.name}: sample {index} of {int(ends[-1])}")
        shard = int(np.searchsorted(ends, index, side="right"))
        offsets = self._offsets[shard]
        at = index - (int(ends[shard - 1]) if shard else 0)
        start, stop = int(offsets[at]), int(offsets[at + 1])
        return pickle.loads(os.pread(self._file(shard), stop - start, start))

    def _file(self, shard: int) -> int:
        """A descriptor of shard ``shard``'s samples: at most ``OPEN`` are kept open (a streamed set
        may have thousands of shards), the least recently read closed first."""
        fd = self._files.pop(shard, None)
        if fd is None:
            fd = os.open(self._path(shard, "samples"), os.O_RDONLY)
            while len(self._files) >= OPEN:
                os.close(self._files.popitem(last=False)[1])
        self._files[shard] = fd
        return fd

    def describe(self, index: int) -> str:
        """Where sample ``index`` lives: its shard and place in it."""
        ends = self._index()
        if not 0 <= index < ends[-1]:
            return f"{self.name}, sample {index} of {int(ends[-1])} (out of range)"
        shard = int(np.searchsorted(ends, index, side="right"))
        return f"{self.name}, shard {shard}, sample {index - (int(ends[shard - 1]) if shard else 0)}"

    def _path(self, shard: int, kind: str) -> str:
        return os.path.join(self.folder, f"{shard:06d}.{kind}")

    def _index(self) -> np.ndarray:
        """Every shard's offsets, spilling the shards this node lacks first (once per process)."""
        if self._ends is None:
            os.makedirs(self.folder, exist_ok=True)
            offsets = [self._spilled(shard) for shard in range(self.n_shards)]
            ends = np.cumsum([len(o) - 1 for o in offsets])
            if ends[-1] == 0:
                raise DatasetError(f"data.dataset={self.name}: its {self.n_shards} shards yielded no sample")
            self._offsets, self._ends = offsets, ends
        return self._ends

    def _spilled(self, shard: int) -> np.ndarray:
        """Shard ``shard``'s offsets, read from the source and spilled first if this node lacks it."""
        from coordinated_prep.pipeline.sources.remote import node_lock

        offsets_path = self._path(shard, "offsets.npy")
        if not os.path.exists(offsets_path):
            with node_lock(offsets_path + ".lock", f"shard {shard} of {self.name}",
                           progress=self._path(shard, "samples") + ".part"):
                if not os.path.exists(offsets_path):  # an earlier holder spilled it meanwhile
                    self._spill(shard, offsets_path)
        return np.load(offsets_path)

    def _spill(self, shard: int, offsets_path: str) -> None:
        """Read shard ``shard`` whole into its spill, in at most ``ATTEMPTS`` reads (the source's errors
        are retried alike, after a backoff, as a remote shard's fetch is); a sample that does not
        pickle fails at once."""
        from coordinated_prep.pipeline.sources.remote import ATTEMPTS, BACKOFF_S

        samples_path = self._path(shard, "samples")
        for attempt in range(ATTEMPTS):
            if attempt:
                time.sleep(BACKOFF_S * 2 ** (attempt - 1))  # a backoff between reads, not a wait for anyone
            try:
                self._write(shard, samples_path, offsets_path)
                return
            except _SourceError as e:
                last = e.__cause__
                logger.warning("%s: reading shard %d failed (attempt %d of %d): %r", self.name, shard, attempt + 1,
                               ATTEMPTS, last)
            finally:
                for part in (samples_path + ".part", offsets_path + ".part"):
                    if os.path.exists(part):  # a failed read leaves nothing half written
                        os.remove(part)
        raise DatasetError(f"data.dataset={self.name}: reading shard {shard} of {self.n_shards} failed {ATTEMPTS} "
                           f"times, last with {type(last).__name__}: {last}; if that is a passing fault, check that "
                           f"its storage is reachable from every node ({CONTRACT})") from last

    def _write(self, shard: int, samples_path: str, offsets_path: str) -> None:
        offsets = [0]
        try:
            with open(samples_path + ".part", "wb") as out:
                for position, sample in enumerate(self._samples(shard)):
                    try:
                        blob = pickle.dumps(sample, protocol=5)
                    except Exception as e:
                        raise DatasetError(f"data.dataset={self.name}: sample {position} of shard {shard} does not "
                                           f"pickle ({type(e).__name__}: {e}); samples travel between processes, so "
                                           "they must pickle (arrays, tensors, PIL images, numbers, strings)") from e
                    out.write(blob)
                    offsets.append(offsets[-1] + len(blob))
                out.flush()
                os.fsync(out.fileno())
            os.replace(samples_path + ".part", samples_path)
            with open(offsets_path + ".part", "wb") as f:
                np.save(f, np.asarray(offsets, dtype=np.int64))
                f.flush()
                os.fsync(f.fileno())
            os.replace(offsets_path + ".part", offsets_path)
            logger.info("%s: shard %d spilled to %s (%d samples, %d bytes)", self.name, shard, self.folder,
                        len(offsets) - 1, offsets[-1])
        except OSError as e:  # this node's disk, not the source: its errors are the source's (_SourceError)
            raise DatasetError(f"data.dataset={self.name}: spilling shard {shard} to {self.folder} failed "
                               f"({type(e).__name__}: {e}); it needs room for the whole dataset on this node's disk "
                               "(set COORDPREP_CACHE to a larger one)") from e

    def _samples(self, shard: int):
        """The source's samples of ``shard``; its errors (from ``shard()`` or the iteration) as :class:`_SourceError`."""
        try:
            samples = iter(self.source.shard(self.n_shards, shard))
        except Exception as e:
            raise _SourceError() from e
        while True:
            try:
                sample = next(samples)
            except StopIteration:
                return
            except Exception as e:
                raise _SourceError() from e
            yield sample

    def __del__(self) -> None:
        for fd in getattr(self, "_files", {}).values():
            try:
                os.close(fd)
            except OSError:
                pass
