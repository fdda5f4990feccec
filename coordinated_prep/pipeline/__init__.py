"""The input pipeline, stage by stage: where samples come from, how they are transformed, and how
prepared samples are stacked into pieces and cut into a trial's batches.

- ``sources/``: datasets of encoded samples (ImageFolder, Parquet records, the built-in ones).
- ``backends/``: the built-in image transforms (torchvision and DALI).
- ``chunk.py``: preparing one piece (a trial cuts pieces into batches: :mod:`coordinated_prep.trial.batching`).
"""

from coordinated_prep.pipeline.datasets import ArrayDataset, Factory

__all__ = ["ArrayDataset", "Factory"]
