"""A pipeline's deterministic prefix and random tail: the split that lets data groups share decoding.

The **prefix** of an encoded-image pipeline is reading and decoding, then the leading transforms of
its ``transform`` that draw nothing at random (a working-size ``Resize``, say); the **tail** is the
rest. The prefix's output for a sample depends on the dataset, the prefix and the sample only, so
every data group of a node with the same dataset and prefix can use it, in every epoch: the node's
decoded tier (:mod:`coordinated_prep.tier`) keeps it, and each group runs only its tail.

How the prefix is found: by the leading steps of a ``Compose`` (torchvision's v1 or v2) whose type
is one of torchvision's deterministic transforms (:data:`DETERMINISTIC`: resizes, centre crops,
dtype conversions, normalisation), exactly that type, not a subclass; a transform of your own joins
it by declaring ``deterministic = True``. The first other step, and everything after it, is the
tail. A group's start then checks the prefix: it runs it on a sample under two different seeds of
every global generator and refuses a prefix whose outputs differ (:mod:`coordinated_prep.pipeline.probe`).
Why not probe every step for randomness: a random transform can give equal outputs under two seeds
by chance (a flip with probability 0.5 does so half the time), and then a random step would be
cached as if it were not. Declared membership fails safe: an unknown step is tail.

What shares: the built-in crop (torchvision backend) and a ``transform`` of the user's on the same
built-in or directory dataset both start with the same decode, so with a decode-only prefix they
share one. Not split: the DALI backend (it decodes only each crop's window), joint ``transforms``
(decode only is their prefix), and map-style datasets of the user's (``dataset[i]`` may be random;
nothing of it is kept across epochs).

A prefix output travels as ``(array, kind)``: its bytes as a NumPy array and whether it was a
``tv_tensors.Image``, a plain tensor or an array (:func:`pack`, :func:`unpack`), so that a kept output
is rebuilt as what the unshared pipeline passes to its tail (another ``tv_tensors`` type is refused).
"""

from __future__ import annotations

import functools
import hashlib
from typing import Any, Sequence

import numpy as np

#: Names of torchvision transforms whose output is a function of their input alone.
_V2 = ("Resize", "CenterCrop", "ToImage", "ToDtype", "ConvertImageDtype", "Normalize", "Grayscale", "RGB",
       "ToPureTensor", "PILToTensor", "Pad", "Identity")
_V1 = ("Resize", "CenterCrop", "ToTensor", "PILToTensor", "ConvertImageDtype", "Normalize", "Grayscale", "Pad")


@functools.lru_cache(maxsize=1)
def deterministic_types() -> frozenset[type]:
    """torchvision's deterministic transform classes (v1 and v2), imported on first use."""
    from torchvision import transforms as v1
    from torchvision.transforms import v2

    found = {getattr(v2, n) for n in _V2 if hasattr(v2, n)} | {getattr(v1, n) for n in _V1 if hasattr(v1, n)}
    return frozenset(found)


def _composes() -> tuple[type, ...]:
    from torchvision import transforms as v1
    from torchvision.transforms import v2

    return (v1.Compose, v2.Compose)


def is_deterministic(step: Any) -> bool:
    """Whether ``step`` may be in a prefix: a listed torchvision type exactly, or ``deterministic = True``."""
    return getattr(step, "deterministic", None) is True or type(step) in deterministic_types()


def split_transform(transform: Any) -> tuple[list[Any], Any]:
    """``transform`` as (its prefix steps, its tail: a Compose of the other steps, or None if none).

    A transform that is not a torchvision ``Compose`` has an empty prefix unless it declares
    ``deterministic = True`` itself (then it is all prefix).
    """
    if transform is None:
        return [], None
    if type(transform) not in _composes():
        return ([transform], None) if is_deterministic(transform) else ([], transform)
    steps = list(transform.transforms)
    k = 0
    while k < len(steps) and is_deterministic(steps[k]):
        k += 1
    rest = steps[k:]
    return steps[:k], (type(transform)(rest) if rest else None)


