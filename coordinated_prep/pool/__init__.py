"""The node-level prep pool: prep actors and the staging budget, shared by every data group of a node."""

from coordinated_prep.pool.spec import PoolSpec, split_budget

__all__ = ["PoolSpec", "split_budget"]
