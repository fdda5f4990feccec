"""A Grafana dashboard for the ``coordprep_*`` metrics, and where Ray's Grafana picks it up.

Ray's dashboard writes its own Grafana dashboards into ``<session>/metrics/grafana/dashboards``
(or ``$RAY_METRICS_GRAFANA_DASHBOARD_OUTPUT_DIR``) and a provisioning file that points Grafana
there, so a Grafana started with Ray's ``grafana.ini`` loads every dashboard in that folder:
:func:`install` writes ours beside them. The panels are PromQL over the names Ray exports
(``ray_`` prefix, counters with ``_total``: :mod:`coordinated_prep.metrics`); a test scrapes a real
sweep and checks that every name a panel uses is exported.
"""

from __future__ import annotations

import json
import os
import re
from typing import Any

from coordinated_prep.errors import ConfigError

UID = "coordprep"
FILE_NAME = "coordprep_grafana_dashboard.json"
OUTPUT_DIR_ENV = "RAY_METRICS_GRAFANA_DASHBOARD_OUTPUT_DIR"  # Ray's override of the dashboards folder
_WINDOW = "[1m]"

#: (title, unit, [(PromQL, legend)], description): what a sweep's operator looks at.
PANELS: tuple[tuple[str, str, tuple[tuple[str, str], ...], str], ...] = (
    ("Stall fraction per trial", "percentunit",
     ((f"rate(ray_coordprep_data_wait_seconds_total{_WINDOW})", "{{trial}}"),),
     "Share of each second a trial spends blocked waiting for its next batch (data-wait rate)."),
    ("Data wait per batch per trial", "s",
     ((f"rate(ray_coordprep_data_wait_seconds_total{_WINDOW}) / rate(ray_coordprep_batches_total{_WINDOW})",
       "{{trial}}"),),
     "Mean seconds a trial waited for each batch it got."),
    ("Batches per second per trial", "ops",
     ((f"rate(ray_coordprep_batches_total{_WINDOW})", "{{trial}}"),),
     "Batches each trial's loader delivers."),
    ("Sharing factor per group", "x",
     ((f"sum by (group) (rate(ray_coordprep_samples_served_total{_WINDOW})) / "
       f"sum by (group) (rate(ray_coordprep_samples_prepared_total{_WINDOW}))", "{{group}}"),),
     "Samples served to trials per sample prepared: how many trials each prepared sample feeds."),
    ("Samples prepared and served per group", "ops",
     ((f"sum by (group) (rate(ray_coordprep_samples_prepared_total{_WINDOW}))", "prepared {{group}}"),
      (f"sum by (group) (rate(ray_coordprep_samples_served_total{_WINDOW}))", "served {{group}}")),
     "Samples per second prepared once by the prep actors, and handed to trials."),
    ("Staged bytes against the budget", "bytes",
     (("ray_coordprep_staged_bytes", "staged {{group}}"), ("ray_coordprep_staging_budget_bytes", "budget {{group}}")),
     "Prepared pieces held in the object store for the group's trials, and the group's byte budget."),
    ("Trials per group", "short", (("ray_coordprep_consumers", "{{group}}"),), "Trials joined to each group now."),
    ("Prep seconds by stage", "s",
     ((f"sum by (stage) (rate(ray_coordprep_prep_seconds_total{_WINDOW}))", "{{stage}}"),),
     "Seconds per second the prep actors spend reading (fetch), decoding and augmenting, and storing (put)."),
    ("Errors by kind", "short",
     (("sum by (kind) (increase(ray_coordprep_errors_total[5m]))", "{{kind}}"),),
     "Skipped samples, failed pieces and trials detached by the lease, over 5 minutes."),
    ("Prep actors and reserved CPUs per node", "short",
     (("ray_coordprep_prep_actors", "actors {{node}}"), ("ray_coordprep_prep_reserved_cpus", "reserved CPUs {{node}}")),
     "The node's prep actors (a pool sized by demand starts with one and grows while trials wait for it), and the "
     "CPUs they reserve from Tune (given back while preparation runs ahead, taken again when trials wait)."),
    ("Node-cache hit rate", "percentunit",
     ((f"sum by (node) (rate(ray_coordprep_cache_hits_total{_WINDOW})) / (sum by (node) "
       f"(rate(ray_coordprep_cache_hits_total{_WINDOW})) + sum by (node) "
       f"(rate(ray_coordprep_cache_misses_total{_WINDOW})))", "{{node}}"),),
     "Share of samples the node's raw-data cache served."),
    ("Storage reads", "ops",
     ((f"sum by (node, reader) (rate(ray_coordprep_storage_reads_total{_WINDOW}))", "{{reader}} {{node}}"),),
     "Samples read from storage per second, by a node cache or by a prep actor past the caches."),
    ("Fresh and echoed samples per trial", "ops",
     ((f"rate(ray_coordprep_fresh_samples_total{_WINDOW})", "fresh {{trial}}"),
      (f"rate(ray_coordprep_echoed_samples_total{_WINDOW})", "echoed {{trial}}")),
     "Samples a trial sees the first time in its epoch, and repeats (data echoing, extra views)."),
    ("Evaluation samples prepared and served", "ops",
     ((f"rate(ray_coordprep_eval_samples_prepared_total{_WINDOW})", "prepared {{pipeline}}"),
      (f"rate(ray_coordprep_eval_samples_served_total{_WINDOW})", "served {{pipeline}}")),
     "Held-out samples prepared (once per sweep when resident) and handed to trials' evaluations."),
)


def dashboard() -> dict[str, Any]:
    """The Grafana dashboard (JSON model) for the ``coordprep_*`` metrics."""
    panels = []
    for i, (title, unit, targets, description) in enumerate(PANELS):
        panels.append({
            "id": i + 1, "type": "timeseries", "title": title, "description": description,
            "datasource": {"type": "prometheus", "uid": "${datasource}"},
            "gridPos": {"h": 8, "w": 12, "x": 12 * (i % 2), "y": 8 * (i // 2)},
            "fieldConfig": {"defaults": {"unit": unit}, "overrides": []},
            "options": {"legend": {"displayMode": "list", "placement": "bottom"}, "tooltip": {"mode": "multi"}},
            "targets": [{"refId": chr(ord("A") + k), "expr": expr, "legendFormat": legend,
                         "datasource": {"type": "prometheus", "uid": "${datasource}"}}
                        for k, (expr, legend) in enumerate(targets)],
        })
    return {
        "uid": UID, "title": "coordinated_prep", "tags": ["ray", "coordinated_prep"], "editable": True,
        "schemaVersion": 39, "version": 1, "refresh": "5s", "time": {"from": "now-30m", "to": "now"},
        "templating": {"list": [{"name": "datasource", "label": "Data source", "type": "datasource",
                                 "query": "prometheus", "current": {"text": "Prometheus", "value": "Prometheus"}}]},
        "annotations": {"list": []}, "panels": panels,
    }


def metric_names(model: dict[str, Any]) -> set[str]:
    """Every ``ray_coordprep_*`` series name the dashboard's PromQL expressions use."""
    names: set[str] = set()
    for panel in model["panels"]:
        for target in panel["targets"]:
            names.update(re.findall(r"\bray_coordprep_[a-z_]+\b", target["expr"]))
    return names


def write(path: str) -> str:
    """Write the dashboard JSON to ``path`` (a file, or a directory to write ``FILE_NAME`` into)."""
    if os.path.isdir(path):
        path = os.path.join(path, FILE_NAME)
    parent = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(parent):
        raise ConfigError(f"dashboard: cannot write {path}: {parent} is not a directory; create it or pick another")
    with open(path, "w", encoding="utf-8") as f:
        json.dump(dashboard(), f, indent=2)
    return path


def install(address: str = "auto") -> str:
    """Write the dashboard where the running Ray cluster's Grafana provisioning picks it up.

    Raises:
        ConfigError: No Ray cluster runs at ``address``, or it has no Grafana folder (started
            without the dashboard); names the fix.
    """
    import ray
    from ray._private.worker import global_worker

    if ray.is_initialized():  # this process is connected already (a driver, a test): use its cluster
        session = global_worker.node.get_session_dir_path()
    else:
        try:
            ray.init(address=address, logging_level="ERROR", log_to_driver=False)
        except (ConnectionError, RuntimeError, ValueError) as e:
            raise ConfigError(f"dashboard: no running Ray cluster at address={address!r} ({e}); start the sweep "
                              "first (with ray: {include_dashboard: true} in its YAML), or write the file with "
                              "--out PATH") from None
        try:
            session = global_worker.node.get_session_dir_path()
        finally:
            ray.shutdown()
    folder = os.environ.get(OUTPUT_DIR_ENV) or os.path.join(session, "metrics", "grafana", "dashboards")
    if not os.path.isdir(folder):
        raise ConfigError(f"dashboard: the Ray cluster has no Grafana dashboards folder ({folder}): it was started "
                          "without the dashboard; set ray: {include_dashboard: true} in the sweep's YAML, or write "
                          "the file with --out PATH and import it in Grafana")
    return write(os.path.join(folder, FILE_NAME))
