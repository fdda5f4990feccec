"""YAML experiment sweeps: parse a file into a SweepConfig, run it with Tune, summarise it."""

from coordinated_prep.sweep.config import SweepConfig, load_sweep

__all__ = ["SweepConfig", "load_sweep"]
