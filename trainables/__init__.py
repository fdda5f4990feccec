"""Ready Tune trainables that train with coordinated_prep's loaders."""

from __future__ import annotations

from typing import Callable

from trainables import resnet, small_cnn

#: Trainables a YAML sweep may name; any other must be given as ``module:function``.
REGISTRY: dict[str, Callable[[dict], None]] = {
    "small_cnn": small_cnn.train,
    "resnet18": resnet.train,
}

__all__ = ["REGISTRY"]
