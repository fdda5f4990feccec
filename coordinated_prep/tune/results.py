"""From a sweep's directory back to its trials: a trial's config and DataSpec (the best by default),
ready for the standalone loader, and the data-group reports the searcher wrote there.

A sweep's directory is Tune's experiment directory (``<storage_path>/<name>``). It holds Tune's
experiment state, from which :class:`ray.tune.ExperimentAnalysis` reads each trial's config (its
DataSpec included: Tune pickles it there) and last result, and :data:`REPORTS_FILE`, which the
:class:`~coordinated_prep.CoordinatedSearcher` writes at each of Tune's experiment checkpoints and
last when the sweep ends (:meth:`~coordinated_prep.CoordinatedSearcher.save_to_dir`), so the group
reports outlive the registry: a finished, interrupted or restored sweep still shows them. A YAML
sweep also writes ``summary.json`` there (:mod:`coordinated_prep.sweep.summary`).

Retrain the best trial without Tune::

    best = coordinated_prep.best_trial("runs/default")
    loader = train_loader(best.data, batch_size=best.config["batch_size"])  # prepared in this process
"""

from __future__ import annotations

import json
import math
import numbers
import os
import tempfile
from dataclasses import dataclass, field
from typing import Any, Literal, Mapping

from coordinated_prep.errors import ConfigError

#: The searcher's reports in a sweep's directory: ``{"metric", "mode", "groups", "caches", "evals", "decoded"}``.
REPORTS_FILE = "coordprep_reports.json"


@dataclass(frozen=True)
class TrialResult:
    """One trial of a finished sweep.

    Attributes:
        trial: Tune's trial id.
        config: The trial's config without its DataSpec (``data``) and Tune's internal keys.
        data: The trial's :class:`~coordinated_prep.DataSpec` (None if its config had none). With
            ``coordinated=True`` a loader outside Tune prepares it in its own process (and says so);
            ``dataclasses.replace(data, coordinated=False)`` says it yourself.
        metrics: The trial's last reported result.
        path: The trial's directory.
    """

    trial: str
    config: dict[str, Any]
    data: Any
    metrics: dict[str, Any] = field(repr=False)
    path: str


def best_trial(path: str, trial: str | None = None, metric: str | None = None,
               mode: Literal["min", "max"] | None = None) -> TrialResult:
    """The trial ``trial`` of the sweep in ``path``, or its best by ``metric`` (last reported value).

    ``metric`` and ``mode`` default to the sweep's own: those its searcher saved (:data:`REPORTS_FILE`),
    or a YAML sweep's ``summary.json``.

    Raises:
        ConfigError: No sweep in ``path``, no such trial, no metric known or reported by any trial;
            each names the path and the fix.
    """
    trials = _trials(path)
    if trial is not None:
        found = [t for t in trials if t.trial == trial]
        if not found:
            raise ConfigError(f"{path}: no trial {trial!r}; its trials are {sorted(t.trial for t in trials)}")
        return found[0]
    saved = _saved(path)
    if metric is not None and metric != saved.get("metric") and mode is None:
        raise ConfigError(f"{path}: metric={metric!r} is not the sweep's own ({saved.get('metric')!r}); say whether "
                          "lower or higher is better with mode='min' or 'max' (--mode)")
    if metric in (None, saved.get("metric")) and mode is not None and saved.get("mode") not in (None, mode):
        raise ConfigError(f"{path}: mode={mode!r} would rank the sweep's own metric {saved.get('metric')!r} the other "
                          f"way from its mode {saved.get('mode')!r}; give the metric it goes with (--metric)")
    metric = metric or saved.get("metric")
    mode = mode or saved.get("mode")
    if not metric or mode not in ("min", "max"):
        raise ConfigError(f"{path}: the sweep's metric and mode are not saved there; pass them "
                          "(best_trial(path, metric='accuracy', mode='max'), or --metric and --mode)")
    scored = sorted((t for t in trials if _number(t.metrics.get(metric)) is not None), key=lambda t: t.trial)
    if not scored:
        raise ConfigError(f"{path}: no trial reported {metric!r}; its trials reported {_reported(trials)}")
    pick = max if mode == "max" else min  # the first of equals in trial-id order, as the summary's
    return pick(scored, key=lambda t: _number(t.metrics[metric]))


def saved_reports(path: str) -> dict[str, Any]:
    """What the sweep's searcher last wrote to ``path`` (:data:`REPORTS_FILE`): per data group, node
    cache, evaluation set and decoded tier; ``{}`` if it wrote nothing (an unshared sweep)."""
    file = os.path.join(path, REPORTS_FILE)
    if not os.path.exists(file):
        return {}
    with open(file, encoding="utf-8") as f:
        return json.load(f)


def write_reports(directory: str, reports: Mapping[str, Any]) -> None:
    """Write :data:`REPORTS_FILE` into ``directory`` (whole, or not at all: a reader never sees half)."""
    target = os.path.join(directory, REPORTS_FILE)
    scratch = target + ".tmp"
    with open(scratch, "w", encoding="utf-8") as f:
        json.dump(reports, f, indent=1, sort_keys=True, default=str)
    os.replace(scratch, target)


def _trials(path: str) -> list[TrialResult]:
    from ray.tune import ExperimentAnalysis

    if not os.path.isdir(path):
        raise ConfigError(f"{path}: no such directory; pass a sweep's directory, <storage_path>/<name>")
    try:
        analysis = ExperimentAnalysis(os.path.abspath(path))
    except Exception as e:  # noqa: BLE001 - Tune's own error for a directory without experiment state
        raise ConfigError(f"{path}: not a sweep's directory ({type(e).__name__}: {e}); pass <storage_path>/<name>, "
                          "the directory Tune wrote the experiment state to") from None
    out = []
    for t in analysis.trials:
        config = dict(t.config or {})
        data = config.pop("data", None)
        config = {k: v for k, v in config.items() if not k.startswith("__")}
        out.append(TrialResult(t.trial_id, config, data, dict(t.last_result or {}), str(t.path)))
    return out


def ranked_by(path: str) -> str | None:
    """The metric the sweep saved in ``path`` ranks its trials by (None if none is saved)."""
    return _saved(path).get("metric")


def _saved(path: str) -> dict[str, Any]:
    saved = saved_reports(path)
    if saved.get("metric"):
        return saved
    summary = os.path.join(path, "summary.json")
    if os.path.exists(summary):
        with open(summary, encoding="utf-8") as f:
            return json.load(f)
    return saved


def _number(value: Any) -> float | None:
    if isinstance(value, numbers.Real) and not isinstance(value, bool) and not math.isnan(value):  # numpy's too
        return float(value)
    return None


def _reported(trials: list[TrialResult]) -> list[str]:
    keys = {k for t in trials for k, v in t.metrics.items() if _number(v) is not None}
    return sorted(keys)[:20]


def save_atomically(value: Any, path: str) -> None:
    """Pickle ``value`` to ``path`` through a temporary file in its folder (never half written)."""
    from ray import cloudpickle

    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), prefix=".tmp-coordprep-")
    try:
        with os.fdopen(fd, "wb") as f:
            cloudpickle.dump(value, f)
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise
