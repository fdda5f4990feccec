"""4 trials at ``cpu: 0.5`` on a 2-core machine, a cheap pipeline, trials that wait on their steps.

Each trial reads ``builtin:shapes`` at 32 px (``--dataset``, ``--size``: ``builtin:photos`` at 224 px
is an expensive one) in batches of 16 and sleeps ``--step-ms`` per batch (an accelerator's step: the
trial waits on it, not on the CPU). 4 trials may run at once. A pool that
holds its actor's 0.5 CPU leaves room for 3; one that gives its CPUs back while its preparation runs
ahead lets Tune start the fourth. Each run is a fresh process with its own Ray instance (2 CPUs).
Run from the repository root: ``PYTHONPATH=. .venv/bin/python docs/scripts/lending_sweep.py --rounds 2``;
to compare two commits, run it in a worktree of each, alternately. Prints one line per run: wall
time (``tune.run`` with the searcher's start and close, Ray's start apart), the most trials that
ran at once, and the pool's decisions.
"""

import argparse
import json
import subprocess
import sys
import time


def _stepping(config: dict) -> None:
    from ray import tune

    from coordinated_prep import train_loader

    began = time.time()
    loader = train_loader(config, batch_size=16, epochs=config["epochs"])
    for _ in range(config["epochs"]):
        for _batch in loader:
            time.sleep(config["step_s"])
    tune.report({"began": began, "ended": time.time()})


def one(step_ms: float, epochs: int, dataset: str, size: int) -> dict:
    """One sweep in this process, on a Ray instance of its own."""
    import ray
    from ray import tune

    from coordinated_prep import CoordinatedSearcher, DataSpec

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    spec = DataSpec(dataset=dataset, pipeline={"size": size}, seed=0)
    start = time.perf_counter()
    searcher = CoordinatedSearcher(max_concurrent=4)
    analysis = tune.run(tune.with_resources(_stepping, {"cpu": 0.5}), search_alg=searcher, verbose=0,
                        config={"data": spec, "epochs": epochs, "step_s": step_ms / 1000, "i": tune.grid_search([0, 1, 2, 3])})
    pools = searcher.pool_reports()
    searcher.close()
    wall = time.perf_counter() - start
    spans = [(t.last_result["began"], t.last_result["ended"]) for t in analysis.trials]
    at_once = max(sum(b <= t < e for b, e in spans) for t, _ in spans)
    growth = [p.get("growth") or {} for p in pools.values()]
    return {"wall_s": round(wall, 1), "most_at_once": at_once,
            "trials_s": [round(e - b, 1) for b, e in spans],
            "decisions": [d[:2] for g in growth for d in g.get("decisions", [])]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--step-ms", type=float, default=40.0)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--dataset", default="builtin:shapes", help="an expensive one: builtin:photos")
    parser.add_argument("--size", type=int, default=32, help="crop size (224 for builtin:photos)")
    parser.add_argument("--one", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        sys.stdout.write(json.dumps(one(args.step_ms, args.epochs, args.dataset, args.size)) + "\n")
        return
    for r in range(args.rounds):
        done = subprocess.run([sys.executable, __file__, "--one", "--step-ms", str(args.step_ms), "--epochs",
                               str(args.epochs), "--dataset", args.dataset, "--size", str(args.size)],
                              capture_output=True, text=True, check=True)
        sys.stdout.write(f"round {r + 1}: {done.stdout.strip().splitlines()[-1]}\n")


if __name__ == "__main__":
    main()
