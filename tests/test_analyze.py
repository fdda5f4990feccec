"""coordprep analyze end to end on a small dataset: terminal table, JSON with every field, PNG."""

from __future__ import annotations

import hashlib
import json
import os
import textwrap

import pytest

from coordinated_prep.cli import main

FIELDS = {"experiment", "trainable", "dataset", "config", "batch_size", "cores", "samples_measured",
          "samples_per_epoch", "step", "bandwidth", "per_sample", "rates", "runs", "stalls_per_epoch", "whatif",
          "created", "files", "disk_measured_on", "per_batch", "coordinated_runs", "pool_overhead_per_sample_s"}
QUICK = ["--no-coordinated-runs"]  # no Ray: only the end-to-end test below runs the coordinated trials


def _experiment(tmp_path, dataset: str, trainable: str = "small_cnn") -> str:
    path = tmp_path / "exp.yaml"
    path.write_text(textwrap.dedent(f"""
        name: probe
        storage_path: {tmp_path / "runs"}
        trainable: {trainable}
        data: {{dataset: {dataset}, pipeline: {{size: 32}}}}
        search_space: {{lr: {{loguniform: [0.01, 0.1]}}, batch_size: {{choice: [16, 32]}}, width: 4, epochs: 1}}
    """))
    return str(path)


def test_analyze_writes_every_field_and_monotone_predictions(ray_session, small_dataset, tmp_path, capsys):
    # One core: one prep actor per coordinated run and one DataLoader worker. 160 samples per trial: one
    # epoch of the 162, cut at 10 batches of 16 as a long dataset's is (run_length, tested below).
    assert main(["analyze", _experiment(tmp_path, small_dataset), "--samples", "96", "--cores", "1",
                 "--trials", "2,1", "--run-samples", "160"]) == 0
    out = capsys.readouterr().out
    assert "Stalls per epoch" in out and "coordinated samples/s" in out and "model vs measured" in out
    report = json.loads((tmp_path / "runs" / "probe" / "analysis" / "analysis.json").read_text())
    assert FIELDS <= set(report), FIELDS - set(report)
    assert report["samples_measured"] == 96 and report["batch_size"] == 16 and report["config"]["width"] == 4
    assert all(v > 0 for v in report["bandwidth"].values())
    assert report["per_sample"]["decode_augment_s"] > 0 and report["per_sample"]["encoded_bytes"] > 0
    for mode in ("synthetic", "warm", "cold"):
        run = report["runs"][mode]
        assert run["measured_samples_s"] > 0 and run["predicted_epoch_s"] > 0
    for kind in ("measured", "predicted"):
        assert set(report["stalls_per_epoch"][kind]) == {"prep_stall_s", "fetch_stall_s"}
        assert all(v >= 0 for v in report["stalls_per_epoch"][kind].values())
    cache = [row["throughput"] for row in report["whatif"]["cache"]]
    cores = [row["throughput"] for row in report["whatif"]["cores"]]
    assert len(cache) == 11 and all(a <= b * (1 + 1e-9) for a, b in zip(cache, cache[1:])), cache
    assert all(a <= b * (1 + 1e-9) for a, b in zip(cores, cores[1:])), cores
    trials = {(row["trials"], row["coordinated"]) for row in report["whatif"]["trials"]}
    assert trials == {(n, c) for n in (1, 2, 4, 8, 16) for c in (False, True)}
    runs = report["coordinated_runs"]
    assert [row["trials"] for row in runs["measured"]] == [1, 2] and runs["step_ms"] > 0
    rows = runs["model_vs_measured"]
    assert [row["trials"] for row in rows] == [1, 2]
    for row in rows:
        assert row["predicted_samples_s"] > 0 and row["measured_samples_s"] > 0 and row["predicted_speedup"] > 0
    assert rows[0]["predicted_speedup"] == rows[0]["measured_speedup"] == 1.0
    assert report["per_batch"]["coordinated_trial_cpu_s"] > 0  # the one-trial run's CPU per batch, in the model
    assert report["rates"]["trial_batch_s"] == report["per_batch"]["coordinated_trial_cpu_s"]
    assert runs["measured"][0]["pool_cpu_ms_per_sample"] > 0 and report["rates"]["pool_sample_s"] >= 0
    png = tmp_path / "runs" / "probe" / "analysis" / "analysis.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000


