"""Data sources: ImageFolder indexing like torchvision's, clear errors, the builtin dataset."""

import os

import numpy as np
import pytest
from PIL import Image
from torchvision.datasets import ImageFolder

from coordinated_prep import DatasetError
from coordinated_prep.pipeline.sources import ImageFolderSource, open_source, shapes
from tests.utils import make_imagefolder


def test_index_and_labels_match_torchvision(tmp_path, caplog):
    root = make_imagefolder(str(tmp_path), classes=4, per_class=7)
    ours = ImageFolderSource(root)
    assert "ignoring 1 file(s) without an image extension" in caplog.text and "notes.txt" in caplog.text
    theirs = ImageFolder(root, is_valid_file=lambda p: p.lower().endswith((".jpg", ".jpeg", ".png")))
    assert ours.classes == tuple(theirs.classes)
    assert [(p, int(l)) for p, l in zip(ours.paths, ours.labels)] == theirs.samples
    assert ours.read(3) == open(theirs.samples[3][0], "rb").read()


def test_errors_name_the_path_and_the_fix(tmp_path):
    with pytest.raises(DatasetError, match="no such directory"):
        ImageFolderSource(str(tmp_path / "missing"))
    with pytest.raises(DatasetError, match="no class subfolders"):
        ImageFolderSource(str(tmp_path))
    (tmp_path / "cats").mkdir()
    (tmp_path / "cats" / "readme.txt").write_text("x")
    with pytest.raises(DatasetError, match="class folder 'cats' holds no images"):
        ImageFolderSource(str(tmp_path))
    with pytest.raises(DatasetError, match="unknown builtin dataset"):
        open_source("builtin:imagenet")


def test_builtin_shapes_are_real_jpegs_of_ten_classes(monkeypatch, tmp_path):
    monkeypatch.setitem(shapes.VARIANTS, "shapes", (shapes.IMAGE_SIZE, shapes.IMAGE_SIZE, 3))
    root = shapes.ensure_shapes(str(tmp_path / "shapes"))
    source = ImageFolderSource(root)
    assert len(source.classes) >= 10 and len(source) == 3 * len(source.classes)
    with Image.open(source.paths[0]) as img:
        assert img.format == "JPEG" and min(img.size) >= 128
    again = shapes.ensure_shapes(str(tmp_path / "shapes"))
    assert again == root and not [p for p in os.listdir(tmp_path) if p.startswith(".generating-")]
    assert np.bincount(source.labels).tolist() == [3] * len(source.classes)


def test_builtin_shapes_large_are_imagenet_sized_jpegs(monkeypatch, tmp_path):
    monkeypatch.setitem(shapes.VARIANTS, "shapes-large", (500, 375, 1))
    source = ImageFolderSource(shapes.ensure_shapes(str(tmp_path / "large"), variant="shapes-large"))
    assert len(source) == len(shapes.CLASSES)
    with Image.open(source.paths[0]) as img:
        assert img.format == "JPEG" and img.size == (500, 375)


def test_builtin_shapes_default_size_is_a_few_thousand_images_of_at_least_128_px():
    width, height, per_class = shapes.VARIANTS["shapes"]
    assert min(width, height) >= 128 and 2000 <= per_class * len(shapes.CLASSES) <= 10000


def test_builtin_photos_are_crops_of_a_photograph_in_two_learnable_classes(monkeypatch, tmp_path):
    from coordinated_prep.pipeline.sources import photos

    assert photos.IMAGES_PER_CLASS * len(photos.CLASSES) >= 4000  # the benchmark's size
    monkeypatch.setattr(photos, "IMAGES_PER_CLASS", 3)
    source = ImageFolderSource(photos.ensure_photos(str(tmp_path / "photos")))
    assert source.classes == ("upright", "upside-down") and np.bincount(source.labels).tolist() == [3, 3]
    with Image.open(source.paths[0]) as img:
        assert img.format == "JPEG" and img.size == (500, 375)
        upright = np.asarray(img, dtype=np.float64)
    assert upright.std() > 20, "a photograph's texture, not a flat fill"
    assert photos.ensure_photos(str(tmp_path / "photos")) == source.root  # generated once
