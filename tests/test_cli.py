"""The coordprep command: errors before Ray starts, and a tiny sweep end to end with its summary."""

import json
import textwrap

import pytest

from coordinated_prep.cli import main


def test_bad_file_exits_2_with_the_key_named(tmp_path, capsys):
    path = tmp_path / "bad.yaml"
    path.write_text("trainable: small_cnn\nsearch_space: {lr: 0.1}\nnum_sampels: 3\n")
    assert main(["sweep", str(path)]) == 2
    err = capsys.readouterr().err
    assert str(path) in err and "num_sampels" in err and "allowed" in err


def test_resume_without_a_saved_sweep_exits_2_naming_the_directory(tmp_path, capsys):
    path = tmp_path / "never_run.yaml"
    text = open("experiments/default.yaml").read().replace("storage_path: runs", f"storage_path: {tmp_path / 'runs'}")
    path.write_text(text)
    assert main(["sweep", str(path), "--resume"]) == 2
    err = capsys.readouterr().err
    assert "no interrupted sweep to resume in" in err and str(tmp_path / "runs" / "default") in err


def test_a_dataset_url_this_machine_cannot_read_exits_2_before_ray_starts(tmp_path, capsys, monkeypatch):
    import socket

    from coordinated_prep.sweep import runner
    from tests.servers import Server

    def refuse_ray(*args, **kwargs):
        raise AssertionError("Ray was started for a sweep whose dataset cannot be read")

    monkeypatch.setattr(runner, "start_ray", refuse_ray)
    monkeypatch.setattr("ray.is_initialized", lambda: False)
    with socket.socket() as s:  # a port nothing listens on: its connections are refused
        s.bind(("127.0.0.1", 0))
        closed = f"http://127.0.0.1:{s.getsockname()[1]}"
    (tmp_path / "served").mkdir()
    with Server("http", str(tmp_path / "http.log"), str(tmp_path / "served")) as server:
        for dataset, error in ((f"{closed}/photos/", "cannot list it"), (f"{server.url}/photos/", "does not exist"),
                               (f"{server.url}/shards-{{0000..0003}}.tar", "shards-0000.tar' does not exist"),
                               (f"{closed}/shards-{{0000..0003}}.tar", "cannot be reached (ClientConnectorError")):
            path = tmp_path / "url.yaml"
            path.write_text(f"trainable: small_cnn\ndata: {{dataset: '{dataset}'}}\nsearch_space: {{lr: 0.1, batch_size: 8, epochs: 1}}\n")
            assert main(["sweep", str(path)]) == 2, dataset
            err = capsys.readouterr().err
            assert str(path) in err and repr(dataset) in err and error in err, err
        searched = tmp_path / "searched.yaml"  # a searched dataset is named by its search-space key
        searched.write_text("trainable: small_cnn\nsearch_space: {lr: 0.1, batch_size: 8, epochs: 1, data.dataset: "
                            f"{{grid: ['builtin:shapes', '{server.url}/photos/']}}}}\n")
        assert main(["sweep", str(searched)]) == 2
        err = capsys.readouterr().err
        assert f"search_space.data.dataset: dataset '{server.url}/photos/' does not exist" in err, err


def test_dry_run_validates_without_ray(capsys):
    assert main(["sweep", "experiments/default.yaml", "--dry-run"]) == 0
    assert "valid" in capsys.readouterr().out
    for argv, named in ((["analyze", "experiments/default.yaml", "--trials", "a,b"], "--trials='a,b'"),
                        (["memory", "experiments/default.yaml", "--steps", "0"], "--steps=0 must be >= 1"),
                        (["bench", "experiments/bench.yaml", "--trials", "x"], "--trials='x'")):
        assert main([*argv, "--dry-run"]) == 2, argv  # a dry run checks the flags too
        assert named in capsys.readouterr().err