def test_a_simulated_step_makes_the_pipeline_the_bottleneck(small_dataset, tmp_path, capsys):
    out = tmp_path / "sim"
    assert main(["analyze", _experiment(tmp_path, small_dataset), "--samples", "64", "--step-ms", "1",
                 "--out", str(out), *QUICK]) == 0
    report = json.loads((out / "analysis.json").read_text())
    assert report["step"] == "simulated 1.0 ms" and report["coordinated_runs"]["model_vs_measured"] == []
    assert report["rates"]["trial_batch_s"] == 0.0
    # 16 samples per 1 ms step: about 16,000 samples/s, beyond what one core reads and decodes.
    assert report["whatif"]["cores"][0]["bottleneck"] == "workers"


def test_a_trainable_without_a_model_needs_step_ms(small_dataset, tmp_path, capsys):
    path = _experiment(tmp_path, small_dataset, trainable="tests.recording:record")
    assert main(["analyze", path, "--samples", "8", *QUICK]) == 2
    err = capsys.readouterr().err
    assert "tests.recording:record" in err and "--step-ms" in err


@pytest.mark.parametrize("args, named", [(["--samples", "1"], "--samples"), (["--cores", "0"], "--cores"),
                                         (["--step-ms", "0"], "--step-ms"), (["--trials", "0,4"], "--trials"),
                                         (["--trials", "four"], "--trials"), (["--run-samples", "1"], "--run-samples"),
                                         (["--samples", "20"], "--samples=20 gives 20 samples, fewer than two batches "
                                                               "of 16 (search_space.batch_size); raise --samples")])
def test_bad_arguments_are_named(small_dataset, tmp_path, capsys, args, named):
    assert main(["analyze", _experiment(tmp_path, small_dataset), *args]) == 2
    assert named in capsys.readouterr().err


def _snapshot(root: str) -> dict[str, tuple]:
    """Every entry under ``root`` (the root included): kind, size, mtime and, for files, a digest of the bytes."""
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in [".", *dirnames, *filenames]:
            path = os.path.normpath(os.path.join(dirpath, name))
            st = os.lstat(path)
            digest = hashlib.sha256(open(path, "rb").read()).hexdigest() if os.path.isfile(path) else None
            out[os.path.relpath(path, root)] = (st.st_mode, st.st_size, st.st_mtime_ns, digest)
    return out


def test_analyze_leaves_the_dataset_directory_byte_for_byte_unchanged(small_dataset, tmp_path, capsys):
    before = _snapshot(small_dataset)
    assert main(["analyze", _experiment(tmp_path, small_dataset), "--samples", "32", "--step-ms", "1", *QUICK]) == 0
    assert _snapshot(small_dataset) == before
    report = json.loads((tmp_path / "runs" / "probe" / "analysis" / "analysis.json").read_text())
    assert report["disk_measured_on"].startswith("the dataset's own files")
    assert report["bandwidth"]["disk_sequential_bytes_s"] > 0


def test_a_disk_probe_is_written_only_where_the_user_says_and_never_in_the_dataset(small_dataset, tmp_path, capsys):
    probe = tmp_path / "probe"
    probe.mkdir()
    before = _snapshot(small_dataset)
    exp = _experiment(tmp_path, small_dataset)
    inside = os.path.join(small_dataset, os.listdir(small_dataset)[0])
    assert main(["analyze", exp, "--samples", "32", "--step-ms", "1", "--disk-probe-dir", inside, *QUICK]) == 2
    assert "lies inside the dataset" in capsys.readouterr().err
    assert main(["analyze", exp, "--samples", "32", "--step-ms", "1", "--disk-probe-dir", str(probe), *QUICK]) == 0
    assert _snapshot(small_dataset) == before and not os.listdir(probe)  # the scratch file was removed
    report = json.loads((tmp_path / "runs" / "probe" / "analysis" / "analysis.json").read_text())
    assert report["disk_measured_on"] == f"a scratch file in {probe}"


def test_run_length_reads_whole_epochs_up_to_the_bound_and_part_of_a_long_one():
    from coordinated_prep.analyze.coordinated import parse_trials, run_length

    assert run_length(2700, 32, 8192) == (4, 0)  # 10,800 samples: whole epochs
    assert run_length(100_000, 32, 8192) == (1, 256)  # 256 batches of one long epoch
    assert run_length(100_000, 64, 2) == (1, 2)  # never fewer than two batches
    assert parse_trials("8,1,4,4") == (1, 4, 8)
