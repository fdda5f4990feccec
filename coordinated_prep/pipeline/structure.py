"""The structure of a sample, and how samples of one structure are stacked and collated.

A sample is any nesting of tuples, lists, named tuples and dicts whose leaves are arrays, tensors
(``tv_tensors`` included), numbers or strings, of any dtype. :func:`flatten` splits it into its leaves
and a :data:`TreeDef`; :class:`Layout` says, per leaf, how a piece stores it:

- ``dense``: one shape for every sample: stacked, so that a batch inside one piece is a view;
- ``ragged``: a shape that varies (boxes, token sequences, waveforms of any length): each sample's
  array kept whole, and a batch holds a per-sample list of tensors (what a detection ``collate_fn``
  gives, where ``default_collate`` would raise);
- ``object``: strings: a per-sample list, as ``default_collate`` gives.

:func:`collate` rebuilds the structure the way ``torch.utils.data.default_collate`` does: a tuple
becomes a list, a named tuple stays one, a dict keeps its keys, numbers become tensors (``int`` ->
int64, ``float`` -> float64, ``bool`` -> bool).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Literal, Mapping, NamedTuple, Sequence

import numpy as np

from coordinated_prep.errors import StructureError

#: A sample's nesting: ``("leaf",)``, ``("tuple", children)``, ``("list", children)``,
#: ``("namedtuple", type, children)`` or ``("dict", type, keys, children)``.
TreeDef = tuple
LEAF: TreeDef = ("leaf",)
Kind = Literal["dense", "ragged", "object"]


def flatten(sample: Any) -> tuple[list[Any], TreeDef]:
    """The leaves of ``sample`` in order, and its nesting."""
    leaves: list[Any] = []
    return leaves, _flatten(sample, leaves)


def _flatten(node: Any, leaves: list[Any]) -> TreeDef:
    if isinstance(node, tuple) and hasattr(node, "_fields"):
        return ("namedtuple", type(node), tuple(_flatten(c, leaves) for c in node))
    if isinstance(node, tuple):
        return ("tuple", tuple(_flatten(c, leaves) for c in node))
    if isinstance(node, list):
        return ("list", tuple(_flatten(c, leaves) for c in node))
    if isinstance(node, dict):
        keys = tuple(node)
        return ("dict", type(node), keys, tuple(_flatten(node[k], leaves) for k in keys))
    leaves.append(node)
    return LEAF


def paths(tree: TreeDef, prefix: str = "") -> list[str]:
    """Dotted names of the leaves of ``tree`` in order: ``"0"``, ``"1.boxes"``; ``""`` for a bare leaf."""
    if tree[0] == "leaf":
        return [prefix]
    names: Sequence[Any] = tree[2] if tree[0] == "dict" else range(len(tree[-1]))
    out: list[str] = []
    for name, child in zip(names, tree[-1]):
        out += paths(child, f"{prefix}.{name}" if prefix else str(name))
    return out


def collate(tree: TreeDef, leaves: Sequence[Any]) -> Any:
    """The batch ``default_collate`` builds, given each leaf already collated, in order."""
    return _build(tree, iter(leaves), as_collated=True)


def unflatten(tree: TreeDef, leaves: Sequence[Any]) -> Any:
    """The sample of ``tree`` with ``leaves`` in order: :func:`flatten`'s inverse (a tuple stays a tuple)."""
    return _build(tree, iter(leaves), as_collated=False)


def _build(tree: TreeDef, it: Any, as_collated: bool) -> Any:
    kind = tree[0]
    if kind == "leaf":
        return next(it)
    if kind == "list" or kind == "tuple" and as_collated:  # default_collate turns a tuple into a list
        return [_build(c, it, as_collated) for c in tree[1]]
    if kind == "tuple":
        return tuple(_build(c, it, as_collated) for c in tree[1])
    if kind == "namedtuple":
        return tree[1](*(_build(c, it, as_collated) for c in tree[2]))
    values = {k: _build(c, it, as_collated) for k, c in zip(tree[2], tree[3])}
    try:
        return tree[1](values)
    except TypeError:  # a mapping type that cannot be built from a dict: a plain dict, as default_collate
        return values


