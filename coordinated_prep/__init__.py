"""coordinated_prep: prepare each sample once per epoch for all the Ray Tune trials that train on it."""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
from typing import TYPE_CHECKING, Any

from coordinated_prep.cache.spec import CacheSpec
from coordinated_prep.errors import CacheError, ConfigError, CoordinatedPrepError, DatasetError, PrepError, SampleError
from coordinated_prep.pool.spec import PoolSpec
from coordinated_prep.spec import DataSpec, PipelineSpec

if TYPE_CHECKING:
    from coordinated_prep.trial.echo import EchoSpec
    from coordinated_prep.trial.loader import Batch, TrainLoader, eval_loader, train_loader
    from coordinated_prep.tune.searcher import CoordinatedSearcher
    from coordinated_prep.tune.results import TrialResult, best_trial
    from coordinated_prep.tune.service import PrepService

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
    "TrialResult",
    "best_trial",
    "eval_loader",
    "train_loader",
]
__version__ = "0.1.0"

# Imported on first use: the trial side needs torch, the coordinator and prep actors must not pay
# for it (importing torch costs a process hundreds of MiB of resident memory).
_LAZY = {
    "Batch": "coordinated_prep.trial.loader",
    "EchoSpec": "coordinated_prep.trial.echo",
    "TrainLoader": "coordinated_prep.trial.loader",
    "eval_loader": "coordinated_prep.trial.loader",
    "train_loader": "coordinated_prep.trial.loader",
    "CoordinatedSearcher": "coordinated_prep.tune.searcher",
    "PrepService": "coordinated_prep.tune.service",
    "TrialResult": "coordinated_prep.tune.results",
    "best_trial": "coordinated_prep.tune.results",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'coordinated_prep' has no attribute {name!r}")


# -- import paths of modules that moved -------------------------------------------------------------
# The package is laid out by side of the Ray boundary (``trial/``, ``stream/``, ``pool/``, ``tune/``).
# The paths before that move stay importable, as the very same module objects, because users wrote
# them and because Tune pickled them into saved experiments (``tuner.pkl`` holds the searcher's class
# path): ``Tuner.restore`` of an experiment saved before the move must still find its classes.
_MOVED = {
    "coordinated_prep.loader": "coordinated_prep.trial.loader",
    "coordinated_prep.streams": "coordinated_prep.trial.streams",
    "coordinated_prep.eval_stream": "coordinated_prep.trial.eval_stream",
    "coordinated_prep.echo": "coordinated_prep.trial.echo",
    "coordinated_prep.pipeline.batching": "coordinated_prep.trial.batching",
    "coordinated_prep.pipeline.shard": "coordinated_prep.trial.shard",
    "coordinated_prep.pipeline.workers": "coordinated_prep.trial.workers",
    "coordinated_prep.staging": "coordinated_prep.stream.staging",
    "coordinated_prep.coordinator": "coordinated_prep.stream.coordinator",
    "coordinated_prep.watch": "coordinated_prep.stream.watch",
    "coordinated_prep.registry": "coordinated_prep.stream.registry",
    "coordinated_prep.eval_set": "coordinated_prep.stream.eval_set",
    "coordinated_prep.prep_actor": "coordinated_prep.pool.prep_actor",
    "coordinated_prep.searcher": "coordinated_prep.tune.searcher",
    "coordinated_prep.schedulers": "coordinated_prep.tune.schedulers",
    "coordinated_prep.service": "coordinated_prep.tune.service",
    "coordinated_prep.memory.auto": "coordinated_prep.memory_tool.auto",
    "coordinated_prep.memory.configs": "coordinated_prep.memory_tool.configs",
    "coordinated_prep.memory.report": "coordinated_prep.memory_tool.report",
    "coordinated_prep.memory.run": "coordinated_prep.memory_tool.run",
    "coordinated_prep.readonly": "coordinated_prep.pages",
}


_SPECS: dict[str, Any] = {}  # new path -> its module's own spec


class _MovedModule(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds an old module path and answers with the module at its new path (one object, two names)."""

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
        return importlib.util.spec_from_loader(fullname, self) if fullname in _MOVED else None

    def create_module(self, spec: Any) -> Any:
        module = importlib.import_module(_MOVED[spec.name])
        _SPECS.setdefault(module.__name__, module.__spec__)  # the import system sets the alias's spec on it next
        return module

    def exec_module(self, module: Any) -> None:
        """Nothing to run (the module ran when it was imported at its new path); its own spec goes back."""
        module.__spec__ = _SPECS[module.__name__]  # __name__ is left as it was


if not any(isinstance(finder, _MovedModule) for finder in sys.meta_path):
    sys.meta_path.append(_MovedModule())
