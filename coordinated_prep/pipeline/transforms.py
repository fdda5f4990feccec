"""A data group's pipeline: its dataset and transforms, as the prep actors and a private stream run it.

Every spec becomes one :class:`Pipeline`, the one path on which pieces are prepared:

- :class:`UserPipeline`: any map-style dataset with torchvision's ``transform``,
  ``target_transform`` and ``transforms`` (wrapped into one joint callable, as ``VisionDataset``
  does). Each call runs with the global generators seeded from (seed, epoch, sample, view)
  (:mod:`coordinated_prep.pipeline.seeding`). A built-in or directory dataset with transforms of
  the user's is one too: its :class:`~coordinated_prep.pipeline.datasets.EncodedImages` reads
  encoded bytes per piece and decodes them before the transforms.
- :class:`ImagePipeline`: a built-in or directory dataset with the built-in transform of a
  :class:`~coordinated_prep.spec.PipelineSpec` (random resized crop and flip, torchvision or DALI),
  whose draws are keyed by (seed, epoch, sample, view) itself. Its samples are
  ``(uint8 (3, size, size), int label)``.

A pipeline's stages: ``fetch`` (read: encoded bytes, or ``dataset[i]``), then ``train`` or ``eval``
(decode and transform), so that sources of encoded bytes keep the read/decode split the node cache
and record files need.
"""

from __future__ import annotations

from typing import Any, Callable, Protocol, Sequence

import numpy as np

from coordinated_prep.errors import ConfigError, SampleError
from coordinated_prep.pipeline.datasets import EncodedImages, Factory, build
from coordinated_prep.pipeline.seeding import _FETCH, key_seed, preserved, reseed
from coordinated_prep.pipeline.split import pack, prefix_key, split_transform, unpack
from coordinated_prep.pipeline.streamed import as_streamed


class Pipeline(Protocol):
    """What prepares samples: read them (``fetch``), then decode and transform them."""

    def __len__(self) -> int: ...

    def fetch(self, indices: Sequence[int], seed: int, epoch: int) -> list[Any]:
        """Per index, in order, what ``train``/``eval`` take, or the SampleError reading it raised."""
        ...

    def train(self, raw: Any, seed: int, epoch: int, index: int, views: int) -> list[Any]:
        """``views`` training samples of one fetched sample (view ``v`` drawn from seed, epoch, index, v)."""
        ...

    def eval(self, raw: Any, seed: int, index: int) -> Any:
        """The evaluation sample of one fetched sample."""
        ...

    def describe(self, index: int) -> str:
        """Where sample ``index`` lives, for errors."""
        ...


# A pipeline that splits (:mod:`coordinated_prep.pipeline.split`) also has ``prefix_key`` (str; None
# where it does not split), ``prefix(raw, index) -> packed`` (the deterministic start: decode and
# the leading deterministic transforms) and ``tail(packed, seed, epoch, index, views) -> samples``,
# and its ``train`` is exactly ``tail(prefix(raw))``, so a kept prefix output gives the same bytes.


