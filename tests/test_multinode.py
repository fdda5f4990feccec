"""Several nodes with ``ray.cluster_utils.Cluster`` (raylets on one machine, each with its own resources).

Trials are pinned to two worker nodes by custom resources. Each node runs its own coordinator and
prep actors; the node caches split the dataset by seed; storage reads are counted by the kernel
(inotify); copies of a dataset that differ between nodes are refused; and one node is removed in the
middle of a sweep.

A cluster of raylets on one machine shares one filesystem, so each worker node's raylet is given its
own dataset cache directory (``COORDPREP_CACHE``): ``builtin:shapes`` then names a different copy on
each node, and node_b's copy holds one image more. The driver's runtime environment sets the
session's cache for every worker instead, except in the test of differing copies, which connects
without it.

The first two sweeps share their prep actors (one per node, started once instead of twice): the
first keeps them (``PoolSpec(keep_warm=True)``), the second starts on them and ends them, before the
test of differing copies reconnects (which would end them: they are the driver's). The sweep that
loses node_b starts a pool of its own, and keeps it at its close: its actor on the lost node is
gone with it (a call to it raises ``ActorUnschedulableError``), and the others are kept.
"""

from __future__ import annotations

import glob
import os
import shutil
import threading

import numpy as np
import pytest
import ray
from ray import tune
from ray.tune import PlacementGroupFactory
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from coordinated_prep import CoordinatedSearcher, DataSpec, PoolSpec
from coordinated_prep.cache import CacheLayout, CacheSpec
from coordinated_prep.cache.arena import arena_dir
from coordinated_prep.plan import holdout_split
from coordinated_prep.pipeline.sources import open_source, shapes
from coordinated_prep.pool import warm
from tests.conftest import REPO, live_coordprep_actors, own_ray
from tests.harness import check_trial_records
from tests.recording import Gate, load_records, record, record_ranks
from tests.test_shared_index import _async_actor_logs_with
from tests.utils import FileOpens, make_imagefolder

EPOCHS = 2
WORKERS = ("node_a", "node_b")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """A head (driver, registry) and two worker nodes, each tagged with its own custom resource, each
    with a dataset cache of its own where its raylet looks (see the module's docstring)."""
    from ray.cluster_utils import Cluster

    caches = {name: str(tmp_path_factory.mktemp(f"cache-{name}")) for name in WORKERS}
    for name, cache in caches.items():
        root = os.path.join(cache, f"shapes-v{shapes._VERSION}")  # where builtin:shapes is looked for
        make_imagefolder(root, classes=2, per_class=12, png_every=99)
        if name == "node_b":
            shutil.copy(os.path.join(root, "class_0", "img_001.jpg"), os.path.join(root, "class_0", "extra.jpg"))
    store = 200 * 2**20
    own_ray()  # this module's Ray is its own
    c = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "object_store_memory": store,
                                                      "include_dashboard": False})
    nodes = {name: c.add_node(num_cpus=1, resources={name: 4}, object_store_memory=store,
                              env_vars={"COORDPREP_CACHE": caches[name]}) for name in WORKERS}
    c.wait_for_nodes()
    _connect(c, shared_cache=True)
    yield c, nodes
    own_ray()
    c.shutdown()


def _connect(c, shared_cache: bool) -> None:
    """(Re)connect this driver to the cluster; ``shared_cache``: every worker uses the session's cache."""
    if ray.is_initialized():
        ray.shutdown()
    env = {"PYTHONPATH": REPO, **({"COORDPREP_CACHE": os.environ["COORDPREP_CACHE"]} if shared_cache else {})}
    ray.init(address=c.address, log_to_driver=False, runtime_env={"env_vars": env})


def _pinned(config: dict) -> PlacementGroupFactory:
    return PlacementGroupFactory([{"CPU": 0.25, config["node"]: 1}])


def _per_node_batch_size():
    """One trial per node, each with a batch size of its own: 8, and on node_b 12 (it straddles the pieces of 8)."""
    return tune.sample_from(lambda c: 12 if c["node"] == "node_b" else 8)


