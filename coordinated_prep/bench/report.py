"""The benchmark's outputs: a terminal table, ``bench.csv`` and ``bench.png``."""

from __future__ import annotations

import csv
import os
from typing import Any, Mapping, Sequence

from coordinated_prep.sweep.summary import format_table

COLUMNS = ("step", "loader", "format", "cache", "trials", "samples_per_s", "mb_per_s", "storage_mb",
           "vs_best_independent", "unique_samples_per_s", "vs_prep_bound", "samples_per_s_with_startup",
           "vs_best_with_startup", "waited_s", "pool_start_s", "trials_started_s", "startup_s", "startup_max_s", "copied_fraction",
           "trial_cpu_ms_per_batch", "loader_cpu_ms_per_batch", "prep_cpu_s", "prep_cpu_ms_per_sample_read", "prep_work_x", "peak_staging_bytes",
           "stall_fraction", "samples", "samples_read", "window_s", "workers_per_trial", "ms_per_sample",
           "launch_s", "run_s", "launch_cpu_s", "ideal_with_startup_s", "cpu_prep_share", "cpu_trials_share",
           "cpu_coordinators_share", "cpu_other_share")


def _num(v: Any, fmt: str) -> str:
    return fmt.format(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else "-"


def format_rows(rows: Sequence[Mapping[str, Any]]) -> str:
    """The rows as aligned tables, each if it has rows: the read-only rows, Tune's launch of empty
    trials, where the coordinated runs' CPU went, then the loaders' rows."""
    reads = [r for r in rows if r["step"] == "read"]
    loaders = [r for r in rows if r["step"] not in ("read", "decode", "launch")]
    launches = [r for r in rows if r["step"] == "launch"]
    tables = [f"decode and augment on one core: {r['ms_per_sample']:.2f} ms per sample, so {r['samples_per_s']:.0f} "
              "samples/s at most on the benchmark's cores" for r in rows if r["step"] == "decode"]
    if reads:
        tables.append(format_table(
            ["read-only", "format", "cache", "samples/s", "MB/s", "storage MB read"],
            [["shuffled", r["format"], r["cache"], _num(r["samples_per_s"], "{:.0f}"), _num(r["mb_per_s"], "{:.1f}"),
              _num(r.get("storage_mb"), "{:.1f}")] for r in reads],
        ))
    if launches:
        tables.append(format_table(
            ["Tune's launch", "N", "launch s", "launch CPU s", "ideal with start-up s", "ceiling vs best (with start-up)"],
            [["empty trials", r["trials"], _num(r["launch_s"], "{:.1f}"), _num(r.get("launch_cpu_s"), "{:.1f}"),
              _num(r.get("ideal_with_startup_s"), "{:.1f}"), _num(r.get("vs_best_with_startup"), "{:.2f}x")]
             for r in launches],
        ))
    # before the loaders' table, whose last line the progress output shows for each row
    cpu = [r for r in loaders if r.get("cpu_prep_share") is not None]
    if cpu:
        tables.append(format_table(
            ["CPU while all trials read", "loader", "data", "N", "prep actors", "trials", "coordinators", "rest"],
            [[r["step"], r["loader"], r.get("format", "files"), r["trials"],
              *(_num(r[f"cpu_{role}_share"], "{:.1%}") for role in ("prep", "trials", "coordinators", "other"))]
             for r in cpu],
        ))
    if loaders:
        tables.append(_format_loaders(loaders))
    return "\n\n".join(tables)


def _format_loaders(rows: Sequence[Mapping[str, Any]]) -> str:
    return format_table(
        ["step", "loader", "data", "N", "samples/s", "vs best indep.", "unique/s", "vs prep bound",
         "with start-up: samples/s", "vs best", "first batch s (mean/max)", "copied", "trial CPU ms/batch",
         "prep CPU ms/sample", "prep work", "stall"],
        [[r["step"], r["loader"], r.get("format", "files"), r["trials"], _num(r["samples_per_s"], "{:.0f}"),
          _num(r.get("vs_best_independent"), "{:.2f}x"), _num(r.get("unique_samples_per_s"), "{:.0f}"),
          _num(r.get("vs_prep_bound"), "{:.2f}"), _num(r.get("samples_per_s_with_startup"), "{:.0f}"),
          _num(r.get("vs_best_with_startup"), "{:.2f}x"),
          f"{_num(r.get('startup_s'), '{:.1f}')}/{_num(r.get('startup_max_s'), '{:.1f}')}",
          _num(r.get("copied_fraction"), "{:.2f}"), _num(r.get("trial_cpu_ms_per_batch"), "{:.2f}"),
          _num(r["prep_cpu_ms_per_sample_read"], "{:.2f}"), _num(r["prep_work_x"], "{:.2f}x"),
          _num(r["stall_fraction"], "{:.2f}")] for r in rows],
    )


def write_outputs(rows: Sequence[Mapping[str, Any]], directory: str, title: str) -> dict[str, str]:
    """Write ``bench.csv`` and ``bench.png`` into ``directory``; returns their paths."""
    os.makedirs(directory, exist_ok=True)
    paths = {"csv": os.path.join(directory, "bench.csv"), "png": os.path.join(directory, "bench.png")}
    with open(paths["csv"], "w", newline="", encoding="utf-8") as f:
        writer = csv.DictWriter(f, fieldnames=COLUMNS, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(rows)
    plot(rows, paths["png"], title)
    return paths


def plot(rows: Sequence[Mapping[str, Any]], path: str, title: str) -> None:
    """One panel per step: aggregate samples/s against N for each loader and format, with the ideal line.

    The read-only rows are in the table and the CSV, not in the plot.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [dict(r, line=r["loader"] + ("" if r.get("format", "files") == "files" else f" ({r['format']})"))
            for r in rows if r["step"] not in ("read", "decode", "launch")]
    steps = list(dict.fromkeys(r["step"] for r in rows))
    fig, axes = plt.subplots(1, len(steps), figsize=(6 * len(steps), 4.5), squeeze=False)
    for ax, step in zip(axes[0], steps):
        mine = [r for r in rows if r["step"] == step]
        for line in dict.fromkeys(r["line"] for r in mine):
            pts = sorted((r["trials"], r["samples_per_s"]) for r in mine if r["line"] == line)
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="s" if "(" in line else "o", label=line,
                    linestyle="-" if line.startswith("coordinated") else "--")
        independent = [r for r in mine if r["line"] in ("dataloader", "dali")]  # on the raw files
        ones = [r for r in independent if r["trials"] == min(x["trials"] for x in independent)]
        if ones:
            base = max(r["samples_per_s"] / r["trials"] for r in ones)
            ns = sorted({r["trials"] for r in mine})
            ax.plot(ns, [base * n for n in ns], color="grey", linewidth=0.8, label="ideal (N x best independent at N=1)")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrent trials N")
        ax.set_ylabel("samples/s, all trials")
        ax.set_title(f"{step} step", fontsize=10)
        ax.set_ylim(bottom=0)
        ax.legend(fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
