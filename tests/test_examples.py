"""The bring-your-own-data examples without the core: each generated dataset, each transform on a sample,
and each model's training on plain DataLoader batches (``default_collate``, as the loaders give them)."""

from __future__ import annotations

import math
import time
from types import SimpleNamespace
from typing import Any, Callable, Iterator

import numpy as np
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, Subset, default_collate
from torchvision import tv_tensors

from trainables import audio, cifar, loop, segmentation
from trainables.common import make_optimizer
from trainables.data import audio as audio_data
from trainables.data import cifar as cifar_data
from trainables.data import segmentation as seg_data
from trainables.loop import Task

GENERATORS = {"cifar": (cifar_data.make, 3000), "segmentation": (seg_data.make, 800), "audio": (audio_data.make, 1000)}


@pytest.fixture(autouse=True)
def _one_thread() -> Iterator[None]:
    """One torch thread, as the trainables train (``torch_threads`` 1): two contend on a small machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


class Applied:
    """A dataset with torchvision's ``transform``/``transforms`` applied per sample, as the core applies them."""

    def __init__(self, dataset: Any, transform: Callable | None = None, transforms: Callable | None = None) -> None:
        self.dataset, self.transform, self.transforms = dataset, transform, transforms

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int) -> tuple[Any, Any]:
        x, y = self.dataset[index]
        return self.transforms(x, y) if self.transforms else (self.transform(x), y)


def _seeded(fn: Callable[[], Any], seed: int) -> Any:
    torch.manual_seed(seed)
    return fn()


@pytest.mark.parametrize("name", sorted(GENERATORS))
def test_generated_datasets_are_deterministic_sized_and_fast(name):
    make, n = GENERATORS[name]
    t0 = time.perf_counter()
    first = make(n=n, seed=0)
    elapsed = time.perf_counter() - t0
    assert len(first) == n and elapsed < 10, elapsed  # about 0.3 s here; the loose bound only catches a blow-up
    again, other = make(n=n, seed=0), make(n=n, seed=1)
    for i in (0, 7, n - 1):
        (x, y), (x2, y2), (x3, _) = first[i], again[i], other[i]
        assert np.array_equal(np.asarray(x), np.asarray(x2)) and np.array_equal(np.asarray(y), np.asarray(y2))
        assert not np.array_equal(np.asarray(x), np.asarray(x3))
    labels = [int(first[i][1]) for i in range(0, n, 97)] if name != "segmentation" else []
    assert all(0 <= y < len(first.classes) for y in labels)


def test_cifar_samples_and_transforms():
    data = cifar_data.make(n=100, seed=0)
    image, label = data[13]
    assert image.shape == (32, 32, 3) and image.dtype == np.uint8 and label == 3
    train = cifar_data.train_transform()
    out = train(image)
    assert out.shape == (3, 32, 32) and out.dtype == torch.float32
    assert torch.equal(_seeded(lambda: train(image), 5), _seeded(lambda: train(image), 5))
    assert not torch.equal(_seeded(lambda: train(image), 5), _seeded(lambda: train(image), 6))
    chw = torch.from_numpy(image).permute(2, 0, 1)  # a CHW uint8 tensor works as well as the HWC array
    assert torch.equal(_seeded(lambda: train(chw), 5), _seeded(lambda: train(image), 5))
    expected = (chw.float() / 255 - torch.tensor(cifar_data.MEAN)[:, None, None]) / torch.tensor(cifar_data.STD)[:, None, None]
    assert torch.allclose(cifar_data.eval_transform()(image), expected, atol=1e-5)
    images, labels = default_collate([(train(data[i][0]), data[i][1]) for i in range(4)])
    assert images.shape == (4, 3, 32, 32) and labels.dtype == torch.int64


def _classes_from_pixels(image: torch.Tensor) -> torch.Tensor:
    """Each pixel's class, as the palette colour nearest to it (images made with jitter=0 and noise=0)."""
    mean, std = torch.tensor(seg_data.MEAN)[:, None, None], torch.tensor(seg_data.STD)[:, None, None]
    rgb = (image * std + mean) * 255
    palette = torch.from_numpy(seg_data.PALETTE)[:, :, None, None]
    return ((rgb[None] - palette) ** 2).sum(1).argmin(0)


