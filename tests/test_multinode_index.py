"""Copies of one dataset that differ between nodes are refused, naming both nodes.

A cluster of raylets on one machine shares one filesystem, so each worker node is given its own
dataset cache directory (``COORDPREP_CACHE`` in the raylet's environment): ``builtin:shapes`` then
names a different copy on each node, and node_b's copy holds one image more.
"""

from __future__ import annotations

import os
import shutil

import pytest
import ray
from ray import tune
from ray.tune import PlacementGroupFactory

from coordinated_prep import CoordinatedSearcher, DataSpec
from coordinated_prep.pipeline.sources import shapes
from tests.conftest import REPO, live_coordprep_actors, own_ray
from tests.recording import record
from tests.test_shared_index import _async_actor_logs_with
from tests.utils import make_imagefolder

WORKERS = ("node_a", "node_b")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    from ray.cluster_utils import Cluster

    caches = {name: str(tmp_path_factory.mktemp(f"cache-{name}")) for name in WORKERS}
    for name, cache in caches.items():
        root = os.path.join(cache, f"shapes-v{shapes._VERSION}")  # where builtin:shapes is looked for
        make_imagefolder(root, classes=2, per_class=12, png_every=99)
        if name == "node_b":
            shutil.copy(os.path.join(root, "class_0", "img_001.jpg"), os.path.join(root, "class_0", "extra.jpg"))
    own_ray()  # this module's Ray is its own
    c = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False})
    nodes = {name: c.add_node(num_cpus=1, resources={name: 4}, env_vars={"COORDPREP_CACHE": caches[name]})
             for name in WORKERS}
    c.wait_for_nodes()
    ray.init(address=c.address, log_to_driver=False, runtime_env={"env_vars": {"PYTHONPATH": REPO}})
    yield nodes
    ray.shutdown()
    c.shutdown()


def test_copies_that_differ_between_nodes_are_refused_naming_both(cluster, tmp_path):
    spec = DataSpec(dataset="builtin:shapes", pipeline={"size": 24}, chunk_size=8, segments=2)
    searcher = CoordinatedSearcher(max_concurrent=1)  # node_a's trial runs, and starts the group, first
    analysis = tune.run(
        tune.with_resources(record, lambda config: PlacementGroupFactory([{"CPU": 0.25, config["node"]: 1}])),
        config={"data": spec, "node": tune.grid_search(list(WORKERS)), "batch_size": 8, "epochs": 1,
                "out": str(tmp_path)},
        search_alg=searcher, verbose=0, raise_on_failed_trial=False,
    )
    searcher.close()
    statuses = {t.config["node"]: t.status for t in analysis.trials}
    assert statuses == {"node_a": "TERMINATED", "node_b": "ERROR"}, statuses  # node_a started the group first
    [failed] = [t for t in analysis.trials if t.status == "ERROR"]
    message = open(failed.error_file).read()
    ids = {name: node.node_id for name, node in cluster.items()}
    assert "differs between nodes" in message and ids["node_a"] in message and ids["node_b"] in message, message
    assert "24 samples" in message and "25 samples" in message, message
    assert live_coordprep_actors() == []
    # Each node's coordinator got its node's index without a blocking ray.get (in an async actor).
    assert _async_actor_logs_with("Using blocking ray.get inside async actor") == []
