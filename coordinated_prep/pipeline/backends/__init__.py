"""Preprocessing backends behind one contract (``coordinated_prep.contracts.Preprocessor``)."""

from __future__ import annotations

from coordinated_prep.contracts import Preprocessor
from coordinated_prep.pipeline.backends.spec import PipelineSpec

__all__ = ["make_preprocessor"]


def make_preprocessor(pipeline: PipelineSpec) -> Preprocessor:
    """The preprocessor for ``pipeline.backend``; heavy backends are imported only here."""
    if pipeline.backend == "torchvision":
        from coordinated_prep.pipeline.backends.torchvision_backend import TorchvisionPreprocessor

        return TorchvisionPreprocessor(pipeline)
    if pipeline.backend == "dali":
        from coordinated_prep.pipeline.backends.dali_backend import DaliPreprocessor

        return DaliPreprocessor(pipeline)
    raise ValueError(f"pipeline.backend={pipeline.backend!r} has no implementation")  # unreachable: spec checks
