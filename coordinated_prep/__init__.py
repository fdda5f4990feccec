"""coordinated_prep: prepare each sample once per epoch for all the Ray Tune trials that train on it."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from coordinated_prep.cache.spec import CacheSpec
from coordinated_prep.errors import CacheError, ConfigError, CoordinatedPrepError, DatasetError, PrepError, SampleError
from coordinated_prep.pool.spec import PoolSpec
from coordinated_prep.spec import DataSpec, PipelineSpec

if TYPE_CHECKING:
    from coordinated_prep.echo import EchoSpec
    from coordinated_prep.loader import Batch, TrainLoader, eval_loader, train_loader
    from coordinated_prep.searcher import CoordinatedSearcher
    from coordinated_prep.service import PrepService

__all__ = [
    "Batch",
    "CacheError",
    "CacheSpec",
    "ConfigError",
    "CoordinatedPrepError",
    "CoordinatedSearcher",
    "DataSpec",
    "DatasetError",
    "EchoSpec",
    "PipelineSpec",
    "PoolSpec",
    "PrepError",
    "PrepService",
    "SampleError",
    "TrainLoader",
    "eval_loader",
    "train_loader",
]
__version__ = "0.1.0"

# Imported on first use: the trial side needs torch, the coordinator and prep actors must not pay
# for it (importing torch costs a process hundreds of MiB of resident memory).
_LAZY = {
    "Batch": "coordinated_prep.loader",
    "EchoSpec": "coordinated_prep.echo",
    "TrainLoader": "coordinated_prep.loader",
    "eval_loader": "coordinated_prep.loader",
    "train_loader": "coordinated_prep.loader",
    "CoordinatedSearcher": "coordinated_prep.searcher",
    "PrepService": "coordinated_prep.service",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'coordinated_prep' has no attribute {name!r}")
