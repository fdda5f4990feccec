"""Starting node caches with Ray: an impossible capacity stops the sweep at start; a killed cache's memory is
reclaimed."""

from __future__ import annotations

import asyncio
import os
import select
import signal

import pytest
import ray
from ray import tune

from coordinated_prep import CacheError, CoordinatedSearcher, DataSpec, PoolSpec
from coordinated_prep.cache import CacheSpec
from coordinated_prep.cache.layout import CacheLayout
from coordinated_prep.cache.start import start_caches
from coordinated_prep.pool import warm
from tests.conftest import live_coordprep_actors
from tests.recording import record
from tests.utils import FileOpens

IMPOSSIBLE = 2**62  # more than /dev/shm or any filesystem of the temporary directory can hold


def _layout(session: str) -> CacheLayout:
    return CacheLayout(session, (ray.get_runtime_context().get_node_id(),))


def _holders(path: str) -> list[int]:
    """Pids of the processes holding ``path`` open."""
    pids = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if any(os.readlink(f"/proc/{pid}/fd/{fd}") == path for fd in os.listdir(f"/proc/{pid}/fd")):
                pids.append(int(pid))
        except OSError:
            continue
    return pids


def test_a_capacity_that_cannot_be_reserved_is_an_error_naming_node_and_fix(ray_session):
    layout = _layout("test-impossible")
    with pytest.raises(CacheError) as info:
        asyncio.run(start_caches(CacheSpec(IMPOSSIBLE), layout))
    message = str(info.value)
    assert f"cache.capacity_bytes={IMPOSSIBLE}" in message and layout.nodes[0] in message
    assert "lower cache.capacity_bytes" in message and "/dev/shm" in message
    assert not any("test-impossible" in name for name in live_coordprep_actors())  # destroyed, not left behind


def _no_data(config: dict) -> None:
    """A trial that reads no data: it ends before its sweep's registry has started."""
    tune.report({"done": 1})


@pytest.mark.parametrize("kept, trainable", [(False, record), (True, record), (True, _no_data)])
def test_a_sweep_whose_cache_cannot_start_fails_at_start_instead_of_reading_storage(ray_session, small_dataset,
                                                                                    tmp_path, monkeypatch, kept,
                                                                                    trainable):
    """With a pool kept warm (``kept``), Tune's trial starts while the registry does: the failed start
    still ends the sweep with its reason, even when the trial ended first, and leaves no actor (the
    kept one is not kept again). One prep actor and one trial: that is all the early start needs."""
    spec = DataSpec(dataset=small_dataset, pipeline={"size": 24}, seed=1, chunk_size=8)
    pool = PoolSpec(actors=1, keep_warm=kept)
    if kept:  # a pool the driver's last sweep kept, of this sweep's shape, its imports done
        lent = warm.lend(pool)
        ray.get([actor.imported.remote() for actors in lent.values() for actor in actors], timeout=300)
        warm.give_back(lent, pool)
        assert list(warm.kept().values()) == [pool.shape_for(2.0)]
    decided = []
    placed = warm.placed
    monkeypatch.setattr(warm, "placed", lambda lent: decided.append(placed(lent)) or decided[-1])
    searcher = CoordinatedSearcher(cache=CacheSpec(IMPOSSIBLE), pool=pool)
    with FileOpens(small_dataset) as opens, pytest.raises(Exception) as info:
        tune.run(tune.with_resources(trainable, {"cpu": 0.25}),
                 config={"data": spec, "batch_size": 10, "epochs": 1, "out": str(tmp_path)},
                 search_alg=searcher, num_samples=1, verbose=0, raise_on_failed_trial=False)
    searcher.close()
    error = str(info.value)
    assert "cannot be reserved on node" in error and "lower cache.capacity_bytes" in error, error
    assert sum(opens.counts.values()) == 0  # no sample was read from storage
    assert live_coordprep_actors() == [] and warm.kept() == {}
    if kept:
        assert decided == [True], "on a kept pool, Tune's trial started while the registry did"
    else:
        assert True not in decided, "a pool of the registry's own is waited for"


def test_a_sigkilled_caches_arena_is_reclaimed_by_the_next_sweeps_cache_and_a_live_one_kept(ray_session):
    killed = asyncio.run(start_caches(CacheSpec("1MiB"), _layout("test-killed")))
    live = asyncio.run(start_caches(CacheSpec("1MiB"), _layout("test-live")))
    [killed_handle], [live_handle] = killed.values(), live.values()
    killed_path, live_path = ray.get(killed_handle.arena_id.remote()).path, ray.get(live_handle.arena_id.remote()).path
    [pid] = _holders(killed_path)
    process = os.pidfd_open(pid)
    os.kill(pid, signal.SIGKILL)
    assert select.select([process], [], [], 30)[0], "the killed cache actor did not exit"  # readable on exit
    os.close(process)
    assert os.path.exists(killed_path)  # SIGKILL: the actor could not delete it
    following = asyncio.run(start_caches(CacheSpec("1MiB"), _layout("test-next")))  # the next sweep on the node
    assert not os.path.exists(killed_path) and os.path.exists(live_path)
    for handles in (live, following):
        for handle in handles.values():
            ray.get(handle.clear.remote())
            ray.kill(handle)
    assert not os.path.exists(live_path)
