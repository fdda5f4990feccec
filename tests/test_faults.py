"""Faults injected through real processes: the sweep goes on, nothing is lost, nothing hangs.

Each test checks exact epochs for the trials that finish, the object store back to its baseline,
and (through pytest-timeout) a bounded finish time.
"""

from __future__ import annotations

import dataclasses

from ray import tune

from coordinated_prep import CoordinatedSearcher, DataSpec, PoolSpec
from tests.conftest import live_coordprep_actors, plasma_objects, plasma_objects_settled, settled
from coordinated_prep.pipeline.sources import open_source
from tests.harness import assert_exactly_once, check_trial_records, train_ids
from tests.utils import make_imagefolder
from tests.recording import load_records, pids_titled, record


def _spec(dataset: str, **overrides) -> DataSpec:
    values = dict(dataset=dataset, pipeline={"size": 32}, seed=9, chunk_size=8, segments=4,
                  lookahead=2)
    values.update(overrides)
    return DataSpec(**values)


def _run(config: dict, tmp_path, pool: PoolSpec | None = None, loaders: dict | None = None, **kwargs):
    """Runs ``record`` under Tune; returns the analysis and the group reports (``loaders``: filled with
    what each trial's loader told the sweep)."""
    searcher = CoordinatedSearcher(pool=pool)
    analysis = tune.run(tune.with_resources(record, {"cpu": 0.25}), config={**config, "out": str(tmp_path)},
                        search_alg=searcher, verbose=0, raise_on_failed_trial=False, **kwargs)
    reports = searcher.group_reports()
    if loaders is not None:
        loaders.update(searcher.loader_reports())
    searcher.close()
    return analysis, reports


def test_a_straggler_is_detached_after_the_lease_and_keeps_exact_epochs(ray_session, small_dataset, tmp_path,
                                                                        warm_pool):
    baseline = plasma_objects()
    # The budget holds two pieces. The slow trial starts first, so the fast one runs beside it and
    # fills the budget within a few batches; from then on production stays blocked for the whole of
    # each slow step (0.6 s), which is longer than the lease (0.25 s), so the slow trial is detached
    # early in its first epoch, not by an incidental pause near its end. The fast trial's steps (0.1 s,
    # 2 epochs) keep it reading beside the slow one for seconds, well under the lease each.
    spec = _spec(small_dataset, staging_bytes=2 * 8 * 3 * 32 * 32, lease_s=0.25)
    # Once detached, the straggler reads on without its delay: the rest of its epochs take no 0.6 s steps.
    loaders: dict = {}
    analysis, reports = _run({"data": spec, "batch_size": 8, "epochs": 2, "delay_while_shared": True,
                              "delay_s": tune.grid_search([0.6, 0.1])}, tmp_path, warm_pool, loaders)
    assert all(t.status == "TERMINATED" for t in analysis.trials), [t.error_file for t in analysis.trials]
    [report] = reports.values()
    assert report["evictions"] >= 1 and report["peak_staged_bytes"] <= spec.staging_bytes
    delays = {t.trial_id: t.config["delay_s"] for t in analysis.trials}
    for trial, epochs in load_records(str(tmp_path)).items():
        check_trial_records(spec, epochs, 8, trial)
        told = loaders[trial]  # what its loader told the sweep (the summary's notes)
        if delays[trial] == max(delays.values()):
            assert int(epochs[-1]["private_samples"]) > 0, "the straggler prepared its own pieces after the lease"
            assert told["private_samples"] == int(epochs[-1]["private_samples"]), told
            assert told["private_reason"].startswith("the lease of 0.25 s detached it at piece "), told
        else:
            assert int(epochs[-1]["private_samples"]) == 0, "the lease detaches the straggler only"
            assert told["private_samples"] == 0 and told["private_reason"] is None, told
    assert live_coordprep_actors() == [] and plasma_objects_settled(baseline) <= baseline


def test_a_killed_coordinator_fails_its_trials_clearly_and_their_retries_join_a_new_one(
        ray_session, small_dataset, tmp_path, warm_pool):
    baseline = plasma_objects()
    spec = _spec(small_dataset)
    # The long-running trial starts first; the second kills the coordinator once it has joined too,
    # so both are members of the group when it dies. Tune retries both (max_failures=1): the
    # registry sees the coordinator is dead and starts a new one, and the retries finish.
    analysis, reports = _run({"data": spec, "batch_size": 8, "epochs": 2, "delay_s": 0.3,
                              "delay_until": "kill_coordinator-done",  # the retries run at full speed
                              "fault": tune.grid_search([None, "kill_coordinator"])}, tmp_path, warm_pool,
                             max_failures=1)
    assert (tmp_path / "kill_coordinator-done").exists(), "the fault was injected"
    assert [t.status for t in analysis.trials] == ["TERMINATED", "TERMINATED"], [t.error_file for t in analysis.trials]
    assert all(t.num_failures == 1 for t in analysis.trials), [t.num_failures for t in analysis.trials]
    [report] = reports.values()
    assert report["coordinator_failures"] == 1 and report["coordinators"] == 1, report
    for trial, epochs in load_records(str(tmp_path)).items():
        check_trial_records(spec, epochs, 8, trial)
    assert settled(lambda: pids_titled("ray::Coordinator"), []) == [], "a coordinator process outlived the sweep"
    assert live_coordprep_actors() == [] and plasma_objects_settled(baseline) <= baseline


