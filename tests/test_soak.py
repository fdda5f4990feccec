"""Soak: 40 trials under ASHA, 4 at a time; memory must not grow with the number of finished trials.

Off by default (marked ``soak``). Run it with::

    .venv/bin/python -m pytest -m soak -s tests/test_soak.py

It prints the object-store and coordinator-memory figures it measured after each finished trial.
"""

from __future__ import annotations

import json
import re
import statistics

import pytest
from ray import tune
from ray.tune import Callback
from ray.tune.schedulers import ASHAScheduler

from coordinated_prep import CoordinatedSearcher, DataSpec
from tests.conftest import live_coordprep_actors, plasma_objects, plasma_objects_settled
from tests.harness import check_trial_records
from tests.recording import load_records, pids_titled, record

pytestmark = pytest.mark.soak


def _plasma_mib() -> int:
    from ray._private.internal_api import memory_summary

    return int(re.search(r"Plasma memory usage (\d+) MiB", memory_summary(stats_only=True)).group(1))


def _coordinator_rss_kib() -> int:
    total = 0
    for pid in pids_titled("ray::Coordinator"):
        with open(f"/proc/{pid}/status") as f:
            total += int(next(line for line in f if line.startswith("VmRSS")).split()[1])
    return total


class _Sampler(Callback):
    """After each finished trial: bytes in the object store and the coordinator's resident memory."""

    def __init__(self) -> None:
        self.samples: list[dict[str, int]] = []

    def on_trial_complete(self, iteration, trials, trial, **info):
        self.samples.append({"finished": len(self.samples) + 1, "plasma_mib": _plasma_mib(),
                             "coordinator_rss_kib": _coordinator_rss_kib()})


def test_forty_trials_under_asha_do_not_grow_memory(ray_session, small_dataset, tmp_path):
    baseline = plasma_objects()
    spec = DataSpec(dataset=small_dataset, pipeline={"size": 32}, chunk_size=8, segments=4)
    sampler = _Sampler()
    searcher = CoordinatedSearcher(max_concurrent=4)
    analysis = tune.run(
        tune.with_resources(record, {"cpu": 0.25}),
        config={"data": spec, "batch_size": tune.choice([8, 16]), "epochs": 4, "score": tune.uniform(0, 1),
                "out": str(tmp_path / "rec")},
        search_alg=searcher, num_samples=40, metric="score", mode="max", verbose=0, callbacks=[sampler],
        scheduler=ASHAScheduler(max_t=4, grace_period=1, reduction_factor=2),
    )
    searcher.close()
    assert all(t.status == "TERMINATED" for t in analysis.trials)
    sizes = {t.trial_id: t.config["batch_size"] for t in analysis.trials}
    for trial, epochs in load_records(str(tmp_path / "rec")).items():
        check_trial_records(spec, epochs, sizes[trial], trial)
    live = [s for s in sampler.samples if s["coordinator_rss_kib"]]
    first, last = live[: len(live) // 4], live[-(len(live) // 4):]
    figures = {
        "samples": sampler.samples,
        "plasma_mib_first_quarter": statistics.mean(s["plasma_mib"] for s in first),
        "plasma_mib_last_quarter": statistics.mean(s["plasma_mib"] for s in last),
        "coordinator_rss_kib_first_quarter": statistics.mean(s["coordinator_rss_kib"] for s in first),
        "coordinator_rss_kib_last_quarter": statistics.mean(s["coordinator_rss_kib"] for s in last),
    }
    print(json.dumps({k: v for k, v in figures.items() if k != "samples"}, indent=2))
    assert figures["plasma_mib_last_quarter"] <= figures["plasma_mib_first_quarter"] + 8
    assert figures["coordinator_rss_kib_last_quarter"] <= 1.2 * figures["coordinator_rss_kib_first_quarter"]
    assert live_coordprep_actors() == [] and plasma_objects_settled(baseline) <= baseline
