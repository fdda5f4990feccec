"""Ray Train V1 (``RAY_TRAIN_V2_ENABLED=0``): ``Tuner(TorchTrainer)``, whose trial is the Train run.

Run as ``python -m tests.train_v1 OUT ADDRESS`` (the flag must be set before Ray Train is imported,
so in a process of its own), a driver of the running Ray instance at ``ADDRESS`` (the tests' shared
one); each rank saves its fresh sample indices per epoch to ``OUT``, and the group reports go to
``OUT/reports.json``.
"""

from __future__ import annotations

import json
import os
import sys

os.environ["RAY_TRAIN_V2_ENABLED"] = "0"

import numpy as np  # noqa: E402
import ray  # noqa: E402


def per_worker(config: dict) -> None:
    import ray.train

    from coordinated_prep import train_loader

    rank = ray.train.get_context().get_world_rank()
    loader = train_loader(config, batch_size=8, epochs=2)
    for epoch in range(2):
        fresh = np.concatenate([b.indices[b.repeats == 0].numpy() for b in loader])
        np.save(os.path.join(config["out"], f"{loader.trial}-rank{rank}-epoch{epoch}.npy"), fresh)
        ray.train.report({"epoch": epoch + 1})


def main(out: str, address: str) -> None:
    from ray import tune
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    from coordinated_prep import CoordinatedSearcher, DataSpec, PoolSpec
    from tests.conftest import REPO
    from tests.utils import make_imagefolder

    root = make_imagefolder(os.path.join(out, "data"), classes=3, per_class=20)
    ray.init(address=address, log_to_driver=False,  # this driver's job: its workers read Train V1's flag
             runtime_env={"env_vars": {"RAY_TRAIN_V2_ENABLED": "0", "PYTHONPATH": REPO}})
    spec = DataSpec(dataset=root, pipeline={"size": 24}, chunk_size=8, holdout=0.2)
    trainer = TorchTrainer(per_worker, scaling_config=ScalingConfig(num_workers=2, resources_per_worker={"CPU": 0.2}),
                           run_config=RunConfig(storage_path=os.path.join(out, "storage")))
    searcher = CoordinatedSearcher(pool=PoolSpec(actors=1, cpus=0.5))
    results = tune.Tuner(trainer, param_space={"train_loop_config": {"data": spec, "out": out}},
                         tune_config=tune.TuneConfig(search_alg=searcher, num_samples=1)).fit()
    reports = searcher.group_reports()
    searcher.close()
    with open(os.path.join(out, "reports.json"), "w") as f:
        json.dump({"errors": [str(e) for e in results.errors], "groups": reports}, f, default=str)
    ray.shutdown()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
