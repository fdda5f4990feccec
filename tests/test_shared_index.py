"""The dataset is indexed once per sweep and node: no coordinator, prep actor or trial walks it again."""

from __future__ import annotations

import glob
import os

import numpy as np
from ray import tune

from coordinated_prep import CoordinatedSearcher, DataSpec, PoolSpec
from coordinated_prep.pipeline.sources import ImageFolderSource
from coordinated_prep.pipeline.sources.folder_index import scan
from tests.harness import check_trial_records
from tests.recording import load_records, record
from tests.utils import FileOpens, make_imagefolder


def test_the_shared_index_equals_a_walk_and_pickles_small(tmp_path):
    root = make_imagefolder(str(tmp_path / "data"), classes=3, per_class=7)
    walked, shared = ImageFolderSource(root), ImageFolderSource(root, scan(root))
    assert list(shared.paths) == list(walked.paths) and shared.classes == walked.classes
    assert np.array_equal(shared.labels, walked.labels) and shared.read(4) == walked.read(4)
    assert shared.paths[-1] == walked.paths[20] and shared.paths[1:3] == list(walked.paths)[1:3]


def test_a_sweep_walks_each_class_folder_once_and_its_trials_find_the_pool_warm(ray_session, tmp_path):
    root = make_imagefolder(str(tmp_path / "data"), classes=3, per_class=20)
    spec = DataSpec(dataset=root, pipeline={"size": 16}, chunk_size=8, segments=2)
    classes = [os.path.join(root, c) for c in sorted(os.listdir(root))]
    with FileOpens(root) as opens:
        searcher = CoordinatedSearcher(pool=PoolSpec(actors=2))
        analysis = tune.run(tune.with_resources(record, {"cpu": 0.25}), search_alg=searcher, verbose=0,
                            config={"data": spec, "batch_size": 8, "epochs": 2, "evaluate": True,
                                    "out": str(tmp_path / "out"), "n": tune.grid_search([1, 2])})
        searcher.close()
    assert all(t.status == "TERMINATED" for t in analysis.trials), [t.error_file for t in analysis.trials]
    # Two trials, a coordinator and two prep actors opened the dataset (trials twice: training and
    # evaluation); the sweep's one walk is the only listing of each class folder.
    assert {c: opens.dir_opens[c] for c in classes} == {c: 1 for c in classes}, opens.dir_opens
    for name, epochs in load_records(str(tmp_path / "out")).items():
        check_trial_records(spec, epochs, 8, name)
        # A warm start: the node's two prep actors had imported torch before this trial asked for data.
        assert int(epochs[0]["warm_at_start"]) == 2, name
    # The coordinator, an async actor, got the index without a blocking ray.get (Ray warns of one).
    assert _async_actor_logs_with("Using blocking ray.get inside async actor") == []


def _async_actor_logs_with(text: str) -> list[str]:
    """The log files of this Ray session's coordinators and node caches that hold ``text``."""
    from ray._private.worker import _global_node

    found = []
    for path in glob.glob(os.path.join(_global_node.get_logs_dir_path(), "worker-*.err")):
        with open(path, errors="replace") as f:
            log = f.read()
        if (":actor_name:Coordinator" in log or ":actor_name:RawCache" in log) and text in log:
            found.append(path)
    return found


def test_outside_a_sweep_each_process_walks_for_itself(tmp_path):
    root = make_imagefolder(str(tmp_path / "data"), classes=2, per_class=5)
    first = os.path.join(root, sorted(os.listdir(root))[0])
    with FileOpens(root) as opens:
        ImageFolderSource(root)
        ImageFolderSource(root)
    assert opens.dir_opens[first] == 2  # the counter sees walks: the sweep test's 1 is not blindness



def test_a_folder_url_is_listed_once_for_the_sweep_and_a_failed_listing_is_tried_again(
        ray_session, warm_pool, small_dataset, tmp_path, node_cache):
    """Every process of the sweep's job that opens a folder URL (here the driver, then two tasks, as a
    coordinator and the prep actors of any node) borrows the registry's one listing of it: the later
    openers cost no listing request. The same for a folder of tar shards."""
    import shutil

    import pytest
    import ray

    from coordinated_prep.convert.tar import convert_to_tar
    from coordinated_prep.errors import DatasetError
    from coordinated_prep.pipeline.sources import open_source
    from tests.servers import Server

    def pages(server: Server) -> dict[str, int]:  # a folder's page is a listing's request
        return {p: n for (method, p), n in server.requests().items() if method == "GET" and p.endswith("/")}

    convert_to_tar(small_dataset, str(tmp_path / "served" / "tars"), shard_size=64)
    with Server("http", str(tmp_path / "http.log"), str(tmp_path / "served")) as server:
        searcher = CoordinatedSearcher(pool=warm_pool)
        searcher.start()
        try:
            with pytest.raises(DatasetError, match="does not exist"):  # through the registry, named as here
                open_source.__wrapped__(f"{server.url}/photos")
            shutil.copytree(small_dataset, tmp_path / "served" / "photos")  # the store answers now
            for folder in ("photos", "tars"):
                url = f"{server.url}/{folder}"
                here = open_source.__wrapped__(url)
                listed = pages(server)
                opened = ray.get([ray.remote(num_cpus=0)(lambda: open_source.__wrapped__(url).labels.tolist()).remote()
                                  for _ in range(2)])
                assert opened == [here.labels.tolist()] * 2 and len(here) == 180, folder
                assert pages(server) == listed, f"{folder}: the later openers listed it again"
                assert listed.get(f"/{folder}/"), f"{folder}: the counter sees the listing: {listed}"
            final = pages(server)
        finally:
            searcher.close()
    classes = [f"/photos/{c}/" for c in sorted(os.listdir(small_dataset))]
    assert {c: final.get(c) for c in classes} == {c: 1 for c in classes}, f"one listing for three openers: {final}"
