"""Sweeps churn (real Tune sweeps): joins past the head, lone trials, pauses, restores, several groups.

Every test checks exact epochs with the shared harness; pytest-timeout bounds each one, so a
stranded trial fails the test instead of hanging it.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import ray
from ray import tune

from coordinated_prep import ConfigError, CoordinatedSearcher, DataSpec, PoolSpec, train_loader
from tests.conftest import live_coordprep_actors, plasma_objects, plasma_objects_settled
from tests.harness import check_trial_records, sample_digests, stream_samples, train_ids
from tests.recording import Gate, Interrupt, load_records, record

PIECE = 8 * 3 * 32 * 32  # bytes of one piece of 8 samples at 32 px


def _spec(dataset: str, **overrides) -> DataSpec:
    values = dict(dataset=dataset, pipeline={"size": 32}, seed=3, chunk_size=8, segments=4, lookahead=2)
    values.update(overrides)
    return DataSpec(**values)


def _save(out: str, name: str, epoch: int, batches: list, loader) -> None:
    os.makedirs(os.path.join(out, name), exist_ok=True)
    np.savez(os.path.join(out, name, f"epoch{epoch}.npz"),
             indices=np.concatenate([b.indices.numpy() for b in batches]),
             stream_epochs=np.concatenate([b.stream_epochs.numpy() for b in batches]),
             digests=np.concatenate([sample_digests(b.images.numpy()) for b in batches]),
             batch_sizes=np.array([len(b) for b in batches]), start=loader.start_piece,
             private_samples=loader.private_samples)


def _gate(name: str):
    return ray.get_actor(name, namespace="coordinated_prep")


def joiner(config: dict) -> None:
    """``first`` reads a few batches, lets ``second`` join, and leaves as soon as it has joined."""
    trial = tune.get_context().get_trial_id()
    if config["role"] == "first":
        loader = train_loader(config, batch_size=8, epochs=1)
        batches = iter(loader)
        for _ in range(2):
            next(batches)
        ray.get(_gate("mid-epoch").open.remote(), timeout=60)
        ray.get(_gate("joined").wait_open.remote(120), timeout=150)
        del batches
        loader.close()  # leaves its group with the head far below the joiner's start
        return
    ray.get(_gate("mid-epoch").wait_open.remote(120), timeout=150)
    loader = train_loader(config, batch_size=8, epochs=2)
    ray.get(_gate("joined").open.remote(), timeout=60)
    for epoch in range(2):
        _save(config["out"], trial, epoch, list(loader), loader)


def test_a_joiner_past_the_head_finishes_when_the_trials_before_it_leave(ray_session, small_dataset, tmp_path,
                                                                         warm_pool):
    baseline = plasma_objects()
    spec = _spec(small_dataset, segments=2, fetch_timeout_s=60)  # a stranded joiner would fail after 60 s
    gates = [Gate.options(name=n, namespace="coordinated_prep").remote() for n in ("mid-epoch", "joined")]
    searcher = CoordinatedSearcher(pool=warm_pool)
    analysis = tune.run(tune.with_resources(joiner, {"cpu": 0.25}), search_alg=searcher, verbose=0,
                        config={"data": spec, "role": tune.grid_search(["first", "second"]), "out": str(tmp_path)})
    [report] = searcher.group_reports().values()
    searcher.close()
    assert all(t.status == "TERMINATED" for t in analysis.trials), [t.error_file for t in analysis.trials]
    [(trial, epochs)] = load_records(str(tmp_path)).items()
    assert int(epochs[0]["start"]) > 0, "the second trial joined mid-epoch, at the next segment"
    check_trial_records(spec, epochs, 8, trial)
    assert report["evictions"] == 0 and report["stall_s"] < 1.0, report
    for gate in gates:
        ray.kill(gate)
    assert live_coordprep_actors() == [] and plasma_objects_settled(baseline) <= baseline


def test_a_lone_trial_evaluating_longer_than_the_lease_is_not_detached(ray_session, small_dataset, tmp_path, warm_pool):
    baseline = plasma_objects()
    # The budget holds two pieces, so the lone trial's prefetched pieces fill it while it evaluates
    # for twice the lease; nobody waits for a piece then, so nobody is detached.
    spec = _spec(small_dataset, staging_bytes=2 * PIECE, lease_s=0.3)
    searcher = CoordinatedSearcher(pool=warm_pool)
    analysis = tune.run(tune.with_resources(record, {"cpu": 0.25}), search_alg=searcher, verbose=0,
                        config={"data": spec, "batch_size": 8, "epochs": tune.grid_search([1, 3]), "eval_s": 0.6,
                                "out": str(tmp_path)})
    [report] = searcher.group_reports().values()
    searcher.close()
    assert all(t.status == "TERMINATED" for t in analysis.trials), [t.error_file for t in analysis.trials]
    assert report["evictions"] == 0, report
    for trial, epochs in load_records(str(tmp_path)).items():
        check_trial_records(spec, epochs, 8, trial)
        assert int(epochs[-1]["private_samples"]) == 0, f"{trial} was detached"
    assert live_coordprep_actors() == [] and plasma_objects_settled(baseline) <= baseline


def two_loaders(config: dict) -> None:
    """Reads three loaders in turn, batch by batch: the same spec twice and another crop size."""
    trial = tune.get_context().get_trial_id()
    loaders = {"a": train_loader(config, 8, epochs=2), "b": train_loader(config, 12, epochs=2),
               "c": train_loader(config, 8, epochs=2, key="other")}
    for epoch in range(2):
        iters = {k: iter(v) for k, v in loaders.items()}
        got: dict[str, list] = {k: [] for k in loaders}
        while iters:
            for k in list(iters):
                batch = next(iters[k], None)
                if batch is None:
                    del iters[k]
                else:
                    got[k].append(batch)
        for k, loader in loaders.items():
            _save(config["out"], f"{trial}-{k}", epoch, got[k], loader)


def test_several_loaders_in_one_trial_each_get_exact_epochs(ray_session, small_dataset, tmp_path, warm_pool):
    baseline = plasma_objects()
    spec, other = _spec(small_dataset), _spec(small_dataset, pipeline={"size": 24})
    searcher = CoordinatedSearcher(pool=warm_pool)
    analysis = tune.run(tune.with_resources(two_loaders, {"cpu": 0.25}), search_alg=searcher, verbose=0,
                        config={"data": spec, "other": other, "out": str(tmp_path)})
    reports = searcher.group_reports()
    searcher.close()
    assert all(t.status == "TERMINATED" for t in analysis.trials), [t.error_file for t in analysis.trials]
    assert reports[spec.group_key]["trials_joined"] == 2 and reports[other.group_key]["trials_joined"] == 1
    records = load_records(str(tmp_path))
    assert len(records) == 3
    for name, epochs in records.items():
        which = name.rsplit("-", 1)[1]
        check_trial_records(other if which == "c" else spec, epochs, 12 if which == "b" else 8, name)
    assert live_coordprep_actors() == [] and plasma_objects_settled(baseline) <= baseline


def test_a_new_iter_ends_the_live_one_and_reads_the_next_epoch_whole(small_dataset):
    """As each ``iter()`` of a ``DataLoader`` is a new epoch (Lightning holds one iterator while it asks
    for the next): the first iterator ends, its unread samples are passed over, and the new epoch is
    one pass over the training split."""
    spec = _spec(small_dataset, coordinated=False)
    loader = train_loader(spec, 8, epochs=3)
    first = iter(loader)
    taken = next(first)
    second = iter(loader)
    with pytest.raises(StopIteration):
        next(first)
    epoch = list(second)
    assert len(epoch) == len(loader)
    assert sorted(np.concatenate([b.indices.numpy() for b in epoch])) == sorted(train_ids(spec))
    assert int(taken.stream_epochs[0]) == 0 and all(int(e) == 1 for b in epoch for e in b.stream_epochs)
    assert len(list(loader)) == len(loader)  # the third epoch
    with pytest.raises(ConfigError, match="epoch 4 requested"):
        iter(loader)


def test_a_sweep_over_three_crop_sizes_costs_one_groups_processes_and_budget(ray_session, small_dataset, tmp_path,
                                                                           warm_pool):
    baseline = plasma_objects()
    specs = [_spec(small_dataset, pipeline={"size": s}) for s in (24, 32, 40)]
    node_budget = 6 * 8 * 3 * 40 * 40  # six of the largest pieces, for the whole node
    searcher = CoordinatedSearcher(pool=PoolSpec(actors=2, staging_bytes=node_budget, keep_warm=True))
    analysis = tune.run(tune.with_resources(record, {"cpu": 0.25}), search_alg=searcher, verbose=0,
                        config={"data": tune.grid_search(specs), "batch_size": 8, "epochs": 2, "delay_s": 0.02,
                                "out": str(tmp_path)})
    reports = searcher.group_reports()
    searcher.close()
    assert all(t.status == "TERMINATED" for t in analysis.trials), [t.error_file for t in analysis.trials]
    assert set(reports) == {s.group_key for s in specs}
    records = load_records(str(tmp_path))
    by_trial = {t.trial_id: t.config["data"] for t in analysis.trials}
    for trial, epochs in records.items():
        check_trial_records(by_trial[trial], epochs, 8, trial)
    assert max(int(e["prep_processes"]) for eps in records.values() for e in eps) == 2, "one pool for 3 groups"
    # Each group's share of the node's one budget, and what it held: at most its share and one piece in
    # flight. (Shares are split again as groups come and go, so the groups' peaks, at different times,
    # may add up past the node's budget: CI measured 367,744 bytes against 230,400 once, with four crop
    # sizes. The sum is not an invariant; see the design notes on staging.)
    assert all(r["budget_bytes"] <= node_budget for r in reports.values())
    assert all(r["peak_staged_bytes"] <= node_budget + specs[-1].chunk_bytes for r in reports.values()), reports
    assert live_coordprep_actors() == [] and plasma_objects_settled(baseline) <= baseline


def test_a_sweep_interrupted_mid_way_resumes_with_tuner_restore(ray_session, small_dataset, tmp_path, warm_pool):
    baseline = plasma_objects()
    # Interrupted at the second result: the two running trials are mid-way (3 epochs each), and the
    # restored searcher suggests the third.
    spec = _spec(small_dataset)
    searcher = CoordinatedSearcher(max_concurrent=2, pool=warm_pool)
    param_space = {"data": spec, "batch_size": 8, "epochs": 3, "checkpoint": True, "delay_s": 0.02,
                   "score": tune.grid_search([1, 2, 3]), "out": str(tmp_path / "records")}
    run = tune.RunConfig(name="interrupted", storage_path=str(tmp_path / "results"), verbose=0,
                         callbacks=[Interrupt(after=2, marker=str(tmp_path / "interrupted"))])
    tuner = tune.Tuner(tune.with_resources(record, {"cpu": 0.25}), param_space=param_space,
                       tune_config=tune.TuneConfig(search_alg=searcher, metric="score", mode="max",
                                                   reuse_actors=True),  # a finished trial's process runs the next
                       run_config=run)
    try:
        interrupted = tuner.fit()
        assert len(interrupted) < 3 or any(r.metrics.get("epoch", 0) < 3 for r in interrupted), "not interrupted"
    except tune.TuneError:
        pass  # how an interrupted fit ends depends on the Ray version; either way its state was saved
    path = str(tmp_path / "results" / "interrupted")
    assert tune.Tuner.can_restore(path)
    # The same param_space again: Tune keeps the DataSpec objects out of its saved state.
    results = tune.Tuner.restore(path, trainable=tune.with_resources(record, {"cpu": 0.25}),
                                 param_space=param_space, resume_unfinished=True).fit()
    searcher.close()  # the restored searcher found this session's registry: one close for both
    assert not results.errors, results.errors
    assert len(results) == 3 and all(r.metrics["epoch"] == 3 for r in results)
    assert all(set(r.config) == set(param_space) for r in results), "the best config is reusable as it is"
    for trial, epochs in load_records(str(tmp_path / "records")).items():
        check_trial_records(spec, epochs, 8, trial)
    assert live_coordprep_actors() == [] and plasma_objects_settled(baseline) <= baseline


def cut_short(config: dict) -> None:
    """Epoch 0 stops after one batch (a max-steps loop); the next two epochs are whole and recorded."""
    trial = tune.get_context().get_trial_id()
    loader = train_loader(config, batch_size=8, epochs=3)
    for _ in loader:
        break
    for epoch in range(2):
        _save(config["out"], trial, epoch, list(loader), loader)


def test_an_epoch_cut_short_is_passed_over_and_the_next_ones_are_exact(ray_session, small_dataset, tmp_path, warm_pool):
    baseline = plasma_objects()
    spec = _spec(small_dataset, fetch_timeout_s=60)
    searcher = CoordinatedSearcher(pool=warm_pool)
    analysis = tune.run(tune.with_resources(cut_short, {"cpu": 0.25}), search_alg=searcher, verbose=0,
                        config={"data": spec, "out": str(tmp_path), "n": tune.grid_search([1, 2])})
    [report] = searcher.group_reports().values()
    searcher.close()
    assert all(t.status == "TERMINATED" for t in analysis.trials), [t.error_file for t in analysis.trials]
    for trial, epochs in load_records(str(tmp_path)).items():
        check_trial_records(spec, epochs, 8, trial)
    # Nothing past the trials' declared 3 epochs from where each joined (however late the second did).
    assert len(report["starts"]) == 2, report
    assert report["samples_prepared"] <= stream_samples(report["starts"].values(), 3, report["samples_per_epoch"],
                                                        spec.chunk_size), report
    assert live_coordprep_actors() == [] and plasma_objects_settled(baseline) <= baseline


def straggler(config: dict) -> None:
    """``fast`` reads three whole epochs; ``slow`` cuts its first epoch short after one batch (a
    fixed number of steps per epoch), reads one batch of the next and then stalls, holding its place,
    until ``fast`` is done."""
    trial = tune.get_context().get_trial_id()
    if config["role"] == "fast":
        loader = train_loader(config, batch_size=8, epochs=3)
        ray.get(_gate("cut").wait_open.remote(120), timeout=150)
        for epoch in range(3):
            _save(config["out"], trial, epoch, list(loader), loader)
        ray.get(_gate("fast-done").open.remote(), timeout=60)
        return
    loader = train_loader(config, batch_size=8, epochs=3, prefetch=6)  # more requests in flight than the budget
    for _ in loader:
        break  # the rest of epoch 0, and the requests it had in flight, are passed over
    ray.get(_gate("cut").open.remote(), timeout=60)
    batches = []
    for batch in loader:
        batches.append(batch)
        if len(batches) == 1:  # a long evaluation: it holds its unread pieces while fast waits
            ray.get(_gate("fast-done").wait_open.remote(150), timeout=180)
    _save(config["out"], trial, 0, batches, loader)


def test_a_straggler_that_cuts_its_epochs_short_is_detached_within_the_lease(ray_session, small_dataset, tmp_path,
                                                                             warm_pool):
    baseline = plasma_objects()
    # fetch_timeout_s is far below the straggler's stall: fast finishes only if the lease (1 s)
    # detaches the straggler; a straggler the lease spared would fail fast's fetch after 60 s.
    spec = _spec(small_dataset, staging_bytes=3 * PIECE, lease_s=1.0, fetch_timeout_s=60)
    gates = [Gate.options(name=n, namespace="coordinated_prep").remote() for n in ("cut", "fast-done")]
    searcher = CoordinatedSearcher(pool=warm_pool)
    analysis = tune.run(tune.with_resources(straggler, {"cpu": 0.25}), search_alg=searcher, verbose=0,
                        config={"data": spec, "role": tune.grid_search(["fast", "slow"]), "out": str(tmp_path)})
    [report] = searcher.group_reports().values()
    searcher.close()
    assert all(t.status == "TERMINATED" for t in analysis.trials), [t.error_file for t in analysis.trials]
    assert report["evictions"] == 1, report
    records = load_records(str(tmp_path))
    by_role = {t.config["role"]: records[t.trial_id] for t in analysis.trials}
    check_trial_records(spec, by_role["fast"], 8, "fast")
    assert all(int(e["private_samples"]) == 0 for e in by_role["fast"]), "fast stayed in its group"
    check_trial_records(spec, by_role["slow"], 8, "slow")  # its epoch: shared, then its own after the detach
    assert int(by_role["slow"][0]["private_samples"]) > 0, "the straggler prepared the rest itself"
    for gate in gates:
        ray.kill(gate)
    assert live_coordprep_actors() == [] and plasma_objects_settled(baseline) <= baseline
