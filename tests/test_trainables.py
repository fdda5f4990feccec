"""The ready trainables: models build at the configured width and the small CNN learns builtin:shapes."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch

from coordinated_prep import DataSpec
from trainables import REGISTRY, resnet, small_cnn


class MemorySession:
    """Keeps every report and the state saved with it; resumes from ``start`` if given."""

    def __init__(self, start: dict[str, Any] | None = None) -> None:
        self.start = start
        self.reports: list[dict[str, Any]] = []
        self.states: list[dict[str, Any]] = []

    def restore(self) -> dict[str, Any] | None:
        return self.start

    def report(self, metrics: dict[str, Any], state: dict[str, Any]) -> None:
        self.reports.append(metrics)
        self.states.append(copy.deepcopy(state))


@pytest.fixture
def _config(small_dataset):
    """A trial's config over the small ImageFolder (162 training samples: 6 batches of 32 an epoch, the last
    short), for what a schedule and a checkpoint do; the learning test trains on builtin:shapes."""
    def make(**overrides: Any) -> dict[str, Any]:
        return {"data": DataSpec(dataset=small_dataset, coordinated=False, pipeline={"size": 32}), "lr": 0.05,
                "batch_size": 32, "epochs": 3, "width": 8, **overrides}

    return make


def test_resnet18_width_is_configurable():
    narrow, full = resnet.build(10, {"width": 16}), resnet.build(10, {})
    assert narrow(torch.zeros(2, 3, 32, 32)).shape == (2, 10)
    assert sum(p.numel() for p in narrow.parameters()) < sum(p.numel() for p in full.parameters()) / 10
    assert set(REGISTRY) == {"small_cnn", "resnet18", "cifar_cnn", "seg_unet", "audio_cnn"}


@pytest.mark.sweep  # trains for real: tens of seconds
def test_small_cnn_learns_builtin_shapes_well_above_chance():
    session = MemorySession()
    config = {"data": DataSpec(coordinated=False, pipeline={"size": 48}), "lr": 0.05, "batch_size": 32,
              "epochs": 3, "width": 16}
    small_cnn.fit(config, small_cnn.build, session)
    reports = session.reports
    assert [r["epoch"] for r in reports] == [1, 2, 3]
    assert reports[-1]["accuracy"] > 0.3, reports  # chance is 0.1 for ten classes
    assert all(0 <= r["stall_fraction"] <= 1 for r in reports)
    # 2,700 training samples: pieces of 256, so every batch of 32 is a view of one, none a copy.
    assert all(r["copied_fraction"] == 0.0 and r["loader_cpu_ms_per_batch"] > 0 for r in reports)


def test_a_resumed_trial_goes_on_from_its_checkpointed_epoch_and_schedule(_config):
    whole = MemorySession()
    small_cnn.fit(_config(), small_cnn.build, whole)
    assert [s["epoch"] for s in whole.states] == [1, 2, 3]
    from trainables import REPORTS

    assert set(whole.reports[0]) == REPORTS["small_cnn"] == REPORTS["resnet18"], "a sweep's metric is checked on it"
    resumed = MemorySession(start=whole.states[0])
    small_cnn.fit(_config(), small_cnn.build, resumed)
    assert [r["epoch"] for r in resumed.reports] == [2, 3]
    assert sum(r["samples"] for r in resumed.reports) == sum(r["samples"] for r in whole.reports[1:])
    # The whole trial's counts go on from the checkpoint's (the first epoch's samples are not lost).
    assert [r["fresh_samples_total"] for r in resumed.reports] == [r["fresh_samples_total"] for r in whole.reports[1:]]
    assert resumed.reports[-1]["echoed_samples_total"] == whole.reports[-1]["echoed_samples_total"]
    # The schedule went on from the checkpoint's step, not from its start.
    assert resumed.states[-1]["scheduler"]["last_epoch"] == whole.states[-1]["scheduler"]["last_epoch"]
    for mine, theirs in zip(resumed.states, whole.states[1:]):
        assert mine["optimizer"]["param_groups"][0]["lr"] == pytest.approx(theirs["optimizer"]["param_groups"][0]["lr"])


def test_a_pbt_exploit_keeps_the_schedule_scaled_to_the_new_learning_rate(_config):
    whole = MemorySession()
    small_cnn.fit(_config(epochs=2), small_cnn.build, whole)
    exploited = MemorySession(start=whole.states[0])  # another trial's state, this trial's doubled lr
    small_cnn.fit(_config(epochs=2, lr=0.1, weight_decay=0.0), small_cnn.build, exploited)
    [mine], theirs = exploited.states, whole.states[1]
    assert mine["lr"] == 0.1
    group = mine["optimizer"]["param_groups"][0]
    assert group["max_lr"] == pytest.approx(0.1) and group["weight_decay"] == 0.0
    assert group["lr"] == pytest.approx(2 * theirs["optimizer"]["param_groups"][0]["lr"])


def test_a_checkpoint_of_the_last_epoch_trains_nothing(_config):
    whole = MemorySession()
    small_cnn.fit(_config(epochs=1), small_cnn.build, whole)
    again = MemorySession(start=whole.states[-1])
    small_cnn.fit(_config(epochs=1), small_cnn.build, again)
    assert again.reports == []


@pytest.mark.parametrize("echo", ["example:2", "batch:2"])
def test_echoed_steps_follow_the_schedule_of_fresh_samples_and_end_it_exactly(echo, _config):
    plain, echoing = MemorySession(), MemorySession()
    small_cnn.fit(_config(epochs=2), small_cnn.build, plain)
    small_cnn.fit(_config(epochs=2, echo=echo), small_cnn.build, echoing)
    per_epoch = plain.reports[0]["steps"]  # fresh batches per epoch: the schedule's unit
    fresh = plain.reports[0]["fresh_samples"]
    for k, (a, b) in enumerate(zip(plain.states, echoing.states)):
        # Twice the optimiser steps, yet the schedule stands where the plain run's does after each epoch.
        assert b["scheduler"]["last_epoch"] == a["scheduler"]["last_epoch"] == (k + 1) * per_epoch
        assert b["optimizer"]["param_groups"][0]["lr"] == pytest.approx(a["optimizer"]["param_groups"][0]["lr"])
    for r in echoing.reports:
        assert r["fresh_samples"] == fresh and r["echoed_samples"] == fresh
        assert r["steps"] >= 2 * per_epoch - 1 and r["samples"] == 2 * fresh
    assert echoing.reports[-1]["fresh_samples_total"] == 2 * fresh
    assert echoing.reports[-1]["echoed_samples_total"] == 2 * fresh


def test_the_schedule_keeps_ranks_in_step_whatever_rows_each_holds():
    """A data-parallel trial's ranks take as many steps; one whose rows include pads (a sample skipped on
    its node) or echoes has fewer fresh ones. The schedule follows the steps, so both ranks train at
    one learning rate (each rank's own fresh count put them a step apart)."""
    from types import SimpleNamespace

    from trainables.training import Recipe

    class Plain(Recipe):  # the abstract parts unused here
        build = evaluate = metrics = step = loader = None

    class Rank:  # a rank's loader after 3 batches of 8 of its epoch of 5
        fresh_batches_per_epoch = 5

        def __init__(self, fresh: int) -> None:
            self.epoch_counts = SimpleNamespace(fresh=fresh)

        def __len__(self) -> int:
            return 5

    steps = [Plain().schedule_step(Rank(fresh), SimpleNamespace(steps=3), 8) for fresh in (8 * 3 - 3, 8 * 3)]
    assert steps == [3, 3], "rank 0 held 3 pads, rank 1 none: one schedule"


def test_the_schedule_cycles_below_the_configured_momentum_and_takes_four_steps():
    from trainables.training import one_cycle

    model = torch.nn.Linear(2, 2)
    for momentum, total in ((0.5, 4), (0.99, 9)):
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=momentum)
        scheduler = one_cycle(optimizer, {"lr": 0.1, "momentum": momentum}, total)  # 4: once a division by zero
        used = []
        for _ in range(total):
            optimizer.step()
            scheduler.step()
            used.append(optimizer.param_groups[0]["momentum"])
        assert max(used) <= momentum and min(used) >= min(0.85, momentum), (momentum, used)
