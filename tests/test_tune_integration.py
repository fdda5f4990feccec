"""End to end through Ray Tune: concurrent trials share one pipeline and each sees exact epochs."""

from __future__ import annotations

import json
import os
import shutil
import time
from types import SimpleNamespace

import numpy as np
import pytest
import ray
from ray import tune
from ray.tune.schedulers import ASHAScheduler

from coordinated_prep import CoordinatedSearcher, DataSpec, train_loader
from coordinated_prep.errors import ConfigError
from coordinated_prep.pipeline.sources import open_source, photos
from tests.conftest import live_coordprep_actors, plasma_objects, plasma_objects_settled
from tests.harness import check_trial_records as _check_trial
from tests.harness import assert_exactly_once, reference_digests, sample_digests, train_ids
from tests.recording import Gate, load_records, record

EPOCHS = 2
LOOKAHEAD = 2


def _spec(dataset: str, **overrides) -> DataSpec:
    values = dict(dataset=dataset, pipeline={"size": 32, "scale": [0.3, 1.0]}, seed=5, chunk_size=8, segments=4,
                  lookahead=LOOKAHEAD)
    values.update(overrides)
    return DataSpec(**values)


@pytest.fixture(scope="module")
def groups_sweep(ray_session, small_dataset, tmp_path_factory, warm_pool):
    """One sweep for the two tests below (a sweep's processes are what costs), all five trials at
    once: three of one spec at batch sizes 8, 12 and 7 (12 and 7 do not divide the pieces of 8),
    one of another seed, and one of the first spec unshared."""
    out = tmp_path_factory.mktemp("groups")
    baseline = plasma_objects()
    a, b, unshared = _spec(small_dataset), _spec(small_dataset, seed=2), _spec(small_dataset, coordinated=False)
    cases = [(a, 8), (a, 12), (a, 7), (b, 16), (unshared, 16)]
    searcher = CoordinatedSearcher(pool=warm_pool)
    tuner = tune.Tuner(
        tune.with_resources(record, {"cpu": 0.2}),  # the pool holds 1 of the 2 CPUs: five trials fit
        param_space={"case": tune.grid_search(list(range(len(cases)))), "epochs": EPOCHS, "out": str(out / "records"),
                     "delay_s": 0.05,  # a compute step, so that the trials' lifetimes overlap
                     "data": tune.sample_from(lambda c: cases[c["case"]][0]),
                     "batch_size": tune.sample_from(lambda c: cases[c["case"]][1])},
        tune_config=tune.TuneConfig(search_alg=searcher),
        run_config=tune.RunConfig(verbose=0, storage_path=str(out / "results")),
    )
    try:  # closed whatever happens: a live registry would fail every later test's leak checks
        results = tuner.fit()
        reports = searcher.group_reports()
    finally:
        searcher.close()
    assert not results.errors, results.errors
    return SimpleNamespace(a=a, b=b, results=results, reports=reports, records=load_records(str(out / "records")),
                           baseline=baseline)


def test_concurrent_trials_of_different_batch_sizes_share_one_pipeline(groups_sweep, small_dataset):
    spec, baseline = groups_sweep.a, groups_sweep.baseline
    by_trial = {r.metrics["trial_id"]: r.config["batch_size"] for r in groups_sweep.results if r.config["data"] == spec}
    assert sorted(by_trial.values()) == [7, 8, 12]
    records = {t: groups_sweep.records[t] for t in by_trial}
    for trial, epochs in records.items():
        assert len(epochs) == EPOCHS
        _check_trial(spec, epochs, by_trial[trial], trial)

    # Each coordinator prepared each (stream epoch, sample) its trials saw exactly once, and nothing
    # else: the trials declared their epochs, so nothing past their last piece was prepared.
    report = groups_sweep.reports[spec.group_key]
    for incarnation in report["per_coordinator"]:
        mine = [r for eps in records.values() for r in eps if str(r["coordinator"]) == incarnation["coordinator"]]
        seen = {(int(e), int(i)) for r in mine for e, i in zip(r["stream_epochs"], r["indices"])}
        assert incarnation["samples_prepared"] == len(seen), (len(seen), incarnation)
    served = sum(len(r["indices"]) for eps in records.values() for r in eps)
    assert report["samples_served"] >= served > report["samples_prepared"], report

    # Trials that started at piece 0 get the very batches of the unshared loader.
    starters = [t for t, eps in records.items() if int(eps[0]["start"]) == 0]
    assert starters, "the first trial to join starts at piece 0"
    for trial in starters:
        private = train_loader(_spec(small_dataset, coordinated=False), batch_size=by_trial[trial])
        for saved in records[trial]:
            batches = list(private)
            assert np.array_equal(np.concatenate([b.indices.numpy() for b in batches]), saved["indices"])
            assert np.array_equal(np.concatenate([sample_digests(b.images.numpy()) for b in batches]), saved["digests"])

    assert live_coordprep_actors() == []
    assert plasma_objects_settled(baseline) <= baseline, "pieces of ours left in the object store"


