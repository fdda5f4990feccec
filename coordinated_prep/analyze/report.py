"""Renderings of an analysis: a terminal table, ``analysis.json`` and ``analysis.png``."""

from __future__ import annotations

import json
import os
from typing import Any, Mapping

from coordinated_prep.sweep.summary import format_table


def _mb(x: float) -> str:
    return f"{x / 1e6:,.0f} MB/s"


def format_report(r: Mapping[str, Any]) -> str:
    """The analysis as plain text for the terminal."""
    bw, ps = r["bandwidth"], r["per_sample"]
    lines = [
        f"Analysis of {r['experiment']}: {r['trainable']} on {r['dataset']} "
        f"(batch {r['batch_size']}, step: {r['step']}, {r['cores']} cores, {r['samples_measured']} samples measured)",
        "",
        f"Bandwidth: disk {_mb(bw['disk_sequential_bytes_s'])} sequential (read from {r.get('disk_measured_on', 'a scratch file')}), "
        f"dataset files cold "
        f"{_mb(bw['dataset_cold_read_bytes_s'])}, page cache {_mb(bw['page_cache_read_bytes_s'])}, "
        f"memory copy {_mb(bw['memory_copy_bytes_s'])}",
        f"Per sample: {ps['encoded_bytes'] / 1024:.1f} KiB encoded; read {ps['read_warm_s'] * 1e3:.3f} ms warm, "
        f"{ps['read_cold_s'] * 1e3:.3f} ms cold; decode+augment {ps['decode_augment_s'] * 1e3:.2f} ms on one core",
        _per_batch(r),
        "",
        format_table(["run", "samples/s", "epoch s", "model epoch s"],
               [[mode, f"{v['measured_samples_s']:.1f}", f"{v['measured_epoch_s']:.1f}", f"{v['predicted_epoch_s']:.1f}"]
                for mode, v in r["runs"].items()]),
        "",
    ]
    m, p = r["stalls_per_epoch"]["measured"], r["stalls_per_epoch"]["predicted"]
    lines.append(f"Stalls per epoch: prep {m['prep_stall_s']:.1f} s measured ({p['prep_stall_s']:.1f} s model), "
                 f"fetch {m['fetch_stall_s']:.1f} s measured ({p['fetch_stall_s']:.1f} s model)")
    lines.append("")
    cache = r["whatif"]["cache"]
    lines.append(format_table(["cache", "samples/s", "bottleneck"],
                        [[f"{c['cache_fraction']:.0%}", f"{c['throughput']:.0f}", c["bottleneck"]] for c in cache[::2]]))
    lines.append("")
    lines.append(format_table(["prep cores", "samples/s", "bottleneck"],
                        [[c["cores"], f"{c['throughput']:.0f}", c["bottleneck"]] for c in r["whatif"]["cores"]]))
    lines.append("")
    lines.extend(_coordinated_table(r))
    trials: dict[int, dict[bool, Mapping[str, Any]]] = {}
    for t in r["whatif"]["trials"]:
        trials.setdefault(t["trials"], {})[t["coordinated"]] = t
    lines.append(format_table(["trials", "independent samples/s", "coordinated samples/s", "speed-up"],
                        [[n, f"{v[False]['throughput']:.0f}", f"{v[True]['throughput']:.0f}",
                          f"{v[True]['throughput'] / v[False]['throughput']:.2f}x"] for n, v in sorted(trials.items())]))
    return "\n".join(lines)


def _per_batch(r: Mapping[str, Any]) -> str:
    pb = r.get("per_batch", {})
    return (f"Per batch, in the trial's own process: {pb.get('coordinated_trial_cpu_s', 0) * 1e3:.2f} ms CPU "
            f"coordinated (fetching pieces, assembling batches), {pb.get('dataloader_main_cpu_s', 0) * 1e3:.2f} ms "
            f"with a DataLoader; the coordinated prep pool's CPU beyond decode+augment: "
            f"{r.get('pool_overhead_per_sample_s', 0) * 1e3:.2f} ms per sample")


