"""A small staging budget (5% of the tests' 512 MiB object store: 25.6 MiB) and large batches: the sweep
finishes within the budget."""

from __future__ import annotations

import dataclasses

from ray import tune

from coordinated_prep import CoordinatedSearcher, DataSpec
from tests.conftest import live_coordprep_actors, plasma_objects, plasma_objects_settled, shared_ray_settings
from tests.harness import check_trial_records
from tests.recording import load_records, record
from tests.utils import make_imagefolder

FRACTION = 0.05  # of the object store, for the staging budget


def test_large_batches_in_a_small_staging_budget_finish_within_it(ray_session, tmp_path, warm_pool):
    root = make_imagefolder(str(tmp_path / "data"), classes=2, per_class=150, size=(160, 120), png_every=99)
    # 96 px pieces of 48 samples are 1.3 MiB; batches of 96 and 144 samples span 2 and 3 pieces.
    spec = DataSpec(dataset=root, pipeline={"size": 96}, chunk_size=48, segments=2)
    baseline = plasma_objects()
    searcher = CoordinatedSearcher(pool=dataclasses.replace(warm_pool, staging_fraction=FRACTION))
    analysis = tune.run(
        tune.with_resources(record, {"cpu": 0.25}),
        config={"data": spec, "batch_size": tune.grid_search([96, 144]), "epochs": 2, "out": str(tmp_path / "rec")},
        search_alg=searcher, verbose=0, raise_on_failed_trial=False,
    )
    [report] = searcher.group_reports().values()
    searcher.close()
    assert all(t.status == "TERMINATED" for t in analysis.trials), [t.error_file for t in analysis.trials]
    assert report["budget_bytes"] == int(shared_ray_settings()["object_store_memory"] * FRACTION) < 26 * 2**20
    assert report["peak_staged_bytes"] <= report["budget_bytes"]
    sizes = {t.trial_id: t.config["batch_size"] for t in analysis.trials}
    for trial, epochs in load_records(str(tmp_path / "rec")).items():
        check_trial_records(spec, epochs, sizes[trial], trial)
    assert live_coordprep_actors() == [] and plasma_objects_settled(baseline) <= baseline
