"""Data echoing in real Tune sweeps: trials echoing differently share one group and keep exact epochs."""

from __future__ import annotations

import os

import numpy as np
import pytest
import ray
from ray import tune

from coordinated_prep import CoordinatedSearcher, DataSpec, PoolSpec, train_loader
from coordinated_prep.trial.echo import EchoSpec
from tests.conftest import live_coordprep_actors, plasma_objects, plasma_objects_settled
from tests.harness import assert_fresh_exactly_once, reference_digests, sample_digests, train_ids
from tests.recording import Gate

EPOCHS = 2


def echo_trial(config: dict) -> None:
    """Reads ``EPOCHS`` epochs with ``config["echo"]``; the ``late`` trial joins once every other trial
    has read 3 batches, and they go on once it has joined: it joins mid-epoch whatever the timing."""
    trial = tune.get_context().get_trial_id()
    config = {**config, **config["trial"]}  # role, echo and batch size, grid-searched together
    gate = ray.get_actor("echo-mid-epoch", namespace="coordinated_prep")
    late = config["role"] == "late"
    if late:
        ray.get(gate.wait_arrivals.remote(config["others"], 120), timeout=150)
    loader = train_loader(config, batch_size=config["batch_size"], epochs=EPOCHS, echo=config["echo"])
    if late:  # joined: its start is fixed
        ray.get(gate.open.remote(), timeout=60)
    for epoch in range(EPOCHS):
        rows = []
        for step, b in enumerate(loader):
            rows.append((b.indices.numpy(), b.repeats.numpy(), b.stream_epochs.numpy(),
                         sample_digests(b.images.numpy())))
            if not late and epoch == 0 and step == 2:
                ray.get(gate.arrive.remote(trial), timeout=60)
                ray.get(gate.wait_open.remote(120), timeout=150)
        os.makedirs(os.path.join(config["out"], trial), exist_ok=True)
        np.savez(os.path.join(config["out"], trial, f"epoch{epoch}.npz"),
                 **{k: np.concatenate([r[i] for r in rows]) for i, k in
                    enumerate(["indices", "repeats", "stream_epochs", "digests"])},
                 start=loader.start_piece, echo=config["echo"], fresh=loader.epoch_counts.fresh,
                 echoed=loader.epoch_counts.echoed, private_samples=loader.private_samples)
        tune.report({"epoch": epoch + 1, "fresh_samples": loader.epoch_counts.fresh,
                     "echoed_samples": loader.epoch_counts.echoed})


def test_trials_echoing_differently_share_one_group_and_keep_exact_epochs(ray_session, small_dataset, tmp_path,
                                                                         warm_pool):
    """With 2 views of each sample, the general case (one view is its special case): each view of each
    sample once per fresh epoch, and each echo mode's copies labelled per view."""
    spec = DataSpec(dataset=small_dataset, pipeline={"size": 32}, seed=5, chunk_size=8, segments=4, lookahead=2,
                    views=2)
    _mixed_echo_sweep(spec, [8, 12], tmp_path, warm_pool)  # 12 straddles the pieces of 8


@pytest.mark.soak
def test_mixed_echo_on_photographs_at_224_px(ray_session, tmp_path):
    """Slow preparation shows races that tiny images hide: joins and echo on real photographs, 224 px.

    Off by default (``soak``): ``.venv/bin/python -m pytest -m soak tests/test_echo_sweep.py``."""
    # Pieces of 64 samples x 2 views (19 MiB): the test's 128 MiB staging budget holds six.
    spec = DataSpec(dataset="builtin:photos", pipeline={"size": 224}, seed=5, views=2, chunk_size=64)
    _mixed_echo_sweep(spec, [64, 96], tmp_path)  # 96 straddles the pieces


