"""coordinated_prep: prepare each sample once per epoch for all the Ray Tune trials that train on it."""

from coordinated_prep.errors import ConfigError, CoordinatedPrepError, DatasetError, PrepError, SampleError
from coordinated_prep.loader import Batch, TrainLoader, eval_loader, train_loader
from coordinated_prep.searcher import CoordinatedSearcher
from coordinated_prep.spec import DataSpec, PipelineSpec

__all__ = [
    "Batch",
    "ConfigError",
    "CoordinatedPrepError",
    "CoordinatedSearcher",
    "DataSpec",
    "DatasetError",
    "PipelineSpec",
    "PrepError",
    "SampleError",
    "TrainLoader",
    "eval_loader",
    "train_loader",
]
__version__ = "0.1.0"