def prefix_key(dataset: str, steps: Sequence[Any]) -> str:
    """The identity of a prefix: the dataset and each step's type and parameters (a torchvision
    step's public attributes; a step of the user's enters by the hash of its pickle)."""
    from coordinated_prep.pipeline.datasets import object_key

    parts = [f"decode:{dataset}"]
    for step in steps:
        name = f"{type(step).__module__}.{type(step).__qualname__}"
        if type(step) in deterministic_types():  # every public attribute: a repr may leave some out (a dtype)
            state = sorted((k, repr(v)) for k, v in vars(step).items() if not k.startswith("_") and k != "training")
            parts.append(f"{name}:{state}")
        else:
            parts.append(f"{name}:{object_key(step, 'data.transform')}")
    if len(parts) == 1:
        return parts[0]
    return f"{parts[0]}|{hashlib.sha256('|'.join(parts[1:]).encode()).hexdigest()[:12]}"


#: What a packed prefix output was: a ``tv_tensors.Image``, a plain tensor, or a NumPy array.
IMAGE, TENSOR, ARRAY = "image", "tensor", "array"
#: Suffix of the kind of a (C, H, W) tensor kept in its (H, W, C) memory, as a JPEG decoder gives it.
HWC = "/hwc"


def pack(output: Any, where: str) -> tuple[np.ndarray, str]:
    """A prefix output as ``(contiguous array, kind)``: its bytes and what it was (IMAGE, TENSOR or ARRAY).

    A decoded image is a (C, H, W) view of (H, W, C) memory. It is kept in that memory (kind ``+ HWC``),
    so that the tail gets it as the decoder gave it: torchvision's antialiased uint8 resize takes 0.7 ms
    on that layout and 1.9 ms on a contiguous (C, H, W) copy of a 500 x 375 photograph, for equal bytes.
    """
    import torch
    from torchvision import tv_tensors

    if isinstance(output, np.ndarray):
        return np.ascontiguousarray(output), ARRAY
    if (not isinstance(output, torch.Tensor) or output.dtype == torch.bfloat16
            or (isinstance(output, tv_tensors.TVTensor) and not isinstance(output, tv_tensors.Image))):
        from coordinated_prep.errors import StructureError

        raise StructureError(
            f"{where}: the deterministic prefix (decode and the leading deterministic transforms) gave a "
            f"{type(output).__name__}{' of bfloat16' if getattr(output, 'dtype', None) == torch.bfloat16 else ''}, "
            "not an image, tensor or array the decoded tier can keep; move the step that makes it after the first "
            "random step, or set deterministic = False on it")
    kind = IMAGE if isinstance(output, tv_tensors.Image) else TENSOR
    tensor = output.as_subclass(torch.Tensor)
    if tensor.dim() == 3 and tensor.shape[0] > 1 and tensor.permute(1, 2, 0).is_contiguous():
        return tensor.permute(1, 2, 0).numpy(), kind + HWC
    return tensor.contiguous().numpy(), kind


def unpack(packed: tuple[np.ndarray, str]) -> Any:
    """What :func:`pack` took, of the same kind, in fresh memory (the tail may change it in place: a
    kept output lies read-only in the object store, and other groups read it after)."""
    import torch
    from torchvision import tv_tensors

    array, kind = packed
    array = np.array(array, copy=True)
    if kind == ARRAY:
        return array
    tensor = torch.from_numpy(array)
    if kind.endswith(HWC):
        tensor, kind = tensor.permute(2, 0, 1), kind.removesuffix(HWC)
    return tv_tensors.Image(tensor) if kind == IMAGE else tensor


def packed_bytes(values: Sequence[tuple[np.ndarray, str]]) -> int:
    """Bytes a list of packed outputs takes in the object store."""
    return sum(int(v[0].nbytes) for v in values)
