"""Sweeps one after another on a prep pool kept warm (``PoolSpec(keep_warm=True)``), as a notebook or a
script of sweeps runs them: per sweep, when its trial entered the trainable, made its loader, had its
first batch and ended, and when ``tune.run`` returned and the searcher was closed (seconds from the
sweep's start).

One trial of one epoch of ``builtin:shapes`` at 32 px per sweep; the first sweep starts the pool.
Run from the repository root: ``PYTHONPATH=. .venv/bin/python docs/scripts/warm_sweeps.py --sweeps 5``.
To compare two commits, run it in a worktree of each, alternately. Prints one JSON line per sweep.
"""

import argparse
import json
import os
import tempfile
import time

import ray
from ray import tune

from coordinated_prep import CoordinatedSearcher, DataSpec, PoolSpec, train_loader


def trial(config: dict) -> None:
    entered = time.time()
    loader = iter(train_loader(config, batch_size=32, epochs=1))
    made = time.time()
    next(loader)
    first = time.time()
    for _ in loader:
        pass
    tune.report({"entered": entered, "loader": made, "first": first, "ended": time.time()})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sweeps", type=int, default=5)
    args = parser.parse_args()
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"PYTHONPATH": os.environ.get("PYTHONPATH", "")}})
    spec = DataSpec(dataset="builtin:shapes", pipeline={"size": 32}, chunk_size=32)
    with tempfile.TemporaryDirectory() as storage:
        for i in range(args.sweeps):
            start = time.time()
            searcher = CoordinatedSearcher(pool=PoolSpec(keep_warm=True))
            analysis = tune.run(tune.with_resources(trial, {"cpu": 0.25}), search_alg=searcher, verbose=0,
                                config={"data": spec, "sweep": i}, storage_path=storage)
            returned = time.time()
            searcher.close()
            result = analysis.trials[0].last_result
            times = {k: result[k] - start for k in ("entered", "loader", "first", "ended")}
            times.update(returned=returned - start, closed=time.time() - start)
            print(json.dumps({"sweep": i, **{k: round(v, 2) for k, v in times.items()}}), flush=True)


if __name__ == "__main__":
    main()
