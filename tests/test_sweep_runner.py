"""How ``coordprep sweep`` starts Ray (a loopback node by default, so nothing listens beyond the machine:
``tests/test_metrics.py`` runs its sweeps on a Ray started so, and checks its exporter's socket),
a sweep whose configs a Tune searcher (Optuna) suggests, and sweeps that search the data pipeline
(``data.pipeline.scale`` in YAML, Tune domains inside a Python data dict), run end to end."""

from __future__ import annotations

import io
import re
import textwrap

import pytest
from ray import tune

from coordinated_prep import CoordinatedSearcher, DataSpec, train_loader
from coordinated_prep.trial.loader import resolve_spec
from coordinated_prep.sweep.config import load_sweep
from coordinated_prep.sweep.progress import ProgressLine
from coordinated_prep.sweep.runner import LOOPBACK, init_kwargs, run_sweep
from coordinated_prep.sweep.summary import format_summary
from tests.harness import stream_samples

def test_init_arguments_default_to_a_loopback_node_and_dashboard():
    init = init_kwargs({"num_cpus": 2, "metrics_export_port": 8080})
    assert init == {"dashboard_host": LOOPBACK, "include_dashboard": False, "num_cpus": 2,
                    "_metrics_export_port": 8080, "_node_ip_address": LOOPBACK}
    assert init_kwargs({"node_ip_address": "10.0.0.5"})["_node_ip_address"] == "10.0.0.5"


_OPTUNA_SWEEP = """
name: optuna
storage_path: {runs}
trainable: small_cnn
data: {{dataset: {dataset}, pipeline: {{size: 32}}, chunk_size: 64}}
pool: {{keep_warm: true}}
search_space: {{lr: {{loguniform: [0.01, 0.1]}}, batch_size: {{choice: [32, 64]}}, width: 4, epochs: 1}}
num_samples: 2
max_concurrent_trials: 2
resources_per_trial: {{cpu: 0.25}}
search: {{type: optuna, seed: 0}}
"""


@pytest.mark.usefixtures("warm_pool")  # one kept pool for the module's sweeps
def test_an_optuna_sweep_from_yaml_shares_its_data(ray_session, small_dataset, tmp_path):
    from ray.tune.search.optuna import OptunaSearch

    path = tmp_path / "optuna.yaml"
    path.write_text(textwrap.dedent(_OPTUNA_SWEEP.format(runs=tmp_path / "runs", dataset=small_dataset)))
    cfg = load_sweep(str(path))
    summary = run_sweep(cfg, verbose=0)
    assert [t["status"] for t in summary["trials"]] == ["TERMINATED"] * 2, summary["trials"]
    # The searcher was Optuna, seeded: TPE seeded with 0 suggests exactly these two configs first
    # (its first 10 come from its seeded random sampler, whatever the trials report).
    optuna = OptunaSearch(seed=0)
    optuna.set_search_properties("accuracy", "max", {k: cfg.search_space[k].to_tune() for k in ("lr", "batch_size")})
    expected = sorted((c["lr"], c["batch_size"]) for c in (optuna.suggest(f"t{i}") for i in range(2)))
    suggested = sorted((t["config"]["lr"], t["config"]["batch_size"]) for t in summary["trials"])
    assert suggested == expected and len({lr for lr, _ in suggested}) == 2
    [group] = summary["groups"].values()  # one data group: every config shares the same DataSpec
    assert group["trials_joined"] == 2
    assert group["samples_served"] == 2 * group["samples_per_epoch"], "each trial read its one epoch"
    # One pass over the stream from the first trial's start to the last one's end, however the two
    # trials' starts fell: each piece prepared once for both.
    assert group["samples_prepared"] == stream_samples(group["starts"].values(), 1, group["samples_per_epoch"], 64)