def test_the_joint_segmentation_transform_keeps_image_and_mask_aligned():
    data = seg_data.make(n=16, seed=3, jitter=0.0, noise=0.0)
    train = seg_data.train_transforms(scale=(0.3, 1.0), degrees=30)
    moved = 0
    for i in range(len(data)):
        image, mask = data[i]
        assert isinstance(mask, tv_tensors.Mask) and mask.dtype == torch.int64 and image.dtype == torch.uint8
        assert torch.equal(_classes_from_pixels(seg_data.eval_transforms()(image, mask)[0]), mask)
        out_image, out_mask = _seeded(lambda: train(image, mask), i)
        assert out_image.dtype == torch.float32 and out_mask.dtype == torch.int64 and out_mask.shape == (64, 64)
        again = _seeded(lambda: train(image, mask), i)
        assert torch.equal(out_image, again[0]) and torch.equal(out_mask, again[1])
        # Bilinear resampling blends colours only along edges; elsewhere the pixels name the mask's class.
        agree = (_classes_from_pixels(out_image) == out_mask).float().mean()
        assert agree > 0.97, (i, agree)
        moved += not torch.equal(out_mask, mask)
        if out_mask.unique().numel() > 1:  # a mask moved on its own would not agree with its image
            assert (_classes_from_pixels(out_image) == out_mask.flip(-1)).float().mean() < agree
    assert moved >= 12
    images, masks = default_collate([seg_data.eval_transforms()(*data[i]) for i in range(4)])
    assert images.shape == (4, 3, 64, 64) and masks.shape == (4, 64, 64) and masks.dtype == torch.int64


