"""The cache's pure parts: MinIO against LRU on training's access pattern, the node partition, the spec."""

from __future__ import annotations

import numpy as np
import pytest

from coordinated_prep.cache import CacheLayout, CacheSpec, LruPolicy, MinioPolicy, parse_bytes
from coordinated_prep.errors import ConfigError
from coordinated_prep.plan import StreamPlan


def _epoch_hit_rates(policy, plan: StreamPlan, sizes: np.ndarray, epochs: int) -> list[float]:
    rates = []
    for epoch in range(epochs):
        hits = 0
        for g in range(epoch * plan.chunks_per_epoch, (epoch + 1) * plan.chunks_per_epoch):
            for i in plan.chunk_samples(g).tolist():
                if policy.lookup(i):
                    hits += 1
                else:
                    policy.admit(i, int(sizes[i]))
        rates.append(hits / plan.samples_per_epoch)
    return rates


@pytest.mark.parametrize("fraction", [0.25, 0.5, 0.8])
def test_minio_hit_rate_is_the_cached_fraction_and_lru_falls_short(fraction):
    n = 2000
    sizes = np.random.default_rng(1).integers(20_000, 60_000, n)  # JPEG-like spread of sizes
    plan = StreamPlan(np.arange(n), seed=3, chunk_size=32, segments=4)
    capacity = int(sizes.sum() * fraction)
    minio, lru = MinioPolicy(capacity), LruPolicy(capacity)
    minio_rates = _epoch_hit_rates(minio, plan, sizes, epochs=4)
    lru_rates = _epoch_hit_rates(lru, plan, sizes, epochs=4)
    cached = len(minio) / n
    assert minio.used_bytes <= capacity and abs(cached - fraction) < 0.05
    assert minio_rates[0] == 0.0
    for rate in minio_rates[1:]:
        assert abs(rate - cached) <= 1 / n  # within one item
    for rate in lru_rates[1:]:  # a fresh random order each epoch: LRU keeps what is not read again
        assert rate < cached - 0.05, (lru_rates, cached)


def test_minio_never_evicts_and_closes_at_the_first_item_that_does_not_fit():
    policy = MinioPolicy(100)
    assert policy.admit("a", 60) and policy.admit("b", 40)
    assert not policy.admit("c", 1) and policy.full
    assert "a" in policy and "b" in policy and "c" not in policy
    assert policy.lookup("a") and not policy.lookup("c")
    assert (policy.hits, policy.misses) == (1, 1)


def test_lru_evicts_the_least_recently_used():
    policy = LruPolicy(100)
    policy.admit("a", 50), policy.admit("b", 50)
    policy.lookup("a")
    policy.admit("c", 50)
    assert "a" in policy and "c" in policy and "b" not in policy


def test_partition_is_disjoint_balanced_seeded_and_the_same_everywhere():
    nodes = ("n1", "n2", "n3")
    layout = CacheLayout("s", nodes, seed=7)
    owners = layout.owners(1000, "n1")
    assert np.array_equal(owners, layout.owners(1000, "n3"))  # no exchange needed: every node derives it
    counts = np.bincount(owners, minlength=3)
    assert counts.max() - counts.min() <= 1
    assert not np.array_equal(owners, CacheLayout("s", nodes, seed=8).owners(1000, "n1"))
    assert set(CacheLayout("s", nodes, partitioned=False).owners(10, "n2").tolist()) == {1}
    assert set(CacheLayout("s", nodes).owners(10, "unknown-node").tolist()) <= {0, 1, 2}


def test_spec_parses_sizes_and_names_bad_values():
    assert CacheSpec("512MiB").capacity_bytes == 512 * 2**20
    assert parse_bytes("1.5GB", "x") == 1_500_000_000 and parse_bytes(4096, "x") == 4096
    with pytest.raises(ConfigError, match="cache.capacity_bytes='lots'"):
        CacheSpec("lots")
    with pytest.raises(ConfigError, match="cache.timeout_s"):
        CacheSpec(100, timeout_s=0)
    with pytest.raises(ConfigError, match=r"unknown key\(s\) \['capacity'\]"):
        CacheSpec.from_mapping({"capacity": 10})
    with pytest.raises(ConfigError, match="capacity_bytes is required"):
        CacheSpec.from_mapping({"partitioned": True})