def _coordinated_table(r: Mapping[str, Any]) -> list[str]:
    """Model against the measured coordinated runs, when they ran."""
    runs = r.get("coordinated_runs") or {}
    rows = runs.get("model_vs_measured") or []
    if not rows:
        return ["Coordinated trials: not measured (--no-coordinated-runs); the model has no trial-side cost", ""]
    read = f"{runs['epochs']} epoch(s)" if runs.get("epochs", 1) > 1 else f"up to {runs.get('run_samples')} samples"
    return [f"Coordinated trials, model vs measured ({read} each, simulated {runs['step_ms']:.1f} ms step, "
            f"batch {runs['batch_size']}):",
            format_table(["trials", "model samples/s", "model speed-up", "measured samples/s", "measured speed-up",
                          "error"],
                         [[x["trials"], f"{x['predicted_samples_s']:.0f}", f"{x['predicted_speedup']:.2f}x",
                           f"{x['measured_samples_s']:.0f}", f"{x['measured_speedup']:.2f}x", f"{x['error']:+.0%}"]
                          for x in rows]), ""]


def write_report(r: Mapping[str, Any], directory: str) -> dict[str, str]:
    """Write ``analysis.json`` and ``analysis.png`` into ``directory``; returns their paths."""
    os.makedirs(directory, exist_ok=True)
    paths = {"json": os.path.join(directory, "analysis.json"), "png": os.path.join(directory, "analysis.png")}
    with open(paths["json"], "w", encoding="utf-8") as f:
        json.dump({**r, "files": paths}, f, indent=2, default=str)
    plot(r, paths["png"])
    return paths


def plot(r: Mapping[str, Any], path: str) -> None:
    """Four panels: the three runs, and throughput against cache size, prep cores and trials."""
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(11, 8))
    ax = axes[0][0]
    modes = list(r["runs"])
    xs = range(len(modes))
    ax.bar([x - 0.2 for x in xs], [r["runs"][m]["measured_epoch_s"] for m in modes], 0.4, label="measured")
    ax.bar([x + 0.2 for x in xs], [r["runs"][m]["predicted_epoch_s"] for m in modes], 0.4, label="model")
    ax.set_xticks(list(xs), modes)
    ax.set_ylabel("seconds per epoch")
    ax.set_title("Where the epoch goes: prep stall = warm - synthetic, fetch stall = cold - warm", fontsize=9)
    ax.legend()
    ax = axes[0][1]
    cache = r["whatif"]["cache"]
    ax.plot([100 * c["cache_fraction"] for c in cache], [c["throughput"] for c in cache], marker="o")
    ax.set_xlabel("dataset cached in memory (%)")
    ax.set_ylabel("samples/s (one trial)")
    ax.set_title(f"What if the cache were larger ({r['cores']} prep cores)", fontsize=9)
    ax.set_ylim(bottom=0)
    ax = axes[1][0]
    cores = r["whatif"]["cores"]
    ax.plot([c["cores"] for c in cores], [c["throughput"] for c in cores], marker="o")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("CPU cores for preparation")
    ax.set_ylabel("samples/s (one trial, warm cache)")
    ax.set_title("What if there were more cores", fontsize=9)
    ax.set_ylim(bottom=0)
    ax = axes[1][1]
    for coordinated, label in ((False, "independent pipelines"), (True, "coordinated prep")):
        rows = [t for t in r["whatif"]["trials"] if t["coordinated"] == coordinated]
        ax.plot([t["trials"] for t in rows], [t["throughput"] for t in rows], marker="o", label=label)
    measured = (r.get("coordinated_runs") or {}).get("model_vs_measured") or []
    if measured:
        ax.plot([x["trials"] for x in measured], [x["measured_samples_s"] for x in measured], "k^", linestyle="none",
                label="coordinated prep, measured")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("concurrent trials")
    ax.set_ylabel("samples/s, all trials")
    ax.set_title(f"N trials on {r['cores']} cores, warm cache", fontsize=9)
    ax.set_ylim(bottom=0)
    ax.legend()
    fig.suptitle(f"coordprep analyze: {os.path.basename(r['experiment'])} ({r['trainable']}, {r['step']} step)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
