"""Datasets a spec can name: a built-in or a directory (a string), any map-style dataset object, or
a factory (an import path and arguments) that builds one in each process.

A data group is keyed by its spec, so every dataset and transform needs a key that is equal for
equal objects: a string is its own key, a :class:`Factory` its import path and arguments, and any
other object the SHA-256 of its pickle (Ray's ``cloudpickle``, as Ray ships it), computed once where the
spec is made and carried with it. An object that cannot be pickled cannot reach a prep actor
either, and is refused with the fix.
"""

from __future__ import annotations

import functools
import hashlib
import importlib
import json
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

import numpy as np

from coordinated_prep.contracts import read_many
from coordinated_prep.errors import ConfigError


@dataclass(frozen=True)
class Factory:
    """``factory(**args)``, built once in each process that uses it: a dataset or a transform named by
    its import path, as YAML can name it (``{factory: "pkg.mod:make", args: {n: 100}}``).

    Use it in Python too for a large in-memory dataset: only the name and the arguments travel with
    the spec (to every trial and prep actor), not the data.

    Args:
        factory: ``"package.module:callable"`` (a dotted attribute path after the colon works too),
            importable in every Ray worker (installed, or on the workers' ``PYTHONPATH``).
        args: Keyword arguments, JSON-like (numbers, strings, lists, mappings).
    """

    factory: str
    args: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not isinstance(self.factory, str) or self.factory.count(":") != 1:
            raise ConfigError(f"factory={self.factory!r} must be an import path 'package.module:callable'")
        if not isinstance(self.args, Mapping):
            raise ConfigError(f"factory {self.factory!r}: args={self.args!r} must be a mapping of keyword arguments")
        try:
            json.dumps(dict(self.args), sort_keys=True)
        except TypeError as e:
            raise ConfigError(f"factory {self.factory!r}: args must be JSON-like (numbers, strings, lists, "
                              f"mappings): {e}") from None
        object.__setattr__(self, "args", dict(self.args))
        resolve_path(self.factory)  # an import path that does not import fails here, where it was written

    def __hash__(self) -> int:
        return hash(self.key)

    @property
    def key(self) -> str:
        """Equal for equal import paths and arguments, in any process."""
        return "factory:" + json.dumps([self.factory, self.args], sort_keys=True)

    def build(self) -> Any:
        """The object, built once per process."""
        return _built(self.key)

    @classmethod
    def from_mapping(cls, values: Mapping[str, Any], where: str) -> "Factory":
        """From ``{factory: ..., args: {...}}``, rejecting other keys by name."""
        unknown = sorted(set(values) - {"factory", "args"})
        if unknown or "factory" not in values:
            raise ConfigError(f"{where}: a factory mapping has the keys 'factory' (\"package.module:callable\") and "
                              f"'args' (optional); got {sorted(values)}")
        try:
            return cls(values["factory"], values.get("args") or {})
        except ConfigError as e:
            raise ConfigError(f"{where}: {e}") from None


@functools.lru_cache(maxsize=32)
def _built(key: str) -> Any:
    path, args = json.loads(key.removeprefix("factory:"))
    target = resolve_path(path)
    try:
        return target(**args)
    except Exception as e:
        raise ConfigError(f"factory {path!r} with args {args} raised {type(e).__name__}: {e}") from e


def resolve_path(path: str) -> Any:
    """The object an import path ``"package.module:attr.attr"`` names.

    Raises:
        ConfigError: The module does not import or has no such attribute, naming both and the fix.
    """
    module_name, _, attrs = path.partition(":")
    try:
        target: Any = importlib.import_module(module_name)
    except Exception as e:  # ImportError, or the module's own error while importing
        raise ConfigError(
            f"factory {path!r}: module {module_name!r} does not import ({type(e).__name__}: {e}); the path must be "
            "'package.module:callable', importable in every Ray worker (install the package, or put its directory "
            "on PYTHONPATH)") from None
    for attr in attrs.split("."):
        if not hasattr(target, attr):
            raise ConfigError(f"factory {path!r}: {module_name!r} has no attribute {attrs!r}; check the name after "
                              "the colon")
        target = getattr(target, attr)
    if not callable(target):
        raise ConfigError(f"factory {path!r} names a {type(target).__name__}, not a callable")
    return target


def build(value: Any) -> Any:
    """``value``, or the object a :class:`Factory` builds."""
    return value.build() if isinstance(value, Factory) else value


def object_key(value: Any, where: str) -> str | None:
    """The group key part of a dataset or transform (see the module's docstring); None for None.

    Raises:
        ConfigError: ``value`` cannot be pickled, naming it and the fix.
    """
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, Factory):
        return value.key
    from coordinated_prep.pipeline.streamed import StreamedShards

    if isinstance(value, StreamedShards):  # its key, taken once: a source's pickle may change on a round trip
        return f"StreamedShards:{value.key}"
    try:
        blob = _pickled(value)
    except Exception as e:
        raise ConfigError(
            f"{where}={_short(value)} cannot be pickled ({type(e).__name__}: {e}), so it can neither be keyed nor "
            "sent to the prep actors; open files, locks and generators inside it must be created lazily (in "
            "__getitem__), or name it by import path: Factory('pkg.mod:make', args)") from None
    return f"{type(value).__qualname__}:{hashlib.sha256(blob).hexdigest()[:16]}"