class LeafSpec(NamedTuple):
    """How one leaf is stored: its kind, its dtype (a torch dtype's name) and, if dense, its shape;
    and ``wrap``, what the dataset's sample held there (:func:`leaf_wrap`), so that a trial's
    ``collate_fn`` gets each sample back as the dataset gave it."""

    kind: Kind
    dtype: str
    shape: tuple[int, ...] | None
    wrap: str | None = None


#: Metadata a ``tv_tensors`` type carries besides its values, kept per sample in a hidden leaf (the
#: attributes the type has, in this torchvision; ``clamping_mode`` where it has one).
TV_METADATA = {"BoundingBoxes": ("format", "canvas_size", "clamping_mode"),
               "KeyPoints": ("canvas_size", "clamping_mode")}


def leaf_wrap(leaf: Any) -> str | None:
    """What a sample's leaf is, beyond its values: a ``tv_tensors`` type's name (``"Image"``,
    ``"BoundingBoxes"``...), ``"int"``, ``"float"`` or ``"bool"`` for a Python number, ``"ndarray"``
    for a NumPy array; None for a plain tensor (and what becomes one: a PIL image) or a string."""
    import torch
    from torchvision import tv_tensors

    if isinstance(leaf, tv_tensors.TVTensor):  # torchvision's own types; a subclass of the user's stays a tensor
        return type(leaf).__name__ if type(leaf) is getattr(tv_tensors, type(leaf).__name__, None) else None
    if isinstance(leaf, torch.Tensor) or isinstance(leaf, str):
        return None
    if isinstance(leaf, bool):
        return "bool"
    if isinstance(leaf, int):
        return "int"
    if isinstance(leaf, float):
        return "float"
    if isinstance(leaf, (np.ndarray, np.generic)):
        return "ndarray"
    return None


def tv_metadata(leaf: Any) -> dict[str, Any] | None:
    """The metadata of a ``tv_tensors`` leaf that has some (:data:`TV_METADATA`), as plain values; None
    for a leaf of another type (a transform that returned a plain tensor there for this sample)."""
    names = TV_METADATA.get(type(leaf).__name__)
    if names is None:
        return None
    out = {}
    for name in names:
        if hasattr(leaf, name):  # None included (a clamping mode of None is one)
            value = getattr(leaf, name)
            out[name] = value.name if hasattr(value, "name") else tuple(value) if name == "canvas_size" else value
    return out


def restore(spec: LeafSpec, value: Any, metadata: Mapping[str, Any] | None = None) -> Any:
    """One sample's leaf as the dataset gave it, from its stored ``value`` (a tensor, or a string):
    a ``tv_tensors`` type over the same memory with its metadata, a Python number, a NumPy view."""
    wrap = spec.wrap
    if wrap is None or isinstance(value, str):
        return value
    if wrap == "int":
        return int(value)
    if wrap == "float":
        return float(value)
    if wrap == "bool":
        return bool(value)
    if wrap == "ndarray":
        return value.numpy()
    from torchvision import tv_tensors

    if wrap in TV_METADATA and metadata is None:  # this sample's leaf was a plain tensor: it stays one
        return value
    return getattr(tv_tensors, wrap)(value, **(metadata or {}))