def test_tuner_groups_by_spec_and_unshared_trials_match(groups_sweep):
    a, b, reports, records = groups_sweep.a, groups_sweep.b, groups_sweep.reports, groups_sweep.records
    assert set(reports) == {a.group_key, b.group_key}, "equal specs share a group; different seeds do not"
    assert reports[a.group_key]["trials_joined"] == 3 and reports[b.group_key]["trials_joined"] == 1
    configs = {r.metrics["trial_id"]: r.config for r in groups_sweep.results}
    assert len(records) == 5 and set(records) == set(configs)
    for trial, epochs in records.items():  # the unshared trial's bytes too
        _check_trial(configs[trial]["data"], epochs, configs[trial]["batch_size"], trial)
    assert live_coordprep_actors() == [] and plasma_objects_settled(groups_sweep.baseline) <= groups_sweep.baseline


def test_asha_stops_trials_early_without_leaks(ray_session, small_dataset, tmp_path, warm_pool):
    baseline = plasma_objects()
    spec = _spec(small_dataset)
    searcher = CoordinatedSearcher(max_concurrent=2, pool=warm_pool)
    epochs = 4
    analysis = tune.run(
        tune.with_resources(record, {"cpu": 0.25}), config={"data": spec, "batch_size": 16, "epochs": epochs, "out": str(tmp_path),
                        # Best first: by the time a worse trial reports a rung, better ones already have,
                        # so ASHA's cutoff stops it (in increasing order it would stop none).
                        "score": tune.grid_search([4, 3, 2, 1])},
        search_alg=searcher, verbose=0, metric="score", mode="max", reuse_actors=True,  # a stopped trial's process runs the next
        scheduler=ASHAScheduler(max_t=epochs, grace_period=1, reduction_factor=2),
    )
    searcher.close()
    iterations = {t.trial_id: t.last_result["training_iteration"] for t in analysis.trials}
    assert all(t.status == "TERMINATED" for t in analysis.trials)
    assert min(iterations.values()) < epochs, "ASHA stopped no trial early"
    assert max(iterations.values()) == epochs, "no trial survived to the end"
    for trial, recorded in load_records(str(tmp_path)).items():
        assert len(recorded) >= iterations[trial]
        _check_trial(spec, recorded, 16, trial)
    assert live_coordprep_actors() == [] and plasma_objects_settled(baseline) <= baseline


@pytest.mark.usefixtures("warm_pool")  # it starts no pool: the kept one stays for the module's next sweep
def test_sharing_without_the_searcher_is_a_clear_error_in_the_trial(ray_session, small_dataset, tmp_path):
    analysis = tune.run(tune.with_resources(record, {"cpu": 0.25}),
                        config={"data": _spec(small_dataset), "batch_size": 8, "epochs": 1, "out": str(tmp_path)},
                        verbose=0, raise_on_failed_trial=False)
    [trial] = analysis.trials
    message = open(trial.error_file).read()
    assert trial.status == "ERROR" and f"trial {trial.trial_id}" in message and "CoordinatedSearcher" in message


def _one_at_a_time(config):
    """:func:`record` of the config's case (its data and batch size), and the span it ran, written
    to ``<out>/<trial>/span.json`` (a failed trial's too)."""
    began = time.time()
    try:
        record({**config, **config["case"]})
    finally:
        with open(os.path.join(config["out"], tune.get_context().get_trial_id(), "span.json"), "w") as f:
            json.dump([began, time.time()], f)