def test_the_progress_line_names_each_groups_sharing_and_stall():
    from coordinated_prep.sweep.progress import format_progress

    line = format_progress(12.4, {"g1": {"samples_prepared": 1000, "samples_served": 2830}},
                           {"t1": ("g1", 0.02), "t2": ("g1", 0.04), "t3": ("g2", 0.5)})
    assert line.startswith("coordprep 12s | ")
    assert "group g1: sharing 2.83x (1,000 prepared, 2,830 served), stall 0.03 (2 trials reported)" in line
    assert "group g2: sharing - (0 prepared, 0 served), stall 0.50 (1 trial reported)" in line
    assert format_progress(0, {}, {}) == "coordprep 0s | no data group yet"


def test_the_progress_line_shows_each_groups_searched_data():
    from coordinated_prep.sweep.progress import format_progress

    line = format_progress(3, {"g1": {}}, {"t1": ("g1", 0.1)}, {"g1": "pipeline.scale.0=0.3416"})
    assert "group g1 (pipeline.scale.0=0.3416): sharing -" in line


def read_one_epoch(config: dict) -> None:
    """A trial that reads one epoch of its data and reports what its ``config["data"]`` held."""
    spec = resolve_spec(config)
    samples = sum(len(batch.labels) for batch in train_loader(config, batch_size=16, epochs=1))
    tune.report({"accuracy": 0.0, "stall_fraction": 0.0, "given_a_dataspec": isinstance(config["data"], DataSpec),
                 "scale": list(spec.pipeline.scale), "group": spec.group_key, "samples": samples})


class _Seen(tune.Callback):
    """Each trial's config, as the driver holds it, and its last result."""

    def __init__(self) -> None:
        self.trials: dict[str, tuple[dict, dict]] = {}

    def on_trial_result(self, iteration, trials, trial, result, **info) -> None:
        self.trials[trial.trial_id] = (trial.config, result)


def _data_sweep(tmp_path, small_dataset: str, name: str, key: str, samples: int) -> str:
    path = tmp_path / f"{name}.yaml"
    path.write_text(textwrap.dedent(f"""
        name: {name}
        storage_path: {tmp_path / "runs"}
        trainable: tests.test_sweep_runner:read_one_epoch
        data: {{dataset: {small_dataset}, pipeline: {{size: 24, scale: [0.3, 1.0]}}, chunk_size: 8}}
        pool: {{keep_warm: true}}
        search_space: {{{key}}}
        num_samples: {samples}
        max_concurrent_trials: 4
        resources_per_trial: {{cpu: 0.25}}
    """))
    return str(path)


@pytest.mark.usefixtures("warm_pool")  # one kept pool for the module's sweeps
def test_a_continuous_domain_on_a_pipeline_key_gives_each_trial_its_own_group(ray_session, small_dataset, tmp_path):
    path = _data_sweep(tmp_path, small_dataset, "continuous", "data.pipeline.scale.0: {uniform: [0.2, 0.6]}", 2)
    seen, progress = _Seen(), io.StringIO()
    summary = run_sweep(load_sweep(path), verbose=0, callbacks=[seen], progress=progress, progress_every_s=0)
    assert [t["status"] for t in summary["trials"]] == ["TERMINATED"] * 2, summary["trials"]
    assert len(seen.trials) == 2
    for config, result in seen.trials.values():
        spec = config["data"]
        assert isinstance(spec, DataSpec) and result["given_a_dataspec"], "a DataSpec, on the driver and in the trial"
        assert spec.pipeline.scale == (config["data.pipeline.scale.0"], 1.0) and 0.2 <= spec.pipeline.scale[0] <= 0.6
        assert result["scale"] == list(spec.pipeline.scale) and result["group"] == spec.group_key
        assert spec.pipeline.size == 24 and spec.chunk_size == 8, "the rest as data gives it"
    assert len({c["data"].pipeline.scale for c, _ in seen.trials.values()}) == 2
    groups = summary["groups"]
    assert set(groups) == {c["data"].group_key for c, _ in seen.trials.values()}, "a data group per trial"
    assert {t["group"] for t in summary["trials"]} == set(groups)
    for key, group in groups.items():
        assert group["trials_joined"] == 1 and group["samples_served"] == group["samples_per_epoch"]
        [(config, _)] = [(c, r) for c, r in seen.trials.values() if c["data"].group_key == key]
        assert group["searched"] == {"data.pipeline.scale.0": config["data.pipeline.scale.0"]}
        assert f"group {key} (pipeline.scale.0=" in progress.getvalue().splitlines()[-1]
    assert "searched data" in format_summary(summary)
    # Different tails (crop scales), one prefix (the decode): the decoded tier decoded each sample once
    # for both groups, whichever ran first.
    n = next(iter(groups.values()))["samples_per_epoch"]
    [tier] = summary["decoded"].values()
    assert sum(g["decodes"] for g in groups.values()) == n == tier["samples"], (groups, tier)
    assert sum(g["tier_hits"] for g in groups.values()) == sum(g["samples_prepared"] for g in groups.values()) - n


