"""A group's start: the layout of its samples, and the refusal of transforms that cannot be seeded.

The built-in image pipeline's layout is known (uint8 crops and int labels). For a pipeline of the
user's, the first few training samples (or held-out ones, for evaluation) are prepared with epoch 0's
draws, and prepared a second time from the same key: a transform drawing from
a generator the library does not seed (``np.random.default_rng()``, a ``torch.Generator`` of its
own) gives other bytes the second time, and would give each trial of a group other bytes than its
unshared run, so the group refuses it. The samples' shapes decide which leaves are stacked and
which are ragged (:func:`coordinated_prep.pipeline.structure.make_layout`).
"""

from __future__ import annotations

from typing import Any, NamedTuple, Sequence

import numpy as np

from coordinated_prep.errors import ConfigError, SampleError, StructureError
from coordinated_prep.pipeline.chunk import image_layout
from coordinated_prep.pipeline.seeding import preserved, reseed
from coordinated_prep.pipeline.structure import Layout, flatten, make_layout, to_array
from coordinated_prep.pipeline.transforms import ImagePipeline, Pipeline, shard_sizes

PROBED = 8  # samples prepared at a group's start (twice each for a pipeline of the user's)


class Probe(NamedTuple):
    """What a group's start learnt: the layout, and the bytes a sample takes in a piece (all views)."""

    layout: Layout
    sample_bytes: int
    shard_sizes: tuple[int, ...] | None = None  # where the source reads shards as needed (pipeline.transforms.shard_sizes)


def probe(pipeline: Pipeline, seed: int, indices: Sequence[int], ragged: Sequence[str], views: int = 1,
          mode: str = "train", where: str = "data") -> Probe:
    """Prepare the first samples of ``indices`` (twice for a user pipeline) and make their layout.

    Raises:
        ConfigError: A transform's output differs between two preparations from the same key.
        StructureError: The samples differ in structure, or hold a leaf no batch can.
        SampleError: None of the first samples could be read or prepared (the first error).
    """
    shards = shard_sizes(pipeline)
    if isinstance(pipeline, ImagePipeline):  # its layout is known: reading samples would only cost reads
        layout = image_layout((3, pipeline.size, pipeline.size))
        return Probe(layout, views * layout.sample_bytes(), shards)
    ids = [int(i) for i in indices[:PROBED]]
    if not ids and mode == "eval":  # nothing held out: no piece will need a layout
        return Probe(image_layout((0,)), 1, shards)
    first = _prepared(pipeline, seed, ids, mode)
    if not first:
        raise ConfigError(f"{where}: no samples to probe (empty {'training' if mode == 'train' else 'held-out'} split)")
    if all(isinstance(s, SampleError) for _, s in first):
        raise first[0][1]
    if mode == "train" and getattr(pipeline, "steps", None):
        _check_prefix(pipeline, [i for i, s in first if not isinstance(s, SampleError)][:2], where)
    # a pipeline of the user's: prepared twice
    second = dict(_prepared(pipeline, seed, [i for i, s in first if not isinstance(s, SampleError)], mode))
    for index, sample in first:
        if not isinstance(sample, SampleError) and not _equal(sample, second[index]):
            raise ConfigError(
                f"{where}: the {'training' if mode == 'train' else 'evaluation'} pipeline gave sample {index} other "
                "values when prepared twice from the same seed, so trials sharing it would not see what they "
                "would see alone. Its randomness comes from a generator this library cannot seed (its own "
                "np.random.default_rng(), random.Random() or torch.Generator). Draw from the global generators "
                "instead (np.random.*, random.*, torch.rand*: seeded per sample and epoch around each call), as "
                "transforms.v2 does")
    samples = [s for _, s in first if not isinstance(s, SampleError)]
    layout = make_layout(samples, ragged, where)
    return Probe(layout, views * layout.sample_bytes(samples), shards)


def _prepared(pipeline: Pipeline, seed: int, ids: list[int], mode: str) -> list[tuple[int, Any]]:
    """(index, sample or its SampleError) for each of ``ids``, with epoch 0's draws (or evaluation's)."""
    out: list[tuple[int, Any]] = []
    for index, raw in zip(ids, pipeline.fetch(ids, seed, 0 if mode == "train" else -1)):
        if isinstance(raw, SampleError):
            out.append((index, raw))
            continue
        try:
            sample = pipeline.train(raw, seed, 0, index, 1)[0] if mode == "train" else pipeline.eval(raw, seed, index)
        except (ConfigError, StructureError):
            raise
        except Exception as e:
            out.append((index, SampleError(index, pipeline.describe(index), f"cannot decode or transform: {e}")))
            continue
        out.append((index, sample))
    return out


def _check_prefix(pipeline: Any, ids: list[int], where: str) -> None:
    """Refuse a prefix (:mod:`coordinated_prep.pipeline.split`) whose output depends on the seed: its
    kept outputs would be served to every group and epoch as if it did not."""
    for index, raw in zip(ids, pipeline.fetch(ids, 0, 0)):
        outputs = []
        for seed in (1, 2):
            with preserved():
                reseed(seed)
                outputs.append(pipeline.prefix(raw, index))
        (a, _), (b, _) = outputs
        if a.shape != b.shape or a.tobytes() != b.tobytes():
            names = ", ".join(type(s).__name__ for s in pipeline.steps)
            raise ConfigError(
                f"{where}: the transform's deterministic prefix ({names}) gave sample {index} other values under "
                "other seeds, so the decoded tier would serve every group and epoch one draw; a step in it draws at "
                "random: take deterministic = True off it (or move it after the first random step)")


def _equal(a: Any, b: Any) -> bool:
    leaves_a, tree_a = flatten(a)
    leaves_b, tree_b = flatten(b)
    if tree_a != tree_b or len(leaves_a) != len(leaves_b):
        return False
    for x, y in zip(leaves_a, leaves_b):
        try:
            x, y = to_array(x, 0, "", "")[0], to_array(y, 0, "", "")[0]
        except Exception:
            continue  # a leaf no batch can hold: make_layout names it
        if isinstance(x, str) or isinstance(y, str):
            if x != y:
                return False
        elif x.shape != y.shape or x.dtype != y.dtype or x.tobytes() != y.tobytes():
            return False
    return True


def train_indices(n: int, holdout: float) -> np.ndarray:
    """The training split's indices (as the plan splits them), in index order."""
    from coordinated_prep.plan import holdout_split

    return np.sort(holdout_split(n, holdout)[0])
