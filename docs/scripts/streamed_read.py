"""A Hugging Face dataset streamed by shard against the same dataset map-style (docs/benchmarks.md).

The 4,096 photographs of ``builtin:photos`` as JPEG bytes with labels, in a ``datasets.Dataset``
(map-style) and as its ``to_iterable_dataset(num_shards=16)``. Per round, for each: the first read
(the streamed one spills every shard to the node's disk: ``coordinated_prep/pipeline/streamed.py``),
every training sample read once by shuffled index, and one unshared epoch of ``train_loader`` with 2
workers (decode and a 224 px random crop and flip). The cache is fresh per round.

    PYTHONPATH=. .venv/bin/python docs/scripts/streamed_read.py --rounds 2
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time

import numpy as np
import torch
from torchvision.io import decode_jpeg
from torchvision.transforms import v2


class Photo:
    """A Hugging Face sample (a dict with JPEG bytes and a label) to a decoded, cropped pair."""

    def __init__(self) -> None:
        self.crop = v2.Compose([v2.RandomResizedCrop(224, antialias=True), v2.RandomHorizontalFlip()])

    def __call__(self, sample):
        data = torch.frombuffer(bytearray(sample["jpeg"]), dtype=torch.uint8)
        return self.crop(decode_jpeg(data)), sample["label"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    os.environ["COORDPREP_CACHE"] = cache = tempfile.mkdtemp(prefix="streamed-bench-")
    import datasets

    from coordinated_prep import DataSpec, train_loader
    from coordinated_prep.pipeline.sources import open_source

    source = open_source("builtin:photos")
    table = datasets.Dataset.from_dict({"jpeg": [source.read(i) for i in range(len(source))],
                                        "label": source.labels.tolist()})
    for r in range(args.rounds):
        shutil.rmtree(os.path.join(cache, "shards"), ignore_errors=True)
        for name, dataset in (("map-style", table), ("streamed, 16 shards", table.to_iterable_dataset(num_shards=16))):
            spec = DataSpec(dataset=dataset, transform=Photo(), seed=r, coordinated=False)
            t = time.perf_counter()
            n = len(spec.dataset)
            first = time.perf_counter() - t
            order = np.random.default_rng(r).permutation(n)
            t = time.perf_counter()
            for i in order:
                spec.dataset[int(i)]
            reads = n / (time.perf_counter() - t)
            t = time.perf_counter()
            samples = sum(len(b) for b in train_loader(spec, 64, epochs=1, num_workers=2))
            epoch = samples / (time.perf_counter() - t)
            print(f"round {r + 1} {name}: first read {first:.2f} s, {reads:,.0f} samples/s read by index, "
                  f"{epoch:,.0f} samples/s in an unshared epoch ({samples} samples)", flush=True)
    shutil.rmtree(cache, ignore_errors=True)


if __name__ == "__main__":
    main()
