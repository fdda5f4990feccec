"""The benchmark's outputs: a terminal table, ``bench.csv`` and ``bench.png``."""

from __future__ import annotations

import csv
import os
from typing import Any, Mapping, Sequence

from coordinated_prep.sweep.summary import format_table

COLUMNS = ("step", "loader", "trials", "samples_per_s", "vs_best_independent", "prep_cpu_s",
           "prep_cpu_ms_per_sample_read", "prep_work_x", "peak_staging_bytes", "stall_fraction", "startup_s", "samples", "samples_read",
           "window_s", "workers_per_trial")


def format_rows(rows: Sequence[Mapping[str, Any]]) -> str:
    """The rows as an aligned table."""
    def num(v: Any, fmt: str) -> str:
        return fmt.format(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else "-"

    return format_table(
        ["step", "loader", "N", "samples/s", "vs best indep.", "prep CPU ms/sample", "prep work", "peak MiB", "stall", "start-up s"],
        [[r["step"], r["loader"], r["trials"], num(r["samples_per_s"], "{:.0f}"),
          num(r.get("vs_best_independent"), "{:.2f}x"), num(r["prep_cpu_ms_per_sample_read"], "{:.2f}"),
          num(r["prep_work_x"], "{:.2f}x"), num(r["peak_staging_bytes"] / 2**20, "{:.0f}"),
          num(r["stall_fraction"], "{:.2f}"), num(r.get("startup_s"), "{:.1f}")] for r in rows],
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
    """One panel per step: aggregate samples/s against N for each loader, with the ideal line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = list(dict.fromkeys(r["step"] for r in rows))
    fig, axes = plt.subplots(1, len(steps), figsize=(6 * len(steps), 4.5), squeeze=False)
    for ax, step in zip(axes[0], steps):
        mine = [r for r in rows if r["step"] == step]
        for loader in dict.fromkeys(r["loader"] for r in mine):
            pts = sorted((r["trials"], r["samples_per_s"]) for r in mine if r["loader"] == loader)
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=loader,
                    linestyle="-" if loader.startswith("coordinated") else "--")
        ones = [r for r in mine if r["trials"] == min(x["trials"] for x in mine) and r["loader"] in ("dataloader", "dali")]
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