@dataclasses.dataclass(frozen=True)
class Layout:
    """The structure every sample of a pipeline must have, and how each leaf is stored.

    Made once per data group from a few samples (:mod:`coordinated_prep.pipeline.probe`), so that
    every piece, prepared by any process, is stacked alike and every batch has one structure.
    """

    tree: TreeDef
    leaves: tuple[LeafSpec, ...]
    #: For each hidden leaf (after the tree's), the tree leaf whose per-sample ``tv_tensors`` metadata it
    #: holds (an ``object`` leaf of dicts: a ``BoundingBoxes``' format and canvas size, sample by sample).
    described: tuple[int, ...] = ()

    @property
    def names(self) -> list[str]:
        """The leaves' dotted names (the tree's; not the hidden ones)."""
        return paths(self.tree)

    @functools.cached_property
    def wrapped(self) -> bool:
        """Whether a ragged leaf holds ``tv_tensors`` (its per-sample entries are wrapped in a batch)."""
        return any(leaf.kind == "ragged" and leaf.wrap not in (None, "int", "float", "bool", "ndarray")
                   for leaf in self.leaves)

    def metadata_of(self, j: int, leaves: Sequence[Any]) -> Sequence[Any] | None:
        """The per-sample metadata of tree leaf ``j`` among a batch's or piece's ``leaves`` (None if it has none)."""
        for k, described in enumerate(self.described):
            if described == j:
                return leaves[len(self.leaves) - len(self.described) + k]
        return None

    def present(self, leaves: Sequence[Any]) -> list[Any]:
        """A batch's collated leaves as ``default_collate`` gives them: a ragged leaf's per-sample
        tensors back in their ``tv_tensors`` types (a stacked leaf stays a plain tensor, as
        ``torch.stack`` leaves one)."""
        if not self.wrapped:
            return list(leaves)
        out = list(leaves)
        for j, leaf in enumerate(self.leaves[: len(self.leaves) - len(self.described)]):
            if leaf.kind == "ragged" and leaf.wrap not in _LOOSE:
                metadata = self.metadata_of(j, leaves)
                out[j] = [restore(leaf, x, metadata[i] if metadata is not None else None) for i, x in enumerate(leaves[j])]
        return out

    def samples(self, leaves: Sequence[Any], n: int) -> list[Any]:
        """The ``n`` samples of a batch's collated ``leaves``, each in the dataset's own structure and
        types (:func:`unflatten`, :func:`restore`): what a ``DataLoader`` hands its ``collate_fn``. A
        stacked leaf's sample is a view of its row."""
        count = len(self.leaves) - len(self.described)
        metadata = [self.metadata_of(j, leaves) for j in range(count)]
        return [unflatten(self.tree, [restore(spec, leaves[j][i], metadata[j][i] if metadata[j] is not None else None)
                                      for j, spec in enumerate(self.leaves[:count])]) for i in range(n)]

    def sample_bytes(self, samples: Sequence[Any] = ()) -> int:
        """Bytes of one sample's dense leaves, plus the largest ragged leaves among ``samples``."""
        total = 0
        for j, leaf in enumerate(self.leaves):
            if leaf.kind == "dense":
                total += int(np.prod(leaf.shape, dtype=np.int64)) * _itemsize(leaf.dtype)
        if samples:
            count = len(self.leaves) - len(self.described)
            ragged = [j for j, leaf in enumerate(self.leaves[:count]) if leaf.kind != "dense"]
            total += max((sum(_nbytes(flatten(s)[0][j]) for j in ragged) for s in samples), default=0)
        return max(total, 1)

    def check(self, sample: Any, index: int, where: str) -> list[np.ndarray | str]:
        """``sample``'s leaves as arrays (strings stay strings), checked against this layout.

        Raises:
            StructureError: Another nesting, dtype or (dense) shape than the layout's, naming the
                sample, the leaf and the fix.
        """
        leaves, tree = flatten(sample)
        if tree != self.tree:
            raise StructureError(
                f"{where}: sample {index} has structure {describe(tree)}, but the pipeline's samples have "
                f"{describe(self.tree)}; make the transform return the same structure for every sample")
        out: list[Any] = []
        for name, leaf, spec in zip(self.names, leaves, self.leaves):
            value, dtype = to_array(leaf, index, name, where)
            if dtype != spec.dtype:
                raise StructureError(
                    f"{where}: sample {index}, leaf {name or 'the sample'!r} is {dtype}, but earlier samples' is "
                    f"{spec.dtype}; convert it to one dtype in the transform")
            if spec.kind == "dense" and value.shape != spec.shape:  # type: ignore[union-attr]
                raise StructureError(
                    f"{where}: sample {index}, leaf {name or 'the sample'!r} has shape {tuple(value.shape)}, but "  # type: ignore[union-attr]
                    f"the first samples all had {spec.shape}, so it is stacked; if its shape varies, declare it "
                    f"ragged (DataSpec(ragged=[{name!r}])), or give it one shape in the transform (pad, resize)")
            out.append(value)
        out.extend(tv_metadata(leaves[j]) for j in self.described)
        return out


#: What a leaf's ``wrap`` says that needs no ``tv_tensors`` type back in a batch.
_LOOSE = (None, "int", "float", "bool", "ndarray")


