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
from dataclasses import dataclass, field
from typing import Callable, Iterator

import pytest
from prometheus_client.parser import text_string_to_metric_families
from ray import tune

from coordinated_prep import CoordinatedSearcher, DataSpec, PoolSpec
from coordinated_prep.cache import CacheSpec
from coordinated_prep.metrics import DEFINITIONS
from coordinated_prep.plan import holdout_split
from coordinated_prep.stream.eval_set import eval_key
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


def _endpoint() -> str:
    """Our lines of the node's metrics endpoint now. Ray's own series are most of its text (600 kB
    with the dashboard): parsing them at every scrape took the driver a quarter of a second."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{PORT}/metrics", timeout=10).read().decode()
    return "\n".join(line for line in text.splitlines() if "ray_coordprep_" in line)


def scrape(text: str) -> dict[tuple[str, frozenset], float]:
    """Our samples in ``text``: (name without Ray's prefix, our tags) -> value."""
    samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name.startswith("ray_coordprep_"):
                tags = frozenset((k, v) for k, v in s.labels.items() if k in ("group", "trial", "stage", "kind", "node", "where", "reader",
                                                                               "pipeline"))
                key = (s.name[len("ray_"):].removesuffix("_total"), tags)
                samples[key] = samples.get(key, 0.0) + s.value  # one series per recording process
    return samples


def _series(text: str) -> dict[str, set[str]]:
    """Per ``ray_coordprep_*`` sample name in ``text`` (counters with ``_total``), the label sets (as
    text) of its samples, zeros included."""
    found: dict[str, set[str]] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name.startswith("ray_coordprep_"):
                found.setdefault(s.name, set()).add(repr(sorted((k, v) for k, v in s.labels.items()
                                                                if k in ("group", "kind", "trial", "node"))))
    return found


@contextlib.contextmanager
def polling(collect: Callable[[], None], every_s: float = 1.0) -> Iterator[None]:
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


@dataclass
class Swept:
    """What the endpoint showed while the module's sweep ran (``during``; gauges leave with their
    actors) and once its final counts had arrived (``final``), and every series name seen (``seen``)."""

    spec: DataSpec  # clean; two trials echoing batches share its group
    skipping: DataSpec  # one unreadable sample, skipped; its one trial does not echo
    epochs: int
    trials: list  # Tune's, all three
    reports: dict  # the searcher's group reports
    node: str
    during: list[dict] = field(default_factory=list)
    final: dict = field(default_factory=dict)
    seen: dict[str, set[str]] = field(default_factory=dict)

    def kinds(self) -> set[str]:
        """The clean group's error series (the other group names the same series)."""
        return {labels for labels in self.seen.get("ray_coordprep_errors_total", ())
                if f"('group', '{self.spec.group_key}')" in labels}

    def echo_series(self, trial: str) -> bool:
        return any(f"('trial', '{trial}')" in labels for labels in self.seen.get("ray_coordprep_echoed_samples_total", ()))


@pytest.fixture(scope="module")
def swept(ray_session, small_dataset, tmp_path_factory) -> Swept:
    """The module's one sweep (a sweep costs about 10 s on 2 cores), scraped as Prometheus would while
    it runs, then until its last counts reached the endpoint (bounded: Ray reports every second).
    Two groups: a clean one whose two trials echo batches (the counts the first test checks), and one
    whose data has an unreadable sample (skipped: the errors series) and whose trial does not echo,
    so every dashboard panel has data and the second test can look for the series of what did not
    happen (errors in the clean group, echoes of that trial)."""
    from coordinated_prep.dashboard import dashboard, metric_names
    from coordinated_prep.metrics import ERROR_KINDS
    from tests.utils import make_imagefolder

    tmp = tmp_path_factory.mktemp("metrics")
    broken = make_imagefolder(str(tmp / "broken"), classes=2, per_class=20)
    with open(os.path.join(broken, "class_0", "img_001.jpg"), "wb") as f:  # a training sample of the split
        f.write(b"not a jpeg")
    spec = DataSpec(dataset=small_dataset, pipeline={"size": 32}, seed=4, chunk_size=8, segments=4,
                    staging_bytes=64 * 8 * 3 * 32 * 32)
    skipping = DataSpec(dataset=broken, pipeline={"size": 16}, seed=2, chunk_size=8, on_error="skip")
    epochs, during, seen = 2, [], {}

    def collect() -> dict:
        text = _endpoint()
        for name, labels in _series(text).items():
            seen.setdefault(name, set()).update(labels)
        return scrape(text)

    # A decoded tier of one byte: its series are exported, and it keeps nothing, so every epoch reads
    # through the node cache, whose counts the first test checks. One fixed prep actor is plenty for
    # these few samples (a pool sized by demand may start a second process while the trials start).
    searcher = CoordinatedSearcher(cache=CacheSpec("32MiB"), pool=PoolSpec(actors=1, decoded_bytes=1))
    try:
        with polling(lambda: during.append(collect())):
            analysis = tune.run(tune.with_resources(record, {"cpu": 0.25}),
                                config={"data": tune.grid_search([spec, spec, skipping]), "batch_size": 8,
                                        "epochs": epochs, "delay_s": 0.02, "evaluate": True,
                                        "echo": tune.sample_from(lambda c: None if c["data"].on_error == "skip"
                                                                 else "batch:2"),
                                        "out": str(tmp / "out")},
                                search_alg=searcher, verbose=0)
        reports = searcher.group_reports()
    finally:
        searcher.close()
    swept = Swept(spec, skipping, epochs, analysis.trials, reports, ray_session.get_runtime_context().get_node_id()[:16],
                  during, seen=seen)
    trials = [t.trial_id for t in swept.trials if t.config["data"].group_key == spec.group_key]
    # A shared group prepares each piece of the trials' epochs once, from wherever each joined.
    prepared = stream_samples(reports[spec.group_key]["starts"].values(), epochs, len(train_ids(spec)), spec.chunk_size)
    wanted = metric_names(dashboard())
    pause = threading.Event()  # never set: a bounded wait between scrapes, not a sleep standing in for synchronisation
    for _ in range(60):
        swept.final = final = collect()
        if (value(final, "samples_prepared", group=spec.group_key) == prepared
                and value(final, "cache_misses", node=swept.node) is not None
                and all(value(final, "samples_served", group=spec.group_key, trial=t) == len(train_ids(spec)) * epochs
                        for t in trials)
                and (value(final, "errors", group=skipping.group_key, kind="skipped_sample") or 0) > 0
                and wanted <= set(seen)
                and all(any(f"('kind', '{k}')" in labels for labels in swept.kinds()) for k in ERROR_KINDS)
                and all(swept.echo_series(t.trial_id) for t in swept.trials)):
            break
        pause.wait(0.5)
    return swept


def test_metrics_are_scraped_during_a_sweep_with_plausible_values(swept):
    spec, epochs, during, final, node = swept.spec, swept.epochs, swept.during, swept.final, swept.node
    group = spec.group_key
    trials = [t.trial_id for t in swept.trials if t.config["data"].group_key == spec.group_key]
    assert len(trials) == 2
    assert any(value(s, "samples_prepared", group=group) for s in during), "no metrics seen while the sweep ran"

    prepared = stream_samples(swept.reports[group]["starts"].values(), epochs, len(train_ids(spec)), spec.chunk_size)
    expected = len(train_ids(spec)) * epochs  # what each trial reads
    names = {name for snapshot in [*during, final] for name, _ in snapshot}  # a gauge may leave with its actor
    missing = {f"coordprep_{n}" for n in DEFINITIONS} - names
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
    # The node cache (it holds both datasets here): one storage read per sample, hits after that;
    # the held-out samples are read once too, when each evaluation set is prepared. The unreadable
    # sample's bytes read fine (its decoding fails), so it is read and cached like the others.
    specs = (spec, swept.skipping)
    held = {s: len(holdout_split(len(open_source(s.dataset)), s.holdout)[1]) for s in specs}
    n = sum(len(train_ids(s)) + held[s] for s in specs)
    assert {value(s, "cache_capacity_bytes", node=node) for s in during} - {None} == {32 * 2**20}
    assert {value(s, "decoded_capacity_bytes", node=node) for s in during} - {None} == {1}
    for name in ("decoded_hits", "decoded_bytes"):  # the tier's actor leaves with the sweep: seen while it ran
        assert {value(s, name, node=node) for s in during} - {None} == {0}, name
    assert value(final, "storage_reads", node=node, reader="cache") == n
    assert value(final, "cache_misses", node=node) >= n  # a request sharing an in-flight load is a miss too
    # Hits served from a snapshot are counted by the prep actors, which the group's close may kill
    # within their last report interval: checked as a lower part of the truth, as the trials' are.
    # Bounded by what each group asked for past its first read of each sample (its pieces, skipped
    # samples included: prepared counts them out).
    asked = sum(stream_samples(swept.reports[s.group_key]["starts"].values(), epochs, len(train_ids(s)), s.chunk_size)
                - len(train_ids(s)) for s in specs)
    assert 0 < value(final, "cache_hits", node=node, where="local") <= asked
    assert 0 < max(value(s, "cache_bytes", node=node) or 0 for s in during) <= 32 * 2**20
    # The held-out split of each dataset, prepared once for the sweep and served at each of its
    # trials' evaluations (the registry exports them; its last second may be lost when the searcher
    # closes it).
    assert {dict(tags)["pipeline"] for name, tags in final if name == "coordprep_eval_samples_prepared"} == {
        eval_key(s) for s in specs}
    assert value(final, "eval_samples_prepared", pipeline=eval_key(spec)) == held[spec]
    assert held[spec] <= value(final, "eval_samples_served", pipeline=eval_key(spec)) <= len(trials) * epochs * held[spec]


def test_every_dashboard_panel_has_series_and_what_did_not_happen_has_zeros(swept):
    """The module's sweep of two groups: one group's data has an unreadable sample (skipped: the errors
    series), the other's trials echo batches, so every panel has data; yet each error kind of the
    clean group has a series, and so has the echo counter of the trial that does not echo, at 0 (a
    panel of a healthy sweep is a line at zero, not "no data")."""
    from coordinated_prep.dashboard import FILE_NAME, dashboard, install, metric_names
    from coordinated_prep.metrics import ERROR_KINDS

    trials, seen = swept.trials, swept.seen
    assert all(t.status == "TERMINATED" for t in trials), [t.error_file for t in trials]
    wanted = metric_names(dashboard())
    assert len(wanted) >= 15, wanted
    assert wanted <= set(seen), f"the dashboard names series no sweep exported: {sorted(wanted - set(seen))}"
    assert value(swept.final, "errors", group=swept.skipping.group_key, kind="skipped_sample") > 0
    # No error happened in the clean group, yet each kind has a series; the trial that does not echo
    # has an echo series (at 0).
    assert all(any(f"('kind', '{kind}')" in labels for labels in swept.kinds()) for kind in ERROR_KINDS), (
        swept.spec.group_key, seen.get("ray_coordprep_errors_total"))
    quiet = [t for t in trials if t.config.get("echo") is None]
    assert len(trials) == 3 and [t.config["data"].group_key for t in quiet] == [swept.skipping.group_key]
    for t in quiet:
        assert swept.echo_series(t.trial_id), t
        assert value(swept.final, "echoed_samples", group=swept.skipping.group_key, trial=t.trial_id) == 0
    # This Ray runs the dashboard, so its Grafana folder exists: the dashboard is installed beside Ray's own.
    path = install()
    assert os.path.basename(path) == FILE_NAME and os.path.dirname(path).endswith(os.path.join("grafana", "dashboards"))
    assert json.load(open(path))["uid"] == "coordprep"
