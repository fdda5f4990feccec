"""Dashboard metrics: scraped over HTTP from the node's Prometheus endpoint during a real sweep, on a
Ray started as ``coordprep sweep`` starts its own (a loopback node: the exporter listens on 127.0.0.1
only)."""

from __future__ import annotations

import contextlib
import json
import math
import os
import socket
import threading
import time
import urllib.request
from typing import Callable, Iterator

import pytest
from prometheus_client.parser import text_string_to_metric_families
from ray import tune

from coordinated_prep import CoordinatedSearcher, DataSpec, PoolSpec
from coordinated_prep.cache import CacheSpec
from coordinated_prep.metrics import DEFINITIONS
from coordinated_prep.plan import holdout_split
from coordinated_prep.pipeline.sources import open_source
from coordinated_prep.sweep.runner import LOOPBACK, start_ray
from tests.conftest import REPO, own_ray
from tests.harness import stream_samples, train_ids
from tests.utils import listening_on
from tests.recording import record


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


PORT = _free_port()


@pytest.fixture(scope="module")
def ray_session():
    """This module's Ray, started by the sweep runner's ``start_ray``: it exports metrics on a known
    port and reports them every second."""
    import ray

    own_ray()  # this module's Ray is its own
    start_ray({"address": "local", "num_cpus": 2, "include_dashboard": True, "object_store_memory": 512 * 2**20,
               "log_to_driver": False, "metrics_export_port": PORT,
               "_system_config": {"metrics_report_interval_ms": 1000},
               "runtime_env": {"env_vars": {"PYTHONPATH": REPO, "COORDPREP_CACHE": os.environ["COORDPREP_CACHE"]}}})
    yield ray
    own_ray()


def test_the_sweeps_own_ray_instance_exports_metrics_on_loopback_only(ray_session):
    assert ray_session.util.get_node_ip_address() == LOOPBACK
    deadline = time.monotonic() + 60
    while not listening_on(PORT) and time.monotonic() < deadline:  # the exporter starts with the agent
        time.sleep(0.5)  # polling a socket table the kernel offers no event for, bounded by the deadline
    assert listening_on(PORT) == {LOOPBACK}


