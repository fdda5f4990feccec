"""Renderings of ``coordprep memory``'s report: a terminal table, ``memory.json`` and ``memory.png``."""

from __future__ import annotations

import json
import os
from typing import Any, Mapping

from coordinated_prep.sweep.summary import format_table

MiB = 2**20


def relative(rows: list[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Each row with ``activation_ratio`` (none's activations / this row's) and ``time_ratio`` (this
    row's step time / none's), against the row of the same model, width, batch and crop with
    ``memory: none`` (None where the sweep measured no such row)."""
    base = {_group(r): r for r in rows if r["memory"] == "none"}
    out = []
    for r in rows:
        b = base.get(_group(r))
        ratios = {"activation_ratio": None, "time_ratio": None}
        if b is not None and r["activation_bytes"] > 0 and b["step_s"] > 0:
            ratios = {"activation_ratio": b["activation_bytes"] / r["activation_bytes"],
                      "time_ratio": r["step_s"] / b["step_s"]}
        out.append({**r, **ratios})
    return out


def _group(r: Mapping[str, Any]) -> tuple[Any, ...]:
    return r["trainable"], r["width"], r["batch_size"], r["size"]


def format_report(report: Mapping[str, Any]) -> str:
    """The report as plain text for the terminal."""
    rows = relative(report["rows"])
    estimate = any(r["peak_kind"] == "cpu_estimate" for r in rows)
    peak = "peak MiB (estimate)" if estimate else "peak MiB"
    table = format_table(
        ["config", "activations MiB", "less than none", "params MiB", "grads MiB", "optimizer MiB", peak,
         "step s", "vs none", "min step s"],
        [[r["config"], f"{r['activation_bytes'] / MiB:.2f}", _x(r["activation_ratio"]), f"{r['param_bytes'] / MiB:.1f}",
          f"{r['grad_bytes'] / MiB:.1f}", f"{r['optimizer_bytes'] / MiB:.1f}", f"{r['peak_bytes'] / MiB:.2f}",
          f"{r['step_s']:.3f}", _pct(r["time_ratio"]), f"{r['step_min_s']:.3f}"] for r in rows])
    lines = [f"Memory of {report['experiment']} on {report['device']} ({report['threads']} threads, torch "
             f"{report['torch']}; step time: median and fastest of {report['steps']} steps after {report['warmup']} warm-up; "
             "on a CPU the configurations take turns, one step each per round)",
             "", table]
    if estimate:
        lines += ["", "Peak (estimate, no GPU): parameters + gradients + optimizer state + activations saved at the "
                      "end of the forward; the transient memory of backward (recomputed stages) is not included."]
    return "\n".join(lines)


def _x(ratio: float | None) -> str:
    return "-" if ratio is None else f"{ratio:.2f}x"


def _pct(ratio: float | None) -> str:
    return "-" if ratio is None else f"{(ratio - 1) * 100:+.0f}%"


def write_report(report: Mapping[str, Any], directory: str) -> dict[str, str]:
    """Write ``memory.json`` and ``memory.png`` into ``directory``; returns their paths."""
    os.makedirs(directory, exist_ok=True)
    paths = {"json": os.path.join(directory, "memory.json"), "png": os.path.join(directory, "memory.png")}
    with open(paths["json"], "w", encoding="utf-8") as f:
        json.dump({**report, "rows": relative(report["rows"]), "files": paths}, f, indent=2, default=str)
    plot(report, paths["png"])
    return paths


def plot(report: Mapping[str, Any], path: str) -> None:
    """Activation memory and peak against step time, one point per configuration."""
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5.5))
    for r in report["rows"]:
        act, peak = r["activation_bytes"] / MiB, r["peak_bytes"] / MiB
        ax.scatter([r["step_s"]], [act], marker="o", color="tab:blue")
        ax.scatter([r["step_s"]], [peak], marker="^", color="tab:orange")
        ax.annotate(r["config"], (r["step_s"], act), fontsize=7, xytext=(4, 4), textcoords="offset points")
    ax.scatter([], [], marker="o", color="tab:blue", label="activations saved for backward")
    estimate = any(r["peak_kind"] == "cpu_estimate" for r in report["rows"])
    ax.scatter([], [], marker="^", color="tab:orange", label="peak" + (" (estimate)" if estimate else ""))
    ax.set_xlabel("step time (s, median)")
    ax.set_ylabel("MiB")
    ax.set_ylim(bottom=0)
    ax.legend(fontsize=8)
    ax.set_title(f"coordprep memory: {os.path.basename(str(report['experiment']))} on {report['device']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
