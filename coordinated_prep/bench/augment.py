"""Decode once for the whole sweep: a sweep over crop scales, with and without the decoded tier.

``python -m coordinated_prep.bench.augment`` runs, one after the other on one Ray instance, the same
sweep of 4 crop scales x 2 trials each on ``builtin:photos`` (4,096 JPEGs of 500 x 375 px): a
``transforms.v2`` pipeline of ``Resize(256)`` (the deterministic prefix), ``RandomResizedCrop(224,
scale=(s, 1))`` and a flip, uint8 out, batch 64, 3 epochs, a simulated accelerator step per batch:

- ``tier``: coordinated, the node's decoded tier large enough for the set (the 4 groups share one
  prefix: each image is decoded and resized once for the whole sweep);
- ``tier-small``: the tier at a quarter of the set (what does not fit is decoded again);
- ``no-tier``: coordinated without a tier (``pool.decoded_fraction: 0``): 4 groups, each decoding
  every image each epoch, as before the tier;
- ``dataloader``: a ``DataLoader`` per trial with the same transform (the cores split over the trials).

Per variant it reports decodes per sample per epoch (prefix runs over training samples, per stream
epoch, all groups together), the wall time from asking Tune to run to the last trial's last batch
(everything a user waits for: the prep pool's start, Tune launching 8 trial processes, start-up),
the trials' span (first loader created to last batch), start-up apart (the prep pool's start plus the
mean time from a loader's creation to its first batch), and the steady rate after every trial's
first batch. Ratios compare variants measured in the same run.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from typing import Any

from coordinated_prep.plan import holdout_split
from coordinated_prep.pool.spec import PoolSpec
from coordinated_prep.spec import DataSpec

VARIANTS = ("tier", "tier-small", "no-tier", "dataloader")
_PREFIX_BYTES = 3 * 256 * 341  # one Resize(256) output of a 500 x 375 photo


def specs(scales: list[float], coordinated: bool, dataset: str = "builtin:photos") -> list[DataSpec]:
    """One DataSpec per crop scale: the same prefix, each its own tail (and data group)."""
    from coordinated_prep.pipeline import Factory

    return [DataSpec(dataset=dataset, seed=0, segments=4, coordinated=coordinated,
                     transform=Factory("trainables.data.photos:train_transform",
                                       {"size": 224, "jitter": 0, "normalize": False, "resize": 256,
                                        "scale": [s, 1.0]}))
            for s in scales]


def measure(variant: str, args: argparse.Namespace, n_train: int) -> dict[str, Any]:
    """One Tune run of the sweep as ``variant``; its row."""
    from ray import tune

    from coordinated_prep.bench.trials import bench_trial
    from coordinated_prep.tune.searcher import CoordinatedSearcher

    coordinated = variant != "dataloader"
    trials = len(args.scales) * args.trials_per_scale
    budget = {"tier": args.tier_bytes, "tier-small": n_train * _PREFIX_BYTES // 4, "no-tier": 0}.get(variant, 0)
    config = {"data": tune.grid_search(specs(args.scales, coordinated)),
              "loader": "coordinated-torchvision" if coordinated else "dataloader", "step": "simulated",
              "epochs": args.epochs, "batch_size": args.batch_size, "workers": max(1, round(args.cores / trials)),
              "step_ms": args.step_ms, "width": 8, "max_batches": 0,
              "trial_index": tune.grid_search(list(range(args.trials_per_scale)))}
    searcher = CoordinatedSearcher(max_concurrent=trials, pool=PoolSpec(actors=args.cores, decoded_bytes=budget)) \
        if coordinated else None
    started = time.time()
    try:
        if searcher:
            searcher.start()
        pool_start = time.time() - started
        analysis = tune.run(tune.with_resources(bench_trial, {"cpu": 0.01}), config=config, search_alg=searcher,
                            max_concurrent_trials=None if searcher else trials, verbose=0, raise_on_failed_trial=True,
                            storage_path=os.path.abspath(os.path.join(args.out, "tune")), name=variant)
        groups = searcher.group_reports() if searcher else {}
        tiers = searcher.decoded_reports() if searcher else {}
    finally:
        if searcher:
            searcher.close()
    results = [t.last_result for t in analysis.trials]
    read = sum(r["samples_read"] for r in results)
    if groups:
        by_epoch: dict[int, int] = {}
        for g in groups.values():
            for e, k in g["decodes_by_epoch"].items():
                by_epoch[int(e)] = by_epoch.get(int(e), 0) + k
        per_epoch = [by_epoch.get(e, 0) / n_train for e in range(max(by_epoch) + 1)]
        prepared = sum(g["samples_prepared"] for g in groups.values())
    else:  # every trial decodes every sample it reads
        per_epoch = [read / args.epochs / n_train] * args.epochs
        prepared = read
    [tier] = tiers.values() if tiers else [{}]
    window = max(r["t_end"] for r in results) - min(r["t_first"] for r in results)
    return {
        "variant": variant, "trials": trials, "groups": len(groups) or trials,
        "decodes_per_sample_epoch": per_epoch, "decodes_epoch1": per_epoch[0],
        "decodes_later": statistics.mean(per_epoch[1:]) if len(per_epoch) > 1 else None,
        "wall_s": max(r["t_end"] for r in results) - started, "pool_start_s": pool_start,
        "startup_s": statistics.mean(r["startup_s"] for r in results), "steady_s": window,
        "trials_s": max(r["t_end"] for r in results) - min(r["t_created"] for r in results),
        "samples_per_s": sum(r["samples"] for r in results) / window, "samples_read": read,
        "samples_prepared": prepared, "tier_budget_mib": budget / 2**20,
        "tier_kept": tier.get("samples"), "tier_mib": tier.get("used_bytes", 0) / 2**20,
    }


def table(rows: list[dict[str, Any]]) -> str:
    """The rows as a Markdown table, with each variant's speed-up over ``no-tier`` and ``dataloader``."""
    wall = {r["variant"]: r["wall_s"] for r in rows}
    steady = {r["variant"]: r["samples_per_s"] for r in rows}
    lines = ["| variant | groups | decodes/sample, epoch 1 | later epochs | tier kept (MiB) | start-up s | "
             "trials s | wall s | vs no-tier: wall, steady | vs DataLoader: wall, steady |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        later = "-" if r["decodes_later"] is None else f"{r['decodes_later']:.2f}"
        kept = "-" if r["tier_kept"] is None else f"{r['tier_kept']} ({r['tier_mib']:.0f})"
        ratio = {k: f"{wall[k] / r['wall_s']:.2f}x, {r['samples_per_s'] / steady[k]:.2f}x" if k in wall else "-"
                 for k in ("no-tier", "dataloader")}
        lines.append(f"| {r['variant']} | {r['groups']} | {r['decodes_epoch1']:.2f} | {later} | {kept} | "
                     f"{r['pool_start_s'] + r['startup_s']:.1f} | {r['trials_s']:.1f} | {r['wall_s']:.1f} | "
                     f"{ratio['no-tier']} | "
                     f"{ratio['dataloader']} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m coordinated_prep.bench.augment", description=__doc__.split("\n")[0])
    parser.add_argument("--scales", type=float, nargs="+", default=[0.08, 0.25, 0.5, 0.75])
    parser.add_argument("--trials-per-scale", type=int, default=2)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--step-ms", type=float, default=5.0)
    parser.add_argument("--cores", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--object-store-mb", type=int, default=4096)
    parser.add_argument("--tier-bytes", type=int, default=1536 * 2**20)
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    parser.add_argument("--out", default="runs/bench-augment")
    args = parser.parse_args(argv)
    import ray

    from coordinated_prep.pipeline.sources import open_source

    n_train = len(holdout_split(len(open_source("builtin:photos")), DataSpec().holdout)[0])
    ray.init(num_cpus=args.cores, object_store_memory=args.object_store_mb * 2**20, include_dashboard=False,
             log_to_driver=False, runtime_env={"env_vars": {"PYTHONPATH": os.getcwd()}})
    rows = []
    try:
        for variant in args.variants:
            rows.append(measure(variant, args, n_train))
            sys.stdout.write(json.dumps(rows[-1]) + "\n")
            sys.stdout.flush()
    finally:
        ray.shutdown()
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "augment.json"), "w", encoding="utf-8") as f:
        json.dump(rows, f, indent=2)
    sys.stdout.write(table(rows) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
