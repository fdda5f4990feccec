"""The node cache with Ray: MinIO's hit rate against LRU's, and one cache shared by every group of a node.

Storage reads are counted by Linux inotify on the dataset's folders, not by the library's counters.
"""

from __future__ import annotations

import dataclasses
import os

import numpy as np
import ray
from ray import tune

from coordinated_prep import CoordinatedSearcher, DataSpec
from coordinated_prep.cache import CacheSpec, LruPolicy
from coordinated_prep.cache.actor import RawCache, Region
from coordinated_prep.cache.arena import ArenaReader
from coordinated_prep.plan import StreamPlan, holdout_split
from coordinated_prep.pipeline.sources import open_source
from tests.conftest import live_coordprep_actors
from tests.harness import check_trial_records
from tests.recording import load_records, record
from tests.utils import FileOpens

EPOCHS = 3


def test_lru_counts_a_key_admitted_again_once():
    lru = LruPolicy(10)
    assert lru.admit("a", 4) and lru.admit("a", 4) and lru.admit("b", 4)
    assert lru.used_bytes == 8 and lru.lookup("a") and lru.lookup("b")
    assert lru.admit("a", 6) and lru.used_bytes == 10 and lru.lookup("a") and lru.lookup("b")


def test_minio_hit_rate_is_the_cached_fraction_while_lru_of_the_same_size_falls_short(ray_session, small_dataset):
    source = open_source(small_dataset)
    n = len(source)
    sizes = np.array([os.path.getsize(source.describe(i)) for i in range(n)])
    capacity = int(sizes.sum() * 0.5)
    node = ray.get_runtime_context().get_node_id()
    # The prefix lets the next cache remove the arena file if this test dies before clear().
    cache = RawCache.remote(CacheSpec(capacity), node, "coordprep-test-cache")
    plan = StreamPlan(np.arange(n), seed=0, chunk_size=16, segments=4)
    lru = LruPolicy(capacity)
    arena = ArenaReader(ray.get(cache.arena_id.remote()))  # what a prep actor on the node maps
    minio_rates, lru_rates, got, own_reads = [], [], {}, 0
    with FileOpens(small_dataset) as opens:
        for epoch in range(EPOCHS):
            before = ray.get(cache.report.remote())
            lru_hits = 0
            for g in range(epoch * plan.chunks_per_epoch, (epoch + 1) * plan.chunks_per_epoch):
                ids = plan.chunk_samples(g).tolist()
                answers = ray.get(cache.lookup.remote(small_dataset, ids, node)).answers
                for i, answer in zip(ids, answers):  # what a prep actor does with each answer
                    if answer is None:  # not cached, and the cache is full: read it from storage
                        own_reads += 1
                        got[i] = source.read(i)
                    elif isinstance(answer, Region):  # cached: a zero-copy view of shared memory
                        got[i] = bytes(arena.view(answer.offset, answer.length))
                    else:  # read by the cache just as it filled up, sent in the reply
                        got[i] = answer.tobytes()
                    if lru.lookup(i):
                        lru_hits += 1
                    else:
                        lru.admit(i, int(sizes[i]))
            after = ray.get(cache.report.remote())
            minio_rates.append((after["hits_local"] - before["hits_local"]) / n)
            lru_rates.append(lru_hits / n)
    report = ray.get(cache.report.remote())
    ray.get(cache.clear.remote())
    ray.kill(cache)
    assert not opens.overflowed
    cached = report["items"] / n
    assert report["used_bytes"] <= capacity and 0.3 < cached < 0.7, report
    assert minio_rates[0] == 0.0
    for rate in minio_rates[1:]:
        assert abs(rate - cached) <= 1 / n, (minio_rates, cached)
    for rate in lru_rates[1:]:
        assert rate < cached - 0.1, (lru_rates, cached)
    # Storage, counted by the kernel: a cached file is read once in all, any other once per epoch
    # (the first time by the cache, which read it just as it filled up, then by the reader).
    reads = np.array([opens.counts[source.describe(i)] for i in range(n)])
    assert set(reads.tolist()) == {1, EPOCHS}
    assert (reads == 1).sum() == report["items"]
    assert reads.sum() == report["storage_reads"] + own_reads
    assert all(got[i] == source.read(i) for i in range(n))  # a JPEG stays a JPEG, byte for byte


def test_every_group_on_the_node_shares_one_cache_and_storage_is_read_once(ray_session, small_dataset, tmp_path,
                                                                           warm_pool):
    source = open_source(small_dataset)
    train, _ = holdout_split(len(source), 0.1)
    specs = [DataSpec(dataset=small_dataset, pipeline={"size": size}, seed=1, chunk_size=8, segments=4)
                      for size in (32, 24)]  # two data groups, one dataset
    # The raw cache alone (it holds the whole dataset): the decoded tier would serve the later epochs and
    # the second group from decoded samples, without a read (tests/test_tier.py).
    searcher = CoordinatedSearcher(cache=CacheSpec("64MiB"), pool=dataclasses.replace(warm_pool, decoded_fraction=0))
    with FileOpens(small_dataset) as opens:
        analysis = tune.run(
            tune.with_resources(record, {"cpu": 0.25}),
            config={"data": tune.grid_search(specs), "batch_size": 10, "epochs": EPOCHS, "out": str(tmp_path)},
            search_alg=searcher, verbose=0,
        )
        groups, caches, pools = searcher.group_reports(), searcher.cache_reports(), searcher.pool_reports()
    searcher.close()
    assert all(t.status == "TERMINATED" for t in analysis.trials), [t.error_file for t in analysis.trials]
    assert not any("cache" in name for name in live_coordprep_actors())  # the registry destroyed it
    records = load_records(str(tmp_path))
    for trial in analysis.trials:
        check_trial_records(trial.config["data"], records[trial.trial_id], 10, trial.trial_id)
    [cache] = caches.values()
    requests = len(specs) * EPOCHS * len(train)
    assert cache["items"] == cache["storage_reads"] == len(train) and cache["hits_remote"] == 0
    # The prep actors serve cached samples from a snapshot of the cached set, without calls. A reader
    # asks the cache for a sample only while its snapshot lacks it, and the hit that answers it makes
    # the reader take a new snapshot: the cache answers each reader's hit for a sample at most once.
    # Without snapshots it would answer every request after the first read of each sample.
    [pool] = pools.values()
    assert cache["hits_local"] <= pool["prep_actors"] * len(train) < requests - len(train), (cache, pool)
    assert sum(g["storage_reads"] for g in groups.values()) == 0  # nothing read past the cache
    assert sum(g["cache_hits"] for g in groups.values()) == requests
    assert not opens.overflowed
    assert {opens.counts[source.describe(int(i))] for i in train} == {1}  # once per sweep, both groups together