@pytest.fixture(scope="module")
def one_at_a_time(ray_session, small_dataset, tmp_path_factory, warm_pool):
    """One sweep for the four tests below (a sweep's processes are what costs): TuneConfig's
    ``max_concurrent_trials=1``, one process reused. Three trials of one spec at batch sizes 8, 12
    and 7, two of it with the DALI backend (2 epochs, batch sizes 8 and 16), then one of a dataset
    whose sample 7 is a truncated JPEG."""
    from tests.utils import make_imagefolder

    tmp = tmp_path_factory.mktemp("one_at_a_time")
    root = make_imagefolder(str(tmp / "data"), classes=2, per_class=20, png_every=99)
    victim = open_source(root).paths[7]
    with open(victim, "r+b") as f:
        f.truncate(60)
    open_source.cache_clear()
    spec, corrupt = _spec(small_dataset), _spec(root, holdout=0.0)
    dali = _spec(small_dataset, pipeline={"size": 32, "scale": [0.3, 1.0], "backend": "dali"})
    baseline = plasma_objects()
    searcher = CoordinatedSearcher(pool=warm_pool)
    # The cases hold their DataSpecs as they are (no sample_from): the searcher reads each trial's
    # group before it releases it, and keeps a group for the trials of it it holds back. The first
    # three have a compute step, so that trials started together would overlap.
    cases = [{"data": spec, "batch_size": b, "delay_s": 0.02} for b in (8, 12, 7)] + [
        {"data": dali, "batch_size": b, "epochs": 2} for b in (8, 16)] + [{"data": corrupt, "batch_size": 8}]
    tuner = tune.Tuner(tune.with_resources(_one_at_a_time, {"cpu": 0.25}),
                       param_space={"case": tune.grid_search(cases), "epochs": 1, "out": str(tmp / "records")},
                       tune_config=tune.TuneConfig(search_alg=searcher, max_concurrent_trials=1, reuse_actors=True),
                       run_config=tune.RunConfig(verbose=0, storage_path=str(tmp / "results")))
    try:  # closed whatever happens: a live registry would fail every later test's leak checks
        results = tuner.fit()
        reports = searcher.group_reports()
    finally:
        searcher.close()
    yield SimpleNamespace(spec=spec, dali=dali, corrupt=corrupt, results=results, reports=reports,
                          out=str(tmp / "records"), victim=victim, baseline=baseline)
    shutil.rmtree(root)


def _of(sweep: SimpleNamespace, spec: DataSpec) -> list:
    """The results of the sweep's trials of ``spec``."""
    return [r for r in sweep.results if r.config["case"]["data"] == spec]


def test_trials_of_one_group_run_one_after_another_read_one_coordinator_kept_between_them(one_at_a_time):
    """Each trial starts after the one before it ended; the searcher holds the next one back, so the
    registry keeps the group for it (coordinated_prep/stream/linger.py) instead of starting it again."""
    sweep = one_at_a_time
    done = _of(sweep, sweep.spec)
    assert len(done) == 3 and not any(r.error for r in done), [r.error for r in done]
    records = load_records(sweep.out)
    for r in done:
        trial = r.metrics["trial_id"]
        _check_trial(sweep.spec, records[trial], r.config["case"]["batch_size"], trial)
    report = sweep.reports[sweep.spec.group_key]
    assert report["trials_joined"] == 3 and report["coordinators"] == 1, report
    assert live_coordprep_actors() == []


def test_tune_configs_max_concurrent_trials_is_honoured(one_at_a_time):
    """Tune drops max_concurrent_trials for a SearchAlgorithm; the CoordinatedSearcher applies it."""
    out = one_at_a_time.out
    spans = sorted(tuple(json.load(open(os.path.join(out, t, "span.json")))) for t in os.listdir(out))
    assert len(spans) == 6 and all(a[1] <= b[0] for a, b in zip(spans, spans[1:])), spans
    with pytest.raises(ConfigError, match="disagree"):
        CoordinatedSearcher(max_concurrent=2)._limit(1)


