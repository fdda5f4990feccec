"""A team's own collate_fn, and samples in the types the dataset gave (tv_tensors with their
metadata, Python numbers, NumPy arrays), as a DataLoader hands them over (no Ray)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader
from torchvision import tv_tensors
from torchvision.transforms import v2

from coordinated_prep import ConfigError, DataSpec, eval_loader, train_loader
from tests.test_user_pipelines import Detection


class Sized(Detection):
    """Detection samples whose canvas (and image) size varies from sample to sample, with a score array."""

    def __getitem__(self, i: int):
        side = 12 + i % 5
        k = i % 3
        image = tv_tensors.Image(torch.full((3, side, side), i % 251, dtype=torch.uint8))
        boxes = tv_tensors.BoundingBoxes(torch.tensor([[j, j, j + 4.0, j + 5.0] for j in range(k)]).reshape(k, 4),
                                         format="XYWH" if i % 2 else "XYXY", canvas_size=(side, side))
        mask = tv_tensors.Mask(torch.zeros(side, side, dtype=torch.uint8))
        return image, {"boxes": boxes, "labels": torch.arange(k) + 1, "masks": mask, "score": np.float32(i),
                       "id": i, "name": f"img{i}"}


def _spec(dataset, **overrides) -> DataSpec:
    return DataSpec(**{"dataset": dataset, "seed": 3, "chunk_size": 16, "holdout": 0.1, "coordinated": False,
                       **overrides})


def test_collate_fn_gets_each_sample_as_the_dataset_gave_it():
    dataset = Sized(64)
    seen = []
    loader = train_loader(_spec(dataset), 8, epochs=1, num_workers=0, collate_fn=lambda b: seen.extend(b) or len(b))
    batches = list(loader)
    default = list(train_loader(_spec(dataset), 8, epochs=1, num_workers=0))  # the same samples, in the same order
    assert batches == [len(b) for b in default], "the loop gets what collate_fn returned, as from a DataLoader"
    assert len(seen) == loader.samples_per_epoch
    for sample, index in zip(seen, torch.cat([b.indices for b in default]).tolist()):
        image, target = dataset[index]
        assert isinstance(sample, tuple) and isinstance(sample[1], dict) and list(sample[1]) == list(target)
        got_image, got = sample
        assert type(got_image) is tv_tensors.Image and torch.equal(got_image, image)
        assert type(got["boxes"]) is tv_tensors.BoundingBoxes and torch.equal(got["boxes"], target["boxes"])
        assert got["boxes"].format == target["boxes"].format and got["boxes"].canvas_size == target["boxes"].canvas_size
        assert type(got["masks"]) is tv_tensors.Mask and got["masks"].shape == target["masks"].shape
        assert type(got["labels"]) is torch.Tensor and torch.equal(got["labels"], target["labels"])
        assert isinstance(got["score"], np.ndarray) and got["score"] == target["score"]
        assert type(got["id"]) is int and got["id"] == index and got["name"] == f"img{index}"


class Records(torch.utils.data.Dataset):
    """Dict samples, as a Hugging Face dataset gives them."""

    def __len__(self) -> int:
        return 40

    def __getitem__(self, i: int) -> dict:
        return {"pixel_values": torch.full((3, 4, 4), float(i)), "labels": i}


def test_a_collate_fns_own_type_and_dict_batches_reach_the_loop_as_from_a_dataloader():
    class Inputs:  # a team's own batch type, as Hugging Face's BatchEncoding is
        def __init__(self, samples):
            self.pixel_values = torch.stack([s["pixel_values"] for s in samples])
            self.labels = torch.tensor([s["labels"] for s in samples])

    def forward(pixel_values, labels):  # a model called as model(**batch)
        return pixel_values.shape[0], labels.tolist()

    spec = _spec(Records(), holdout=0.0, chunk_size=8)
    ours = list(train_loader(spec, 8, epochs=1, num_workers=0, collate_fn=Inputs))
    assert all(type(b) is Inputs for b in ours) and sum(len(b.labels) for b in ours) == 40
    assert sorted(int(x) for b in ours for x in b.labels) == list(range(40))
    held = eval_loader(_spec(Records(), chunk_size=8), 2, collate_fn=Inputs)
    evaluated = list(held)  # 4 held out
    assert len(evaluated) == 2 and all(type(b) is Inputs for b in evaluated)
    # `loss / len(loader.dataset)`, as over a DataLoader: the samples a pass reads
    assert len(held.dataset) == 4 and len(train_loader(spec, 8, epochs=1, num_workers=0).dataset) == 40
    default = list(train_loader(spec, 8, epochs=1, num_workers=0))  # default_collate's dict, spread into a model
    assert [forward(**b)[0] for b in default] == [8] * 5 and sorted(sum((forward(**b)[1] for b in default), [])) == \
        list(range(40))
    assert set(default[0].keys()) == {"pixel_values", "labels"} and not hasattr(list(train_loader(
        _spec(Sized(16), holdout=0.0), 8, epochs=1, num_workers=0))[0], "keys"), "tuple samples: no keys, as a tuple"
    # A dict batch is a Mapping, as default_collate's dict is: Lightning finds its batch size in its values
    # (a Trainer logging on_epoch failed: "We could not infer the batch_size from the batch").
    from collections.abc import Mapping

    from pytorch_lightning.utilities.data import extract_batch_size

    assert isinstance(default[0], Mapping) and extract_batch_size(default[0]) == 8 and len(default[0]) == 8
    assert dict(default[0]).keys() == {"pixel_values", "labels"} and "labels" in default[0]
    assert torch.equal(default[0].to("cpu")["labels"], default[0]["labels"]) and isinstance(default[0].to("cpu"), Mapping)


def test_a_namedtuple_pair_reaches_the_collate_fn_as_the_dataset_gave_it():
    import collections

    Pair = collections.namedtuple("Pair", ["x", "y"])

    class Named(torch.utils.data.Dataset):
        def __len__(self) -> int:
            return 16

        def __getitem__(self, i: int):
            return Pair(torch.full((2,), float(i)), i)

    def collate(samples):  # a team's collate_fn reading the fields by name (it got plain tuples)
        return torch.stack([s.x for s in samples]), torch.tensor([s.y for s in samples])

    [(x, y)] = list(train_loader(_spec(Named(), holdout=0.0, chunk_size=16), 16, epochs=1, num_workers=0,
                                 collate_fn=collate))
    assert sorted(y.tolist()) == list(range(16)) and torch.equal(x[:, 0], y.float())


def test_default_batches_keep_tv_tensors_where_default_collate_would_and_ragged_entries_keep_theirs():
    dataset = Detection(48)
    [ours] = list(train_loader(_spec(dataset, holdout=0.0, chunk_size=48), 48, epochs=1, num_workers=0))
    order = ours.indices.tolist()
    images, targets = ours.data
    reference = next(iter(DataLoader([dataset[i] for i in order], batch_size=48,
                                     collate_fn=lambda b: (torch.utils.data.default_collate([x for x, _ in b]),
                                                           [t for _, t in b]))))
    assert type(images) is type(reference[0]) is torch.Tensor and torch.equal(images, reference[0])
    for got, want in zip(targets["boxes"], [t["boxes"] for t in reference[1]]):
        assert type(got) is tv_tensors.BoundingBoxes and torch.equal(got, want) and got.canvas_size == want.canvas_size


def test_a_detection_model_trains_on_the_batches_of_its_usual_collate_fn():
    from torchvision.models.detection import fasterrcnn_mobilenet_v3_large_320_fpn

    torch.manual_seed(0)
    model = fasterrcnn_mobilenet_v3_large_320_fpn(weights=None, weights_backbone=None, num_classes=40, min_size=64,
                                                  max_size=64)
    model.train()
    spec = _spec(Detection(32), transforms=v2.Compose([v2.RandomHorizontalFlip(), v2.ToDtype(torch.float32, scale=True)]),
                 eval_transforms=v2.ToDtype(torch.float32, scale=True))
    loader = train_loader(spec, 4, epochs=1, num_workers=0, collate_fn=lambda b: tuple(zip(*b)))
    images, targets = next(iter(loader))
    assert len(images) == 4 and all(type(t["boxes"]) is tv_tensors.BoundingBoxes for t in targets)
    images[0].mul_(0.5)  # in place, as an augmentation in the loop would
    losses = model(list(images), list(targets))
    assert set(losses) >= {"loss_classifier", "loss_box_reg"} and all(torch.isfinite(v) for v in losses.values())
    sum(losses.values()).backward()
    val = eval_loader(spec, 4, collate_fn=lambda b: tuple(zip(*b)))
    model.eval()
    with torch.no_grad():
        [(held, predictions)] = [(images, model(list(images))) for images, _ in list(val)[:1]]
    assert len(predictions) == len(held) > 0 and all("boxes" in p for p in predictions)


def test_a_sample_whose_boxes_are_a_plain_tensor_gets_them_back_plain_and_collate_fn_must_be_callable():
    class Switching(Detection):
        """Boxes as BoundingBoxes, except sample 21's (a transform that unwrapped them for that sample)."""

        def __getitem__(self, i):
            image, target = super().__getitem__(i)
            if i == 21:
                target["boxes"] = target["boxes"].as_subclass(torch.Tensor)
            return image, {**target, "id": i}

    seen = []
    list(train_loader(_spec(Switching(40), holdout=0.0), 8, epochs=1, num_workers=0, collate_fn=seen.extend))
    types = {target["id"]: type(target["boxes"]) for _, target in seen}
    assert len(types) == 40 and types.pop(21) is torch.Tensor, "sample 21's plain boxes stay plain"
    assert set(types.values()) == {tv_tensors.BoundingBoxes}
    with pytest.raises(ConfigError, match="collate_fn=3 is not callable"):
        train_loader(_spec(Detection(8)), 4, collate_fn=3)
