"""A data group's trials together: one YAML sweep run in the searcher's group order and in Tune's own.

``python -m coordinated_prep.bench.order [experiments/grid.yaml]`` runs the sweep four times, one
after the other on one Ray instance, alternating ``search.order: tune`` and ``search.order: group``
(the default).
Per run it prints the wall time (``run_sweep``, the prep pool's start included) and, per data group,
the samples its trials were served against those its prep actors prepared (the sharing factor:
2.00x when two trials read every piece once prepared; 1.00x when no two trials of the group ever ran
together). The file's trials, concurrency and data are used as written.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import sys
import time

from coordinated_prep.sweep.config import load_sweep
from coordinated_prep.sweep.runner import run_sweep


def measure(path: str, order: str) -> dict:
    cfg = load_sweep(path)
    cfg = dataclasses.replace(cfg, name=f"{cfg.name}-order-{order}",
                              search=dataclasses.replace(cfg.search, order=order))
    start = time.perf_counter()
    summary = run_sweep(cfg, verbose=0)
    wall = time.perf_counter() - start
    groups = {key: {"served": g.get("samples_served", 0), "prepared": g.get("samples_prepared", 0),
                    "factor": round(g["saving"], 2) if g.get("saving") else None}
              for key, g in summary["groups"].items()}
    failed = [t["trial"] for t in summary["trials"] if t.get("status") != "TERMINATED"]
    return {"order": order, "wall_s": round(wall, 1), "groups": groups, "failed": failed}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("sweep", nargs="?", default="experiments/grid.yaml")
    parser.add_argument("--orders", default="tune,group,tune,group",
                        help="the runs, in this order (alternated: the first run in a process also warms it)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    rows = [measure(args.sweep, order) for order in args.orders.split(",")]
    for row in rows:
        factors = ", ".join(f"{g['factor']}x ({g['served']} served / {g['prepared']} prepared)"
                            for g in row["groups"].values())
        sys.stdout.write(f"order={row['order']:5s}  wall {row['wall_s']:6.1f} s  groups: {factors}"
                         + (f"  FAILED: {row['failed']}" if row["failed"] else "") + "\n")
    sys.stdout.write(json.dumps(rows) + "\n")
    return 1 if any(row["failed"] for row in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
