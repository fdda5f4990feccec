"""coordprep bench at a tiny size, end to end: every loader, both steps, raw files and Parquet records, CSV and PNG.

No timings are asserted: only that every row is there, with the counts it must have.
"""

from __future__ import annotations

import csv
import os
import textwrap

import pytest

from coordinated_prep.bench.config import BenchConfig, load_bench
from coordinated_prep.bench.cpu import ROLES, ProcessSampler, cpu_by_role, machine_busy_s, read_processes, role_of
from coordinated_prep.cli import main
from coordinated_prep.errors import ConfigError
from coordinated_prep.plan import holdout_split
from coordinated_prep.pipeline.sources import open_source
from coordinated_prep.pipeline.sources.parquet import MANIFEST
from tests.conftest import live_coordprep_actors


def test_a_tiny_bench_runs_every_loader_and_format_and_writes_csv_and_png(ray_session, small_dataset, tmp_path, capsys):
    path = tmp_path / "bench.yaml"
    path.write_text(textwrap.dedent(f"""
        name: tiny
        storage_path: {tmp_path / "runs"}
        dataset: {small_dataset}
        size: 32
        batch_size: 16
        epochs: 1
        trials: [2]
        steps: [simulated, cnn]
        simulated_step_ms: 1
        cnn_trials: [1]
        cnn_loaders: [dali]   # a coordinated bench trial cut at max_batches: tests/test_analyze.py
        cnn_batches: 2
        cnn_width: 4
        record_trials: [2]
        record_loaders: [coordinated-torchvision]   # a DataLoader over Parquet: tests/test_parquet.py
        cores: 2
        pool_actors: 1   # each coordinated run starts its pool: one process importing torch, not two
    """))
    assert main(["bench", str(path)]) == 0
    out = capsys.readouterr().out
    assert "coordinated-dali" in out and "Written:" in out and "parquet" in out
    rows = list(csv.DictReader((tmp_path / "runs" / "tiny" / "bench.csv").open()))
    epoch = len(holdout_split(len(open_source(small_dataset)), 0.1)[0])
    reads = [r for r in rows if r["step"] == "read"]
    assert [(r["format"], r["cache"]) for r in reads] == [
        ("files", "cold"), ("files", "warm"), ("parquet", "cold"), ("parquet", "warm"), ("tar", "cold"),
        ("tar", "warm"), ("files+node cache", "cold, filling"), ("files+node cache", "cached")]
    for r in reads:  # the whole training split, shuffled, without decoding
        assert int(r["samples"]) == epoch and float(r["samples_per_s"]) > 0 and float(r["mb_per_s"]) > 0, r
    assert (tmp_path / "runs" / "tiny" / "parquet" / MANIFEST).is_file(), "the dataset was converted once"
    assert os.listdir(tmp_path / "runs" / "tiny" / "tar") == ["shard-000000.tar"], "and written as tar shards"
    [bound] = [r for r in rows if r["step"] == "decode"]  # the cores' decode-and-augment bound, measured
    assert float(bound["ms_per_sample"]) > 0 and float(bound["samples_per_s"]) > 0
    launches = [r for r in rows if r["step"] == "launch"]  # Tune's launch of N empty trials, before each N's loaders
    assert [r["trials"] for r in launches] == ["2"]
    for r in launches:
        assert 0 < float(r["launch_s"]) <= float(r["run_s"]) and float(r["launch_cpu_s"]) > 0, r
        # the ceiling: launch CPU plus one preparation of the epochs' samples, over the cores
        unique = epoch * float(bound["ms_per_sample"]) / 1000
        assert float(r["ideal_with_startup_s"]) == pytest.approx((float(r["launch_cpu_s"]) + unique) / 2), r
        assert int(r["samples_read"]) == int(r["trials"]) * epoch and float(r["vs_best_with_startup"]) > 0, r
    rows = [r for r in rows if r["step"] not in ("decode", "launch")]
    files = [r for r in rows if r["step"] != "read" and r["format"] == "files"]
    assert [(r["step"], r["trials"]) for r in files[::4]] == [("simulated", "2"), ("cnn", "1")]
    assert [r["loader"] for r in files if r["step"] == "cnn"] == ["dali"]
    records = [(r["step"], r["loader"], r["trials"]) for r in rows if r["step"] != "read" and r["format"] == "parquet"]
    assert records == [("simulated", "coordinated-torchvision", "2")]
    for r in rows:
        if r["step"] == "read":
            continue
        assert float(r["samples_per_s"]) > 0, r
        if (r["step"], r["loader"]) != ("cnn", "dali"):  # DALI's threads share the CNN's process
            assert float(r["prep_cpu_s"]) > 0, r
        if r["step"] == "simulated":  # every loader reads exact epochs, and a shared group prepares each once
            assert int(r["samples_read"]) == int(r["trials"]) * epoch, r
            expected_work = 1.0 if r["loader"].startswith("coordinated") else float(r["trials"])
            assert float(r["prep_work_x"]) == pytest.approx(expected_work), r
        assert (float(r["peak_staging_bytes"]) > 0) == r["loader"].startswith("coordinated"), r
        assert float(r["samples_per_s_with_startup"]) > 0 and float(r["waited_s"]) > float(r["window_s"]), r
        if r["step"] == "simulated":
            assert float(r["trial_cpu_ms_per_batch"]) > 0, r
        shares = [r[f"cpu_{role}_share"] for role in ROLES]  # sampled twice a second: a tiny run may have none
        if not r["loader"].startswith("coordinated") or shares[0] == "":
            assert shares == [""] * len(ROLES), r
        else:
            assert 0 < float(shares[0]) and sum(map(float, shares)) <= 1.05, r
        if r["loader"].startswith("coordinated"):  # batches of 16 inside pieces of 32: all views
            assert float(r["copied_fraction"]) == 0.0 and float(r["vs_prep_bound"]) > 0, r
    # every row is compared with the best independent loader at its N (the CNN's DALI row with itself)
    assert all(float(r["vs_best_independent"]) > 0 for r in rows if r["step"] != "read")
    png = (tmp_path / "runs" / "tiny" / "bench.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000
    assert live_coordprep_actors() == []


def test_the_shipped_bench_file_is_valid():
    cfg = load_bench("experiments/bench.yaml")
    assert cfg.trials == (1, 2, 4, 8) and cfg.size == 224 and cfg.batch_size >= 64
    assert cfg.dataset == "builtin:photos" and cfg.simulated_step_ms == 5 and cfg.epochs == 3
    assert cfg.record_trials == (1, 4) and cfg.record_loaders == ("dataloader", "coordinated-torchvision")
    speed = load_bench("experiments/bench-speed.yaml")  # the README's speed table
    assert speed.trials == (1, 4, 8) and speed.loaders == ("dataloader", "coordinated-torchvision")
    assert (speed.dataset, speed.simulated_step_ms, speed.epochs, speed.record_trials) == ("builtin:photos", 5, 3, ())
    assert speed.pool_actors == speed.cores  # one prep actor per core unless the file says otherwise


@pytest.mark.parametrize("text, named", [("trials: [0]", "bench.trials"), ("loaders: [torch]", "torch"),
                                         ("sizes: 3", "sizes"), ("steps: []", "bench.steps"),
                                         ("cnn_batches: 1", "bench.cnn_batches"),
                                         ("loaders: [dataloader]\ncnn_loaders: [dali]", "bench.cnn_loaders"),
                                         ("record_trials: [0]", "bench.record_trials"),
                                         ("record_loaders: [dali]", "dali reads image files itself"),
                                         ("pool_actors: 0", "bench.pool_actors")])
def test_bad_bench_files_name_the_key(tmp_path, text, named):
    path = tmp_path / "b.yaml"
    path.write_text(text + "\n")
    with pytest.raises(ConfigError, match=named) as e:
        load_bench(str(path))
    assert str(path) in str(e.value)


def test_the_shipped_user_pipeline_bench_runs_its_factory_in_both_loaders():
    from coordinated_prep.bench.run import data_spec
    from coordinated_prep.pipeline import Factory

    cfg = load_bench("experiments/bench-v2.yaml")
    assert cfg.transform == Factory("trainables.data.photos:train_transform",
                                    {"size": 224, "jitter": 0.4, "normalize": True})
    assert cfg.trials == (1, 4, 8) and cfg.loaders == ("dataloader", "coordinated-torchvision")
    assert (cfg.simulated_step_ms, cfg.epochs, cfg.record_trials) == (5, 3, ())
    shared, private = data_spec(cfg, "coordinated-torchvision"), data_spec(cfg, "dataloader")
    assert shared.transform == private.transform == cfg.transform and shared.user_transforms
    assert shared.coordinated and not private.coordinated
    import torch
    from torchvision import tv_tensors

    image = tv_tensors.Image(torch.randint(0, 256, (3, 375, 500), dtype=torch.uint8))
    out = cfg.transform.build()(image)  # what each prepared sample holds: float, normalised, 224 px
    assert out.shape == (3, 224, 224) and out.dtype == torch.float32


@pytest.mark.parametrize("loaders, record_loaders", [("[dataloader, dali]", "[dataloader]"),
                                                     ("[coordinated-dali]", "[dataloader]"),
                                                     ("[dataloader]", "[coordinated-dali]")])
def test_a_user_transform_with_a_dali_loader_is_refused(tmp_path, loaders, record_loaders):
    path = tmp_path / "b.yaml"
    path.write_text(textwrap.dedent(f"""
        transform: {{factory: "trainables.data.photos:train_transform"}}
        loaders: {loaders}
        record_loaders: {record_loaders}
    """))
    with pytest.raises(ConfigError, match=r"bench.transform=.*cannot run in the DALI loaders") as e:
        load_bench(str(path))
    assert str(path) in str(e.value)


@pytest.mark.parametrize("transform, named", [("trainables.data.photos:train_transform", "must be {factory"),
                                              ("{factory: nowhere.at_all:fn}", "does not import"),
                                              ("{factory: 'trainables.data.photos:train_transform', size: 3}",
                                               "keys 'factory'")])
def test_a_bad_bench_transform_names_the_key(tmp_path, transform, named):
    path = tmp_path / "b.yaml"
    path.write_text(f"transform: {transform}\nloaders: [dataloader]\n")
    with pytest.raises(ConfigError, match=named) as e:
        load_bench(str(path))
    assert "bench.transform" in str(e.value) or "factory" in str(e.value)


def test_defaults_are_valid():
    assert BenchConfig().loaders[0] == "dataloader"


def test_cpu_is_told_apart_by_the_process_titles_ray_gives_its_workers():
    assert role_of("ray::PrepActor.prepare") == "prep" and role_of("ray::PrepActor") == "prep"
    assert role_of("ray::ImplicitFunc.train ") == "trials" and role_of("ray::Coordinator.fetch") == "coordinators"
    assert role_of("/usr/bin/python -m pytest") == "other" and role_of("") == "other"
    before = {1: (100, "prep"), 2: (50, "trials"), 3: (7, "other")}
    after = {1: (300, "prep"), 2: (60, "trials"), 4: (20, "coordinators")}  # 3 ended, 4 started meanwhile
    assert cpu_by_role(before, after, 100.0) == {"prep": 2.0, "trials": 0.1, "coordinators": 0.2, "other": 0.0}


def test_the_sampler_shares_cpu_by_role_between_the_snapshots_inside_a_window():
    import threading

    calls = []
    taken = threading.Event()

    def reader():  # each snapshot: the prep actor 10 ticks further, the trial 5; the 6th is the last asked for
        calls.append(None)
        k = len(calls)
        if k == 6:
            taken.set()
        return {1: (10 * k, "prep"), 2: (5 * k, "trials")}

    with ProcessSampler(interval_s=0.001, reader=reader) as sampler:
        assert taken.wait(timeout=30), "the sampler took no snapshots"
    stamps = [t for t, _ in sampler._snapshots]
    assert stamps == sorted(stamps) and len(stamps) >= 6
    shares = sampler.shares(stamps[1], stamps[4], cores=2)  # snapshots 2..5: 30 and 15 ticks
    seconds = (stamps[4] - stamps[1]) * 2
    ticks = os.sysconf("SC_CLK_TCK")
    assert shares["prep"] == pytest.approx(30 / ticks / seconds)
    assert shares["trials"] == pytest.approx(15 / ticks / seconds)
    assert shares["coordinators"] == shares["other"] == 0
    assert sampler.shares(stamps[-1] + 10, stamps[-1] + 20, cores=2) is None  # no snapshots there


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="no /proc to read")
def test_proc_readings_find_this_process_and_the_cpu_it_spends():
    import hashlib
    import time

    before = read_processes()[os.getpid()]
    busy = machine_busy_s()
    cpu = time.process_time()
    while time.process_time() - cpu < 0.3:  # 0.3 s of CPU in this process
        hashlib.sha256(bytes(1 << 20)).digest()
    ticks, role = read_processes()[os.getpid()]
    assert role == "other" and before[1] == "other"
    assert (ticks - before[0]) / os.sysconf("SC_CLK_TCK") >= 0.25  # ticks are 10 ms: allow the rounding
    assert machine_busy_s() - busy >= 0.25  # the machine was busy at least as long as this process
