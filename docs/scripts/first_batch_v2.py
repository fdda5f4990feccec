"""Time from a sweep's start to each trial's first batch, for a ``transforms.v2`` pipeline.

Three data groups (three crop scales), one trial each, all at once, on a cold prep pool, twice in one
Ray instance. Run from the repository root: ``PYTHONPATH=. .venv/bin/python docs/scripts/first_batch_v2.py``.
Prints one JSON line per sweep.
"""

import json
import os
import tempfile
import time

import ray
from ray import tune
from torchvision.transforms import v2

from coordinated_prep import CoordinatedSearcher, DataSpec, train_loader
from tests.utils import make_imagefolder


def trial(config: dict) -> None:
    loader = iter(train_loader(config, batch_size=16, epochs=1))
    next(loader)
    first = time.time() - config["t0"]
    for _ in loader:
        pass
    tune.report({"first": first})


def main() -> None:
    root = make_imagefolder(os.path.join(tempfile.mkdtemp(), "data"), classes=3, per_class=60)
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"PYTHONPATH": os.getcwd()}})
    specs = [DataSpec(dataset=root, seed=1, chunk_size=16,
                      transform=v2.Compose([v2.Resize(32, antialias=True), v2.RandomResizedCrop(24, scale=(s, 1.0))]))
             for s in (0.2, 0.5, 0.8)]
    for rep in range(2):
        searcher = CoordinatedSearcher()
        t0 = time.time()
        analysis = tune.run(tune.with_resources(trial, {"cpu": 0.1}), config={"data": tune.grid_search(specs), "t0": t0},
                            search_alg=searcher, verbose=0)
        searcher.close()
        firsts = sorted(round(t.last_result["first"], 1) for t in analysis.trials)
        print(json.dumps({"sweep": rep, "first_batch_s": firsts, "total_s": round(time.time() - t0, 1)}))


if __name__ == "__main__":
    main()
