"""``coordprep analyze``: DS-Analyzer-style differential analysis of an experiment's input pipeline."""

from coordinated_prep.analyze.model import Prediction, Rates, predict, stalls

__all__ = ["Prediction", "Rates", "predict", "stalls"]