class ImagePipeline:
    """The built-in image pipeline: encoded images, decoded and cropped by a ``PipelineSpec``'s backend.

    Its prefix is the decode (torchvision backend; the DALI backend decodes each crop's window and
    does not split), the same as a ``transform`` of the user's on the same dataset starts with.

    Args:
        source: The opened source (or its node-cache wrapper).
        preprocessor: The backend (:func:`coordinated_prep.pipeline.backends.make_preprocessor`).
        size: The side of its square crops.
        dataset: The dataset's name (``DataSpec.dataset``): the prefix's identity.
    """

    def __init__(self, source: Any, preprocessor: Any, size: int, dataset: str = "") -> None:
        self.source = source
        self.preprocessor = preprocessor
        self.size = size
        self.train_batch = self._train_batch if hasattr(preprocessor, "train_batch") else None
        splits = hasattr(preprocessor, "augment") and self.train_batch is None
        self.prefix_key = prefix_key(dataset, []) if splits else None

    def __len__(self) -> int:
        return len(self.source)

    def fetch(self, indices: Sequence[int], seed: int, epoch: int) -> list[Any]:
        return EncodedImages(self.source).read_many(indices)

    def train(self, raw: Any, seed: int, epoch: int, index: int, views: int) -> list[Any]:
        if self.prefix_key is not None:
            return self.tail(self.prefix(raw, index), seed, epoch, index, views)
        label = int(self.source.labels[index])
        if views == 1:
            return [(self.preprocessor.train(raw, seed, epoch, index), label)]
        return [(image, label) for image in self.preprocessor.train_views(raw, seed, epoch, index, views)]

    def prefix(self, raw: Any, index: int) -> tuple[np.ndarray, str]:
        """The decoded image, packed in the decoder's memory layout (as a user transform's prefix is)."""
        from torchvision import tv_tensors

        return pack(tv_tensors.Image(self.preprocessor.decode(raw)), f"the decode of sample {index}")

    def tail(self, packed: tuple[np.ndarray, str], seed: int, epoch: int, index: int, views: int) -> list[Any]:
        """The crop and flip of each view, from a decoded image (copied: a kept one is read-only)."""
        import torch

        images = self.preprocessor.augment(unpack(packed).as_subclass(torch.Tensor), seed, epoch, index, views)
        label = int(self.source.labels[index])
        return [(images[v], label) for v in range(views)]

    def _train_batch(self, raws: Sequence[Any], seed: int, epoch: int, indices: Sequence[int],
                     views: Sequence[int]) -> list[Any]:
        """Many samples in one call (DALI), aligned with ``indices`` and ``views``."""
        images = self.preprocessor.train_batch(raws, seed, epoch, indices, None if not any(views) else views)
        return [(images[k], int(self.source.labels[i])) for k, i in enumerate(indices)]

    def eval(self, raw: Any, seed: int, index: int) -> Any:
        return self.preprocessor.eval(raw), int(self.source.labels[index])

    def describe(self, index: int) -> str:
        return self.source.describe(index)


class UserPipeline:
    """Any map-style dataset, with torchvision-style transforms seeded per (seed, epoch, sample, view).

    ``dataset[i]`` (or, for encoded images, reading and decoding) runs seeded by (seed, epoch, i), so
    a dataset with random transforms of its own is reproducible too; each view's transforms run
    seeded by (seed, epoch, i, view). Views share what ``dataset[i]`` returned and must not change it
    in place.

    Encoded images split (:mod:`coordinated_prep.pipeline.split`): the prefix decodes and runs
    ``steps``, the tail runs ``train`` on ``(image, label)``.

    Args:
        dataset: A map-style dataset (or a Factory of one), or an EncodedImages.
        train: The joint training transform ``sample -> sample``, or None (for encoded images: the tail).
        eval: The joint evaluation transform, or None.
        name: The dataset's name for errors.
        steps: For encoded images: the prefix's transforms of the image, after decoding.
        key: For encoded images: the prefix's identity (:func:`~coordinated_prep.pipeline.split.prefix_key`).
    """

    train_batch = None

    def __init__(self, dataset: Any, train: Callable[[Any], Any] | None, eval: Callable[[Any], Any] | None,
                 name: str, steps: Sequence[Any] = (), key: str | None = None) -> None:
        self.dataset = dataset
        self._train = train
        self._eval = eval
        self.name = name
        self._encoded = isinstance(dataset, EncodedImages)
        self.steps = list(steps)
        self.prefix_key = key if self._encoded else None

    def __len__(self) -> int:
        return len(self.dataset)

    def fetch(self, indices: Sequence[int], seed: int, epoch: int) -> list[Any]:
        if self._encoded:
            return self.dataset.read_many(indices)
        out: list[Any] = []
        with preserved():
            for index in indices:
                reseed(key_seed(seed, epoch, index, 0, _FETCH))
                try:
                    out.append(self.dataset[index])
                except Exception as e:  # the user's __getitem__: on_error decides
                    out.append(SampleError(index, self.describe(index),
                                           f"dataset[{index}] raised {type(e).__name__}: {e}"))
        return out

    def train(self, raw: Any, seed: int, epoch: int, index: int, views: int) -> list[Any]:
        if self._encoded:
            return self.tail(self.prefix(raw, index), seed, epoch, index, views)
        return self._views(raw, seed, epoch, index, views)

    def prefix(self, raw: Any, index: int) -> tuple[np.ndarray, str]:
        """Decode and run the prefix's steps: the same output whatever the seed or epoch."""
        image, _ = self.dataset.decode(raw, index)
        for step in self.steps:
            image = step(image)
        return pack(image, f"data.transform (sample {index}, {self.describe(index)})")

    def tail(self, packed: tuple[np.ndarray, str], seed: int, epoch: int, index: int, views: int) -> list[Any]:
        """The rest of the training transform on ``(image, label)``, per view seeded by (seed, epoch, index, view)."""
        return self._views((unpack(packed), int(self.dataset.source.labels[index])), seed, epoch, index, views)

    def _views(self, sample: Any, seed: int, epoch: int, index: int, views: int) -> list[Any]:
        """The training transform of ``sample`` once per view, seeded by (seed, epoch, index, view)."""
        with preserved():
            out = []
            for view in range(views):
                reseed(key_seed(seed, epoch, index, view))
                out.append(self._train(sample) if self._train is not None else sample)
            return out

    def eval(self, raw: Any, seed: int, index: int) -> Any:
        with preserved():
            reseed(key_seed(seed, -1, index))
            if self._encoded:
                raw = self.dataset.decode(raw, index)
            return self._eval(raw) if self._eval is not None else raw

    def describe(self, index: int) -> str:
        if hasattr(self.dataset, "describe"):
            return self.dataset.describe(index)
        return f"{self.name}[{index}]"


