"""The loader outside a sweep against a ``DataLoader`` with the same workers and the same transform.

``python -m coordinated_prep.bench.standalone --workers 2`` reads one epoch of ``builtin:photos``'
training split through a ``transforms.v2`` pipeline (224 px random resized crop, flip, colour jitter)
both ways, one after the other in one process, and writes a table: seconds to the first batch,
seconds for the epoch (start-up included), and samples per second after the first batch.
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any, Iterable

import numpy as np


def photos_transform(size: int = 224) -> Any:
    """The benchmarks' user pipeline: random resized crop, flip and colour jitter, kept uint8."""
    from torchvision.transforms import v2

    return v2.Compose([v2.RandomResizedCrop(size, antialias=True), v2.RandomHorizontalFlip(),
                       v2.ColorJitter(0.4, 0.4, 0.4)])


def _timed(batches: Iterable[Any]) -> dict[str, float]:
    t0 = time.perf_counter()
    first = None
    samples = 0
    for batch in batches:
        images = batch[0]
        samples += len(images)
        if first is None:
            first = time.perf_counter() - t0
            samples_after = -len(images)
    total = time.perf_counter() - t0
    steady = (samples + samples_after) / max(total - (first or 0.0), 1e-9)
    return {"first_batch_s": first or 0.0, "epoch_s": total, "samples": samples, "steady_samples_per_s": steady}


def compare(dataset: str = "builtin:photos", workers: int = 2, batch_size: int = 64, size: int = 224,
            limit: int | None = None) -> dict[str, dict[str, float]]:
    """One epoch each: ``train_loader`` (coordinated=False, ``workers`` processes) and a ``DataLoader``.

    Args:
        dataset: A built-in or ImageFolder dataset.
        workers: Worker processes of both.
        batch_size: Samples per batch.
        size: The crop's side.
        limit: Read only the first ``limit`` samples of the split (both loaders alike); None: all.
    """
    import torch
    from torch.utils.data import DataLoader, Subset

    from coordinated_prep import DataSpec, train_loader
    from coordinated_prep.pipeline.datasets import EncodedImages
    from coordinated_prep.pipeline.sources import open_source
    from coordinated_prep.plan import holdout_split

    transform = photos_transform(size)
    source = open_source(dataset)
    train, _ = holdout_split(len(source), 0.1)
    if limit is not None:
        train = np.sort(train)[:limit]

    class Decoded(torch.utils.data.Dataset):
        def __init__(self) -> None:
            self.images = EncodedImages(source)

        def __len__(self) -> int:
            return len(source)

        def __getitem__(self, i: int) -> Any:
            image, label = self.images[i]
            return transform(image), label

    baseline = DataLoader(Subset(Decoded(), train.tolist()), batch_size=batch_size, shuffle=True, num_workers=workers)
    results = {"dataloader": _timed(baseline)}
    spec = DataSpec(dataset=dataset, transform=transform, coordinated=False, holdout=0.1)
    loader = train_loader(spec, batch_size, epochs=1, num_workers=workers)
    if limit is not None:
        loader_batches = _limited(loader, len(train))
    else:
        loader_batches = iter(loader)
    results["train_loader"] = _timed(loader_batches)
    loader.close()
    return results


def _limited(loader: Any, samples: int) -> Iterable[Any]:
    seen = 0
    for batch in loader:
        if seen >= samples:
            break
        seen += len(batch)
        yield batch


def main(argv: list[str] | None = None) -> int:
    """Run :func:`compare` and write its table to stdout."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dataset", default="builtin:photos")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--size", type=int, default=224)
    parser.add_argument("--limit", type=int, default=None)
    args = parser.parse_args(argv)
    results = compare(args.dataset, args.workers, args.batch_size, args.size, args.limit)
    sys.stdout.write(f"{'loader':<14}{'first batch s':>14}{'epoch s':>10}{'samples':>9}{'steady samples/s':>18}\n")
    for name, r in results.items():
        sys.stdout.write(f"{name:<14}{r['first_batch_s']:>14.2f}{r['epoch_s']:>10.2f}{r['samples']:>9.0f}"
                         f"{r['steady_samples_per_s']:>18.1f}\n")
    ratio = results["train_loader"]["steady_samples_per_s"] / results["dataloader"]["steady_samples_per_s"]
    sys.stdout.write(f"train_loader / DataLoader, steady: {ratio:.2f}x\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
