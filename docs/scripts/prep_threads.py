"""The built-in pipeline on 1, 2 and 3 threads of one process: how much of a second core a second
thread gets (torchvision's decode and resize release the GIL). Measures what a prep actor with two
preparation threads could do instead of a second actor, which imports torch and torchvision again
(about 3 CPU-seconds on the 2-core machine). Run from the repository root:
``PYTHONPATH=. .venv/bin/python docs/scripts/prep_threads.py --rounds 2``.
"""

import argparse
import threading
import time


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--samples", type=int, default=512)
    args = parser.parse_args()
    import torch

    from coordinated_prep.pipeline.backends.torchvision_backend import TorchvisionPreprocessor
    from coordinated_prep.pipeline.sources import open_source
    from coordinated_prep.spec import PipelineSpec

    torch.set_num_threads(1)  # as in a prep actor: one intra-op thread per preparing thread
    source = open_source("builtin:photos")
    pre = TorchvisionPreprocessor(PipelineSpec(size=224))  # decode, 224 px random resized crop, flip
    n = args.samples
    blobs = [source.read(i) for i in range(n)]

    def work(lo: int, hi: int) -> None:
        for i in range(lo, hi):
            pre.train(blobs[i], 0, 0, i)

    work(0, 32)  # warm
    for r in range(args.rounds):
        for threads in (1, 2, 3):
            parts = [threading.Thread(target=work, args=(k * n // threads, (k + 1) * n // threads))
                     for k in range(threads)]
            started = time.perf_counter()
            for t in parts:
                t.start()
            for t in parts:
                t.join()
            wall = time.perf_counter() - started
            if threads == 1:
                alone = wall
            print(f"round {r + 1}, {threads} thread(s): {n / wall:,.0f} samples/s, {alone / wall:.2f}x one thread",
                  flush=True)


if __name__ == "__main__":
    main()