def _spec(dataset: str) -> DataSpec:
    return DataSpec(dataset=dataset, pipeline={"size": 32}, seed=2, chunk_size=8, segments=4,
                    lookahead=2)


def _owners(caches: dict, spec: DataSpec, n: int) -> tuple[tuple[str, ...], np.ndarray]:
    nodes = tuple(sorted(caches))  # the registry's layout: every live node, sorted
    return nodes, CacheLayout("-", nodes, seed=0).owners(n, nodes[0])


def test_each_node_serves_its_own_trials_and_storage_is_read_once(cluster, small_dataset, tmp_path):
    _, nodes = cluster
    spec = _spec(small_dataset)
    source = open_source(small_dataset)
    train, _ = holdout_split(len(source), spec.holdout)
    # The caches together hold the dataset; the next sweep starts on its prep actors (see the module's docstring).
    searcher = CoordinatedSearcher(cache=CacheSpec("32MiB"), pool=PoolSpec(keep_warm=True))
    with FileOpens(small_dataset) as opens:
        analysis = tune.run(
            tune.with_resources(record, _pinned),
            config={"data": spec, "node": tune.grid_search(list(WORKERS)), "batch_size": _per_node_batch_size(),
                    "epochs": EPOCHS, "out": str(tmp_path)},
            search_alg=searcher, verbose=0,
        )
        groups, caches = searcher.group_reports(), searcher.cache_reports()
    searcher.close()
    assert all(t.status == "TERMINATED" for t in analysis.trials), [t.error_file for t in analysis.trials]
    assert sorted(t.config["batch_size"] for t in analysis.trials) == [8, 12]
    assert not glob.glob(f"{arena_dir()}/coordprep-{searcher.session}-*")  # the caches deleted their arenas
    records = load_records(str(tmp_path))
    node_ids = {name: node.node_id for name, node in nodes.items()}
    for trial in analysis.trials:
        epochs = records[trial.trial_id]
        check_trial_records(spec, epochs, trial.config["batch_size"], trial.trial_id)
        node = node_ids[trial.config["node"]]
        assert {str(e["node"]) for e in epochs} == {node}  # pinned where asked
        assert node[:8] in str(epochs[0]["coordinator"])  # served by the coordinator of its own node

    [group] = groups.values()
    assert sorted(group["nodes"]) == sorted(node_ids.values()) and group["coordinators"] == 2  # one per node
    assert len(caches) == 3  # head and both workers: every live node holds a part
    nodes_sorted, owners = _owners(caches, spec, len(source))
    for k, node in enumerate(nodes_sorted):  # each cache holds exactly its part of the training split
        assert caches[node]["items"] == int((owners[train] == k).sum()), caches[node]
    assert sum(c["storage_reads"] for c in caches.values()) == len(train)
    assert sum(c["hits_remote"] for c in caches.values()) > 0  # misses served from another node's cache
    assert group["storage_reads"] == 0
    assert not opens.overflowed
    assert {opens.counts[source.describe(int(i))] for i in train} == {1}  # once per sweep, both nodes together