def _pickled(value: Any) -> bytes:
    """``value`` pickled as Ray's cloudpickle pickles it, refusing an open file anywhere inside it.

    cloudpickle pickles a file open for reading by reading its contents, so a dataset holding one
    would reach every prep actor as a copy of the file's bytes at that moment, not as a file."""
    import io

    from ray import cloudpickle  # as Ray ships it

    class _Refusing(cloudpickle.CloudPickler):
        def reducer_override(self, obj: Any) -> Any:
            if isinstance(obj, io.IOBase):
                raise TypeError(f"it holds an open file ({getattr(obj, 'name', type(obj).__name__)!r})")
            return super().reducer_override(obj)

    out = io.BytesIO()
    _Refusing(out, protocol=cloudpickle.DEFAULT_PROTOCOL).dump(value)
    return out.getvalue()


def check_map_style(dataset: Any, where: str) -> None:
    """Refuse a dataset that is not map-style, naming what it lacks.

    Raises:
        ConfigError: No ``__len__`` or ``__getitem__`` (an iterable-style dataset, say).
    """
    from coordinated_prep.pipeline.streamed import is_map_style

    missing = [m for m in ("__len__", "__getitem__") if not hasattr(type(dataset), m)]
    if not is_map_style(dataset) and not missing:
        missing = ["random access (it is a torch IterableDataset)"]
    if missing:
        raise ConfigError(f"{where}={_short(dataset)} has no {' or '.join(missing)}: a map-style dataset (random "
                          "access by index) is needed, as every sample's place in the epoch is planned ahead; "
                          + _map_style_hint(dataset))


def _map_style_hint(dataset: Any) -> str:
    """How to give the data of an iterable-style ``dataset`` as a map-style one, by where it comes from."""
    module = type(dataset).__module__ or ""
    if module.startswith("webdataset"):
        return ("give the shards themselves as the dataset: dataset='/data/train-{000000..000063}.tar' (a pattern, a "
                ".tar file or a folder of them) reads WebDataset shards by index")
    if module.startswith("datasets"):
        return ("give one split (dataset['train']): a Hugging Face Dataset, or an IterableDataset streamed by shard, "
                "works as it is")
    return ("give the data as a map-style dataset (a torch Dataset with __len__ and __getitem__), WebDataset tar "
            "shards or Parquet by path, or arrays in coordinated_prep.pipeline.ArrayDataset; or keep it iterable and "
            "give it n_shards and shard(num_shards, index), the same samples of one shard on every call "
            "(coordinated_prep.pipeline.streamed)")


class ArrayDataset:
    """Samples from arrays in memory, aligned by their first axis: sample ``i`` is
    ``(arrays[0][i], arrays[1][i], ...)`` (one array: ``arrays[0][i]`` alone), like
    ``torch.utils.data.TensorDataset`` for NumPy arrays and tensors alike.

    Raises:
        ConfigError: No arrays, or arrays of different lengths.
    """

    def __init__(self, *arrays: Sequence[Any]) -> None:
        if not arrays:
            raise ConfigError("ArrayDataset() needs at least one array")
        lengths = {len(a) for a in arrays}
        if len(lengths) != 1:
            raise ConfigError(f"ArrayDataset: the arrays' lengths differ ({[len(a) for a in arrays]}); they must be "
                              "aligned by their first axis")
        self.arrays = arrays

    def __len__(self) -> int:
        return len(self.arrays[0])

    def __getitem__(self, index: int) -> Any:
        items = tuple(_item(a[index]) for a in self.arrays)
        return items if len(items) > 1 else items[0]


def _item(value: Any) -> Any:
    """A NumPy scalar as a Python number (as ``default_collate`` would see a label); arrays as they are."""
    return value.item() if isinstance(value, np.generic) else value


class EncodedImages:
    """A built-in or directory dataset (ImageFolder, Parquet records) as a map-style dataset of
    ``(tv_tensors.Image uint8 (3, H, W), int label)``, keeping the read/decode split: prep actors read
    encoded bytes in one call per piece (through the node cache if there is one) and decode later.

    Args:
        source: The opened source (:func:`coordinated_prep.pipeline.sources.open_source`), or its
            cached wrapper.
    """

    def __init__(self, source: Any) -> None:
        self.source = source

    def __len__(self) -> int:
        return len(self.source)

    def __getitem__(self, index: int) -> tuple[Any, int]:
        return self.decode(self.source.read(index), index)

    def read_many(self, indices: Sequence[int]) -> list[Any]:
        """Per index, its encoded bytes or the SampleError reading it raised."""
        return read_many(self.source, indices)

    def decode(self, data: Any, index: int) -> tuple[Any, int]:
        """``(image, label)`` of encoded ``data`` (any format torchvision decodes: JPEG, PNG, ...)."""
        import torch
        from torchvision import tv_tensors
        from torchvision.io import ImageReadMode, decode_image

        raw = torch.from_numpy(np.frombuffer(data, dtype=np.uint8).copy())  # a few kB; the source's bytes stay read-only
        image = decode_image(raw, mode=ImageReadMode.RGB)
        return tv_tensors.Image(image), int(self.source.labels[index])

    def describe(self, index: int) -> str:
        """Where sample ``index`` lives."""
        return self.source.describe(index)


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."