def test_a_corrupt_jpeg_fails_its_trials_naming_the_file(one_at_a_time):
    sweep = one_at_a_time
    [failed] = _of(sweep, sweep.corrupt)
    assert failed.error is not None and len(sweep.results.errors) == 1, sweep.results.errors
    [trial] = [t for t, epochs in load_records(sweep.out).items() if not epochs]  # it saved no epoch
    message = open(os.path.join(failed.path, "error.txt")).read()
    assert f"trial {trial}" in message and "sample 7" in message and sweep.victim in message, message
    assert live_coordprep_actors() == [] and plasma_objects_settled(sweep.baseline) <= sweep.baseline


def test_the_dali_backend_shares_exact_epochs(one_at_a_time):
    sweep = one_at_a_time
    done = _of(sweep, sweep.dali)
    assert len(done) == 2 and not any(r.error for r in done), [r.error for r in done]
    records = load_records(sweep.out)
    for r in done:  # bytes equal to what the DALI pipeline makes of each sample here
        trial = r.metrics["trial_id"]
        assert len(records[trial]) == 2
        _check_trial(sweep.dali, records[trial], r.config["case"]["batch_size"], trial)
    assert sweep.reports[sweep.dali.group_key]["trials_joined"] == 2
    assert live_coordprep_actors() == [] and plasma_objects_settled(sweep.baseline) <= sweep.baseline


def _grouped_lifetime(config):
    start = time.time()
    time.sleep(0.5)  # long enough that trials started together overlap
    tune.report({"start": start, "end": time.time(), "group": config["data"].group_key})


@pytest.mark.parametrize("searched", ["grid", "optuna"])
def test_a_sweeps_trials_run_group_by_group(ray_session, small_dataset, tmp_path, warm_pool, searched):
    """Tune generates a YAML grid over two data groups as A, B, A, B (num_samples: 2), and Optuna
    seeded with 10 suggests A, B, A, B too; two at a time, the searcher runs them as A, A, B, B.
    (How each suggestion's group is read, DataSpecs in the grid included, and the look-ahead's bound
    are tested without Ray in tests/test_group_order.py.)"""
    from ray.tune.search.optuna import OptunaSearch

    from coordinated_prep.sweep.data_space import DataSearch

    a, b = _spec(small_dataset, seed=1), _spec(small_dataset, seed=2)
    # as `coordprep sweep` builds it: the DataSpec made from each trial's data keys
    search = DataSearch({"dataset": small_dataset, "pipeline": {"size": 32, "scale": [0.3, 1.0]}, "chunk_size": 8,
                         "segments": 4, "lookahead": LOOKAHEAD}, ("data.seed",))
    if searched == "grid":
        param_space, searcher, num_samples = {"data.seed": tune.grid_search([1, 2])}, None, 2
    else:
        param_space, searcher, num_samples = {"data.seed": tune.choice([1, 2])}, OptunaSearch(seed=10), 4
        alone = OptunaSearch(seed=10, metric="start", mode="max")  # what it suggests, in its order
        alone.set_search_properties(None, None, dict(param_space))
        assert [alone.suggest(f"t{i}")["data.seed"] for i in range(4)] == [1, 2, 1, 2]
    searcher = CoordinatedSearcher(searcher, pool=warm_pool)
    tuner = tune.Tuner(tune.with_resources(_grouped_lifetime, {"cpu": 0.25}),
                       param_space={**param_space, "data": search.to_tune()},
                       tune_config=tune.TuneConfig(search_alg=searcher, max_concurrent_trials=2, num_samples=num_samples,
                                                   reuse_actors=True, metric="start", mode="max"),
                       run_config=tune.RunConfig(verbose=0, storage_path=str(tmp_path)))
    results = tuner.fit()
    searcher.close()
    assert not results.errors, results.errors
    by_start = [r.metrics["group"] for r in sorted(results, key=lambda r: r.metrics["start"])]
    assert sorted(by_start) == sorted([a.group_key, b.group_key] * 2)
    assert by_start[0] == by_start[1] and by_start[2] == by_start[3], by_start  # alone: A, B, A, B
    spans = [(r.metrics["start"], r.metrics["end"]) for r in results]
    assert max(sum(s <= t < e for s, e in spans) for t, _ in spans) <= 2, spans  # the limit still holds


def _lifetime(config):
    start = time.time()
    time.sleep(1.0)  # long enough that trials started one after another overlap
    tune.report({"start": start, "end": time.time()})


