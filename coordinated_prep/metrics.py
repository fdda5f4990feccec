"""Metrics for the Ray dashboard and Prometheus, through ``ray.util.metrics``.

Every name starts with ``coordprep_``. Series of a data group carry its key (``group``); per-trial
series also carry ``trial``; the node caches' series carry ``node`` (the first 16 characters of the
node id). Ray exports them from
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
| ``coordprep_fresh_samples`` | counter | group, trial | the trial's loader: samples seen the first time in the epoch |
| ``coordprep_echoed_samples`` | counter | group, trial | the trial's loader: repeats (echoes, extra views) |
| ``coordprep_cache_hits`` | counter | node, where | node cache: ``local`` (same node) or ``remote`` reader |
| ``coordprep_cache_misses`` | counter | node | node cache |
| ``coordprep_cache_bytes`` | gauge | node | node cache: encoded bytes held |
| ``coordprep_cache_capacity_bytes`` | gauge | node | node cache |
| ``coordprep_storage_reads`` | counter | node, reader | samples read from storage by a ``cache`` or a ``prep`` actor |
| ``coordprep_decoded_hits`` | counter | node | decoded tier: samples served from kept prefix outputs |
| ``coordprep_decoded_bytes`` | gauge | node | decoded tier: bytes kept |
| ``coordprep_decoded_capacity_bytes`` | gauge | node | decoded tier |
| ``coordprep_prep_actors`` | gauge | node | registry: the node's prep actors now (a pool sized by demand grows) |
| ``coordprep_prep_reserved_cpus`` | gauge | node | registry: the CPUs the node's pool reserves now (a lending pool gives them back) |
| ``coordprep_eval_samples_prepared`` | counter | pipeline | registry: held-out samples its prep pools prepared |
| ``coordprep_eval_samples_served`` | counter | pipeline | registry: held-out samples handed to trials' evaluations |

Metric objects are created lazily in the process that records them, and recording never
raises: metrics are an observer, not a dependency. A counter appears on the endpoint only once a
process records it, so every counter the dashboard draws is declared at 0 where its series begins
(:func:`declare`: the coordinator per group and per trial that joins it, the loader per trial, the
node cache per node; a trial's zero series comes from the coordinator too because the trial's process
may exit within one report interval of its start): on a
healthy sweep the error and echo panels show 0, not "No data". Each process exports on Ray's report interval
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
    "fresh_samples": ("counter", "Fresh samples a trial's loader delivered (first time in the epoch)",
                      ("group", "trial")),
    "echoed_samples": ("counter", "Repeated samples a trial's loader delivered (data echoing, extra views)",
                       ("group", "trial")),
    "cache_hits": ("counter", "Samples the node cache served, to a reader on its node (local) or another (remote)",
                   ("node", "where")),
    "cache_misses": ("counter", "Samples asked of the node cache that it did not hold", ("node",)),
    "cache_bytes": ("gauge", "Encoded bytes the node cache holds", ("node",)),
    "cache_capacity_bytes": ("gauge", "The node cache's capacity", ("node",)),
    "storage_reads": ("counter", "Samples read from storage, by a node cache or by a prep actor itself",
                      ("node", "reader")),
    "decoded_hits": ("counter", "Samples whose prefix output (decoded, resized) the node's decoded tier served",
                     ("node",)),
    "decoded_bytes": ("gauge", "Bytes of prefix outputs the node's decoded tier keeps", ("node",)),
    "decoded_capacity_bytes": ("gauge", "The node's decoded tier's budget", ("node",)),
    "prep_actors": ("gauge", "Prep actors of the node's pool now (a pool sized by demand grows while trials wait)",
                    ("node",)),
    "prep_reserved_cpus": ("gauge", "CPUs the node's prep pool reserves now (a pool sized by demand gives them back "
                           "while its preparation runs ahead, and takes them again when trials wait)", ("node",)),
    "eval_samples_prepared": ("counter", "Held-out samples prepared for evaluation (once per pipeline when "
                              "resident)", ("pipeline",)),
    "eval_samples_served": ("counter", "Held-out samples handed to trials' evaluations", ("pipeline",)),
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


def declare(name: str, **tags: str) -> None:
    """Export counter ``name`` (without the prefix) for ``tags`` at 0 now, before any increment."""
    try:
        _metric(name)._record(0, tags=tags)  # Counter.inc refuses 0; a record of 0 creates the series
    except Exception as e:
        logger.debug("metric %s not declared: %s", name, e)


#: The ``kind`` values of ``errors``, each declared at 0 per group.
ERROR_KINDS = ("skipped_sample", "failed_piece", "lease_detached")
#: The counters a trial's loader records (tags ``group``, ``trial``).
TRIAL_COUNTERS = ("data_wait_seconds", "batches", "fresh_samples", "echoed_samples")


def declare_group(group: str) -> None:
    """Declare at 0 the counters a coordinator records for ``group``."""
    declare("samples_prepared", group=group)
    for stage in ("fetch", "decode_augment", "put"):
        declare("prep_seconds", group=group, stage=stage)
    for kind in ERROR_KINDS:
        declare("errors", group=group, kind=kind)


def declare_trial(group: str, trial: str) -> None:
    """Declare at 0 the counters of ``trial`` in ``group`` (its loader's, and what it is served)."""
    for name in (*TRIAL_COUNTERS, "samples_served"):
        declare(name, group=group, trial=trial)


def set_gauge(name: str, value: float, **tags: str) -> None:
    """Set gauge ``name`` (without the prefix) to ``value`` for ``tags``."""
    try:
        _metric(name).set(value, tags=tags)
    except Exception as e:
        logger.debug("metric %s not recorded: %s", name, e)
