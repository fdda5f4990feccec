"""The benchmark's Tune trainable: one trial reading with one of the four loaders.

The independent loaders are what a user would write without this library: a
``torch.utils.data.DataLoader`` over the files with the torchvision transforms, or a DALI
pipeline with its own file reader and random crop. Both apply the same augmentation (random
resized crop to ``size``, horizontal flip) to the same JPEGs as the coordinated loaders. On the
Parquet copy of the dataset the DataLoader reads through the same ``ParquetSource`` as the
coordinated loaders (its forked workers open their own shard handles); DALI's file reader has no
Parquet counterpart, so per-trial DALI runs on the raw files only. With a user transform (a
factory in the spec), the DataLoader's dataset decodes each image as the coordinated loader does
(:class:`~coordinated_prep.pipeline.datasets.EncodedImages`) and applies the same factory's transform.
"""

from __future__ import annotations

import math
import resource
import time
from typing import Any, Callable, Iterator, Mapping

import numpy as np
import torch

from coordinated_prep.pipeline.backends import make_preprocessor
from coordinated_prep.pipeline.datasets import EncodedImages, build
from coordinated_prep.plan import holdout_split
from coordinated_prep.pipeline.sources import open_source
from coordinated_prep.spec import DataSpec
from coordinated_prep.trial.timing import Timing, timed


def bench_trial(config: Mapping[str, Any]) -> None:
    """Read ``epochs`` epochs with ``config["loader"]``, run ``config["step"]`` per batch, report once.

    Reports the samples read after the first batch and the wall-clock window they took
    (``t_first``, ``t_end``: the aggregate rate leaves out every loader's start-up alike, which is
    reported on its own as ``startup_s``, loader creation to first batch), the seconds waiting for
    data and computing, the CPU seconds the trial's own preparation took (DataLoader workers, or
    DALI threads in this process), and what reading cost the trial's own process per batch
    (``trial_cpu_ms_per_batch``, with a simulated step; for a coordinated loader also the share
    of batches copied rather than viewed, and the loader's own CPU per batch).
    """
    from ray import tune

    torch.set_num_threads(1)
    spec: DataSpec = config["data"]
    kind, epochs, batch = config["loader"], int(config["epochs"]), int(config["batch_size"])
    step = _step(config, len(open_source(spec.dataset).classes))
    limit = int(config.get("max_batches") or 0)
    cpu0, children0 = time.process_time(), _children_cpu()
    timing = Timing()  # data wait after the first batch; compute and batches (steps) of every batch
    t_created = time.time()
    loader = _loader(kind, config, spec, batch, epochs)
    t_first, samples, read = _read(loader, epochs, limit, step, timing)
    t_end = time.time()
    private_prep_cpu = _private_prep_cpu(kind, config, cpu0, children0)
    trial_cpu = time.process_time() - cpu0  # this process, all its threads (Ray's too); not its workers
    batches = getattr(getattr(loader, "loader", None), "stats", None)  # a coordinated loader's own counters
    if hasattr(loader, "close"):
        loader.close()
    simulated, steps = config["step"] == "simulated", timing.steps
    tune.report({"samples": samples, "samples_read": read, "t_created": t_created, "t_first": t_first or t_end,
                 "t_end": t_end, "startup_s": (t_first or t_end) - t_created, "data_wait_s": timing.wait,
                 "compute_s": timing.compute, "stall_fraction": timing.stall_fraction,
                 "private_prep_cpu_s": private_prep_cpu, "batches": steps,
                 "trial_cpu_ms_per_batch": 1000 * trial_cpu / max(steps, 1) if simulated else None,
                 "copied_fraction": batches.copied_fraction if batches is not None else None,
                 "loader_cpu_ms_per_batch": batches.cpu_ms_per_batch if batches is not None else None})


def _read(loader: Any, epochs: int, limit: int, step: Callable[[Any, Any], None],
          timing: Timing) -> tuple[float | None, int, int]:
    """Read ``epochs`` timed passes over ``loader`` (``limit`` batches each at most; 0: all), ``step``
    per batch. Returns when the first batch came in (None: none did), the samples read after it and
    all samples read. ``timing`` leaves out the wait for the first batch: start-up, reported apart."""
    t_first, samples, read = None, 0, 0
    for _ in range(epochs):
        # timed() drops its iterator when the pass ends: a DataLoader's cut short by the limit shuts
        # its workers down (and waits for them) there, before the next epoch's start.
        for images, labels in timed(loader, timing, limit):
            read += len(labels)
            if t_first is None:  # steady state starts once the first batch is in
                t_first, timing.wait = time.time(), 0.0
            else:
                samples += len(labels)
            step(images, labels)
    return t_first, samples, read


def _private_prep_cpu(kind: str, config: Mapping[str, Any], cpu0: float, children0: float) -> float | None:
    """The CPU seconds the trial's own preparation took since ``cpu0`` / ``children0``."""
    if kind == "dataloader":
        return _children_cpu() - children0  # the workers have exited: their CPU is counted
    if kind == "dali":
        # DALI's threads share this process with the step: its CPU is DALI's only when the step
        # sleeps; beside a CNN on the CPU it cannot be told apart.
        return time.process_time() - cpu0 if config["step"] == "simulated" else None
    return 0.0


