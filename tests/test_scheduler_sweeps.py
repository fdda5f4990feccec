"""Sweeps under PBT and HyperBand from YAML: one sweep per scheduler serves every property checked here.

A scheduler pauses, exploits, resumes and stops trials all through a sweep, so each sweep checks:

- the scheduler did its work (PBT logged exploits; HyperBand stopped trials early), and every
  trial's epochs are exact, a resumed or exploited trial's included, though every trial writes into
  every batch in place after recording it (a write reaches no other trial and no later epoch);
- a paused trial releases its place within seconds: the lease is far longer than the test and the
  budget holds under an epoch, so a paused trial that kept its place would stall its group for the
  whole lease at every pause;
- churn never prepares more than it serves: each pause leaves pieces prepared ahead for the trial
  unfetched (21 pieces an epoch, each a join point, and a lookahead of most of an epoch, as in
  issue 22's sweep: 1,617 samples in 13 pieces of 128 and the default lookahead of 8);
- nothing is left behind: no actor of ours, no object in the store.

The sweep runs once per module (a fixture) and each property is its own test, so a failure names
the property. The rules of the fixed HyperBand are tested without Ray in ``test_schedulers.py``.
"""

from __future__ import annotations

import os
import textwrap

import pytest

from coordinated_prep.sweep.config import load_sweep
from coordinated_prep.sweep.runner import run_sweep
from tests.conftest import live_coordprep_actors, plasma_objects, plasma_objects_settled
from tests.harness import check_trial_records
from tests.recording import load_records

PIECE = 8 * 3 * 24 * 24  # bytes of one piece of 8 samples at 24 px

SCHEDULERS = {  # (scheduler, scores: one trial each, cpu per trial, epochs)
    # Four trials, two at a time (cpu 0.5; the pool takes one of the two CPUs): PBT pauses the worst
    # quarter to exploit the best, and Tune pauses some to run others, so trials come and go all the
    # time and overlap little.
    "pbt": ("{type: pbt, perturbation_interval: 1, quantile_fraction: 0.25, "
            "hyperparam_mutations: {score: {choice: [1, 2, 3, 4]}}}", [1, 2, 3, 4], 0.5, 4),
    # Five trials at once, the fewest with a bracket that both stops a trial and resumes a paused one:
    # HyperBand (max_t 3, factor 2.5) puts the first two in a bracket that runs them to the end and
    # the next three in one that pauses each at iteration 1 until all three got there, then stops the
    # worst and runs the best two on to iteration 2 (at least one of them was paused: only the last
    # to get there runs on without a pause), where it stops them.
    "hyperband": ("{type: hyperband, max_t: 3, reduction_factor: 2.5}", [1, 2, 3, 4, 5], 0.125, 3),
}


pytestmark = pytest.mark.usefixtures("warm_pool")  # each scheduler's sweep starts on the pool the last one kept


@pytest.fixture(scope="module", params=sorted(SCHEDULERS))
def sweep(request, ray_session, small_dataset, tmp_path_factory):
    """``(scheduler, config, summary, records, leaked)`` of one recorded sweep under the scheduler."""
    name = request.param
    scheduler, scores, cpu, epochs = SCHEDULERS[name]
    tmp = tmp_path_factory.mktemp(name)
    path = tmp / f"{name}.yaml"
    path.write_text(textwrap.dedent(f"""
        name: {name}
        storage_path: {tmp / "runs"}
        trainable: tests.recording:record
        data: {{dataset: {small_dataset}, pipeline: {{size: 24}}, seed: 1, chunk_size: 8, segments: 21,
                lookahead: 16, staging_bytes: {16 * PIECE}, lease_s: 300}}
        pool: {{keep_warm: true}}
        search_space:
          batch_size: 8
          epochs: {epochs}
          checkpoint: true
          delay_s: 0.01
          write: true
          score: {{grid: {scores}}}
          out: {tmp / "records"}
        max_concurrent_trials: 6
        reuse_actors: {str(name == "pbt").lower()}  # PBT's exploits run in the exploited trial's process
        resources_per_trial: {{cpu: {cpu}}}
        metric: score
        mode: max
        scheduler: {scheduler}
    """))
    baseline = plasma_objects()
    cfg = load_sweep(str(path))
    summary = run_sweep(cfg, verbose=0)
    leaked = (live_coordprep_actors(), plasma_objects_settled(baseline) - baseline)
    records = load_records(str(tmp / "records"), contiguous=name != "pbt")  # PBT copies a trial's past epochs
    return name, cfg, summary, records, leaked


def test_the_scheduler_did_its_work_and_every_trials_epochs_are_exact(sweep):
    name, cfg, summary, records, _ = sweep
    assert all(t["status"] == "TERMINATED" for t in summary["trials"]), summary["trials"]
    if name == "pbt":
        with open(os.path.join(cfg.storage_path, cfg.name, "pbt_global.txt")) as f:
            exploits = [line for line in f if line.strip()]  # Tune's PBT logs one line per exploit
        assert len(exploits) >= 1
    else:
        assert any(t["epochs"] < SCHEDULERS[name][3] for t in summary["trials"]), "HyperBand stopped some trials early"
    assert len(records) == len(summary["trials"])
    for trial, epochs in records.items():
        check_trial_records(cfg.data, epochs, 8, trial)  # a resumed or exploited trial's epochs are exact too


def test_paused_trials_release_their_place_within_seconds(sweep):
    name, _, summary, _, _ = sweep
    [group] = summary["groups"].values()
    # A paused trial leaves when its loader is collected as Tune unwinds it, or when its process ends
    # (released_dead), whichever comes first; either way it re-joins when resumed.
    assert group["trials_joined"] > len(summary["trials"]), f"no trial of the {name} sweep was paused: {group}"
    assert group["evictions"] == 0 and group["stall_s"] < 10, group


def test_churn_never_prepares_more_than_it_serves(sweep):
    name, _, summary, _, _ = sweep
    [group] = summary["groups"].values()
    figures = {k: group[k] for k in ("samples_prepared", "samples_served", "trials_joined", "coordinators")}
    assert group["samples_prepared"] <= group["samples_served"], f"{name}: {figures}"


def test_nothing_is_left_behind(sweep):
    actors, extra_objects = sweep[4]
    assert actors == [] and extra_objects <= 0, sweep[4]
