"""The DALI backend against the torchvision backend on the same inputs (DALI's CPU operators)."""

from __future__ import annotations

import sys

import numpy as np
import pytest

from coordinated_prep import PipelineSpec
from coordinated_prep.pipeline.backends import make_preprocessor
from tests.utils import image_chunk
from coordinated_prep.errors import ConfigError
from coordinated_prep.pipeline.sources import ImageFolderSource
from tests.utils import make_imagefolder

SPEC = dict(size=32, scale=(0.2, 1.0), hflip=0.5)


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> ImageFolderSource:
    """Small JPEGs and PNGs in two classes."""
    return ImageFolderSource(make_imagefolder(str(tmp_path_factory.mktemp("dali")), classes=2, per_class=12))


def test_same_layout_dtype_and_nearly_the_same_pixels_as_torchvision(source):
    tv = make_preprocessor(PipelineSpec(**SPEC))
    dali = make_preprocessor(PipelineSpec(**SPEC, backend="dali"))
    for i in range(len(source)):
        data = source.read(i)
        a, b = tv.train(data, 3, 1, i), dali.train(data, 3, 1, i)
        assert a.shape == b.shape == (3, 32, 32) and a.dtype == b.dtype == np.uint8
        # The same crop box and flip; only the resampler differs, by well under one grey level on average.
        assert np.abs(a.astype(int) - b.astype(int)).mean() < 2.0, (i, source.describe(i))
        e, f = tv.eval(data), dali.eval(data)
        assert e.shape == f.shape == (3, 32, 32) and np.abs(e.astype(int) - f.astype(int)).mean() < 2.0


def test_deterministic_per_seed_epoch_and_sample_and_batches_align(source):
    dali = make_preprocessor(PipelineSpec(**SPEC, backend="dali"))
    datas = [source.read(i) for i in range(len(source))]
    ids = list(range(len(source)))
    batch = dali.train_batch(datas, 5, 2, ids)
    again = make_preprocessor(PipelineSpec(**SPEC, backend="dali")).train_batch(datas, 5, 2, ids)
    assert batch.shape == (len(ids), 3, 32, 32) and np.array_equal(batch, again)
    for k in (0, 7, len(ids) - 1):  # row k is sample ids[k], whether prepared alone or in a batch
        assert np.array_equal(batch[k], dali.train(datas[k], 5, 2, ids[k]))
    assert not np.array_equal(batch, dali.train_batch(datas, 5, 3, ids)), "another epoch, other crops"


def test_prepared_chunks_align_labels_and_indices_with_torchvision(source):
    ids = np.array([5, 0, 17, 3, 11])
    a, _ = image_chunk(source, make_preprocessor(PipelineSpec(**SPEC)), 1, 0, ids, 32)
    b, timing = image_chunk(source, make_preprocessor(PipelineSpec(**SPEC, backend="dali")), 1, 0, ids, 32)
    assert np.array_equal(a.indices, b.indices) and np.array_equal(a.labels, b.labels)
    assert np.array_equal(b.labels, source.labels[ids]) and b.images.shape == a.images.shape
    assert np.abs(a.images.astype(int) - b.images.astype(int)).mean() < 2.0
    assert timing.fetch_s > 0 and timing.transform_s > 0


def test_a_corrupt_sample_in_a_dali_batch_is_found_and_skipped(tmp_path):
    source = ImageFolderSource(make_imagefolder(str(tmp_path), classes=1, per_class=6, png_every=99))
    with open(source.paths[2], "r+b") as f:
        f.truncate(50)
    dali = make_preprocessor(PipelineSpec(size=16, backend="dali"))
    chunk, timing = image_chunk(source, dali, 0, 0, np.arange(6), 16, on_error="skip")
    assert chunk.indices.tolist() == [0, 1, 3, 4, 5] and chunk.images.shape == (5, 3, 16, 16)
    assert [s[0] for s in timing.skipped] == [2] and "img_002" in timing.skipped[0][1]


def test_a_missing_dali_is_a_clear_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "nvidia.dali", None)  # makes `import nvidia.dali` raise ImportError
    with pytest.raises(ConfigError, match=r"pip install nvidia-dali-cuda120.*backend: torchvision"):
        make_preprocessor(PipelineSpec(size=16, backend="dali"))


def test_views_before_augmentation_match_torchvisions_draws(source):
    dali = make_preprocessor(PipelineSpec(**SPEC, backend="dali"))
    tv = make_preprocessor(PipelineSpec(**SPEC))
    ids = np.array([3, 8, 1])
    a, _ = image_chunk(source, dali, 2, 1, ids, 32, views=2)
    b, _ = image_chunk(source, tv, 2, 1, ids, 32, views=2)
    plain, _ = image_chunk(source, dali, 2, 1, ids, 32)
    assert a.images.shape == (6, 3, 32, 32) and np.array_equal(a.indices, np.tile(ids, 2))
    assert np.array_equal(a.images[:3], plain.images), "view 0 is the draw without views"
    # The same crop box per view as torchvision's: only the resampler differs.
    assert np.abs(a.images.astype(int) - b.images.astype(int)).mean() < 2.0
    assert not np.array_equal(a.images[:3], a.images[3:]), "view 1 is another draw"
    view = dali.train_views(source.read(8), 2, 1, 8, 2)
    assert np.array_equal(view, a.images[[1, 4]])
