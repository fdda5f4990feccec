"""``coordprep echo``: does data echoing pay on this machine? Echo variants side by side, real learning.

The file (``experiments/echo.yaml``) holds a sweep (the usual schema, under ``sweep``) and the
variants to compare (under ``variants``: a name, a trial ``echo`` setting, and the group's
``views``). Each variant runs the same sweep on its own, one after another on a fresh prep pool:
the sweep's trials (one per model seed) run concurrently and share one data group. Per trial, the
target is the held-out accuracy echo-off reaches at its end with the same model seed; the report
gives each variant's wall-clock time and fresh samples to that target, its final accuracy (mean and
spread over seeds) and its stall fraction, and plots accuracy against time (``echo.png``).
"""

from __future__ import annotations

import copy
import csv
import json
import logging
import math
import os
import time
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

from coordinated_prep.trial.echo import EchoSpec
from coordinated_prep.errors import ConfigError
from coordinated_prep.sweep.config import SweepConfig, _parse
from coordinated_prep.sweep.summary import format_table
from coordinated_prep.sweep.yaml_loader import load_yaml

logger = logging.getLogger(__name__)

BASELINE = "off"  # the variant whose final accuracy per seed is the target


@dataclass(frozen=True)
class Variant:
    """One way to echo: a trial ``echo`` setting and the data group's ``views``."""

    name: str
    echo: Any = 1
    views: int = 1


@dataclass(frozen=True)
class EchoExperiment:
    """The sweep to run once per variant, and the variants (the first named ``off`` is the baseline)."""

    path: str
    sweep: Mapping[str, Any]
    variants: tuple[Variant, ...]

    def config(self, variant: Variant) -> SweepConfig:
        """The sweep of ``variant``: its echo in the search space, its views in the data spec."""
        raw = copy.deepcopy(dict(self.sweep))
        raw["name"] = f"{raw.get('name', 'echo')}-{variant.name.replace(':', '-')}"
        raw.setdefault("search_space", {})["echo"] = variant.echo
        raw["data"] = dict(raw.get("data") or {}, views=variant.views)
        try:
            return _parse(self.path, raw)
        except ConfigError as e:
            raise ConfigError(f"{self.path}: variant {variant.name!r}: {e}") from None


def load_echo(path: str) -> EchoExperiment:
    """Read and validate an echo experiment; every variant's sweep is validated before anything runs.

    Raises:
        ConfigError: Names the file, the key and what is allowed.
    """
    raw = load_yaml(path)
    if not isinstance(raw, Mapping) or set(raw) - {"sweep", "variants"} or "sweep" not in raw:
        raise ConfigError(f"{path}: an echo experiment is a mapping with keys 'sweep' (a sweep, as for "
                          "coordprep sweep) and 'variants' (a list of {name, echo, views})")
    found = raw.get("variants") or []
    if not isinstance(found, list) or not found:
        raise ConfigError(f"{path}: variants must be a non-empty list of {{name, echo, views}}")
    variants = []
    for i, v in enumerate(found):
        if not isinstance(v, Mapping) or "name" not in v or set(v) - {"name", "echo", "views"}:
            raise ConfigError(f"{path}: variants[{i}]={v!r} must be a mapping with name, echo and views (optional)")
        EchoSpec.parse(v.get("echo", 1), f"{path}: variants[{i}].echo")
        variants.append(Variant(str(v["name"]), v.get("echo", 1), v.get("views", 1)))
    names = [v.name for v in variants]
    if BASELINE not in names or len(set(names)) != len(names):
        raise ConfigError(f"{path}: variant names {names} must be distinct and include {BASELINE!r} (the baseline)")
    space = raw["sweep"].get("search_space") if isinstance(raw["sweep"], Mapping) else None
    if not isinstance(space, Mapping) or "model_seed" not in space:
        raise ConfigError(f"{path}: sweep.search_space.model_seed is missing: the variants are compared seed by "
                          "seed; add e.g. model_seed: {grid: [0, 1, 2]}")
    experiment = EchoExperiment(path, raw["sweep"], tuple(variants))
    for v in variants:
        experiment.config(v)
    return experiment


def run_echo(experiment: EchoExperiment, out: str, verbose: int = 0) -> dict[str, Any]:
    """Run every variant's sweep in turn and write ``echo.csv``, ``echo.json`` and ``echo.png`` into ``out``."""
    from ray.tune import ExperimentAnalysis

    from coordinated_prep.sweep.runner import run_sweep

    curves: dict[str, dict[str, list[dict[str, Any]]]] = {}
    wall: dict[str, float] = {}
    for variant in experiment.variants:
        cfg = experiment.config(variant)
        logger.info("echo experiment: variant %s (%s)", variant.name, EchoSpec.parse(variant.echo).name)
        t0 = time.perf_counter()
        summary = run_sweep(cfg, verbose=verbose)
        wall[variant.name] = time.perf_counter() - t0
        errors = [t["trial"] for t in summary["trials"] if t["status"] != "TERMINATED"]
        if errors:
            raise ConfigError(f"variant {variant.name}: trials {errors} did not finish; see {summary['path']}")
        analysis = ExperimentAnalysis(os.path.join(os.path.abspath(cfg.storage_path), cfg.name))
        curves[variant.name] = {}
        for frame in analysis.trial_dataframes.values():
            rows = frame.sort_values("training_iteration").to_dict("records")
            seed = str(rows[0].get("config/model_seed", rows[0]["trial_id"]))
            curves[variant.name][seed] = rows
    result = summarize(curves, wall)
    os.makedirs(out, exist_ok=True)
    _write_csv(curves, os.path.join(out, "echo.csv"))
    with open(os.path.join(out, "echo.json"), "w", encoding="utf-8") as f:
        json.dump(result, f, indent=2, default=str)
    result["png"] = _plot(curves, result, os.path.join(out, "echo.png"))
    return result