@pytest.mark.usefixtures("warm_pool")
def test_a_tiny_sweep_prints_and_writes_its_summary(ray_session, small_dataset, tmp_path, capsys):
    path = tmp_path / "tiny.yaml"
    path.write_text(textwrap.dedent(f"""
        name: tiny
        storage_path: {tmp_path / "runs"}
        trainable: small_cnn
        data: {{dataset: {small_dataset}, pipeline: {{size: 24}}, chunk_size: 8}}
        pool: {{actors: 2, keep_warm: true}}
        search_space: {{lr: {{loguniform: [0.01, 0.1]}}, batch_size: {{choice: [8, 16]}}, width: 4, epochs: 2}}
        num_samples: 2
        max_concurrent_trials: 2
        resources_per_trial: {{cpu: 0.25}}
    """))
    assert main(["sweep", str(path), "--verbose", "0"]) == 0
    out = capsys.readouterr().out
    assert "Best trial:" in out and "prepared" in out and "served" in out
    summary = json.loads((tmp_path / "runs" / "tiny" / "summary.json").read_text())
    assert len(summary["trials"]) == 2 and summary["best_trial"]["accuracy"] is not None
    [group] = summary["groups"].values()
    assert group["samples_served"] == 2 * 2 * group["samples_per_epoch"], "the trials declared their 2 epochs"
    assert group["samples_prepared"] <= 2 * 2 * group["samples_per_epoch"]
    assert all(group[stage] > 0 for stage in ("fetch_s", "transform_s", "put_s")), group
    assert all(0 <= t["stall_fraction"] <= 1 for t in summary["trials"])
    assert "put s" in out and "stall" in out
    # The progress line beside Tune's table: each group's sharing factor and stall (at least the final one).
    [line] = [l for l in out.splitlines() if l.startswith("coordprep ") and "sharing" in l][-1:]
    assert f"group {next(iter(summary['groups']))}: sharing " in line and "(2 trials reported)" in line
    assert group["samples_prepared"] >= group["samples_per_epoch"] and group["coordinators"] >= 1
    assert all(t["stall_fraction"] is not None for t in summary["trials"])
    [pool] = summary["pools"].values()  # a fixed pool (pool.actors: 2), said so in the summary
    assert pool["prep_actors"] == 2 and pool["growth"] is None and "Prep pool on node" in out
    assert "2 actors, fixed" in out

    # From the sweep's directory back to its best trial, ready for the standalone loader, and the
    # data-group reports the searcher saved there.
    from coordinated_prep import DataSpec, best_trial, train_loader
    from coordinated_prep.tune.results import saved_reports

    sweep_dir = str(tmp_path / "runs" / "tiny")
    assert main(["best", sweep_dir]) == 0
    out = capsys.readouterr().out
    assert f"Best trial: {summary['best_trial']['trial']}" in out and "train_loader(best.data" in out
    assert f"{group['samples_served']}" in out, "the group's figures, from the saved reports"
    best = best_trial(sweep_dir)
    assert best.trial == summary["best_trial"]["trial"] and best.config == summary["best_trial"]["config"]
    assert isinstance(best.data, DataSpec) and best.data.group_key == next(iter(summary["groups"]))
    saved = saved_reports(sweep_dir)
    assert (saved["metric"], saved["mode"]) == ("accuracy", "max")
    assert saved["groups"][best.data.group_key]["samples_served"] == group["samples_served"]
    again = train_loader(best.data, batch_size=best.config["batch_size"], epochs=1, num_workers=0)
    assert sum(len(b) for b in again) == group["samples_per_epoch"]
    assert main(["best", sweep_dir, "--metric", "train_loss", "--mode", "min"]) == 0
    out = capsys.readouterr().out  # the snippet finds the trial shown, ranked as asked
    assert f"best = best_trial({sweep_dir!r}, metric='train_loss', mode='min')" in out
    assert f"Best trial: {best_trial(sweep_dir, metric='train_loss', mode='min').trial} " in out
    assert main(["best", sweep_dir, "--trial", "nope"]) == 2
    assert "no trial 'nope'" in capsys.readouterr().err
    assert main(["best", sweep_dir, "--mode", "min"]) == 2  # the worst accuracy, labelled best: refused
    assert "mode='min' would rank the sweep's own metric 'accuracy' the other way" in capsys.readouterr().err


def test_quiet_turns_the_progress_line_off(monkeypatch, capsys):
    import sys

    import coordinated_prep.sweep.runner as runner

    seen = []
    monkeypatch.setattr(runner, "run_sweep", lambda cfg, **kw: seen.append(kw["progress"]) or {
        "trials": [], "groups": {}, "metric": "accuracy", "mode": "max", "best_trial": None, "path": "x"})
    main(["sweep", "experiments/default.yaml", "--quiet"])
    main(["sweep", "experiments/default.yaml"])
    assert seen == [None, sys.stdout]


def test_dashboard_out_writes_grafana_json_with_a_panel_per_view(tmp_path, capsys):
    assert main(["dashboard", "--out", str(tmp_path)]) == 0
    model = json.loads((tmp_path / "coordprep_grafana_dashboard.json").read_text())
    assert model["uid"] == "coordprep" and model["schemaVersion"] >= 30
    titles = {p["title"] for p in model["panels"]}
    assert {"Stall fraction per trial", "Sharing factor per group", "Staged bytes against the budget",
            "Prep seconds by stage", "Errors by kind", "Node-cache hit rate", "Storage reads"} <= titles
    assert all(p["targets"] and all(t["expr"] for t in p["targets"]) for p in model["panels"])
    assert str(tmp_path) in capsys.readouterr().out
    assert main(["dashboard", "--out", str(tmp_path / "no" / "such" / "dir" / "d.json")]) == 2
    assert "is not a directory" in capsys.readouterr().err


