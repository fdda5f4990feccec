"""5-fold cross-validation of 2 configs: one shared group, a group per fold, and unshared trials.

The small CNN on ``builtin:shapes`` at 64 px (as ``experiments/cv.yaml``): 5 folds x 2 learning rates,
10 trials of 2 epochs, 4 at a time (``cpu: 0.25``, ``reuse_actors``). Three kinds, each in a fresh
process with its own Ray instance, alternated:

- ``shared``: ``DataSpec(fold=(5, i))``; the fold is not in the group key, so the 10 trials are one group;
- ``groups``: the same specs with ``lookahead=8 + i``, which puts each fold in a group of its own
  without changing a byte (what a fold in the group key would give: each group prepares the whole
  split for its fold's 2 trials);
- ``unshared``: ``coordinated=False``: each trial prepares its own 4 folds.

Run from the repository root: ``PYTHONPATH=. .venv/bin/python docs/scripts/cv_sweep.py --rounds 2``.
Prints one line per run: wall time (the Tuner's fit, the prep pool's start included; Ray's start
apart), the machine's CPU seconds meanwhile (``/proc/stat``), the samples prepared (the groups'
reports; unshared: each trial's part per epoch, which the tests show it prepares exactly) and the
samples the trials trained on.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

EPOCHS, FOLDS, LRS = 2, 5, (0.02, 0.05)


def _cpu_s() -> float:
    with open("/proc/stat") as f:
        ticks = [int(v) for v in f.readline().split()[1:]]
    return (sum(ticks) - ticks[3] - ticks[4]) / os.sysconf("SC_CLK_TCK")


def one(kind: str, storage: str) -> dict:
    """One sweep of ``kind`` in this process: wall time, the machine's CPU time, samples prepared and read."""
    import ray
    from ray import tune

    from coordinated_prep import CoordinatedSearcher, DataSpec
    from coordinated_prep.pipeline.part import part_ids
    from coordinated_prep.pipeline.sources import open_source
    from trainables import REGISTRY

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    base = dict(dataset="builtin:shapes", seed=0, holdout=0.0, pipeline={"size": 64, "scale": [0.35, 1.0], "hflip": 0.5})
    extra = {"shared": lambda i: {}, "groups": lambda i: {"lookahead": 8 + i},
             "unshared": lambda i: {"coordinated": False}}[kind]
    specs = [DataSpec(**base, fold=(FOLDS, i), **extra(i)) for i in range(FOLDS)]
    searcher = CoordinatedSearcher(max_concurrent=4)
    tuner = tune.Tuner(
        tune.with_resources(REGISTRY["small_cnn"], {"cpu": 0.25}),
        param_space={"data": tune.grid_search(specs), "lr": tune.grid_search(list(LRS)), "batch_size": 32,
                     "width": 8, "epochs": EPOCHS},
        tune_config=tune.TuneConfig(search_alg=searcher, metric="accuracy", mode="max", reuse_actors=True),
        run_config=tune.RunConfig(storage_path=storage, verbose=0))
    cpu, start = _cpu_s(), time.perf_counter()
    results = tuner.fit()
    wall, cpu = time.perf_counter() - start, _cpu_s() - cpu
    reports = searcher.group_reports() if kind != "unshared" else {}
    searcher.close()
    n = len(open_source("builtin:shapes"))
    read = sum(EPOCHS * len(part_ids(s, n)) for s in specs) * len(LRS)
    prepared = sum(g["samples_prepared"] for g in reports.values()) if reports else read
    return {"kind": kind, "wall_s": round(wall, 1), "cpu_s": round(cpu, 1), "groups": len(reports),
            "samples_prepared": prepared, "samples_read": read, "errors": len(results.errors),
            "best_accuracy": round(results.get_best_result().metrics["accuracy"], 4)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--one", choices=["shared", "groups", "unshared"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        with tempfile.TemporaryDirectory() as storage:
            print(json.dumps(one(args.one, storage)), flush=True)
        return
    for _ in range(args.rounds):
        for kind in ("shared", "groups", "unshared"):
            subprocess.run([sys.executable, __file__, "--one", kind], check=True)


if __name__ == "__main__":
    main()