@pytest.mark.usefixtures("warm_pool")  # one kept pool for the module's sweeps
def test_a_grid_on_a_pipeline_key_forms_one_group_per_value(ray_session, small_dataset, tmp_path):
    path = _data_sweep(tmp_path, small_dataset, "grid", "data.pipeline.scale: {grid: [[0.2, 1.0], [0.5, 1.0]]}", 2)
    summary = run_sweep(load_sweep(path), verbose=0)
    assert [t["status"] for t in summary["trials"]] == ["TERMINATED"] * 4, summary["trials"]
    by_group: dict[str, list] = {}
    for t in summary["trials"]:
        by_group.setdefault(t["group"], []).append(t["config"]["data.pipeline.scale"])
    assert sorted(by_group.values()) == [[[0.2, 1.0]] * 2, [[0.5, 1.0]] * 2], "2 values x 2 samples: 2 groups of 2"
    groups = summary["groups"]
    assert set(groups) == set(by_group)
    for key, group in groups.items():
        assert group["trials_joined"] == 2 and group["samples_served"] == 2 * group["samples_per_epoch"]
        assert group["searched"] == {"data.pipeline.scale": by_group[key][0]}


@pytest.mark.usefixtures("warm_pool")  # one kept pool for the module's sweeps
def test_tune_domains_inside_a_python_data_dict_work_with_the_coordinated_searcher(ray_session, small_dataset,
                                                                                   tmp_path):
    searcher, seen, progress = CoordinatedSearcher(pool={"keep_warm": True}), _Seen(), io.StringIO()
    data = {"dataset": small_dataset, "chunk_size": 8, "pipeline": {"size": 24, "scale": [tune.uniform(0.2, 0.6), 1.0]}}
    tuner = tune.Tuner(
        tune.with_resources(read_one_epoch, {"cpu": 0.25}), param_space={"data": data},
        tune_config=tune.TuneConfig(search_alg=searcher, num_samples=2, metric="accuracy", mode="max"),
        run_config=tune.RunConfig(name="python", storage_path=str(tmp_path / "runs"), verbose=0,
                                  callbacks=[seen, ProgressLine(searcher.group_reports_ref, progress, 0)]))
    try:
        results = tuner.fit()
        groups = searcher.group_reports()
    finally:
        searcher.close()
    assert not results.errors and len(seen.trials) == 2
    reported = {r["group"] for _, r in seen.trials.values()}
    assert len(reported) == 2 and set(groups) == reported, "a continuous value: a data group per trial"
    for config, result in seen.trials.values():
        assert not result["given_a_dataspec"] and 0.2 <= config["data"]["pipeline"]["scale"][0] <= 0.6
    last = progress.getvalue().splitlines()[-1]
    assert all(re.search(rf"group {key}: sharing [^|]*, stall 0.00 \(1 trial reported\)", last) for key in reported), \
        f"the progress line reads a plain dict's group too: {last}"
