"""The raw-data cache: MinIO per node, partitioned across nodes (CoorDL's two caches)."""

from coordinated_prep.cache.layout import CacheLayout
from coordinated_prep.cache.policy import LruPolicy, MinioPolicy
from coordinated_prep.cache.spec import CacheSpec, parse_bytes

__all__ = ["CacheLayout", "CacheSpec", "LruPolicy", "MinioPolicy", "parse_bytes"]