def test_the_ranks_of_a_data_parallel_trial_on_two_nodes_read_their_own_nodes_coordinators(
        cluster, small_dataset, tmp_path):
    spec = _spec(small_dataset)
    searcher = CoordinatedSearcher(pool=PoolSpec(decoded_fraction=0))  # on the kept actors, ending them
    analysis = tune.run(tune.with_resources(record_ranks, {"cpu": 0.1}), search_alg=searcher, verbose=0,
                        config={"data": spec, "workers": 2, "batch_size": 8, "epochs": 2, "out": str(tmp_path),
                                "placement": "STRICT_SPREAD", "cpu_per_worker": 0.25})
    groups = searcher.group_reports()
    searcher.close()
    assert all(t.status == "TERMINATED" for t in analysis.trials), [t.error_file for t in analysis.trials]
    [trial] = analysis.trials
    ranks = {int(d[4:]): sorted(os.listdir(tmp_path / trial.trial_id / d), key=lambda f: int(f[5:-4]))
             for d in os.listdir(tmp_path / trial.trial_id)}
    epochs = {r: [dict(np.load(tmp_path / trial.trial_id / f"rank{r}" / f)) for f in files] for r, files in ranks.items()}
    nodes = [str(epochs[r][0]["node"]) for r in (0, 1)]
    assert nodes[0] != nodes[1], "the two ranks run on two nodes"
    for r in (0, 1):  # each read from the coordinator of its own node, no piece prepared privately
        assert nodes[r][:8] in str(epochs[r][0]["coordinator"]) and int(epochs[r][-1]["private_samples"]) == 0
    train = holdout_split(len(open_source(small_dataset)), spec.holdout)[0]
    for e in range(2):
        rows = [epochs[r][e] for r in (0, 1)]
        assert int(rows[0]["start"]) == int(rows[1]["start"]), "one start on both nodes"
        assert len(rows[0]["batch_sizes"]) == len(rows[1]["batch_sizes"])
        fresh = np.concatenate([row["indices"][row["repeats"] == 0] for row in rows])
        assert sorted(fresh.tolist()) == sorted(train.tolist()), f"epoch {e}: not every sample exactly once"
    [group] = groups.values()
    assert group["coordinators"] == 2 and group["cohorts"] == 2, group  # one per node, each with its rank


def test_copies_that_differ_between_nodes_are_refused_naming_both(cluster, tmp_path):
    c, nodes = cluster
    warm.release()  # its pool must not start on kept actors: they carry the session's cache
    try:
        _connect(c, shared_cache=False)  # each node's workers see their raylet's cache
        spec = DataSpec(dataset="builtin:shapes", pipeline={"size": 24}, chunk_size=8, segments=2)
        searcher = CoordinatedSearcher(max_concurrent=1)  # node_a's trial runs, and starts the group, first
        analysis = tune.run(
            tune.with_resources(record, _pinned),
            config={"data": spec, "node": tune.grid_search(list(WORKERS)), "batch_size": 8, "epochs": 1,
                    "out": str(tmp_path)},
            search_alg=searcher, verbose=0, raise_on_failed_trial=False,
        )
        searcher.close()
        assert live_coordprep_actors() == []
    finally:
        _connect(c, shared_cache=True)
    statuses = {t.config["node"]: t.status for t in analysis.trials}
    assert statuses == {"node_a": "TERMINATED", "node_b": "ERROR"}, statuses  # node_a started the group first
    [failed] = [t for t in analysis.trials if t.status == "ERROR"]
    message = open(failed.error_file).read()
    ids = {name: node.node_id for name, node in nodes.items()}
    assert "differs between nodes" in message and ids["node_a"] in message and ids["node_b"] in message, message
    assert "24 samples" in message and "25 samples" in message, message
    # Each node's coordinator got its node's index without a blocking ray.get (in an async actor).
    assert _async_actor_logs_with("Using blocking ray.get inside async actor") == []