def test_a_loader_dropped_without_close_leaves_its_group(ray_session, small_dataset, warm_pool):
    import gc

    from coordinated_prep import CoordinatedSearcher
    from coordinated_prep.trial.loader import TrainLoader
    from coordinated_prep.trial.streams import SharedStream
    from tests.conftest import settled

    spec = DataSpec(dataset=small_dataset, pipeline={"size": 16}, chunk_size=8)
    searcher = CoordinatedSearcher(pool=warm_pool)
    searcher.start()
    try:
        kept = TrainLoader(SharedStream(spec, "t1", "t1", 8), 8)  # this one stays
        dropped = TrainLoader(SharedStream(spec, "t1", "t1#2", 8), 8)
        coordinator = kept._stream._coordinator

        def consumers() -> list[str]:
            return sorted(ray_session.get(coordinator.report.remote(), timeout=30)["consumers"])

        assert consumers() == ["t1", "t1#2"]
        del dropped  # never closed
        gc.collect()
        assert settled(consumers, ["t1"]) == ["t1"], "the dropped loader's consumer left its group"
        kept.close()
        assert settled(consumers, []) == []
    finally:
        searcher.close()



def test_skip_policy_leaves_a_truncated_jpeg_out_of_training_and_a_corrupt_file_out_of_evaluation(
        ray_session, tmp_path, warm_pool):
    """Under ``on_error: skip``, the trial's epochs leave out the training sample whose JPEG is
    truncated, and its evaluation the held-out file that is not an image, as an unshared loader does."""
    from coordinated_prep.plan import holdout_split
    from coordinated_prep.trial.loader import eval_loader

    root = make_imagefolder(str(tmp_path / "data"), classes=2, per_class=20, png_every=99)
    spec = _spec(root, holdout=0.1, on_error="skip")
    source = open_source(root)
    train, held = holdout_split(len(source), spec.holdout)
    victim, broken = int(train[5]), source.paths[int(held[0])]
    with open(source.paths[victim], "r+b") as f:
        f.truncate(60)
    with open(broken, "wb") as f:
        f.write(b"not a jpeg")
    open_source.cache_clear()
    baseline = plasma_objects()
    searcher = CoordinatedSearcher(pool=warm_pool)
    try:
        analysis = tune.run(tune.with_resources(record, {"cpu": 0.25}), search_alg=searcher, verbose=0,
                            raise_on_failed_trial=False,
                            config={"data": spec, "batch_size": 8, "epochs": 2, "evaluate": True,
                                    "out": str(tmp_path / "records")})
        [report], [evaluation] = searcher.group_reports().values(), searcher.eval_reports().values()
    finally:
        searcher.close()
    assert all(t.status == "TERMINATED" for t in analysis.trials), [t.error_file for t in analysis.trials]
    assert report["samples_skipped"] == 1
    expected = [i for i in train_ids(spec) if i != victim]
    [(trial, epochs)] = load_records(str(tmp_path / "records")).items()
    assert_exactly_once([e["indices"] for e in epochs], expected, trial)
    [t] = analysis.trials
    assert t.last_result["eval_samples"] == len(held) - 1, t  # evaluated without that one sample
    assert evaluation["samples_skipped"] == 1 and evaluation["skipped_files"] == [broken], evaluation
    # Unshared (the same function in the trial's own process): the same sample left out.
    assert sum(len(b) for b in eval_loader(dataclasses.replace(spec, coordinated=False), 8)) == len(held) - 1
    assert live_coordprep_actors() == [] and plasma_objects_settled(baseline) <= baseline


def test_a_prep_actor_killed_mid_epoch_is_replaced_and_a_trial_killed_mid_epoch_is_retried(ray_session,
                                                                                            small_dataset, tmp_path):
    """One trial kills a prep actor mid-epoch, the other its own process: the prep actor is replaced
    and its work redone, and the dead trial leaves its group (its sibling reads on) and its retry
    (Tune's, max_failures=1) joins again; both trials' epochs are exact. A fresh pool: killing a kept
    actor would leave the next test's kept pool short."""
    baseline = plasma_objects()
    spec = _spec(small_dataset)
    analysis, _ = _run({"data": spec, "batch_size": 8, "epochs": 2,
                        "fault": tune.grid_search(["kill_prep", "kill_self"])}, tmp_path, max_failures=1)
    assert all(t.status == "TERMINATED" for t in analysis.trials), [t.error_file for t in analysis.trials]
    assert (tmp_path / "kill_prep-done").exists() and (tmp_path / "killed-once").exists(), "both faults were injected"
    # Only the killed trial was retried: the prep actor's death failed no trial.
    assert {t.config["fault"]: t.num_failures for t in analysis.trials} == {"kill_prep": 0, "kill_self": 1}
    for trial, epochs in load_records(str(tmp_path)).items():
        check_trial_records(spec, epochs, 8, trial)  # byte-identical: re-prepared pieces equal the originals
    assert live_coordprep_actors() == [] and plasma_objects_settled(baseline) <= baseline
