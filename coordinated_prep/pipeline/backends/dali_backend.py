"""Preprocessing with NVIDIA DALI (``nvidia-dali-cuda120``): CPU operators, or GPU decoding where one exists.

The same declarative spec as the torchvision backend: the crop box and flip of each sample come
from :func:`~coordinated_prep.pipeline.backends.augment.crop_params` (pure in seed, epoch and index), and
DALI decodes only that region (``decoders.image_slice``), resizes it with antialiasing, flips it and
lays it out as uint8 CHW. Outputs equal the torchvision backend's in shape, dtype and alignment;
pixel values differ slightly (another resampler). Pieces are prepared a batch at a time
(:meth:`DaliPreprocessor.train_batch`), which is how DALI pays off.

DALI is imported when a DaliPreprocessor is created, never at package import, and a missing or
broken installation raises a :class:`~coordinated_prep.errors.ConfigError` that says so.
"""

from __future__ import annotations

import atexit
import gc
import io
from typing import Any, Sequence

import numpy as np
from PIL import Image

from coordinated_prep.errors import ConfigError
from coordinated_prep.pipeline.backends.augment import crop_params
from coordinated_prep.pipeline.backends.spec import PipelineSpec


def import_dali() -> tuple[Any, Any, Any]:
    """``(fn, types, pipeline_def)`` from nvidia.dali, or a ConfigError naming the fix."""
    global _collect_at_exit
    try:
        from nvidia.dali import fn, pipeline_def, types
    except Exception as e:  # ImportError, or a broken install failing inside its own imports
        raise ConfigError(
            "pipeline.backend='dali' needs NVIDIA DALI: pip install nvidia-dali-cuda120 "
            f"(importing nvidia.dali failed: {type(e).__name__}: {e}); or use backend: torchvision"
        ) from e
    if not _collect_at_exit:
        # A DALI pipeline sits in reference cycles, so only the garbage collector frees it; left to
        # the interpreter's final teardown, its destructor can crash the process on exit (DALI
        # issue 6166). Collecting at exit, before the teardown, destroys them while all is intact.
        atexit.register(gc.collect)
        _collect_at_exit = True
    return fn, types, pipeline_def


_collect_at_exit = False