def summarize(curves: Mapping[str, Mapping[str, Sequence[Mapping[str, Any]]]],
              wall: Mapping[str, float]) -> dict[str, Any]:
    """Per variant: time and fresh samples to echo-off's final accuracy (per seed), final accuracy, stalls.

    ``curves[variant][seed]`` lists the trial's reports in order (``accuracy``, ``time_total_s``,
    ``fresh_samples_total``, ``echoed_samples_total``, ``stall_fraction``). Pure: tested without Ray.
    """
    targets = {seed: rows[-1]["accuracy"] for seed, rows in curves[BASELINE].items()}
    rows_out = []
    base_time: float | None = None
    for name, trials in curves.items():
        reach_t, reach_fresh, finals, stalls, fresh, echoed, missed = [], [], [], [], 0, 0, []
        for seed, rows in trials.items():
            finals.append(rows[-1]["accuracy"])
            stalls += [r.get("stall_fraction", 0.0) for r in rows]
            fresh += int(rows[-1].get("fresh_samples_total") or 0)
            echoed += int(rows[-1].get("echoed_samples_total") or 0)
            hit = next((r for r in rows if r["accuracy"] >= targets.get(seed, math.inf)), None)
            if hit is None:
                missed.append(seed)
            else:
                reach_t.append(hit["time_total_s"])
                reach_fresh.append(hit.get("fresh_samples_total") or 0)
        mean_t = sum(reach_t) / len(reach_t) if reach_t else None
        if name == BASELINE:
            base_time = mean_t
        rows_out.append({
            "variant": name, "seeds": len(trials), "reached": len(reach_t), "missed_seeds": missed,
            "time_to_target_s": mean_t,
            "fresh_to_target": sum(reach_fresh) / len(reach_fresh) if reach_fresh else None,
            "final_accuracy": sum(finals) / len(finals), "final_min": min(finals), "final_max": max(finals),
            "stall_fraction": sum(stalls) / len(stalls) if stalls else None,
            "fresh_samples": fresh, "echoed_samples": echoed, "sweep_wall_s": wall.get(name),
        })
    for row in rows_out:
        t = row["time_to_target_s"]
        row["speedup"] = base_time / t if base_time and t and not row["missed_seeds"] else None
    return {"targets": targets, "variants": rows_out}


def format_echo(result: Mapping[str, Any]) -> str:
    """The terminal table."""
    def num(v: Any, fmt: str) -> str:
        return fmt.format(v) if isinstance(v, (int, float)) else "-"

    targets = ", ".join(f"seed {s}: {a:.3f}" for s, a in result["targets"].items())
    return f"target (echo-off's final accuracy per model seed): {targets}\n\n" + format_table(
        ["variant", "reached", "time to target s", "vs off", "fresh to target", "final acc (min-max)", "stall",
         "fresh", "echoed", "sweep s"],
        [[r["variant"], f"{r['reached']}/{r['seeds']}", num(r["time_to_target_s"], "{:.1f}"),
          num(r["speedup"], "{:.2f}x"), num(r["fresh_to_target"], "{:.0f}"),
          f"{r['final_accuracy']:.3f} ({r['final_min']:.3f}-{r['final_max']:.3f})", num(r["stall_fraction"], "{:.2f}"),
          r["fresh_samples"], r["echoed_samples"], num(r["sweep_wall_s"], "{:.0f}")] for r in result["variants"]])


_CSV = ("variant", "seed", "epoch", "time_total_s", "accuracy", "loss", "fresh_samples_total", "echoed_samples_total",
        "steps", "stall_fraction")


def _write_csv(curves: Mapping[str, Mapping[str, Sequence[Mapping[str, Any]]]], path: str) -> None:
    with open(path, "w", newline="", encoding="utf-8") as f:
        writer = csv.DictWriter(f, fieldnames=_CSV, extrasaction="ignore")
        writer.writeheader()
        for name, trials in curves.items():
            for seed, rows in trials.items():
                for r in rows:
                    writer.writerow({**r, "variant": name, "seed": seed})


def _plot(curves: Mapping[str, Mapping[str, Sequence[Mapping[str, Any]]]], result: Mapping[str, Any],
          path: str) -> str:
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for k, (name, trials) in enumerate(curves.items()):
        for i, rows in enumerate(trials.values()):
            ax.plot([r["time_total_s"] for r in rows], [r["accuracy"] for r in rows], marker="o", markersize=3,
                    color=colours[k % len(colours)], alpha=0.8, label=name if i == 0 else None)
    target = sum(result["targets"].values()) / len(result["targets"])
    ax.axhline(target, color="grey", linestyle="--", linewidth=1, label="echo-off's final (mean)")
    ax.set_xlabel("wall-clock time of the trial, s")
    ax.set_ylabel("held-out accuracy")
    ax.set_title("Data echoing: accuracy against time (one line per model seed)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