def scrape() -> dict[tuple[str, frozenset], float]:
    """Our samples on the node's endpoint: (name without Ray's prefix, our tags) -> value."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{PORT}/metrics", timeout=10).read().decode()
    samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name.startswith("ray_coordprep_"):
                tags = frozenset((k, v) for k, v in s.labels.items() if k in ("group", "trial", "stage", "kind", "node", "where", "reader",
                                                                               "pipeline"))
                key = (s.name[len("ray_"):].removesuffix("_total"), tags)
                samples[key] = samples.get(key, 0.0) + s.value  # one series per recording process
    return samples


@contextlib.contextmanager
def polling(collect: Callable[[], None], every_s: float = 0.5) -> Iterator[None]:
    """Call ``collect`` every ``every_s`` seconds in a thread while the block runs (and stop it after)."""
    stop = threading.Event()

    def poll() -> None:
        while not stop.wait(every_s):
            collect()

    thread = threading.Thread(target=poll, daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join(timeout=30)


def value(samples, name: str, **tags: str) -> float | None:
    return samples.get((f"coordprep_{name}", frozenset(tags.items())))


def test_metrics_are_scraped_during_a_sweep_with_plausible_values(ray_session, small_dataset, tmp_path):
    spec = DataSpec(dataset=small_dataset, pipeline={"size": 32}, seed=4, chunk_size=8, segments=4,
                    staging_bytes=64 * 8 * 3 * 32 * 32)
    group, epochs = spec.group_key, 2
    during: list[dict] = []
    # A decoded tier of one byte: its series are exported, and it keeps nothing, so every epoch reads
    # through the node cache, whose counts this test checks.
    # The pool is kept for the module's next sweep (its processes start once).
    searcher = CoordinatedSearcher(cache=CacheSpec("32MiB"), pool=PoolSpec(decoded_bytes=1, keep_warm=True))
    try:
        with polling(lambda: during.append(scrape())):  # the scraper Prometheus would be, while the sweep runs
            analysis = tune.run(tune.with_resources(record, {"cpu": 0.25}),
                                config={"data": spec, "batch_size": 8, "epochs": epochs, "delay_s": 0.05,
                                        "echo": "batch:2", "evaluate": True, "score": tune.grid_search([1, 2]),
                                        "out": str(tmp_path)},
                                search_alg=searcher, verbose=0)
        [report] = searcher.group_reports().values()
    finally:
        searcher.close()
    trials = [t.trial_id for t in analysis.trials]
    assert any(value(s, "samples_prepared", group=group) for s in during), "no metrics seen while the sweep ran"

    # Ray reports every second: wait (bounded) until the final counts have reached the endpoint.
    # A shared group prepares each piece of the trials' epochs once, from wherever each joined.
    prepared = stream_samples(report["starts"].values(), epochs, len(train_ids(spec)), spec.chunk_size)
    expected = len(train_ids(spec)) * epochs  # what each trial reads
    node = ray_session.get_runtime_context().get_node_id()[:16]
    final: dict = {}
    pause = threading.Event()  # never set: a bounded wait between scrapes
    for _ in range(60):
        final = scrape()
        if value(final, "samples_prepared", group=group) == prepared and value(
                final, "cache_misses", node=node) is not None and all(
                value(final, "samples_served", group=group, trial=t) == expected for t in trials):
            break
        pause.wait(0.5)
    names = {name for snapshot in [*during, final] for name, _ in snapshot}  # a gauge may leave with its actor
    missing = {f"coordprep_{n}" for n in DEFINITIONS if n != "errors"} - names
    assert not missing, f"metrics missing from the endpoint: {missing}"
    assert value(final, "samples_prepared", group=group) == prepared, "a shared group prepares each sample once per epoch"
    for t in trials:
        assert value(final, "samples_served", group=group, trial=t) == expected
        # Exported from the trial's own process, every second: the last second before the process
        # exits may never reach the agent, so these are checked as a lower part of the truth.
        # Batch echoing (batch:2) delivers every batch twice: half the samples are fresh, half echoed.
        batches = value(final, "batches", group=group, trial=t)
        assert 0 < batches <= 2 * epochs * math.ceil(len(train_ids(spec)) / 8)
        assert 0 < value(final, "fresh_samples", group=group, trial=t) <= expected
        assert 0 < value(final, "echoed_samples", group=group, trial=t) <= expected
        assert value(final, "data_wait_seconds", group=group, trial=t) > 0
    assert {value(s, "staging_budget_bytes", group=group) for s in during} - {None} == {spec.staging_bytes}
    peaks = [value(s, "staged_bytes", group=group) or 0 for s in during]
    assert max(peaks) <= spec.staging_bytes
    for stage in ("fetch", "decode_augment", "put"):
        assert value(final, "prep_seconds", group=group, stage=stage) > 0, stage
    assert value(final, "consumers", group=group) == 0
    # The node cache (it holds the whole dataset here): one storage read per sample, hits after that;
    # the held-out samples are read once too, when the evaluation set is prepared.
    held = len(holdout_split(len(open_source(spec.dataset)), spec.holdout)[1])
    n = len(train_ids(spec)) + held
    assert {value(s, "cache_capacity_bytes", node=node) for s in during} - {None} == {32 * 2**20}
    assert {value(s, "decoded_capacity_bytes", node=node) for s in during} - {None} == {1}
    for name in ("decoded_hits", "decoded_bytes"):  # the tier's actor leaves with the sweep: seen while it ran
        assert {value(s, name, node=node) for s in during} - {None} == {0}, name
    assert value(final, "storage_reads", node=node, reader="cache") == n
    assert value(final, "cache_misses", node=node) >= n  # a request sharing an in-flight load is a miss too
    # Hits served from a snapshot are counted by the prep actors, which the group's close may kill
    # within their last report interval: checked as a lower part of the truth, as the trials' are.
    assert 0 < value(final, "cache_hits", node=node, where="local") <= prepared - len(train_ids(spec))
    assert 0 < max(value(s, "cache_bytes", node=node) or 0 for s in during) <= 32 * 2**20
    # The held-out split, prepared once for the sweep and served at each of the trials' evaluations
    # (the registry exports them; its last second may be lost when the searcher closes it).
    [pipeline] = {dict(tags)["pipeline"] for name, tags in final if name == "coordprep_eval_samples_prepared"}
    assert value(final, "eval_samples_prepared", pipeline=pipeline) == held
    assert held <= value(final, "eval_samples_served", pipeline=pipeline) <= len(trials) * epochs * held


def _scraped_sweep(tmp_path, collect, done, **config) -> list:
    """Recorded trials, one per variant of ``config`` (Tune's, a grid or sample of ``data`` and ``echo``
    among them), with evaluation and a node cache, on the module's kept pool, the endpoint scraped by
    ``collect`` while they run (gauges leave with their actors), then until ``done(trial_ids)``
    (bounded: the last exports reach the endpoint on Ray's report interval). Returns the trials."""
    searcher = CoordinatedSearcher(cache=CacheSpec("8MiB"), pool=PoolSpec(keep_warm=True))
    with polling(collect):
        try:
            analysis = tune.run(tune.with_resources(record, {"cpu": 0.25}),
                                config={"batch_size": 8, "delay_s": 0.05, "evaluate": True,
                                        "out": str(tmp_path / "out"), **config},
                                search_alg=searcher, verbose=0)
        finally:
            searcher.close()
        ids = [t.trial_id for t in analysis.trials]
        pause = threading.Event()  # never set: a bounded wait, not a sleep standing in for synchronisation
        for _ in range(30):
            if done(ids):
                break
            pause.wait(0.5)
    return analysis.trials


def _series() -> dict[str, set[str]]:
    """Per ``ray_coordprep_*`` sample name on the endpoint now (counters with ``_total``), the label
    sets (as text) of its samples, zeros included."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{PORT}/metrics", timeout=10).read().decode()
    found: dict[str, set[str]] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name.startswith("ray_coordprep_"):
                found.setdefault(s.name, set()).add(repr(sorted((k, v) for k, v in s.labels.items()
                                                                if k in ("group", "kind", "trial", "node"))))
    return found


def test_every_dashboard_panel_has_series_and_what_did_not_happen_has_zeros(ray_session, tmp_path):
    """One sweep of two groups, one trial each: one group's data has an unreadable sample (skipped: the
    errors series) and its trial echoes batches, so every panel has data; the other's is clean and its
    trial does not echo, yet each error kind of that group and its trial's echo counter have a
    series, at 0 (a panel of a healthy sweep is a line at zero, not "no data")."""
    from coordinated_prep.dashboard import FILE_NAME, dashboard, install, metric_names
    from coordinated_prep.metrics import ERROR_KINDS
    from tests.utils import make_imagefolder

    broken = make_imagefolder(str(tmp_path / "broken"), classes=2, per_class=20)
    with open(os.path.join(broken, "class_0", "img_001.jpg"), "wb") as f:
        f.write(b"not a jpeg")
    clean = make_imagefolder(str(tmp_path / "clean"), classes=2, per_class=20)  # every file readable
    skipping = DataSpec(dataset=broken, pipeline={"size": 16}, seed=2, chunk_size=8, on_error="skip")
    healthy = DataSpec(dataset=clean, pipeline={"size": 16}, seed=3, chunk_size=8)
    group = healthy.group_key
    seen: dict[str, set[str]] = {}

    def collect() -> None:
        for name, labels in _series().items():
            seen.setdefault(name, set()).update(labels)

    def kinds() -> set[str]:  # the healthy group's error series (the other group's name the same series)
        return {labels for labels in seen.get("ray_coordprep_errors_total", ()) if f"('group', '{group}')" in labels}

    def echo_series(trial: str) -> bool:
        return any(f"('trial', '{trial}')" in labels for labels in seen.get("ray_coordprep_echoed_samples_total", ()))

    wanted = metric_names(dashboard())

    def done(ids: list[str]) -> bool:
        return (wanted <= set(seen) and all(any(f"('kind', '{k}')" in labels for labels in kinds()) for k in ERROR_KINDS)
                and all(echo_series(t) for t in ids))

    trials = _scraped_sweep(tmp_path, collect, done, epochs=2,
                            data=tune.grid_search([skipping, healthy]),
                            echo=tune.sample_from(lambda c: "batch:2" if c["data"].on_error == "skip" else None))
    assert all(t.status == "TERMINATED" for t in trials), [t.error_file for t in trials]
    assert len(wanted) >= 15, wanted
    assert wanted <= set(seen), f"the dashboard names series no sweep exported: {sorted(wanted - set(seen))}"
    # No error and no echo happened in the healthy group, yet each kind and its trial's echo counter
    # have a series (at 0).
    assert all(any(f"('kind', '{kind}')" in labels for labels in kinds()) for kind in ERROR_KINDS), (
        group, seen.get("ray_coordprep_errors_total"))
    healthy_trials = [t for t in trials if t.config["data"].on_error != "skip"]
    assert len(trials) == 2 and len(healthy_trials) == 1 and all(t.config.get("echo") is None for t in healthy_trials)
    for t in healthy_trials:
        assert echo_series(t.trial_id), t
    # This Ray runs the dashboard, so its Grafana folder exists: the dashboard is installed beside Ray's own.
    path = install()
    assert os.path.basename(path) == FILE_NAME and os.path.dirname(path).endswith(os.path.join("grafana", "dashboards"))
    assert json.load(open(path))["uid"] == "coordprep"
