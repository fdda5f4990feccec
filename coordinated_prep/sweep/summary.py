"""The end-of-sweep summary: best trial, per-trial results, and per data group what sharing saved."""

from __future__ import annotations

import json
import math
import numbers
import os
from typing import Any, Mapping, Sequence

from coordinated_prep.pipeline.part import PART_FIELDS
from coordinated_prep.stream.watch import trial_of

_TRIAL_COLUMNS = ("trial", "status", "epochs", "metric", "stall_fraction", "batch_size")


def is_score(value: Any) -> bool:
    """A reported number a sweep can rank by: any real number (numpy's too), not a bool, not NaN."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool) and not math.isnan(value)


def build_summary(trials: Sequence[Mapping[str, Any]], groups: Mapping[str, Mapping[str, Any]],
                  metric: str, mode: str, caches: Mapping[str, Mapping[str, Any]] | None = None,
                  evals: Mapping[str, Mapping[str, Any]] | None = None,
                  decoded: Mapping[str, Mapping[str, Any]] | None = None, coordinated: bool = True,
                  pools: Mapping[str, Mapping[str, Any]] | None = None) -> dict[str, Any]:
    """Assemble the summary from per-trial rows and the searcher's reports (data groups, node caches,
    evaluation sets, decoded tiers, node prep pools); ``coordinated``: whether the sweep ran a prep pool
    (``data.coordinated``)."""
    scored = sorted((t for t in trials if is_score(t.get(metric))), key=lambda t: str(t.get("trial")))
    # the first of equals in trial-id order (as ``coordprep best`` picks)
    best = (max if mode == "max" else min)(scored, key=lambda t: t[metric]) if scored else None
    group_rows = {}
    for key, g in groups.items():
        prepared, served = g.get("samples_prepared", 0), g.get("samples_served", 0)
        group_rows[key] = dict(g, saving=(served / prepared) if prepared else None)
    rows = []
    for t in trials:  # a group's trials share their searched data values (equal values, one group)
        values = searched_data(t.get("config") or {})
        if values and t.get("group") in group_rows:
            group_rows[t["group"]].setdefault("searched", values)
        ranks = (groups.get(t.get("group")) or {}).get("ranks", {}).get(t.get("trial"))
        rows.append(dict(t, ranks=ranks) if ranks else t)  # the Ray Train workers that joined for the trial
    return {"metric": metric, "mode": mode, "coordinated": coordinated, "best_trial": best, "trials": rows,
            "groups": group_rows,
            "caches": dict(caches or {}), "evaluation": dict(evals or {}), "decoded": dict(decoded or {}),
            "pools": dict(pools or {})}


def searched_data(config: Mapping[str, Any]) -> dict[str, Any]:
    """The data keys of a trial config that name its data group (``data.pipeline.scale.0``: the values a
    sweep searched inside ``data``); not its part of the split (``data.fold.1``, ``data.fraction``),
    which the trials of one group differ in (:mod:`coordinated_prep.pipeline.part`)."""
    return {k: v for k, v in config.items() if k.startswith("data.") and k.split(".")[1] not in PART_FIELDS}


def format_searched(values: Mapping[str, Any]) -> str:
    """``pipeline.scale.0=0.3416, seed=1``: searched data values, short (floats to 4 significant digits)."""
    return ", ".join(f"{k.removeprefix('data.')}={_short(v)}" for k, v in values.items())


def _short(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_short(v) for v in value) + "]"
    return str(value)


def write_summary(summary: Mapping[str, Any], directory: str) -> str:
    """Write ``summary.json`` into ``directory``; returns its path."""
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, "summary.json")
    with open(path, "w", encoding="utf-8") as f:
        json.dump(summary, f, indent=2, default=str)
    return path


def format_summary(summary: Mapping[str, Any]) -> str:
    """A plain-text rendering for the terminal."""
    metric = summary["metric"]
    lines = []
    best = summary["best_trial"]
    if best:
        lines.append(f"Best trial: {best['trial']}  {metric}={best[metric]:.4f}  config={best.get('config')}")
    else:
        lines.append(f"Best trial: none reported {metric}")
    lines.append("")
    echoing = any(t.get("echoed_samples") for t in summary["trials"])
    ranked = any(t.get("ranks") for t in summary["trials"])  # data-parallel trials (Ray Train workers)
    lines.append(format_table(
        ["trial", "status", "epochs", metric, "stall", "batch", "own prep"] + (["ranks"] if ranked else [])
        + (["echo", "fresh", "echoed"] if echoing else []),
        [[t["trial"], t["status"], t.get("epochs", ""), _num(t.get(metric)), _num(t.get("stall_fraction")),
          t.get("batch_size", ""), t.get("private_samples", "-")] + ([t.get("ranks") or 1] if ranked else [])
         + ([t.get("echo", "off"), t.get("fresh_samples", "-"), t.get("echoed_samples", "-")] if echoing else [])
         for t in summary["trials"]],
    ))
    lines.append("")
    if summary.get("resumed"):
        lines.append("Resumed: the trials above are the whole sweep's; the figures below are this run's.")
        lines.append("")
    rows = []
    searched = any(g.get("searched") for g in summary["groups"].values())
    for key, g in summary["groups"].items():
        rows.append([key] + ([format_searched(g.get("searched") or {}) or "-"] if searched else []) + [
                     g.get("dataset"), g.get("samples_prepared"), g.get("samples_served"),
                     _num(g.get("saving"), "{:.2f}x"), _num(g.get("peak_staged_bytes", 0) / 2**20, "{:.1f}"),
                     _num(g.get("fetch_s"), "{:.1f}"), _num(g.get("transform_s"), "{:.1f}"),
                     _num(g.get("put_s"), "{:.1f}"), g.get("evictions", 0), g.get("released_dead", 0),
                     _num(g.get("stall_s"), "{:.1f}"), len(g.get("nodes", [])) or "-"])
    if rows:
        lines.append(format_table(["group"] + (["searched data"] if searched else [])
                                  + ["dataset", "prepared", "served", "saving", "peak MiB", "fetch s", "decode+aug s",
                                     "put s", "detached", "released", "stall s", "nodes"], rows))
        lines += sharing_notes(summary["groups"]) + private_notes(summary["trials"])
    elif not summary.get("coordinated", True):
        lines.append("No coordinated data groups (coordinated: false): every trial prepared its own data.")
    else:
        failed = sum(t.get("status") == "ERROR" for t in summary["trials"])
        why = (f"{failed} of {len(summary['trials'])} trials failed; their errors are above" if failed
               else "no report of its data groups was kept")
        lines.append(f"No data group reported: the sweep was coordinated, but no trial read shared data ({why}).")
    evals = summary.get("evaluation") or {}
    if evals:
        lines.append("")
        lines.append(format_table(
            ["evaluation set", "held-out", "resident", "evaluations", "prepared", "served"],
            [[key, e.get("samples"), f"{e.get('resident_pieces')}/{e.get('pieces')} pieces", e.get("evaluations"),
              e.get("samples_prepared"), e.get("samples_served")] for key, e in evals.items()],
        ))
    lines.extend(pool_notes(summary.get("pools") or {}))
    tiers = summary.get("decoded") or {}
    if tiers:
        lines.append("")
        lines.append(format_table(
            ["decoded tier node", "samples kept", "MiB kept", "MiB budget", "full", "hits", "misses", "waited"],
            [[node[:12], "lost" if t.get("lost") else t.get("samples", "-"),
              _num(t.get("used_bytes", 0) / 2**20, "{:.1f}"), _num(t.get("capacity_bytes", 0) / 2**20, "{:.1f}"),
              t.get("full", "-"), t.get("hits", 0), t.get("misses", 0), t.get("waits", 0)]
             for node, t in tiers.items()],
        ))
        decodes = sum(g.get("decodes", 0) for g in summary["groups"].values())
        through = decodes + sum(g.get("tier_hits", 0) for g in summary["groups"].values())  # split pipelines only
        lines.append(f"Prefix runs (read, decode and the deterministic steps) {decodes} for {through} samples "
                     f"prepared through the tier ({_num(decodes / through if through else None, '{:.2f}')} per sample)")
    caches = summary.get("caches") or {}
    if caches:
        lines.append("")
        lines.append(format_table(
            ["cache node", "items held", "MiB held", "full", "storage reads", "served to other nodes"],
            [[node[:12], "lost" if c.get("lost") else c.get("items", "-"),
              _num(c.get("used_bytes", 0) / 2**20, "{:.1f}"), c.get("full", "-"), c.get("storage_reads", "-"),
              c.get("hits_remote", "-")] for node, c in caches.items()],
        ))
        hits = sum(g.get("cache_hits", 0) for g in summary["groups"].values())
        past = sum(g.get("storage_reads", 0) for g in summary["groups"].values())
        cache_reads = sum(c.get("storage_reads", 0) for c in caches.values())
        # A sample a cache delivered after reading it from storage for the asker is not a hit.
        rate = (hits - cache_reads) / (hits + past) if hits + past else None
        lines.append(f"Samples delivered by the caches: {hits}; storage reads: {cache_reads} by the caches, {past} "
                     f"by prep actors past them; hit rate {_num(rate, '{:.2f}')}")
    return "\n".join(lines)


def pool_notes(pools: Mapping[str, Mapping[str, Any]]) -> list[str]:
    """A line per node: its prep actors and the CPUs they reserve, and why a pool sized by demand grew,
    gave CPUs back or took them again (or did not)."""
    lines = []
    for node, p in pools.items():
        growth = p.get("growth")
        if growth is None:
            lines.append(f"Prep pool on node {node[:12]}: {p.get('prep_actors')} actors, fixed "
                         f"({_num(p.get('reserved_cpus'), '{:.2f}')} CPUs reserved).")
            continue
        why = "; ".join(f"{at} s {what}: {reason}" if reason else f"{at} s {what}"
                        for at, what, reason in growth.get("decisions", []))
        lines.append(f"Prep pool on node {node[:12]}: {p.get('prep_actors')} of at most {growth.get('most_actors')} "
                     f"actors ({_num(p.get('reserved_cpus'), '{:.2f}')} CPUs reserved); "
                     + (f"{_changes(growth)}: {why}" if why else "never grew: the trials did not wait for it"))
    return lines


def _changes(growth: Mapping[str, Any]) -> str:
    """How often a pool sized by demand grew, gave a share of CPUs back, and took one again."""
    said = f"grew {growth.get('grown')} time(s)"
    if growth.get("released"):
        said += f", gave CPUs back {growth['released']} time(s) (its preparation ran ahead)"
    if growth.get("reserved"):
        said += f", took them again {growth['reserved']} time(s)"
    return said


def sharing_notes(groups: Mapping[str, Mapping[str, Any]]) -> list[str]:
    """A line per data group where sharing did not pay (saving under 1.5x), saying why."""
    notes = []
    for key, g in groups.items():
        saving = g.get("saving")
        # trials (a data-parallel trial's ranks once, a trial's loaders ``T#k`` once)
        joined = len({trial_of(k) for k in g.get("starts") or {}}) or g.get("trials_joined", 0)
        if saving is None or saving >= 1.5:
            continue
        if joined <= 1:
            why = "one trial read it: there was nothing to share"
        else:
            why = (f"{joined} trials read it, but seldom at the same time (each prepares what no one running "
                   "beside it reads); run more of its trials at once (max_concurrent_trials), keep search.order: "
                   "group, or make the data groups fewer")
        notes.append(f"Group {key}: saving {saving:.2f}x; {why}.")
    return notes


def private_notes(trials: list[Mapping[str, Any]]) -> list[str]:
    """A line per trial of a group that prepared samples itself, saying why (its loader told the sweep)."""
    return [f"Trial {t['trial']} prepared {t.get('private_samples') or 'some'} samples itself ({t['private_reason']})."
            for t in trials if t.get("private_reason")]


def _num(value: Any, fmt: str = "{:.4f}") -> str:
    return fmt.format(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else "-"


def format_table(header: list[str], rows: list[list[Any]]) -> str:
    """Left-aligned columns with a dashed rule under the header (the summary, analyze and bench tables)."""
    cells = [header] + [[str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    out = ["  ".join(c.ljust(w) for c, w in zip(r, widths)) for r in cells]
    out.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(out)
