"""Any sample structure, stacked into pieces and cut into batches shaped as default_collate's (no Ray)."""

from __future__ import annotations

import collections

import numpy as np
import pytest
import torch
from torch.utils.data import default_collate
from torchvision import tv_tensors

from coordinated_prep import DataSpec, train_loader
from coordinated_prep.errors import StructureError
from coordinated_prep.pipeline import ArrayDataset
from coordinated_prep.pipeline.chunk import stack
from coordinated_prep.pipeline.structure import make_layout

Point = collections.namedtuple("Point", ["x", "y"])


class Samples:
    """A map-style dataset whose sample ``i`` is ``make(i)``."""

    def __init__(self, make, n: int = 40) -> None:
        self.make, self.n = make, n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        return self.make(i)


STRUCTURES = {
    "tuple of image and int": lambda i: (np.full((3, 4, 4), i, np.uint8), i % 3),
    "dict of tensors, float, bool, str": lambda i: {"image": torch.full((2, 3), float(i)), "w": i / 2, "flag": i % 2 == 0,
                                                    "name": f"s{i}"},
    "nested list and namedtuple": lambda i: [Point(np.int32(i), np.float16(i / 4)), (torch.arange(3) + i, [i, -i])],
    "tv_tensors and float16": lambda i: (tv_tensors.Image(torch.full((1, 2, 2), i, dtype=torch.uint8)),
                                         tv_tensors.Mask(torch.full((2, 2), i % 2, dtype=torch.int64)),
                                         np.full(5, i, np.float16)),
    "bfloat16": lambda i: torch.full((2,), float(i), dtype=torch.bfloat16),
}


def _same(a, b) -> None:
    """``a`` and ``b`` have one structure and equal leaves (tensors of one dtype, lists, strings)."""
    assert type(a) is type(b), (type(a), type(b))
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    elif isinstance(a, dict):
        assert list(a) == list(b)
        for k in a:
            _same(a[k], b[k])
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            _same(x, y)
    else:
        assert a == b


@pytest.mark.parametrize("name", list(STRUCTURES))
@pytest.mark.parametrize("batch_size", [4, 7])
def test_batches_have_default_collates_structure(name, batch_size):
    dataset = Samples(STRUCTURES[name])
    spec = DataSpec(dataset=dataset, coordinated=False, holdout=0.0, chunk_size=8)
    loader = train_loader(spec, batch_size, epochs=1, num_workers=0)
    seen = []
    for batch in loader:
        _same(batch.data, default_collate([dataset[i] for i in batch.indices.tolist()]))
        seen += batch.indices.tolist()
    assert sorted(seen) == list(range(len(dataset)))


def test_a_batch_unpacks_like_a_dataloaders_and_keeps_its_indices():
    dataset = ArrayDataset(np.arange(48, dtype=np.float32).reshape(12, 4), np.arange(12) % 3)
    loader = train_loader(DataSpec(dataset=dataset, coordinated=False, holdout=0.0), 5, epochs=1, num_workers=0)
    for batch in loader:
        inputs, targets = batch
        assert inputs.dtype == torch.float32 and targets.dtype == torch.int64
        assert torch.equal(inputs[:, 0], batch.indices.float() * 4) and torch.equal(targets, batch.indices % 3)
        assert batch[0] is inputs and len(batch) == len(batch.indices)


def test_ragged_leaves_come_as_per_sample_lists_and_stacked_ones_as_views():
    boxes = lambda i: (np.full((2, 8, 8), i, np.uint8), {"boxes": np.full((i % 4, 4), i, np.float32),
                                                         "labels": np.arange(i % 4, dtype=np.int64)})
    layout = make_layout([boxes(i) for i in range(8)], ragged=(), where="t")
    assert [leaf.kind for leaf in layout.leaves] == ["dense", "ragged", "ragged"]
    piece = stack(layout, [layout.check(boxes(i), i, "t") for i in range(8)], np.arange(8), 0)
    dataset = Samples(boxes, n=30)
    loader = train_loader(DataSpec(dataset=dataset, coordinated=False, holdout=0.0, chunk_size=10), 5, epochs=1,
                          num_workers=0)
    for batch in loader:
        images, target = batch
        assert images.shape == (5, 2, 8, 8) and isinstance(target["boxes"], list)
        for i, b, lab in zip(batch.indices.tolist(), target["boxes"], target["labels"]):
            assert b.shape == (i % 4, 4) and (b == i).all() and torch.equal(lab, torch.arange(i % 4))
    assert piece.leaves[1][5].shape == (1, 4)


def test_a_leaf_declared_ragged_is_ragged_even_when_the_probe_saw_one_shape():
    sample = lambda i: (np.zeros(3, np.float32), np.zeros((1 if i < 20 else 2, 4), np.float32))
    dataset = Samples(sample)
    with pytest.raises(StructureError, match=r"leaf '1' has shape \(2, 4\).*ragged=\['1'\]"):
        list(train_loader(DataSpec(dataset=dataset, coordinated=False, holdout=0.0, chunk_size=8), 8, epochs=1,
                          num_workers=0))
    loader = train_loader(DataSpec(dataset=dataset, coordinated=False, holdout=0.0, chunk_size=8, ragged=["1"]), 8,
                          epochs=1, num_workers=0)
    assert sum(len(b) for b in loader) == 40


@pytest.mark.parametrize("bad, match", [
    (lambda i: (np.zeros(3), i) if i != 23 else (np.zeros(3), i, 0), r"sample 23 has structure \(leaf, leaf, leaf\)"),
    (lambda i: (np.zeros(3), i) if i != 23 else (np.zeros(3, np.float32), i), r"sample 23, leaf '0' is float32"),
    (lambda i: (np.zeros(3), None), r"leaf '1' is a NoneType"),
])
def test_a_transform_that_changes_the_structure_is_refused_naming_the_sample(bad, match):
    spec = DataSpec(dataset=Samples(bad), coordinated=False, holdout=0.0, chunk_size=8)
    with pytest.raises(StructureError, match=match):
        list(train_loader(spec, 8, epochs=1, num_workers=0))
