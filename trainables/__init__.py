"""Ready Tune trainables that train with coordinated_prep's loaders."""

from __future__ import annotations

from typing import Any, Callable, Mapping

from torch import nn

from trainables import audio, cifar, resnet, segmentation, small_cnn

#: Trainables a YAML sweep may name; any other must be given as ``module:function``.
REGISTRY: dict[str, Callable[[dict], None]] = {
    "small_cnn": small_cnn.train,
    "resnet18": resnet.train,
    # The examples that bring their own dataset and transforms (docs/pipelines.md): not in MODELS,
    # whose models ``coordprep analyze`` and ``coordprep memory`` feed the built-in (3, size, size) images.
    "cifar_cnn": cifar.train,
    "seg_unet": segmentation.train,
    "audio_cnn": audio.train,
}

#: The model each registered trainable trains (``build(num_classes, config)``), for ``coordprep analyze``.
MODELS: dict[str, Callable[[int, Mapping[str, Any]], nn.Module]] = {
    "small_cnn": small_cnn.build,
    "resnet18": resnet.build,
}

__all__ = ["MODELS", "REGISTRY"]