def test_max_concurrent_trials_holds_for_a_searcher_with_a_space_of_its_own(ray_session, tmp_path, warm_pool):
    """Optuna given its own space and no param_space: Tune then never calls set_search_properties,
    where the searcher read TuneConfig(max_concurrent_trials=...); it reads it in add_configurations."""
    from ray.tune.search.optuna import OptunaSearch

    searcher = CoordinatedSearcher(OptunaSearch({"x": tune.uniform(0, 1)}, metric="start", mode="max", seed=1),
                                   pool=warm_pool)
    tuner = tune.Tuner(tune.with_resources(_lifetime, {"cpu": 0.25}),
                       tune_config=tune.TuneConfig(search_alg=searcher, max_concurrent_trials=1, num_samples=2,
                                                   reuse_actors=True),
                       run_config=tune.RunConfig(verbose=0, storage_path=str(tmp_path)))
    results = tuner.fit()
    searcher.close()
    assert not results.errors, results.errors
    spans = sorted((r.metrics["start"], r.metrics["end"]) for r in results)
    assert len(spans) == 2 and spans[0][1] <= spans[1][0], spans
    assert searcher._objective == ("start", "max"), "the reports are written with the searcher's objective"


def test_a_sweeps_config_reused_outside_tune_prepares_in_process(small_dataset):
    """A sweep's best config (coordinated) trains again outside Tune, in this process."""
    best = {"data": _spec(small_dataset)}
    reused = train_loader(best, batch_size=8, epochs=1)
    private = train_loader(_spec(small_dataset, coordinated=False), batch_size=8, epochs=1)
    got, want = list(reused), list(private)
    assert np.array_equal(np.concatenate([b.indices.numpy() for b in got]),
                          np.concatenate([b.indices.numpy() for b in want]))
    assert np.array_equal(np.concatenate([sample_digests(b.images.numpy()) for b in got]),
                          np.concatenate([sample_digests(b.images.numpy()) for b in want]))


def _stepping(config: dict) -> None:
    """Reads epochs in batches of 8 with a step of ``step_s`` per batch (an accelerator's: the trial
    waits on it, not on the CPU) and reports when it began and ended. With ``opens``, it opens that
    :class:`Gate` as it begins and reads one epoch; with ``until_open``, it reads until an epoch ends
    with that gate open, or ``epochs`` epochs."""
    began = time.time()
    if config.get("opens"):
        ray.get(ray.get_actor(config["opens"], namespace="coordinated_prep").open.remote(), timeout=60)
    gate = ray.get_actor(config["until_open"], namespace="coordinated_prep") if config.get("until_open") else None
    loader = train_loader(config, batch_size=8, epochs=config["epochs"])  # declared: the next epoch runs ahead too
    seen = 0
    for _ in range(config["epochs"]):
        for batch in loader:
            seen += len(batch)
            time.sleep(config["step_s"])  # stands for the accelerator's step, not for synchronisation
        if gate is None or ray.get(gate.opened.remote(), timeout=60):
            break
    tune.report({"began": began, "ended": time.time(), "seen": seen})


def test_a_pool_whose_preparation_runs_ahead_gives_its_cpus_back_and_tune_runs_another_trial(ray_session,
                                                                                              small_dataset):
    """Two trials at ``cpu: 1`` on 2 CPUs: while the pool holds its actor's 0.5 CPU, one fits. The
    pipeline is cheap and the trial waits on its steps, so the pool gives its share back to Tune
    (and says why), and Tune starts the second trial while the first still runs: the first reads
    until the second has begun, or 40 epochs (about 50 s) if the pool kept its CPUs."""
    spec = _spec(small_dataset)
    gate = Gate.options(name="second-began", namespace="coordinated_prep").remote()
    searcher = CoordinatedSearcher()
    roles = [{"epochs": 40, "until_open": "second-began"}, {"epochs": 1, "opens": "second-began"}]
    analysis = tune.run(tune.with_resources(_stepping, {"cpu": 1}), search_alg=searcher, verbose=0,
                        config={"data": spec, "role": tune.grid_search([0, 1]), "step_s": 0.06,
                                **{k: tune.sample_from(lambda c, k=k: roles[c["role"]].get(k))
                                   for k in ("epochs", "until_open", "opens")}})
    [pool] = searcher.pool_reports().values()
    searcher.close()
    del gate  # held until here: the trials open it and read it
    assert all(t.status == "TERMINATED" for t in analysis.trials), [t.error_file for t in analysis.trials]
    first, second = sorted(analysis.trials, key=lambda t: t.config["role"])
    assert second.last_result["began"] < first.last_result["ended"], (
        f"the second trial waited for the first to end; the pool's growth: {pool['growth']}")
    epoch = len(train_ids(spec))
    assert first.last_result["seen"] % epoch == 0 and second.last_result["seen"] == epoch, "whole epochs"
    assert first.last_result["seen"] < 40 * epoch, "the first trial read until the second began"
    assert pool["growth"]["released"] >= 1 and pool["growth"]["decisions"][0][1] == "release", pool
    assert "preparation runs ahead" in pool["growth"]["decisions"][0][2], pool
    assert live_coordprep_actors() == []


