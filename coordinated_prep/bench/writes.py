"""A trial's CPU per batch for a loop that writes into its batches and one that only reads them.

``python -m coordinated_prep.bench.writes [--before TREE]`` puts pieces of real-sized images (64
samples of 3 x 224 x 224, uint8: 9.6 MB, one batch of 64 each) in the object store, then reads them in
another Ray process (what a trial is) as the trial's stream does: fetch the piece, hold it as this
tree holds shared pieces, cut the batch. Per batch it runs one of:

- ``read``: ``images.float()`` (normalisation out of place; nothing written);
- ``write``: ``images.sub_(1)`` then ``.float()`` (the same normalisation in place);
- ``clone+write``: ``images.clone().sub_(1)`` then ``.float()`` (what a loop had to do while shared
  batches were read-only).

and reports the process CPU per batch (``time.process_time``, every thread of the process: the fetch,
the hold, the cut and the op), the median of ``--rounds`` rounds. With ``--before TREE`` (a checkout of
an earlier commit), the same loops run in a second process on that tree's code, side by side in the
same run and the same Ray instance; a tree whose shared batches are read-only skips ``write``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import numpy as np

LOOPS = ("read", "write", "clone+write")


def _measure(refs: list, loop: str, rounds: int) -> float | None:
    """Median CPU seconds per batch of ``loop`` over ``rounds`` passes over ``refs`` (in a Ray process)."""
    import ray
    import torch

    from coordinated_prep.trial.batching import batched

    torch.set_num_threads(1)
    hold = getattr(__import__("coordinated_prep.pipeline.chunk", fromlist=["PreparedChunk"]).PreparedChunk,
                   "guarded", None)
    if hold is None:  # a tree whose shared pieces are read-only
        if loop == "write":
            return None
        from coordinated_prep.readonly import protect

        def hold(piece):
            protect(piece.buffer)
            return piece
    per_batch = []
    for _ in range(rounds):
        cpu, batches = time.process_time(), 0
        for ref in refs:
            piece = hold(ray.get(ref))
            for batch in batched(iter([piece]), len(piece)):
                images = batch.images
                if loop == "write":
                    images.sub_(1)
                elif loop == "clone+write":
                    images = images.clone().sub_(1)
                images.float()
                batches += 1
            del piece, batch, images
        per_batch.append((time.process_time() - cpu) / batches)
    return statistics.median(per_batch)


def _run_here(pieces: int, rounds: int) -> dict[str, float | None]:
    import ray

    from coordinated_prep.pipeline.chunk import image_piece

    try:
        from coordinated_prep.pages import padded_empty
    except ImportError:  # a tree from before pages.py
        from coordinated_prep.readonly import padded_empty

    rng = np.random.default_rng(0)
    refs = []
    for p in range(pieces):
        images = padded_empty((64, 3, 224, 224))
        images[...] = rng.integers(0, 256, size=images.shape, dtype=np.uint8)
        ids = np.arange(p * 64, (p + 1) * 64)
        refs.append(ray.put(image_piece(images, ids % 10, ids, 0)))
    task = ray.remote(num_cpus=1)(_measure)
    return {loop: ray.get(task.remote(refs, loop, rounds), timeout=600) for loop in LOOPS}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pieces", type=int, default=16, help="pieces (batches) per round (default 16)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--before", help="a checkout of an earlier commit, measured side by side")
    parser.add_argument("--json", action="store_true", help="print one JSON object (used for --before)")
    args = parser.parse_args(argv)
    import ray

    joined = os.environ.get("COORDPREP_BENCH_ADDRESS")  # the --before run joins the first run's Ray
    start = {} if joined else dict(num_cpus=2, include_dashboard=False, object_store_memory=2 * 2**30)
    ray.init(address=joined or "local", log_to_driver=False, runtime_env={"env_vars": {"PYTHONPATH": os.getcwd()}},
             **start)
    try:
        trees = {"this tree": _run_here(args.pieces, args.rounds)}
        if args.before:
            address = ray.get_runtime_context().gcs_address
            env = dict(os.environ, PYTHONPATH=args.before, COORDPREP_BENCH_ADDRESS=address)
            # This file, on the earlier tree's package (PYTHONPATH comes before the installed tree).
            done = subprocess.run([sys.executable, os.path.abspath(__file__), "--json", "--pieces",
                                   str(args.pieces), "--rounds", str(args.rounds)], cwd=args.before, env=env,
                                  capture_output=True, text=True, timeout=1800, check=True)
            trees["before"] = json.loads(done.stdout.strip().splitlines()[-1])["this tree"]
    finally:
        ray.shutdown()
    if args.json:
        sys.stdout.write(json.dumps(trees) + "\n")
        return 0
    sys.stdout.write("CPU ms per batch of 64 x 3 x 224 x 224 (uint8), median of the rounds\n")
    sys.stdout.write(f"{'tree':<10} " + " ".join(f"{loop:>16}" for loop in LOOPS) + "\n")
    for tree, row in trees.items():
        cells = ["-" if row[loop] is None else f"{1000 * row[loop]:.2f}" for loop in LOOPS]
        sys.stdout.write(f"{tree:<10} " + " ".join(f"{c:>16}" for c in cells) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