def _mixed_echo_sweep(spec: DataSpec, batch_sizes: list[int], tmp_path, pool: PoolSpec | None = None) -> None:
    """Four trials of one group, one per echo mode (one joining mid-epoch): exact fresh epochs, the
    repeat bound, and every row's bytes those of the unshared pipeline."""
    baseline = plasma_objects()
    gate = Gate.options(name="echo-mid-epoch", namespace="coordinated_prep").remote()
    small, large = batch_sizes
    trials = [("opener", "off", small), ("early", "example:3", large), ("early", "auto:3", small),
              ("late", "batch:2", small)]  # the late one joins mid-epoch
    searcher = CoordinatedSearcher(max_concurrent=len(trials), pool=pool)
    analysis = tune.run(tune.with_resources(echo_trial, {"cpu": 0.125}), search_alg=searcher, verbose=0,
                        config={"data": spec, "out": str(tmp_path), "others": len(trials) - 1,
                                "trial": tune.grid_search([{"role": r, "echo": e, "batch_size": b}
                                                           for r, e, b in trials])})
    reports = searcher.group_reports()
    searcher.close()
    ray.kill(gate)
    assert all(t.status == "TERMINATED" for t in analysis.trials), [t.error_file for t in analysis.trials]
    [report] = reports.values()  # echo is not part of the group: one group, one stream
    assert report["trials_joined"] == len(trials)
    ids = train_ids(spec)
    starts = {}
    for trial in os.listdir(tmp_path):
        path = os.path.join(tmp_path, trial)
        if not os.path.isdir(path):
            continue
        epochs = [dict(np.load(os.path.join(path, f"epoch{k}.npz"))) for k in range(EPOCHS)]
        echo = EchoSpec.parse(str(epochs[0]["echo"]))
        assert_fresh_exactly_once(epochs, ids, spec.views * echo.factor, f"{trial} ({echo.name})")
        for e in epochs:
            view = e["repeats"] // echo.factor  # a repeat of view v's row is labelled v * factor + copy
            want = reference_digests(spec, e["stream_epochs"], e["indices"], view)
            assert np.array_equal(e["digests"], want), f"{trial}: bytes differ from the unshared pipeline's"
            assert int(e["fresh"]) == len(ids) and int(e["private_samples"]) == 0
            if echo.mode in ("example", "batch"):
                assert int(e["echoed"]) == (spec.views * echo.factor - 1) * len(ids)
        starts[echo.name] = int(epochs[0]["start"])
    [late] = [EchoSpec.parse(e).name for r, e, _ in trials if r == "late"]
    assert starts[late] > 0, "the late trial joined mid-epoch"
    assert live_coordprep_actors() == [] and plasma_objects_settled(baseline) <= baseline


@pytest.mark.usefixtures("warm_pool")  # its variants' sweeps run on one kept pool
def test_the_echo_experiment_runs_a_tiny_configuration_end_to_end(ray_session, small_dataset, tmp_path):
    from coordinated_prep.bench.echo import format_echo, load_echo, run_echo

    path = tmp_path / "echo.yaml"
    path.write_text(f"""
sweep:
  name: tiny-echo
  storage_path: {tmp_path}/runs
  trainable: small_cnn
  data: {{dataset: {small_dataset}, pipeline: {{size: 16}}, seed: 1}}
  search_space: {{lr: 0.05, batch_size: 32, width: 4, epochs: 1, model_seed: 0}}
  num_samples: 1
  resources_per_trial: {{cpu: 0.25}}
  pool: {{keep_warm: true}}
variants:
  - {{name: "off", echo: 1}}
  - {{name: both, echo: "example:2", views: 2}}
""")
    # The second variant sets the trials' echo and the data's views: each sample is read 2 x 2 times,
    # 1 fresh and 3 echoed (either setting alone would give 1, neither 0).
    result = run_echo(load_echo(str(path)), str(tmp_path / "out"))
    rows = {r["variant"]: r for r in result["variants"]}
    assert set(rows) == {"off", "both"} and set(result["targets"]) == {"0"}
    assert rows["off"]["reached"] == 1 and rows["off"]["echoed_samples"] == 0
    fresh = rows["off"]["fresh_samples"]
    assert rows["both"]["fresh_samples"] == fresh and rows["both"]["echoed_samples"] == 3 * fresh
    for name in ("echo.csv", "echo.json", "echo.png"):
        assert (tmp_path / "out" / name).stat().st_size > 0
    assert "time to target s" in format_echo(result)


def ready_consumer(config: dict) -> None:
    """Reads with echo="auto", but before each batch waits (bounded) until the next piece is at hand."""
    loader = train_loader(config, batch_size=8, epochs=1, echo="auto")
    stream = loader._stream  # the trial's SharedStream: its requests in flight
    batches = iter(loader)
    ready_before = 0
    while True:
        stream._request_ahead()
        if stream._pending:  # the coordinator answers once the piece is prepared
            done, _ = ray.wait([stream._pending[0][1]], timeout=60)
            ready_before += stream.ready(1)
        if next(batches, None) is None:
            break
    tune.report({"fresh": loader.epoch_counts.fresh, "echoed": loader.epoch_counts.echoed,
                 "ready_before": ready_before, "samples": loader.samples_per_epoch})


def test_auto_never_echoes_when_the_shared_stream_is_always_ready(ray_session, small_dataset, warm_pool):
    spec = DataSpec(dataset=small_dataset, pipeline={"size": 32}, seed=6, chunk_size=8, segments=4)
    searcher = CoordinatedSearcher(pool=warm_pool)
    analysis = tune.run(tune.with_resources(ready_consumer, {"cpu": 0.25}), search_alg=searcher, verbose=0,
                        config={"data": spec})
    searcher.close()
    [trial] = analysis.trials
    assert trial.status == "TERMINATED", trial.error_file
    result = trial.last_result
    assert result["fresh"] == result["samples"] and result["echoed"] == 0, result
    assert result["ready_before"] >= result["samples"] // 8 - 1, "SharedStream.ready saw the answers at hand"
