"""A model's forward as a list of stages, the unit of activation checkpointing."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from torch import nn

from coordinated_prep.errors import ConfigError


@dataclass(frozen=True)
class Stage:
    """One step of a model's forward.

    Attributes:
        fn: Maps the previous stage's output to this stage's.
        modules: The modules ``fn`` runs (their batch-norm statistics are protected on recompute).
        checkpointed: Whether the memory modes checkpoint it (the cheap head is left alone).
    """

    fn: Callable[[Any], Any]
    modules: tuple[nn.Module, ...]
    checkpointed: bool = True


def split_stages(model: nn.Module) -> list[Stage]:
    """The stages of a torchvision-style ResNet (stem, layer1-4, head) or of an ``nn.Sequential``
    (one stage per block ending in a pooling layer, then the head).

    Raises:
        ConfigError: a model of any other shape (the memory modes need to know its stages).
    """
    if all(hasattr(model, a) for a in ("conv1", "bn1", "relu", "maxpool", "layer1", "layer4", "avgpool", "fc")):
        return _resnet(model)
    if isinstance(model, nn.Sequential):
        return _sequential(model)
    raise ConfigError(f"memory modes need a model whose stages are known: a torchvision ResNet or an nn.Sequential, "
                      f"not {type(model).__name__}; train it with memory: none")


def _resnet(m: nn.Module) -> list[Stage]:
    stem = (m.conv1, m.bn1, m.relu, m.maxpool)
    stages = [Stage(_chain(stem), stem)]
    for name in ("layer1", "layer2", "layer3", "layer4"):
        layer = getattr(m, name)
        stages.append(Stage(layer, (layer,)))

    def head(x: Any) -> Any:
        return m.fc(m.avgpool(x).flatten(1))

    stages.append(Stage(head, (m.avgpool, m.fc), checkpointed=False))
    return stages


def _sequential(m: nn.Sequential) -> list[Stage]:
    pools = (nn.MaxPool2d, nn.AvgPool2d)
    stages: list[Stage] = []
    block: list[nn.Module] = []
    for child in m:
        block.append(child)
        if isinstance(child, pools):
            stages.append(Stage(_chain(block), tuple(block)))
            block = []
    if block:
        stages.append(Stage(_chain(block), tuple(block), checkpointed=not stages))
    return stages


def _chain(modules: Any) -> Callable[[Any], Any]:
    modules = tuple(modules)

    def run(x: Any) -> Any:
        for module in modules:
            x = module(x)
        return x

    return run