def test_audio_samples_transforms_and_mel_filterbank():
    data = audio_data.make(n=20, seed=0)
    wave, label = data[7]
    assert wave.shape == (1, 8000) and wave.dtype == torch.int16 and label == 2
    train, evaluate = audio_data.train_transform(), audio_data.eval_transform()
    out = train(wave)
    assert out.shape == (1, 40, 6000 // 64 + 1) and out.dtype == torch.float32 and torch.isfinite(out).all()
    assert torch.equal(_seeded(lambda: train(wave), 1), _seeded(lambda: train(wave), 1))
    assert not torch.equal(_seeded(lambda: train(wave), 1), _seeded(lambda: train(wave), 2))
    assert torch.equal(evaluate(wave), evaluate(wave)) and evaluate(wave).shape == out.shape
    # A pure tone lands in the band whose centre is nearest its frequency.
    t = torch.arange(8000) / 8000
    filters = audio_data.mel_filterbank(129, 40, 8000, 50.0)
    centres = filters.argmax(0).float() * 4000 / 128
    for hz in (300.0, 1000.0, 2500.0):
        tone = torch.sin(2 * math.pi * hz * t)[None]
        band = int(audio_data.LogMel()(tone).mean(-1)[0].argmax())
        assert abs(float(centres[band]) - hz) <= 2 * 4000 / 128, (hz, float(centres[band]))


def _tiny(name: str) -> tuple[Task, Any, dict[str, Any]]:
    """A task, 64 transformed training samples of it, and the model config."""
    if name == "cifar":
        return cifar.TASK, Applied(Subset(cifar_data.make(n=64), range(64)), cifar_data.train_transform()), {"width": 8}
    if name == "segmentation":
        return segmentation.TASK, Applied(seg_data.make(n=64), transforms=seg_data.train_transforms()), {"width": 4}
    return audio.TASK, Applied(audio_data.make(n=64), audio_data.train_transform()), {"width": 8}


@pytest.mark.parametrize("name", ["cifar", "segmentation", "audio"])
def test_each_model_trains_on_default_collate_batches(name):
    task, data, config = _tiny(name)
    torch.manual_seed(0)
    batches = list(DataLoader(Subset(data, range(32)), batch_size=16, shuffle=True))  # two, seen ten times each
    model = task.build(task.num_classes, config)
    optimizer = make_optimizer(model, {"lr": 0.02})
    losses = []
    for step in range(20):
        inputs, targets = batches[step % 2]
        losses.append(loop.train_step(model, optimizer, nn.CrossEntropyLoss(), inputs, targets, torch.device("cpu")))
    assert all(math.isfinite(x) for x in losses)
    assert np.mean(losses[-4:]) < np.mean(losses[:4]) * 0.8, losses


class FakeTrainLoader:
    """Stands in for ``coordinated_prep.train_loader``: each epoch a DataLoader over ``config["data"]["train"]``,
    each batch ``config["views"]`` times (the views a spec asks for)."""

    def __init__(self, config: dict[str, Any], batch_size: int, epochs: int) -> None:
        self.data, self.batch_size, self.epochs = config["data"]["train"], batch_size, epochs
        self.views = config.get("views", 1)
        self.fresh_batches_per_epoch = math.ceil(len(self.data) / batch_size)
        self.private_samples = 0
        self.stats = SimpleNamespace(copied_fraction=0.0, cpu_ms_per_batch=0.0)

    def __enter__(self) -> "FakeTrainLoader":
        return self

    def __exit__(self, *exc: object) -> None:
        pass

    def __len__(self) -> int:
        return self.views * self.fresh_batches_per_epoch

    def __iter__(self) -> Iterator[Any]:
        return (b for b in DataLoader(self.data, batch_size=self.batch_size, shuffle=True) for _ in range(self.views))


def _fake_eval_loader(config: dict[str, Any], batch_size: int) -> Iterator[Any]:
    return iter(DataLoader(config["data"]["eval"], batch_size=batch_size))


class MemorySession:
    """Keeps every report and state; resumes from ``start``."""

    def __init__(self, start: dict[str, Any] | None = None) -> None:
        self.start, self.reports, self.states = start, [], []

    def restore(self) -> dict[str, Any] | None:
        return self.start

    def report(self, metrics: dict[str, Any], state: dict[str, Any]) -> None:
        self.reports.append(metrics)
        self.states.append(state)


def test_fit_task_reports_the_task_scores_and_resumes(monkeypatch):
    monkeypatch.setattr(loop, "train_loader", lambda config, batch_size, epochs: FakeTrainLoader(config, batch_size, epochs))
    monkeypatch.setattr(loop, "eval_loader", _fake_eval_loader)
    data = seg_data.make(n=80)
    config = {"data": {"train": Applied(Subset(data, range(64)), transforms=seg_data.train_transforms()),
                       "eval": Applied(Subset(data, range(64, 80)), transforms=seg_data.eval_transforms())},
              "lr": 0.05, "batch_size": 16, "epochs": 2, "width": 4}
    whole = MemorySession()
    loop.fit_task(config, segmentation.TASK, whole)
    assert [r["epoch"] for r in whole.reports] == [1, 2] and [r["steps"] for r in whole.reports] == [4, 4]
    assert all(0 <= r["miou"] <= 1 and 0 <= r["pixel_accuracy"] <= 1 and math.isfinite(r["loss"])
               for r in whole.reports)
    assert whole.states[-1]["scheduler"]["last_epoch"] == 8
    assert set(whole.reports[0]) == segmentation.REPORTS, "what a sweep's metric is checked against"
    from trainables import REPORTS, audio, cifar

    classify = segmentation.REPORTS - {"miou", "pixel_accuracy"} | {"accuracy"}
    assert REPORTS["cifar_cnn"] == cifar.REPORTS == audio.REPORTS == classify
    resumed = MemorySession(start=whole.states[0])
    loop.fit_task(config, segmentation.TASK, resumed)
    assert [r["epoch"] for r in resumed.reports] == [2]
    assert resumed.states[-1]["scheduler"]["last_epoch"] == 8
    # Two views of each sample: twice the batches, and the schedule still follows the epochs (it ended
    # halfway through, one step per batch, leaving the last epoch at a learning rate of about 0).
    viewed = MemorySession()
    loop.fit_task({**config, "views": 2}, segmentation.TASK, viewed)
    assert [r["steps"] for r in viewed.reports] == [8, 8]
    assert [s["scheduler"]["last_epoch"] for s in viewed.states] == [4, 8]


def test_segmentation_scores_from_the_confusion_matrix():
    scores = segmentation.TASK.scores(3)
    targets = torch.tensor([[[0, 0, 1, 2]]])
    logits = nn.functional.one_hot(torch.tensor([[[0, 1, 1, 1]]]), 3).permute(0, 3, 1, 2).float()
    scores.update(logits, targets)
    result = scores.result()
    assert result["pixel_accuracy"] == pytest.approx(0.5)
    assert result["miou"] == pytest.approx((1 / 2 + 1 / 3 + 0 / 1) / 3)
