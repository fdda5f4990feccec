"""A progress line beside Tune's table: each data group's sharing factor and stall fraction, as the sweep runs.

The Tune callback asks the searcher's registry for its group reports without blocking Tune's loop
(the request is sent, and read on a later step once answered) and writes one line every
``every_s`` seconds to the stream it is given (``coordprep sweep`` passes stdout; ``--quiet``
passes none). The line's text is a pure function of the reports and the trials' results.
"""

from __future__ import annotations

import time
from typing import Any, Callable, Mapping, TextIO

from ray import tune

from coordinated_prep.spec import DataSpec
from coordinated_prep.sweep.summary import format_searched, searched_data


def format_progress(elapsed_s: float, reports: Mapping[str, Mapping[str, Any]],
                    stalls: Mapping[str, tuple[str, float]], searched: Mapping[str, str] | None = None) -> str:
    """``coordprep 12s | group 3f2a1b9c0d11: sharing 2.83x (... prepared, ... served), stall 0.03 (4 trials reported)``.

    Args:
        elapsed_s: Seconds since the sweep started.
        reports: The registry's group reports (``samples_prepared``, ``samples_served``).
        stalls: Per trial id: (group key, the stall fraction of its last reported epoch).
        searched: Per group key: its searched data values, short (``pipeline.scale.0=0.34``), shown
            after the key (``group 3f2a1b9c0d11 (pipeline.scale.0=0.34): ...``).
    """
    parts = [f"coordprep {elapsed_s:.0f}s"]
    for group in sorted(set(reports) | {g for g, _ in stalls.values()}):
        report = reports.get(group, {})
        prepared, served = report.get("samples_prepared", 0), report.get("samples_served", 0)
        values = [s for g, s in stalls.values() if g == group]
        sharing = f"{served / prepared:.2f}x" if prepared else "-"
        stall = f"{sum(values) / len(values):.2f}" if values else "-"
        trials = f"{len(values)} trial{'' if len(values) == 1 else 's'}"
        label = f" ({searched[group]})" if searched and searched.get(group) else ""
        parts.append(f"group {group}{label}: sharing {sharing} ({prepared:,} prepared, {served:,} served), "
                     f"stall {stall} ({trials} reported)")
    if len(parts) == 1:
        parts.append("no data group yet")
    return " | ".join(parts)


class ProgressLine(tune.Callback):
    """Writes :func:`format_progress` to ``out`` every ``every_s`` seconds while the sweep runs, and once at its end.

    Args:
        reports: Returns an object reference to the group reports (the searcher's
            ``group_reports_ref``), or None when there is no registry yet.
        out: Where the line goes.
        every_s: Seconds between lines (0: whenever an answer is in).
    """

    def __init__(self, reports: Callable[[], Any], out: TextIO, every_s: float = 5.0) -> None:
        self._reports = reports
        self._out = out
        self._every_s = every_s
        self._start = time.monotonic()
        self._last = float("-inf")
        self._pending: Any = None
        self._stalls: dict[str, tuple[str, float]] = {}
        self._searched: dict[str, str] = {}

    def __getstate__(self) -> dict[str, Any]:  # Tune saves its callbacks with the sweep: no stream, no refs
        return {"_every_s": self._every_s}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state, _reports=lambda: None, _out=None, _start=time.monotonic(), _last=float("-inf"),
                             _pending=None, _stalls={}, _searched={})

    def on_trial_result(self, iteration: int, trials: list, trial: Any, result: dict, **info: Any) -> None:
        spec = trial.config.get("data")
        if isinstance(spec, Mapping):  # Tune domains inside a plain dict: the trial that reported built it alike
            spec = DataSpec.from_mapping(spec)
        if isinstance(spec, DataSpec) and isinstance(result.get("stall_fraction"), (int, float)):
            self._stalls[trial.trial_id] = (spec.group_key, float(result["stall_fraction"]))
            self._searched[spec.group_key] = format_searched(searched_data(trial.config))

    def on_step_end(self, iteration: int, trials: list, **info: Any) -> None:
        import ray

        if self._out is None:
            return
        if self._pending is None:
            if time.monotonic() - self._last >= self._every_s:
                self._pending = self._reports()
            return
        done, _ = ray.wait([self._pending], timeout=0)  # never blocks Tune's loop
        if done:
            self._write(ray.get(self._pending))

    def on_experiment_end(self, trials: list, **info: Any) -> None:
        import ray

        if self._out is None:
            return
        ref = self._pending or self._reports()
        try:
            reports = ray.get(ref, timeout=30) if ref is not None else {}
        except (ray.exceptions.RayError, ray.exceptions.GetTimeoutError):
            reports = {}
        self._write(reports)

    def _write(self, reports: Mapping[str, Mapping[str, Any]]) -> None:
        self._pending = None
        self._last = time.monotonic()
        self._out.write(format_progress(self._last - self._start, reports, self._stalls, self._searched) + "\n")
        self._out.flush()
