"""Metrics for the Ray dashboard and Prometheus, through ``ray.util.metrics``.

Every name starts with ``coordprep_`` and every series carries the data group's key (``group``;
``private`` for an unshared trial); per-trial series also carry ``trial``. Ray exports them from
each process to the node's metrics agent, which serves them in Prometheus format on the node's
metrics export port (Ray adds its ``ray_`` prefix there; counters gain ``_total``).

| name | kind | tags | recorded by |
| --- | --- | --- | --- |
| ``coordprep_samples_prepared`` | counter | group | coordinator, per settled piece |
| ``coordprep_samples_served`` | counter | group, trial | coordinator, per fetch |
| ``coordprep_staged_bytes`` | gauge | group | coordinator, on every change |
| ``coordprep_staging_budget_bytes`` | gauge | group | coordinator |
| ``coordprep_consumers`` | gauge | group | coordinator: trials joined now |
| ``coordprep_prep_seconds`` | counter | group, stage | coordinator: ``fetch``, ``decode_augment``, ``put`` |
| ``coordprep_errors`` | counter | group, kind | coordinator: ``skipped_sample``, ``failed_piece``, ``lease_detached`` |
| ``coordprep_data_wait_seconds`` | counter | group, trial | the trial's loader: time blocked on data |
| ``coordprep_batches`` | counter | group, trial | the trial's loader |

Metric objects are created lazily in the process that records them, and recording never
raises: metrics are an observer, not a dependency. Each process exports on Ray's report interval
(``metrics_report_interval_ms``), so what a trial records in its last interval before its process
exits may never reach the endpoint; the coordinator's counters are complete while it lives.
"""

from __future__ import annotations

import functools
import logging
from typing import Any

logger = logging.getLogger(__name__)

PREFIX = "coordprep_"

#: name -> (kind, description, tag keys)
DEFINITIONS: dict[str, tuple[str, str, tuple[str, ...]]] = {
    "samples_prepared": ("counter", "Samples read and preprocessed by the group's prep actors", ("group",)),
    "samples_served": ("counter", "Samples handed to a trial from the staging buffer", ("group", "trial")),
    "staged_bytes": ("gauge", "Bytes of prepared pieces staged now (reserved or ready)", ("group",)),
    "staging_budget_bytes": ("gauge", "The group's staging byte budget", ("group",)),
    "consumers": ("gauge", "Trials joined to the group now", ("group",)),
    "prep_seconds": ("counter", "Seconds the prep actors spent per stage (fetch, decode_augment, put)",
                     ("group", "stage")),
    "errors": ("counter", "Errors by kind (skipped_sample, failed_piece, lease_detached)", ("group", "kind")),
    "data_wait_seconds": ("counter", "Seconds a trial waited for its next batch", ("group", "trial")),
    "batches": ("counter", "Batches a trial's loader delivered", ("group", "trial")),
}


@functools.lru_cache(maxsize=None)
def _metric(name: str) -> Any:
    from ray.util import metrics

    kind, description, tags = DEFINITIONS[name]
    cls = {"counter": metrics.Counter, "gauge": metrics.Gauge}[kind]
    return cls(PREFIX + name, description=description, tag_keys=tags)


def inc(name: str, value: float, **tags: str) -> None:
    """Add ``value`` to counter ``name`` (without the prefix) for ``tags``."""
    if value <= 0:
        return
    try:
        _metric(name).inc(value, tags=tags)
    except Exception as e:  # never let observability break training
        logger.debug("metric %s not recorded: %s", name, e)


def set_gauge(name: str, value: float, **tags: str) -> None:
    """Set gauge ``name`` (without the prefix) to ``value`` for ``tags``."""
    try:
        _metric(name).set(value, tags=tags)
    except Exception as e:
        logger.debug("metric %s not recorded: %s", name, e)