class Joint:
    """torchvision's ``StandardTransform``: ``transform`` on the input and ``target_transform`` on the
    target of an ``(input, target)`` sample, or ``transforms`` on both together; ``transform`` alone
    takes the whole sample when it is not a pair (a dict, a bare tensor).

    Raises:
        StructureError: (when called) ``target_transform`` or ``transforms`` given for a sample
            that is not an ``(input, target)`` pair.
    """

    def __init__(self, transform: Any = None, target_transform: Any = None, transforms: Any = None,
                 where: str = "data") -> None:
        self.transform, self.target_transform, self.transforms = transform, target_transform, transforms
        self.where = where

    def __call__(self, sample: Any) -> Any:
        pair = isinstance(sample, (tuple, list)) and len(sample) == 2
        if not pair:
            if self.target_transform is not None or self.transforms is not None:
                from coordinated_prep.errors import StructureError

                raise StructureError(
                    f"{self.where}: the dataset's samples are a {type(sample).__name__}, not an (input, target) pair, "
                    "so target_transform and transforms do not apply; pass one transform= that takes the whole sample")
            return self.transform(sample) if self.transform is not None else sample
        inputs, target = sample
        if self.transforms is not None:
            inputs, target = self.transforms(inputs, target)
        if self.transform is not None:
            inputs = self.transform(inputs)
        if self.target_transform is not None:
            target = self.target_transform(target)
        if hasattr(sample, "_fields"):  # a namedtuple pair stays one (its collate_fn reads .x and .y)
            return type(sample)(inputs, target)
        return (inputs, target) if isinstance(sample, tuple) else [inputs, target]


def shard_sizes(pipeline: Pipeline) -> tuple[int, ...] | None:
    """Samples per shard where the pipeline's source reads its shards as the epochs need them (tar
    shards named by a shard index: the stream plan then follows the shards); None otherwise."""
    source = getattr(pipeline, "source", None) or getattr(getattr(pipeline, "dataset", None), "source", None)
    return getattr(source, "shard_sizes", None)


def make_pipeline(spec: Any, source: Any = None) -> Pipeline:
    """The pipeline of a DataSpec, built in this process.

    Args:
        spec: The group's :class:`~coordinated_prep.spec.DataSpec`.
        source: For a built-in or directory dataset, its opened source (a node-cache wrapper, say);
            None: opened here.
    """
    from coordinated_prep.pipeline.backends import make_preprocessor
    from coordinated_prep.pipeline.sources import open_source

    steps: list[Any] = []
    key = None
    transform = build(spec.transform)
    if isinstance(spec.dataset, str):
        source = source if source is not None else open_source(spec.dataset)
        if not spec.user_transforms:
            return ImagePipeline(source, make_preprocessor(spec.pipeline), spec.pipeline.size, spec.dataset)
        dataset: Any = EncodedImages(source)
        if spec.transforms is None:  # joint transforms: the decode is their prefix
            steps, transform = split_transform(transform)
        key = prefix_key(spec.dataset, steps)
    else:
        dataset = build(spec.dataset)
        if isinstance(spec.dataset, Factory):  # a factory of an iterable dataset read by shard
            dataset = as_streamed(dataset, key=spec.dataset.key, name=spec.dataset_name) or dataset
    train = Joint(transform, build(spec.target_transform), build(spec.transforms), "data")
    evaluate = Joint(build(spec.eval_transform), build(spec.target_transform), build(spec.eval_transforms), "data")
    if len(dataset) == 0:
        raise ConfigError(f"data.dataset={spec.dataset_name}: the dataset is empty")
    return UserPipeline(dataset, train, evaluate, spec.dataset_name, steps, key)