def _cifar(tmp_path, old: str, new: str, name: str = "cifar.yaml") -> str:
    text = open("experiments/cifar-v2.yaml").read()
    assert old in text
    path = tmp_path / name
    path.write_text(text.replace(old, new))
    return str(path)


def test_dry_run_builds_every_factory_with_its_arguments(tmp_path, capsys):
    misspelt = _cifar(tmp_path, "jitter: 0.3", "jiter: 0.3", "misspelt.yaml")
    assert main(["sweep", misspelt, "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert misspelt in err and "data: transform" in err and "'jiter'" in err
    # torchvision only warns at an inverted range (and then crops another area than asked): refused here
    inverted = _cifar(tmp_path, "scale: [0.6, 1.0]", "scale: [1.7, 1.0]", "inverted.yaml")
    assert main(["sweep", inverted, "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert inverted in err and "data: transform" in err and "Scale and ratio should be of kind (min, max)" in err


def test_dry_run_names_the_searched_value_that_builds_a_bad_transform(tmp_path, capsys):
    searched = _cifar(tmp_path, "  lr: {loguniform: [0.02, 0.2]}",
                      "  lr: {loguniform: [0.02, 0.2]}\n  data.transform.args.scale: {grid: [[0.5, 1.0], [1.0, 0.5]]}")
    assert main(["sweep", searched, "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert "search_space.data.transform.args.scale=[1.0, 0.5]" in err and "[0.5, 1.0]" not in err.split("args")[0]
    good = _cifar(tmp_path, "  lr: {loguniform: [0.02, 0.2]}",
                  "  lr: {loguniform: [0.02, 0.2]}\n  data.transform.args.scale: {grid: [[0.5, 1.0], [0.8, 1.0]]}",
                  "good.yaml")
    assert main(["sweep", good, "--dry-run"]) == 0
    assert "2 data specs built" in capsys.readouterr().out


def test_a_trial_failing_on_its_configuration_exits_2_and_the_summary_says_what_happened():
    import ray.exceptions

    from coordinated_prep.cli import exit_status
    from coordinated_prep.errors import ConfigError
    from coordinated_prep.sweep.runner import error_kind
    from coordinated_prep.sweep.summary import build_summary, format_summary

    wrapped = ray.exceptions.RayTaskError("train", "Traceback ...", ConfigError("factory 'x:y' raised TypeError"))
    assert error_kind(wrapped.as_instanceof_cause()) == "config"
    assert error_kind(wrapped) == "config"
    assert error_kind(ray.exceptions.RayTaskError("train", "...", RuntimeError("CUDA"))) == "other"
    assert error_kind(None) is None
    rows = [{"trial": "a", "status": "ERROR", "error_kind": "config"}, {"trial": "b", "status": "TERMINATED"}]
    assert exit_status({"trials": rows}) == 2
    assert exit_status({"trials": [dict(rows[0], error_kind="other"), rows[1]]}) == 1
    assert exit_status({"trials": rows[1:]}) == 0
    # Every trial failed before reading: the sweep was still coordinated, and the summary says so.
    text = format_summary(build_summary(rows[:1], {}, "accuracy", "max", coordinated=True))
    assert "coordinated: false" not in text and "no trial read shared data (1 of 1 trials failed" in text
    unshared = format_summary(build_summary(rows[1:], {}, "accuracy", "max", coordinated=False))
    assert "coordinated: false" in unshared


def test_the_summary_says_where_sharing_did_not_pay_and_why():
    from coordinated_prep.sweep.summary import build_summary, format_summary

    groups = {"aaa": {"samples_prepared": 100, "samples_served": 200, "starts": {"t1": 0, "t2": 0}},
              "bbb": {"samples_prepared": 100, "samples_served": 100, "starts": {"t3": 0}},
              "ccc": {"samples_prepared": 200, "samples_served": 210, "starts": {"t4": 0, "t5": 9}},
              "ddp": {"samples_prepared": 100, "samples_served": 100, "starts": {"t6": 0}, "trials_joined": 2},
              "eee": {"samples_prepared": 300, "samples_served": 300, "starts": {"t7": 0, "t7#2": 10, "t7#3": 20}}}
    text = format_summary(build_summary([{"trial": "t1", "status": "TERMINATED"}], groups, "accuracy", "max"))
    assert "Group aaa" not in text  # 2.00x: it paid
    assert "Group bbb: saving 1.00x; one trial read it" in text
    assert "Group ccc: saving 1.05x; 2 trials read it, but seldom at the same time" in text
    assert "Group ddp: saving 1.00x; one trial read it" in text  # one trial's two ranks split its epoch
    assert "Group eee: saving 1.00x; one trial read it" in text  # one trial's loader made anew each epoch


def test_the_summary_ranks_numpy_scores_and_says_a_resumed_runs_figures_are_below_the_trials():
    import numpy as np

    from coordinated_prep.sweep.summary import build_summary, format_summary

    rows = [{"trial": "t1", "status": "TERMINATED", "loss": np.float32(0.5)},
            {"trial": "t2", "status": "TERMINATED", "loss": np.float64(0.25)}]
    groups = {"aaa": {"samples_prepared": 100, "samples_served": 200, "starts": {"t1": 0, "t2": 0}}}
    summary = build_summary(rows, groups, "loss", "min")
    assert summary["best_trial"]["trial"] == "t2"
    summary["resumed"] = True
    lines = format_summary(summary).splitlines()
    note = next(k for k, line in enumerate(lines) if line.startswith("Resumed:"))
    assert any(line.startswith("t2") for line in lines[:note]) and any(line.startswith("aaa") for line in lines[note:])


def test_the_summary_says_how_each_nodes_pool_grew_and_why():
    from coordinated_prep.pool.elastic import Growth
    from coordinated_prep.sweep.summary import build_summary, format_summary

    grew, idle = Growth(most=2), Growth(most=4)
    for _ in range(3):
        grew.tick(1.9, 1, False, 2.0, 7.5)
    grew.started(True, 12.0)
    lent = Growth(most=2, lends=True)  # trials served without waiting: it gives its one share back
    for _ in range(3):
        lent.tick(0.0, 2, False, 2.0, 20.0)
    pools = {"node-a" * 8: {"prep_actors": 2, "reserved_cpus": 1.0, "growth": grew.report()},
             "node-b" * 8: {"prep_actors": 1, "reserved_cpus": 0.5, "growth": idle.report()},
             "node-c" * 8: {"prep_actors": 2, "reserved_cpus": 1.0, "growth": None},
             "node-d" * 8: {"prep_actors": 1, "reserved_cpus": 0.0, "growth": lent.report()}}
    text = format_summary(build_summary([{"trial": "t1", "status": "TERMINATED"}], {}, "accuracy", "max", pools=pools))
    assert ("Prep pool on node node-anode-a: 2 of at most 2 actors (1.00 CPUs reserved); grew 1 time(s): 7.5 s grow: "
            "each trial was blocked 95% of the last 6 s on the pool's 1 actor(s), 1 reserving CPUs; 12.0 s added: "
            "2 actor(s), 2 reserving CPUs") in text
    assert "node-bnode-b: 1 of at most 4 actors (0.50 CPUs reserved); never grew: the trials did not wait" in text
    assert "node-cnode-c: 2 actors, fixed (1.00 CPUs reserved)" in text
    assert ("node-dnode-d: 1 of at most 2 actors (0.00 CPUs reserved); grew 0 time(s), gave CPUs back 1 time(s) (its "
            "preparation ran ahead): 20.0 s release: each trial was blocked 0.0% of the last 6 s: preparation runs "
            "ahead, so 0 of 1 actor(s)' CPUs stay reserved") in text


def test_the_summary_names_each_trial_that_prepared_samples_itself_and_why():
    from coordinated_prep.sweep.runner import _measured
    from coordinated_prep.sweep.summary import build_summary, format_summary

    late = "it met its sibling ranks after its node had released their start, piece 8"
    lease = "the lease of 0.25 s detached it at piece 3: it held the group's staging budget while other trials waited"
    loaders = {"t6@0": {"epochs": 2, "private_samples": 0, "private_reason": None},
               "t6@1": {"epochs": 2, "private_samples": 324, "private_reason": late},
               "t7": {"epochs": 2, "private_samples": 130, "private_reason": lease},
               "t8": {"epochs": 2, "private_samples": 0, "private_reason": None}}
    rows = [_measured({"trial": t, "status": "TERMINATED", "private_samples": reported}, loaders)
            for t, reported in (("t6", 0), ("t7", 130), ("t8", 0), ("t9", None))]
    assert [(r["private_samples"], r["private_reason"]) for r in rows] == [
        (324, f"rank 1: {late}"), (130, lease), (0, None), (None, None)]  # t9: no loader reported
    groups = {"g": {"samples_prepared": 100, "samples_served": 300, "starts": {"t6": 0, "t7": 0, "t8": 0}}}
    text = format_summary(build_summary(rows, groups, "accuracy", "max"))
    assert f"Trial t6 prepared 324 samples itself (rank 1: {late})." in text
    assert f"Trial t7 prepared 130 samples itself ({lease})." in text
    assert "Trial t8" not in text and "Trial t9" not in text