def launch_trial(config: Mapping[str, Any]) -> None:
    """Read nothing: report when Tune started this trial's function.

    It lives in this module, so its process imports what :func:`bench_trial`'s does (torch, the
    backends, this package): N of these measure what Tune's launch of N trials costs before any
    loader is created, the floor under every loader's time with start-up.
    """
    from ray import tune

    tune.report({"t_started": time.time()})


def _children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def _step(config: Mapping[str, Any], num_classes: int) -> Callable[[Any, Any], None]:
    if config["step"] == "simulated":
        seconds = float(config["step_ms"]) / 1000

        def simulated(images: torch.Tensor, labels: torch.Tensor) -> None:
            time.sleep(seconds)  # an accelerator step: the CPU is free meanwhile

        return simulated
    from trainables import MODELS
    from trainables.common import train_step
    from trainables.training import setup

    width = int(config.get("width", 8))
    trainer = setup({"lr": 0.05}, lambda device: MODELS["small_cnn"](num_classes, {"width": width}),
                    torch.device("cpu"))  # seed 0, one thread, as every trainable's preamble
    loss_fn = torch.nn.CrossEntropyLoss()
    return lambda images, labels: train_step(trainer.model, trainer.optimizer, loss_fn, images, labels,
                                             trainer.device)


def _loader(kind: str, config: Mapping[str, Any], spec: DataSpec, batch: int, epochs: int) -> Any:
    workers = int(config["workers"])
    if kind.startswith("coordinated"):
        from coordinated_prep.trial.loader import train_loader

        return _Pairs(train_loader(config, batch, epochs=epochs))
    source = open_source(spec.dataset)
    train_ids, _ = holdout_split(len(source), spec.holdout)
    if kind == "dataloader":
        if spec.transform is not None:  # the user pipeline, built from the same factory as the prep actors'
            dataset: Any = _Transformed(EncodedImages(source), build(spec.transform), train_ids)
        else:
            dataset = _FileDataset(source, make_preprocessor(spec.pipeline), train_ids, spec.seed)  # type: ignore[arg-type]
        generator = torch.Generator().manual_seed(int(config.get("trial_index", 0)))
        return torch.utils.data.DataLoader(dataset, batch_size=batch, shuffle=True, num_workers=workers,
                                           generator=generator, persistent_workers=False)
    return _DaliReader(source, train_ids, spec, batch, workers, int(config.get("trial_index", 0)))


class _Pairs:
    """A coordinated TrainLoader yielding (images, labels) like the others."""

    def __init__(self, loader: Any) -> None:
        self.loader = loader

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        for b in self.loader:
            yield b.images, b.labels

    def close(self) -> None:
        self.loader.close()


class _FileDataset(torch.utils.data.Dataset):
    """Map-style dataset: read the file, decode and augment with the torchvision backend."""

    def __init__(self, source: Any, preprocessor: Any, ids: np.ndarray, seed: int) -> None:
        self.source, self.preprocessor, self.ids, self.seed = source, preprocessor, ids, seed
        self.epoch = 0

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, k: int) -> tuple[torch.Tensor, int]:
        i = int(self.ids[k])
        return torch.from_numpy(self.preprocessor.train(self.source.read(i), self.seed, 0, i)), int(self.source.labels[i])


class _Transformed(torch.utils.data.Dataset):
    """Map-style dataset as a user writes one: read and decode the image, apply the transform.

    The transform draws from each DataLoader worker's own seeded generator (no per-sample
    reseeding: what a user's loop does, and no cost the coordinated loader's seeding adds).
    """

    def __init__(self, images: EncodedImages, transform: Any, ids: np.ndarray) -> None:
        self.images, self.transform, self.ids = images, transform, ids

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, k: int) -> tuple[Any, int]:
        image, label = self.images[int(self.ids[k])]
        return self.transform(image), label


class _DaliReader:
    """A DALI pipeline as its documentation writes one: file reader, random-crop decoder, resize, flip."""

    def __init__(self, source: Any, ids: np.ndarray, spec: DataSpec, batch: int, threads: int, seed: int) -> None:
        from coordinated_prep.pipeline.backends.dali_backend import import_dali

        fn, types, pipeline_def = import_dali()
        p = spec.pipeline
        files = [source.paths[int(i)] for i in ids]
        labels = [int(source.labels[int(i)]) for i in ids]
        self.samples = len(files)
        self.batch = batch

        @pipeline_def(batch_size=batch, num_threads=threads, device_id=None, seed=seed + 1, prefetch_queue_depth=2)
        def reader() -> Any:
            jpegs, label = fn.readers.file(files=files, labels=labels, random_shuffle=True, name="reader")
            images = fn.decoders.image_random_crop(jpegs, device="cpu", output_type=types.RGB,
                                                   random_area=list(p.scale), random_aspect_ratio=list(p.ratio))
            images = fn.resize(images, resize_x=p.size, resize_y=p.size, interp_type=types.INTERP_LINEAR,
                               antialias=True)
            images = fn.crop_mirror_normalize(images, dtype=types.UINT8, output_layout="CHW",
                                              mirror=fn.random.coin_flip(probability=p.hflip))
            return images, label

        self.pipe = reader()
        self.pipe.build()

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        left = self.samples
        for _ in range(math.ceil(self.samples / self.batch)):
            images, labels = self.pipe.run()
            n = min(self.batch, left)
            left -= n
            yield (torch.from_numpy(images.as_array()[:n]),
                   torch.from_numpy(labels.as_array()[:n].reshape(-1).astype(np.int64)))
