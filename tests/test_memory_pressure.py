"""A small object store (256 MiB) and large batches: the sweep finishes within the staging budget."""

from __future__ import annotations

import os

import pytest
from ray import tune

from coordinated_prep import CoordinatedSearcher, DataSpec
from tests.conftest import REPO, live_coordprep_actors, own_ray, plasma_objects, plasma_objects_settled
from tests.harness import check_trial_records
from tests.recording import load_records, record
from tests.utils import make_imagefolder

STORE = 256 * 2**20


@pytest.fixture(scope="module")
def small_store_ray(tmp_path_factory):
    import ray

    own_ray()  # this module's Ray is its own
    ray.init(address="local", num_cpus=2, include_dashboard=False, object_store_memory=STORE, log_to_driver=False,
             runtime_env={"env_vars": {"PYTHONPATH": REPO, "COORDPREP_CACHE": os.environ["COORDPREP_CACHE"]}})
    yield ray
    ray.shutdown()


def test_large_batches_in_a_small_object_store_finish_within_the_budget(small_store_ray, tmp_path):
    root = make_imagefolder(str(tmp_path / "data"), classes=2, per_class=150, size=(160, 120), png_every=99)
    # 96 px pieces of 48 samples are 1.3 MiB; batches of 96 and 144 samples span 2 and 3 pieces.
    spec = DataSpec(dataset=root, pipeline={"size": 96}, chunk_size=48, segments=2)
    baseline = plasma_objects()
    searcher = CoordinatedSearcher(pool={"staging_fraction": 0.1})
    analysis = tune.run(
        tune.with_resources(record, {"cpu": 0.25}),
        config={"data": spec, "batch_size": tune.grid_search([96, 144]), "epochs": 2, "out": str(tmp_path / "rec")},
        search_alg=searcher, verbose=0, raise_on_failed_trial=False,
    )
    [report] = searcher.group_reports().values()
    searcher.close()
    assert all(t.status == "TERMINATED" for t in analysis.trials), [t.error_file for t in analysis.trials]
    assert report["budget_bytes"] == int(STORE * 0.1)
    assert report["peak_staged_bytes"] <= report["budget_bytes"]
    sizes = {t.trial_id: t.config["batch_size"] for t in analysis.trials}
    for trial, epochs in load_records(str(tmp_path / "rec")).items():
        check_trial_records(spec, epochs, sizes[trial], trial)
    assert live_coordprep_actors() == [] and plasma_objects_settled(baseline) <= baseline
