"""A user's transforms travel inside a :class:`~coordinated_prep.spec.DataSpec` as pickled bytes,
and become objects again only in a process that reads them.

A spec goes to every process of a sweep: the trials (in their Tune config), the registry, the
coordinators and the prep actors. Only the prep actors (and a trial that prepares for itself:
unshared, detached or a "behind" rank) run the transforms. Unpickling a ``transforms.v2``
pipeline imports torchvision, which imports ``torch._dynamo`` (torchvision's ``roi_align``): 4 to
6 CPU-seconds per process on these 2-core machines, measured in a registry and its coordinators,
which are on the path to a sweep's first batch. So the spec pickles such a field as
:class:`Packed` bytes, and :class:`Carried` unpickles it on the field's first read in the process
that reads it; a process that only passes the spec on pickles the same bytes again.

The dataset is not carried so: the registry and the coordinators read a dataset object (its
length, its index), and a large one pickled inside bytes would lose Ray's zero-copy buffers.
"""

from __future__ import annotations

import sys
from typing import Any


class Packed:
    """A user object pickled by value (cloudpickle, as Ray pickles a task's arguments)."""

    __slots__ = ("blob",)

    def __init__(self, blob: bytes) -> None:
        self.blob = blob

    @classmethod
    def of(cls, value: Any) -> Any:
        """``value`` packed, or as it is when it is light to unpickle (None, text, one of ours, packed)
        or pickled outside Ray."""
        if value is None or isinstance(value, (str, Packed)) or type(value).__module__.startswith("coordinated_prep."):
            return value
        if "ray" not in sys.modules:  # pickled outside Ray (a DataLoader's workers): as it is, no Ray import
            return value
        from ray import cloudpickle

        return cls(cloudpickle.dumps(value))

    def __reduce__(self) -> tuple:
        return Packed, (self.blob,)


class Carried:
    """A data descriptor for a frozen dataclass field that may hold a :class:`Packed` value:
    reading the field unpacks it once, in the reading process (``dataclasses`` takes the default
    from ``Carried(default)`` and sets the field through :meth:`__set__`)."""

    def __init__(self, default: Any = None) -> None:
        self.default = default

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    def __get__(self, obj: Any, owner: type | None = None) -> Any:
        if obj is None:
            return self.default
        value = obj.__dict__.get(self.name, self.default)
        if isinstance(value, Packed):
            from ray import cloudpickle

            value = cloudpickle.loads(value.blob)
            obj.__dict__[self.name] = value  # a frozen value's cache: the same object on every read
        return value

    def __set__(self, obj: Any, value: Any) -> None:
        obj.__dict__[self.name] = value


def raw(obj: Any, name: str) -> Any:
    """``obj``'s field ``name`` as it is held: :class:`Packed` if not read in this process yet."""
    return obj.__dict__.get(name)
