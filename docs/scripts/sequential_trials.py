"""Three trials of one data group (batch sizes 8, 12 and 7, 2 epochs, 180 images at 32 px), run one
at a time and then two at a time (``reuse_actors``, a kept pool): the wall time of each ``tune.run``,
how many coordinators the group had, and the samples it prepared for those it served.

Where trials do not overlap, the registry keeps a group whose searcher still holds trials of it
(``coordinated_prep/stream/linger.py``) instead of starting it again for each. Run from the
repository root: ``PYTHONPATH=. .venv/bin/python docs/scripts/sequential_trials.py``; to compare
two commits, run it in a worktree of each, one after the other. Prints one JSON line per run.
"""

import argparse
import json
import os
import tempfile
import time

import ray
from ray import tune

from coordinated_prep import CoordinatedSearcher, DataSpec, PoolSpec
from tests.recording import record
from tests.utils import make_imagefolder


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--at-once", type=int, nargs="+", default=[1, 2], help="trials at a time, one run each")
    args = parser.parse_args()
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"PYTHONPATH": os.environ.get("PYTHONPATH", "")}})
    dataset = make_imagefolder(tempfile.mkdtemp(), classes=3, per_class=60)
    spec = DataSpec(dataset=dataset, pipeline={"size": 32}, seed=5, chunk_size=8, segments=4, lookahead=2)
    for at_once in args.at_once:
        searcher = CoordinatedSearcher(max_concurrent=at_once, pool=PoolSpec(keep_warm=True))
        start = time.time()
        tune.run(tune.with_resources(record, {"cpu": 0.25}), search_alg=searcher, verbose=0, reuse_actors=True,
                 config={"data": spec, "batch_size": tune.grid_search([8, 12, 7]), "epochs": 2,
                         "out": tempfile.mkdtemp()})
        wall = time.time() - start
        [report] = searcher.group_reports().values()
        searcher.close()
        print(json.dumps({"at_once": at_once, "wall_s": round(wall, 1), "coordinators": report["coordinators"],
                          "prepared": report["samples_prepared"], "served": report["samples_served"]}))


if __name__ == "__main__":
    main()
