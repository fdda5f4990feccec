"""The what-if model of coordprep analyze: pure, so checked over random measured rates."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from coordinated_prep.analyze.model import Rates, against_measured, predict, stalls

positive = st.floats(1e-6, 1e6, allow_nan=False, allow_infinity=False)
costs = st.floats(0.0, 1.0, allow_nan=False, allow_infinity=False)
rates_st = st.builds(Rates, samples=st.integers(1, 10**7), sample_bytes=positive, compute_rate=positive,
                     read_s=costs, cold_read_s=costs, prep_s=costs, disk_bandwidth=positive,
                     batch_size=st.integers(1, 512), trial_batch_s=costs, dataloader_batch_s=costs,
                     pool_sample_s=costs)


@settings(max_examples=300, deadline=None)
@given(rates=rates_st, cores=st.integers(1, 64), trials=st.integers(1, 16), coordinated=st.booleans())
def test_more_cache_never_predicts_less_throughput(rates, cores, trials, coordinated):
    seq = [predict(rates, trials=trials, cores=cores, cache_fraction=f / 10, coordinated=coordinated).throughput
           for f in range(11)]
    assert all(a <= b * (1 + 1e-9) for a, b in zip(seq, seq[1:])), seq


@settings(max_examples=300, deadline=None)
@given(rates=rates_st, f=st.floats(0, 1), trials=st.integers(1, 16), coordinated=st.booleans())
def test_more_cores_never_predict_less_throughput(rates, f, trials, coordinated):
    seq = [predict(rates, trials=trials, cores=c, cache_fraction=f, coordinated=coordinated).throughput
           for c in (1, 2, 4, 8, 16)]
    assert all(a <= b * (1 + 1e-9) for a, b in zip(seq, seq[1:])), seq


@settings(max_examples=300, deadline=None)
@given(rates=rates_st, f=st.floats(0, 1), trials=st.integers(1, 16), cores=st.integers(1, 64))
def test_throughput_is_bounded_by_compute_and_stalls_are_not_negative(rates, f, trials, cores):
    p = predict(rates, trials=trials, cores=cores, cache_fraction=f, coordinated=True)
    assert p.throughput <= trials * rates.compute_rate * (1 + 1e-9)
    s = stalls(rates, cores)
    assert s["prep_stall_s"] >= 0 and s["fetch_stall_s"] >= 0


def test_coordination_multiplies_a_prep_bound_sweep_and_not_a_compute_bound_one():
    prep_bound = Rates(samples=1000, sample_bytes=1e5, compute_rate=10_000, read_s=1e-5, cold_read_s=1e-4,
                       prep_s=1e-2, disk_bandwidth=1e9, batch_size=10, trial_batch_s=1e-4)
    alone = predict(prep_bound, trials=8, cores=2, coordinated=False)
    shared = predict(prep_bound, trials=8, cores=2, coordinated=True)
    assert alone.bottleneck == shared.bottleneck == "workers"
    assert shared.throughput / alone.throughput == pytest.approx(8 * (1e-2 + 1e-5) / (1e-2 + 1e-5 + 8 * 1e-5), rel=1e-9)
    compute_bound = Rates(samples=1000, sample_bytes=1e5, compute_rate=10, read_s=1e-5, cold_read_s=1e-4,
                          prep_s=1e-3, disk_bandwidth=1e9, batch_size=10, trial_batch_s=1e-4)
    assert predict(compute_bound, trials=4, cores=2, coordinated=True).throughput == pytest.approx(40)
    assert predict(compute_bound, trials=4, cores=2).bottleneck == "compute"


def test_cold_cache_becomes_disk_bound_on_a_slow_disk():
    slow_disk = Rates(samples=1000, sample_bytes=1e6, compute_rate=1e5, read_s=0, cold_read_s=0, prep_s=1e-4,
                      disk_bandwidth=1e7, batch_size=10)
    cold, warm = predict(slow_disk, cores=4, cache_fraction=0.0), predict(slow_disk, cores=4, cache_fraction=1.0)
    assert cold.bottleneck == "disk" and cold.disk_s == pytest.approx(100.0)
    assert warm.bottleneck == "workers" and stalls(slow_disk, 4)["fetch_stall_s"] == pytest.approx(100.0 - 0.025)


@pytest.mark.parametrize("field, value", [("samples", 0), ("compute_rate", -1.0), ("prep_s", -0.1), ("batch_size", 0),
                                          ("trial_batch_s", -1e-3), ("dataloader_batch_s", -1e-3),
                                          ("pool_sample_s", -1e-3)])
def test_bad_rates_are_named(field, value):
    values = dict(samples=10, sample_bytes=1.0, compute_rate=1.0, read_s=0.0, cold_read_s=0.0, prep_s=0.0,
                  disk_bandwidth=1.0, batch_size=1)
    values[field] = value
    with pytest.raises(ValueError, match=field):
        Rates(**values)


@settings(max_examples=300, deadline=None)
@given(rates=rates_st, cores=st.integers(1, 64), f=st.floats(0, 1))
def test_a_trial_side_cost_makes_coordinated_throughput_per_trial_fall_as_trials_grow(rates, cores, f):
    per_trial = [predict(rates, trials=n, cores=cores, cache_fraction=f, coordinated=True).throughput / n
                 for n in (1, 2, 4, 8, 16)]
    assert all(b <= a * (1 + 1e-9) for a, b in zip(per_trial, per_trial[1:])), per_trial
    if rates.trial_batch_s > 0:
        free = dataclasses.replace(rates, trial_batch_s=0.0)
        for n in (1, 8):
            assert (predict(rates, trials=n, cores=cores, cache_fraction=f, coordinated=True).throughput
                    <= predict(free, trials=n, cores=cores, cache_fraction=f, coordinated=True).throughput * (1 + 1e-9))


@settings(max_examples=200, deadline=None)
@given(rates=rates_st, cores=st.integers(1, 64), f=st.floats(0, 1), trials=st.integers(1, 16),
       coordinated=st.booleans())
def test_without_per_batch_costs_the_model_is_the_old_one(rates, cores, f, trials, coordinated):
    free = dataclasses.replace(rates, trial_batch_s=0.0, dataloader_batch_s=0.0, pool_sample_s=0.0)
    p = predict(free, trials=trials, cores=cores, cache_fraction=f, coordinated=coordinated)
    passes = 1 if coordinated else trials
    work = passes * free.samples * (free.read_s + (1 - f) * free.cold_read_s + free.prep_s)
    assert p.workers_s == pytest.approx(work / cores, rel=1e-9, abs=1e-300)


def test_the_trial_side_term_by_hand():
    # 6,400 samples per 1 ms x batch 32 step; read 0.02 ms + prep 0.38 ms a sample; 1 ms per batch per trial.
    rates = Rates(samples=3200, sample_bytes=1e4, compute_rate=32_000, read_s=2e-5, cold_read_s=0.0, prep_s=3.8e-4,
                  disk_bandwidth=1e9, batch_size=32, trial_batch_s=1e-3, dataloader_batch_s=2e-3)
    one = predict(rates, trials=1, cores=2, coordinated=True)
    assert one.workers_s == pytest.approx((3200 * 4e-4 + 100 * 1e-3) / 2)  # 0.69 s
    eight = predict(rates, trials=8, cores=2, coordinated=True)
    assert eight.workers_s == pytest.approx((3200 * 4e-4 + 8 * 100 * 1e-3) / 2)  # 1.04 s
    assert eight.throughput / one.throughput == pytest.approx(8 * 0.69 / 1.04)  # 5.3x, not 8x
    alone = predict(rates, trials=8, cores=2)
    assert alone.workers_s == pytest.approx(8 * (3200 * 4e-4 + 100 * 2e-3) / 2)
    rows = against_measured(rates, 2, {1: 4000.0, 8: 20_000.0})
    assert [r["trials"] for r in rows] == [1, 8]
    assert rows[1]["predicted_speedup"] == pytest.approx(8 * 0.69 / 1.04) and rows[1]["measured_speedup"] == 5.0
    assert rows[0]["error"] == pytest.approx(3200 / 0.69 / 4000 - 1)


@pytest.mark.parametrize("measured", [{}, {1: 0.0}, {0: 10.0}])
def test_bad_measured_runs_are_named(measured):
    rates = Rates(samples=10, sample_bytes=1.0, compute_rate=1.0, read_s=0.0, cold_read_s=0.0, prep_s=0.0,
                  disk_bandwidth=1.0, batch_size=1)
    with pytest.raises(ValueError, match="measured"):
        against_measured(rates, 1, measured)


def test_the_pool_overhead_is_paid_once_per_sample_by_coordinated_trials_only():
    base = Rates(samples=1000, sample_bytes=1e4, compute_rate=1e6, read_s=0.0, cold_read_s=0.0, prep_s=1e-3,
                 disk_bandwidth=1e9, batch_size=10)
    pooled = dataclasses.replace(base, pool_sample_s=5e-4)
    for n in (1, 8):
        assert predict(pooled, trials=n, cores=2, coordinated=True).workers_s == pytest.approx(1000 * 1.5e-3 / 2)
        assert predict(pooled, trials=n, cores=2).workers_s == predict(base, trials=n, cores=2).workers_s
