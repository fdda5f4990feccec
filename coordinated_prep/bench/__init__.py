"""``coordprep bench``: coordinated prep against the loaders users pick instead, side by side."""

from coordinated_prep.bench.config import BenchConfig, load_bench

__all__ = ["BenchConfig", "load_bench"]
