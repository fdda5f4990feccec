"""CPU per sample of a user pipeline's preparation, and per batch of cutting prepared pieces.

``python -m coordinated_prep.bench.samples [--rounds 3]`` prepares 4 pieces of 256 CIFAR-style
samples through ``trainables.data.cifar:train_transform`` (:func:`~coordinated_prep.pipeline.chunk.prepare_chunk`,
one torch thread, as a prep actor), then cuts them into batches of 32 twenty times, and prints one
JSON line: the medians over the rounds of the preparation's CPU milliseconds per sample and of the
CPU microseconds per batch. To compare with an earlier tree, run the same module from that tree's
checkout (``cd /tmp/before && PYTHONPATH=. python -m coordinated_prep.bench.samples``), alternating
the trees in one session. Run from the repository root (the factories are importable from there).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m coordinated_prep.bench.samples", description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args(argv)
    import torch

    from coordinated_prep import DataSpec
    from coordinated_prep.pipeline import Factory
    from coordinated_prep.pipeline.chunk import prepare_chunk
    from coordinated_prep.pipeline.probe import probe, train_indices
    from coordinated_prep.pipeline.transforms import make_pipeline
    from coordinated_prep.trial.batching import batched

    torch.set_num_threads(1)
    spec = DataSpec(dataset=Factory("trainables.data.cifar:make", {"n": 2048}),
                    transform=Factory("trainables.data.cifar:train_transform"), seed=0, coordinated=False, holdout=0.0)
    pipeline = make_pipeline(spec)
    ids = train_indices(len(pipeline), 0.0)
    layout = probe(pipeline, 0, ids, ()).layout
    prep, cut = [], []
    for r in range(args.rounds):
        c0 = time.process_time()
        pieces = [prepare_chunk(pipeline, layout, 0, r, ids[i : i + 256])[0] for i in range(0, 1024, 256)]
        c1 = time.process_time()
        n = sum(1 for _ in range(20) for _ in batched(iter(pieces), 32))
        c2 = time.process_time()
        prep.append(1000 * (c1 - c0) / 1024)
        cut.append(1e6 * (c2 - c1) / n)
    sys.stdout.write(json.dumps({"prep_ms_per_sample": round(statistics.median(prep), 3),
                                 "cut_us_per_batch": round(statistics.median(cut), 1)}) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
