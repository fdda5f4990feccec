"""A small sweep shared and unshared: 2 trials x 3 epochs of one data group, wall time and CPU.

The small CNN on ``builtin:shapes`` at 64 px, 2 trials at a time (``cpu: 0.5``). Each run is a fresh
process with its own Ray instance; shared and unshared runs alternate. Run from the repository root:
``PYTHONPATH=. .venv/bin/python docs/scripts/small_sweep.py --rounds 3``. To compare two commits, run it
in a worktree of each, alternately. Prints one line per run: wall time (``run_sweep``, Ray's start
included), the machine's CPU seconds meanwhile (``/proc/stat``), and each node's prep pool.
"""

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import tempfile
import time

SWEEP = """
name: small
trainable: small_cnn
data: {dataset: "builtin:shapes", seed: 0, pipeline: {size: 64, scale: [0.35, 1.0], hflip: 0.5}}
search_space: {lr: {loguniform: [0.01, 0.1]}, batch_size: 32, width: 8, epochs: 3}
num_samples: SAMPLES
max_concurrent_trials: CONCURRENT
resources_per_trial: {cpu: 0.5}
metric: accuracy
mode: max
"""


def _cpu_s() -> float:
    with open("/proc/stat") as f:
        ticks = [int(v) for v in f.readline().split()[1:]]
    return (sum(ticks) - ticks[3] - ticks[4]) / os.sysconf("SC_CLK_TCK")


def one(shared: bool, storage: str, samples: int, concurrent: int) -> dict:
    """One sweep in this process: its wall time, the machine's CPU time, its pools."""
    from coordinated_prep.sweep.config import load_sweep
    from coordinated_prep.sweep.runner import run_sweep

    path = os.path.join(storage, "small.yaml")
    with open(path, "w") as f:
        f.write(SWEEP.replace("SAMPLES", str(samples)).replace("CONCURRENT", str(concurrent)) + f"storage_path: {storage}\n")
    cfg = load_sweep(path)
    cfg = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, coordinated=shared))
    cpu, start = _cpu_s(), time.perf_counter()
    summary = run_sweep(cfg, verbose=0)
    return {"shared": shared, "wall_s": round(time.perf_counter() - start, 1), "cpu_s": round(_cpu_s() - cpu, 1),
            "failed": [t["trial"] for t in summary["trials"] if t.get("status") != "TERMINATED"],
            "pools": {n[:12]: {"actors": p.get("prep_actors"), "growth": p.get("growth")}
                      for n, p in summary.get("pools", {}).items()}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--samples", type=int, default=2, help="trials of the group (num_samples)")
    parser.add_argument("--concurrent", type=int, default=2, help="trials at a time (max_concurrent_trials)")
    parser.add_argument("--one", choices=["shared", "unshared"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        with tempfile.TemporaryDirectory() as storage:
            print(json.dumps(one(args.one == "shared", storage, args.samples, args.concurrent)), flush=True)
        return
    for _ in range(args.rounds):
        for kind in ("shared", "unshared"):
            subprocess.run([sys.executable, __file__, "--one", kind, "--samples", str(args.samples),
                            "--concurrent", str(args.concurrent)], check=True)


if __name__ == "__main__":
    main()