def test_a_node_leaving_mid_sweep_sends_its_part_back_to_storage_and_the_others_go_on(
        cluster, small_dataset, tmp_path):
    c, nodes = cluster
    spec = _spec(small_dataset)
    source = open_source(small_dataset)
    train, _ = holdout_split(len(source), spec.holdout)
    gate = Gate.options(name="gate", namespace="coordinated_prep", scheduling_strategy=NodeAffinitySchedulingStrategy(
        ray.get_runtime_context().get_node_id(), soft=False)).remote()
    # The raw caches alone: a decoded tier would spare the later epochs the reads this test counts.
    # Its prep actors are kept at its close: the lost node's with it are gone, and killing them must
    # neither raise nor leave the others unkept (Ray answers them ActorUnschedulableError).
    searcher = CoordinatedSearcher(cache=CacheSpec("32MiB"), pool=PoolSpec(decoded_fraction=0, keep_warm=True))
    lost = nodes["node_b"].node_id

    def remove_node_b() -> None:  # once both trials (one per node) have finished their first epoch, and wait
        ray.get(gate.wait_arrivals.remote(2, 300), timeout=330)
        c.remove_node(nodes["node_b"])
        ray.get(gate.open.remote(), timeout=60)

    remover = threading.Thread(target=remove_node_b, daemon=True)
    with FileOpens(small_dataset) as opens:
        remover.start()
        analysis = tune.run(
            tune.with_resources(record, _pinned),
            config={"data": spec, "node": tune.grid_search(list(WORKERS)), "batch_size": _per_node_batch_size(),
                    "epochs": EPOCHS, "out": str(tmp_path), "gate": "gate", "gate_after": 0},
            search_alg=searcher, verbose=0, raise_on_failed_trial=False, max_failures=0,
        )
        remover.join(timeout=60)
        caches = searcher.cache_reports()
    searcher.close()
    kept, alive = set(warm.kept()), {node["NodeID"] for node in ray.nodes() if node["Alive"]}
    warm.release()
    ray.kill(gate)
    for path in glob.glob(f"{arena_dir()}/coordprep-{searcher.session}-*"):  # the lost node's, on this machine
        os.unlink(path)
    assert kept == alive and lost not in kept, (kept, alive)  # the lost node's actors gone, the others kept
    by_node = {n: [t for t in analysis.trials if t.config["node"] == n] for n in WORKERS}
    assert all(t.status == "TERMINATED" for t in by_node["node_a"]), [t.error_file for t in by_node["node_a"]]
    assert len(by_node["node_a"]) == len(by_node["node_b"]) == 1
    assert all(t.status == "ERROR" for t in by_node["node_b"])  # it died with its node
    records = load_records(str(tmp_path))
    for trial in by_node["node_a"]:  # the survivor kept exact epochs across the loss
        check_trial_records(spec, records[trial.trial_id], trial.config["batch_size"], trial.trial_id)
    assert caches[lost].get("lost"), caches

    nodes_sorted, owners = _owners(caches, spec, len(source))
    reads = np.array([opens.counts[source.describe(int(i))] for i in train])
    mine = owners[train] != nodes_sorted.index(lost)
    assert set(reads[mine].tolist()) == {1}  # the surviving caches kept serving their parts
    assert reads[~mine].min() >= 1 and reads[~mine].max() <= EPOCHS
    assert reads[~mine].sum() > (~mine).sum()  # after the loss, node_b's part came from storage again


def test_a_lending_pool_holds_its_shares_of_cpus_on_its_own_node_and_gives_them_back(cluster):
    """A pool sized by demand holds each actor's share of CPUs as a placement group pinned to its node
    (by the ``ray.io/node-id`` label), whatever node has CPUs free, and removes it when it gives the
    share back or ends. Here a pool for node_a (the test before removes node_b) of (as if) 2 CPUs: 1
    actor, 0.5 CPU."""
    import asyncio
    import dataclasses

    from ray.util import placement_group_table

    from coordinated_prep.pool.node import NodePool

    _, nodes = cluster
    node = nodes["node_a"].node_id
    warm.release()  # no kept prep actor holds node_a's CPUs, whatever ran before
    pool = NodePool(node, 2.0, 200 * 2**20, PoolSpec(decoded_fraction=0), None)
    try:
        assert pool.lends and pool.growth.shares == len(pool.shares) == 1 and pool.reserved_cpus == 0.5
        asyncio.run(pool.ready())
        [share] = pool.shares
        assert set(placement_group_table(share)["bundles_to_node_id"].values()) == {node}
        assert asyncio.run(pool.reserve()), "a second share fits beside the first (node_a has 1 CPU)"
        assert set(placement_group_table(pool.shares[1])["bundles_to_node_id"].values()) == {node}
        pool.spec = dataclasses.replace(pool.spec, start_timeout_s=1.0)  # a refusal within 1 s, not SHARE_TIMEOUT_S
        assert not asyncio.run(pool.reserve()) and "no CPU came free" in pool.given_up_why, "node_a is full"
        assert len(pool.shares) == 2 and pool.reserved_cpus == 1.0
        pool.release()
        assert placement_group_table(share)["state"] == "CREATED" and len(pool.shares) == 1
    finally:
        pool.kill()
    assert placement_group_table(share)["state"] == "REMOVED" and pool.shares == []