class DaliPreprocessor:
    """Decode and augment with DALI pipelines fed from Python (``external_source``).

    Args:
        pipeline: The declarative preprocessing spec.
        max_batch: Most samples per ``train_batch`` call (the pipeline is rebuilt larger if needed).
        threads: DALI worker threads (one: a prep actor owns one core).
    """

    def __init__(self, pipeline: PipelineSpec, max_batch: int = 64, threads: int = 1) -> None:
        self.pipeline = pipeline
        self._fn, self._types, self._pipeline_def = import_dali()
        self._threads = threads
        self._gpu = _cuda_visible()
        self._train: Any = None
        self._train_batch = 0
        self._eval: Any = None
        self._max_batch = max_batch

    # -- the Preprocessor contract -----------------------------------------------------------
    def train(self, data: bytes, seed: int, epoch: int, index: int) -> np.ndarray:
        """Decode and randomly augment one training sample into uint8 (3, size, size)."""
        return self.train_batch([data], seed, epoch, [index])[0]

    def train_views(self, data: bytes, seed: int, epoch: int, index: int, views: int) -> np.ndarray:
        """Augment one sample ``views`` times into uint8 (views, 3, size, size) (DALI decodes each crop window)."""
        return self.train_batch([data] * views, seed, epoch, [index] * views, list(range(views)))

    def eval(self, data: bytes) -> np.ndarray:
        """Decode, resize the shorter side and centre-crop one sample into uint8 (3, size, size)."""
        if self._eval is None:
            self._eval = self._build_eval()
        width, height = _image_size(data)
        (new_h, new_w), (top, left) = eval_geometry(height, width, self.pipeline.eval_resize, self.pipeline.size)
        try:
            self._eval.feed_input("encoded", [np.frombuffer(data, dtype=np.uint8)])
            self._eval.feed_input("resized", [np.array([new_h, new_w], dtype=np.float32)])
            self._eval.feed_input("anchor", [np.array([top, left], dtype=np.int32)])
            return _to_numpy(self._eval.run()[0])[0]
        except Exception:
            self._eval = None
            raise

    def train_batch(self, datas: Sequence[bytes], seed: int, epoch: int, indices: Sequence[int],
                    views: Sequence[int] | None = None) -> np.ndarray:
        """Decode and augment many samples at once into uint8 (n, 3, size, size), aligned with
        ``indices`` (and ``views``: each row's view number, for echoing before augmentation)."""
        p = self.pipeline
        n = len(datas)
        if n == 0:
            return np.empty((0, 3, p.size, p.size), dtype=np.uint8)
        if self._train is None or n > self._train_batch:
            self._train_batch = max(n, self._max_batch)
            self._train = self._build_train(self._train_batch)
        anchors, shapes, flips = [], [], []
        for data, index, view in zip(datas, indices, views if views is not None else [0] * n):
            width, height = _image_size(data)
            box = crop_params(seed, epoch, int(index), height, width, p.scale, p.ratio, p.hflip, int(view))
            anchors.append(np.array([box.top, box.left], dtype=np.int32))
            shapes.append(np.array([box.height, box.width], dtype=np.int32))
            flips.append(np.array(int(box.flip), dtype=np.int32))
        try:
            self._train.feed_input("encoded", [np.frombuffer(d, dtype=np.uint8) for d in datas])
            self._train.feed_input("anchor", anchors)
            self._train.feed_input("shape", shapes)
            self._train.feed_input("flip", flips)
            return _to_numpy(self._train.run()[0])
        except Exception:
            self._train = None  # a pipeline that failed mid-run is not reused
            raise

    # -- pipelines ----------------------------------------------------------------------------
    # The pipeline functions close over locals only, never ``self``: a pipeline that referenced its
    # preprocessor would form a cycle left to the garbage collector, and DALI pipelines destroyed
    # late in interpreter shutdown can crash the process on exit.
    def _build_train(self, batch: int) -> Any:
        fn, types, size = self._fn, self._types, self.pipeline.size
        decoder_device = "mixed" if self._gpu else "cpu"

        @self._pipeline_def(batch_size=batch, num_threads=self._threads, device_id=0 if self._gpu else None,
                            prefetch_queue_depth=1, exec_dynamic=True)
        def train() -> Any:
            encoded = fn.external_source(name="encoded", dtype=types.UINT8, ndim=1)
            anchor = fn.external_source(name="anchor", dtype=types.INT32, ndim=1)
            shape = fn.external_source(name="shape", dtype=types.INT32, ndim=1)
            flip = fn.external_source(name="flip", dtype=types.INT32, ndim=0)
            images = fn.decoders.image_slice(encoded, anchor, shape, device=decoder_device,
                                             output_type=types.RGB, normalized_anchor=False,
                                             normalized_shape=False, axis_names="HW")
            images = fn.resize(images, resize_x=size, resize_y=size, interp_type=types.INTERP_LINEAR,
                               antialias=True)
            images = fn.flip(images, horizontal=flip)
            return fn.transpose(images, perm=[2, 0, 1])

        pipe = train()
        pipe.build()
        return pipe

    def _build_eval(self) -> Any:
        fn, types, p = self._fn, self._types, self.pipeline
        decoder_device = "mixed" if self._gpu else "cpu"

        @self._pipeline_def(batch_size=1, num_threads=self._threads, device_id=0 if self._gpu else None,
                            prefetch_queue_depth=1, exec_dynamic=True)
        def evaluate() -> Any:
            encoded = fn.external_source(name="encoded", dtype=types.UINT8, ndim=1)
            resized = fn.external_source(name="resized", dtype=types.FLOAT, ndim=1)  # (height, width)
            anchor = fn.external_source(name="anchor", dtype=types.INT32, ndim=1)  # (top, left)
            images = fn.decoders.image(encoded, device=decoder_device, output_type=types.RGB)
            images = fn.resize(images, size=resized, interp_type=types.INTERP_LINEAR, antialias=True)
            images = fn.slice(images, anchor, np.array([p.size, p.size], dtype=np.int32), normalized_anchor=False,
                              normalized_shape=False, axis_names="HW", out_of_bounds_policy="pad")
            return fn.transpose(images, perm=[2, 0, 1])

        pipe = evaluate()
        pipe.build()
        return pipe


def eval_geometry(height: int, width: int, shorter: int, size: int) -> tuple[tuple[int, int], tuple[int, int]]:
    """((resized height, width), (top, left)) of torchvision's resize-shorter-side then centre crop."""
    if height <= width:
        new_h, new_w = shorter, int(shorter * width / height)
    else:
        new_h, new_w = int(shorter * height / width), shorter
    return (new_h, new_w), (int(round((new_h - size) / 2.0)), int(round((new_w - size) / 2.0)))


def _image_size(data: bytes) -> tuple[int, int]:
    """(width, height) from the image header, without decoding the pixels."""
    with Image.open(io.BytesIO(data)) as image:
        return image.size


def _to_numpy(tensors: Any) -> np.ndarray:
    if hasattr(tensors, "as_cpu"):  # GPU output
        tensors = tensors.as_cpu()
    return np.ascontiguousarray(tensors.as_array())


def _cuda_visible() -> bool:
    """Whether this process may use a GPU (Ray hides GPUs from actors that did not ask for one)."""
    try:
        import torch

        return torch.cuda.is_available()
    except Exception:
        return False
