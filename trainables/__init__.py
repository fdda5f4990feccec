"""Ready Tune trainables that train with coordinated_prep's loaders.

The registries name each trainable's module and import it on first lookup: a trial that trains the
small CNN never imports torchvision (about 2 s of CPU per trial process on these machines) because
another trainable's module would.
"""

from __future__ import annotations

import importlib
from typing import Any, Callable, Iterator, Mapping


class _Lazy(Mapping[str, Any]):
    """A read-only name -> ``"module:attribute"`` mapping whose values are imported when looked up."""

    def __init__(self, paths: dict[str, str]) -> None:
        self._paths = paths

    def __getitem__(self, name: str) -> Any:
        module, _, attr = self._paths[name].partition(":")
        return getattr(importlib.import_module(module), attr)

    def __iter__(self) -> Iterator[str]:
        return iter(self._paths)

    def __len__(self) -> int:
        return len(self._paths)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self._paths!r})"


#: Trainables a YAML sweep may name; any other must be given as ``module:function``.
REGISTRY: Mapping[str, Callable[[dict], None]] = _Lazy({
    "small_cnn": "trainables.small_cnn:train",
    "resnet18": "trainables.resnet:train",
    # The examples that bring their own dataset and transforms (docs/pipelines.md): not in MODELS,
    # whose models ``coordprep analyze`` and ``coordprep memory`` feed the built-in (3, size, size) images.
    "cifar_cnn": "trainables.cifar:train",
    "seg_unet": "trainables.segmentation:train",
    "audio_cnn": "trainables.audio:train",
})

#: The model each registered trainable trains (``build(num_classes, config)`` -> ``nn.Module``), for
#: ``coordprep analyze``.
MODELS: Mapping[str, Callable[[int, Mapping[str, Any]], Any]] = _Lazy({
    "small_cnn": "trainables.small_cnn:build",
    "resnet18": "trainables.resnet:build",
})

#: What each registered trainable reports every epoch (besides Tune's own ``training_iteration``,
#: ``time_total_s``, ...): a YAML sweep's ``metric`` is checked against it before Ray starts.
REPORTS: Mapping[str, frozenset[str] | None] = _Lazy({
    "small_cnn": "trainables.common:REPORTS",
    "resnet18": "trainables.common:REPORTS",
    "cifar_cnn": "trainables.cifar:REPORTS",
    "seg_unet": "trainables.segmentation:REPORTS",
    "audio_cnn": "trainables.audio:REPORTS",
})

__all__ = ["MODELS", "REGISTRY", "REPORTS"]
