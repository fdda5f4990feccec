"""Preprocessing: output layout, determinism per (seed, epoch, sample), crop parameters in bounds."""

import io

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from PIL import Image

from coordinated_prep import PipelineSpec, SampleError
from coordinated_prep.pipeline.backends import make_preprocessor
from coordinated_prep.pipeline.backends.augment import crop_params
from tests.utils import image_chunk
from coordinated_prep.pipeline.sources import ImageFolderSource
from tests.utils import make_imagefolder


def _jpeg(w=90, h=60, seed=0) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8)).save(buf, "JPEG")
    return buf.getvalue()


def test_train_and_eval_give_uint8_chw_of_the_pipeline_size():
    prep = make_preprocessor(PipelineSpec(size=32))
    out = prep.train(_jpeg(), seed=0, epoch=0, index=5)
    assert out.dtype == np.uint8 and out.shape == (3, 32, 32)
    assert prep.eval(_jpeg()).shape == (3, 32, 32)


def test_augmentation_is_a_pure_function_of_seed_epoch_and_index():
    prep = make_preprocessor(PipelineSpec(size=32))
    data = _jpeg()
    a = prep.train(data, 1, 2, 3)
    assert np.array_equal(a, make_preprocessor(PipelineSpec(size=32)).train(data, 1, 2, 3))
    assert not np.array_equal(a, prep.train(data, 1, 3, 3))
    assert not np.array_equal(a, prep.train(data, 2, 2, 3))


@settings(max_examples=200, deadline=None)
@given(seed=st.integers(0, 2**31), epoch=st.integers(0, 100), index=st.integers(0, 10**6),
       h=st.integers(1, 600), w=st.integers(1, 600))
def test_crop_boxes_stay_inside_the_image(seed, epoch, index, h, w):
    p = crop_params(seed, epoch, index, h, w, (0.08, 1.0), (3 / 4, 4 / 3), 0.5)
    assert 0 <= p.top and p.top + p.height <= h and 0 <= p.left and p.left + p.width <= w
    assert p.height > 0 and p.width > 0


def test_a_corrupt_file_names_its_index_and_path(tmp_path):
    root = make_imagefolder(str(tmp_path), classes=1, per_class=3, png_every=99)
    source = ImageFolderSource(root)
    with open(source.paths[1], "r+b") as f:
        f.truncate(40)
    with pytest.raises(SampleError, match=r"sample 1 \(.*img_001.jpg\): cannot decode"):
        image_chunk(source, make_preprocessor(PipelineSpec(size=16)), 0, 0, np.array([0, 1]), 16)


def test_skip_policy_leaves_the_broken_sample_out_and_reports_it(tmp_path):
    root = make_imagefolder(str(tmp_path), classes=1, per_class=3, png_every=99)
    source = ImageFolderSource(root)
    with open(source.paths[1], "r+b") as f:
        f.truncate(40)
    prep = make_preprocessor(PipelineSpec(size=16))
    chunk, timing = image_chunk(source, prep, 0, 0, np.array([0, 1, 2]), 16, on_error="skip")
    assert chunk.indices.tolist() == [0, 2] and chunk.images.shape[0] == 2 and chunk.labels.shape == (2,)
    [(index, path, reason)] = timing.skipped
    assert index == 1 and path == source.paths[1] and "cannot decode" in reason
    full, _ = image_chunk(source, prep, 0, 0, np.array([0, 2]), 16)
    assert np.array_equal(full.images, chunk.images), "skipping one sample does not change the others"


def test_a_file_that_disappears_after_the_scan_is_a_sample_error_or_skipped(tmp_path):
    import os

    root = make_imagefolder(str(tmp_path), classes=1, per_class=3, png_every=99)
    source = ImageFolderSource(root)
    os.remove(source.paths[2])
    prep = make_preprocessor(PipelineSpec(size=16))
    with pytest.raises(SampleError, match=r"sample 2 \(.*img_002.jpg\): cannot read the file"):
        image_chunk(source, prep, 0, 0, np.array([0, 2]), 16)
    chunk, timing = image_chunk(source, prep, 0, 0, np.array([0, 2]), 16, on_error="skip")
    assert chunk.indices.tolist() == [0] and timing.skipped[0][0] == 2