class _OpenOnceGrown(tune.Callback):
    """Opens the gate ``pool-grown`` once the searcher's pool has grown (checked at each result)."""

    def __init__(self, searcher: CoordinatedSearcher) -> None:
        self.searcher = searcher

    def on_trial_result(self, iteration, trials, trial, result, **info):
        [pool] = self.searcher.pool_reports().values()
        if pool["prep_actors"] > 1:
            ray.get(ray.get_actor("pool-grown", namespace="coordinated_prep").open.remote(), timeout=60)


def test_a_pool_sized_by_demand_starts_with_one_actor_and_grows_while_the_trial_waits(ray_session, tmp_path,
                                                                                      monkeypatch):
    """A pool left to size itself starts one prep actor; a trial that reads as fast as it can (no
    compute step) is blocked on it, so the pool grows to its most (one per CPU: 2 here) and says why.
    The trial reads until an epoch that began after the growth: its pieces went to both actors in
    turn, and it holds the unshared bytes. Every epoch is exact."""
    # Real photographs at 224 px, so that preparation is slow: 384 of builtin:photos' kind (its 4,096
    # take 14 s to make), epochs of 345 samples (half the 5 s that 691 took on one actor), up to 32 of
    # them (the growth took 23 s in docs/benchmarks.md). Short epochs, as the trial stops only at the
    # end of the first epoch begun after the growth.
    monkeypatch.setattr(photos, "IMAGES_PER_CLASS", 192)
    spec = DataSpec(dataset=photos.ensure_photos(str(tmp_path / "photos")), pipeline={"size": 224}, seed=3,
                    chunk_size=64)
    gate = Gate.options(name="pool-grown", namespace="coordinated_prep").remote()
    searcher = CoordinatedSearcher()
    searcher.start()
    [started] = searcher.pool_reports().values()
    assert started["prep_actors"] == 1 and started["growth"]["most_actors"] == 2, started
    analysis = tune.run(tune.with_resources(record, {"cpu": 0.25}), search_alg=searcher, verbose=0,
                        callbacks=[_OpenOnceGrown(searcher)],
                        config={"data": spec, "batch_size": 64, "epochs": 32, "declare_epochs": False,
                                "until_open": "pool-grown", "out": str(tmp_path / "records")})
    assert all(t.status == "TERMINATED" for t in analysis.trials), [t.error_file for t in analysis.trials]
    [pool] = searcher.pool_reports().values()
    searcher.close()
    del gate  # held until here: the callback opens it, the trial reads it
    assert pool["prep_actors"] == 2 and pool["growth"]["grown"] == 1, pool
    assert [what for _, what, _ in pool["growth"]["decisions"]] == ["grow", "added"], pool
    [epochs] = load_records(str(tmp_path / "records")).values()
    assert len(epochs) < 32, "the trial read past the growth: it stopped after the first epoch begun after it"
    for epoch in epochs:
        assert_exactly_once([epoch["indices"]], train_ids(spec))
    last = epochs[-1]
    picked = np.arange(0, len(last["indices"]), 97)
    assert np.array_equal(last["digests"][picked],
                          reference_digests(spec, last["stream_epochs"][picked], last["indices"][picked]))