def make_layout(samples: Sequence[Any], ragged: Sequence[str], where: str) -> Layout:
    """The layout of ``samples`` (probed ones): a leaf is dense if every one has the same shape,
    unless ``ragged`` names it.

    Raises:
        StructureError: The samples differ in nesting or dtype, a leaf is of an unsupported type,
            or ``ragged`` names no leaf.
    """
    first, tree = flatten(samples[0])
    names = paths(tree)
    unknown = sorted(set(ragged) - set(names))
    if unknown:
        raise StructureError(f"{where}: ragged={unknown} names no leaf of the samples; their leaves are {names}")
    specs = []
    for j, (name, (value, dtype)) in enumerate(zip(names, (to_array(x, 0, n, where) for x, n in zip(first, names)))):
        if isinstance(value, str):
            specs.append(LeafSpec("object", dtype, None))
            continue
        shapes = {value.shape}
        for k, s in enumerate(samples[1:], 1):
            leaves, t = flatten(s)
            if t != tree:
                raise StructureError(
                    f"{where}: sample {k} of the probe has structure {describe(t)}, sample 0 {describe(tree)}; make "
                    "the transform return the same structure for every sample")
            shapes.add(to_array(leaves[j], k, name, where)[0].shape)  # type: ignore[union-attr]
        kind: Kind = "dense" if len(shapes) == 1 and name not in ragged else "ragged"
        specs.append(LeafSpec(kind, dtype, value.shape if kind == "dense" else None, leaf_wrap(first[j])))
    described = tuple(j for j, spec in enumerate(specs) if spec.wrap in TV_METADATA)
    specs += [LeafSpec("object", "metadata", None) for _ in described]
    layout = Layout(tree, tuple(specs), described)
    for k, s in enumerate(samples):
        layout.check(s, k, where)  # dtypes agree too
    return layout


def to_array(leaf: Any, index: int, name: str, where: str) -> tuple[np.ndarray | str, str]:
    """A leaf as a NumPy array (its storage) and its torch dtype's name; a string stays itself.

    Raises:
        StructureError: A leaf of a type no batch can hold (None, an object), naming it.
    """
    import torch

    if isinstance(leaf, torch.Tensor):
        t = leaf.detach().cpu().as_subclass(torch.Tensor).contiguous()
        dtype = str(t.dtype).removeprefix("torch.")
        if t.dtype == torch.bfloat16:  # NumPy has no bfloat16: store its bits
            return t.view(torch.int16).numpy(), dtype
        return t.numpy(), dtype
    if isinstance(leaf, np.ndarray) or isinstance(leaf, np.generic):
        arr = np.asarray(leaf)
        arr = arr if arr.flags.c_contiguous else np.ascontiguousarray(arr)  # (ascontiguousarray makes 0-d 1-d)
        if arr.dtype.kind in "OUSV":
            raise StructureError(f"{where}: sample {index}, leaf {name or 'the sample'!r} is a NumPy array of "
                                 f"dtype {arr.dtype}, which no tensor can hold; convert it to numbers")
        return arr, str(torch.from_numpy(arr.reshape(-1)[:0].copy()).dtype).removeprefix("torch.")
    if isinstance(leaf, bool):
        return np.asarray(leaf, dtype=np.bool_), "bool"
    if isinstance(leaf, int):
        return np.asarray(leaf, dtype=np.int64), "int64"
    if isinstance(leaf, float):
        return np.asarray(leaf, dtype=np.float64), "float64"
    if isinstance(leaf, str):
        return leaf, "str"
    try:  # a PIL image, or anything NumPy understands
        arr = np.asarray(leaf)
    except Exception:
        arr = None
    if arr is None or arr.dtype.kind in "OUSV":
        raise StructureError(
            f"{where}: sample {index}, leaf {name or 'the sample'!r} is a {type(leaf).__name__}, which a batch cannot "
            "hold; end the transform with tensors, arrays, numbers or strings (v2.ToImage(), v2.PILToTensor())")
    return to_array(arr, index, name, where)


def describe(tree: TreeDef) -> str:
    """A short text of a nesting: ``(leaf, {boxes, labels})``."""
    kind = tree[0]
    if kind == "leaf":
        return "leaf"
    if kind == "dict":
        return "{" + ", ".join(f"{k}: {describe(c)}" for k, c in zip(tree[2], tree[3])) + "}"
    inner = ", ".join(describe(c) for c in tree[-1])
    return f"[{inner}]" if kind == "list" else f"({inner})"


def _itemsize(dtype: str) -> int:
    import torch

    return getattr(torch, dtype).itemsize


def _nbytes(leaf: Any) -> int:
    return int(getattr(leaf, "nbytes", 0) or (leaf.numel() * leaf.element_size() if hasattr(leaf, "numel") else 64))
