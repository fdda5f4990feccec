"""Datasets and transforms of the user's, outside a sweep: keys, seeding, errors, the standalone loader (no Ray)."""

from __future__ import annotations

import os
import re
import signal
import threading

import numpy as np
import pytest
import torch
from torchvision.transforms import v2

from coordinated_prep import ConfigError, DataSpec, SampleError, eval_loader, train_loader
from coordinated_prep.errors import PrepError, StructureError
from coordinated_prep.pipeline import ArrayDataset, Factory
from tests.harness import assert_exactly_once, batch_digests


def images(n: int = 96, size: int = 24, seed: int = 0) -> ArrayDataset:
    """``n`` random uint8 (size, size, 3) images with labels ``i % 10``: CIFAR-style arrays in memory."""
    rng = np.random.default_rng(seed)
    return ArrayDataset(rng.integers(0, 256, (n, size, size, 3), dtype=np.uint8), np.arange(n) % 10)


AUGMENT = v2.Compose([v2.ToImage(), v2.RandomResizedCrop(16, scale=(0.3, 1.0), antialias=True), v2.RandomHorizontalFlip(),
                      v2.ColorJitter(0.4, 0.4, 0.4), v2.RandAugment(), v2.ToDtype(torch.float32, scale=True),
                      v2.Normalize([0.5] * 3, [0.25] * 3)])


def _epochs(loader, epochs: int) -> list[dict]:
    out = []
    for _ in range(epochs):
        ids, digests = [], []
        for batch in loader:
            ids.append(batch.indices.numpy())
            digests.append(batch_digests(batch))
        out.append({"indices": np.concatenate(ids), "digests": np.concatenate(digests)})
    return out


def test_equal_datasets_and_transforms_make_one_group_key_and_others_another():
    a = DataSpec(dataset=images(), transform=AUGMENT)
    assert a.group_key == DataSpec(dataset=images(), transform=AUGMENT).group_key, "built alike: one group"
    assert a.group_key != DataSpec(dataset=images(seed=1), transform=AUGMENT).group_key
    assert a.group_key != DataSpec(dataset=images(), transform=v2.RandomHorizontalFlip()).group_key
    f = DataSpec(dataset=Factory("tests.test_datasets:images", {"n": 64}))
    assert f.group_key == DataSpec(dataset={"factory": "tests.test_datasets:images", "args": {"n": 64}}).group_key
    assert f.group_key != DataSpec(dataset=Factory("tests.test_datasets:images", {"n": 65})).group_key


def test_a_dataset_that_cannot_be_pickled_is_refused_with_the_fix():
    class Holding(ArrayDataset):
        lock = None

    held = Holding(np.zeros((4, 2)))
    held.lock = threading.Lock()
    with pytest.raises(ConfigError, match=r"data.dataset=.* cannot be pickled .*created lazily.*Factory"):
        DataSpec(dataset=held)


@pytest.mark.parametrize("workers", [0, 2])
def test_the_standalone_loader_serves_exact_epochs_with_the_bytes_of_any_worker_count(workers):
    spec = DataSpec(dataset=images(), transform=AUGMENT, holdout=0.25, chunk_size=16, coordinated=False)
    loader = train_loader(spec, 10, epochs=3, num_workers=workers)
    got = _epochs(loader, 3)
    if workers:  # the declared epochs read: no worker process prepares a fourth
        assert loader._stream._workers._it is None, "the workers outlived the declared epochs"
    train = sorted(set(range(96)) - set(_held_out(spec)))
    assert_exactly_once([e["indices"] for e in got], train)
    alone = _epochs(train_loader(spec, 10, epochs=3, num_workers=0), 3)
    for e, want in zip(got, alone):
        assert np.array_equal(e["indices"], want["indices"]) and np.array_equal(e["digests"], want["digests"])
    assert not np.array_equal(np.sort(got[0]["digests"]), np.sort(got[1]["digests"])), "each epoch draws anew"


def _held_out(spec: DataSpec) -> np.ndarray:
    from coordinated_prep.plan import holdout_split

    return holdout_split(96, spec.holdout)[1]


@pytest.mark.parametrize("workers", [0, 1])
def test_the_callers_random_state_is_left_as_it_was(workers):
    """Nor does starting worker processes draw from it (a DataLoader seeds its workers from torch's generator)."""
    torch.manual_seed(7)
    np.random.seed(7)
    want_t, want_n = torch.rand(3), np.random.rand(3)
    torch.manual_seed(7)
    np.random.seed(7)
    list(train_loader(DataSpec(dataset=images(), transform=AUGMENT, coordinated=False), 32, epochs=1,
                      num_workers=workers))
    assert torch.equal(torch.rand(3), want_t) and np.array_equal(np.random.rand(3), want_n)


class OwnGenerator:
    """A transform with a generator of its own, which no caller can seed."""

    def __init__(self) -> None:
        self.rng = np.random.default_rng()

    def __call__(self, x):
        return x + torch.as_tensor(self.rng.integers(0, 3, size=x.shape), dtype=x.dtype)


def test_a_transform_the_library_cannot_seed_is_refused_at_the_start():
    spec = DataSpec(dataset=images(), transform=v2.Compose([v2.ToImage(), OwnGenerator()]), coordinated=False)
    with pytest.raises(ConfigError, match=r"other values when prepared twice from the same seed.*its own "
                                          r"np.random.default_rng\(\).*global generators"):
        train_loader(spec, 8, num_workers=0)


class Flaky:
    """Sample 13's ``__getitem__`` raises."""

    def __len__(self) -> int:
        return 40

    def __getitem__(self, i: int):
        if i == 13:
            raise OSError("truncated record")
        return np.full(4, i, np.float32), i


def test_a_dataset_that_raises_for_one_index_fails_naming_it_or_skips_it():
    with pytest.raises(SampleError, match=r"sample 13 \(Flaky\[13\]\): dataset\[13\] raised OSError: truncated record"):
        list(train_loader(DataSpec(dataset=Flaky(), coordinated=False, holdout=0.0, chunk_size=8), 8, epochs=1,
                          num_workers=0))
    spec = DataSpec(dataset=Flaky(), coordinated=False, holdout=0.0, chunk_size=8, on_error="skip")
    seen = np.concatenate([b.indices.numpy() for b in train_loader(spec, 8, epochs=1, num_workers=0)])
    assert sorted(seen.tolist()) == [i for i in range(40) if i != 13]


def test_a_workers_error_is_raised_where_the_piece_is_read():
    with pytest.raises(SampleError, match=r"sample 13"):
        list(train_loader(DataSpec(dataset=Flaky(), coordinated=False, holdout=0.0, chunk_size=8), 8, epochs=1,
                          num_workers=2))


class Hanging:
    """Sample 13's ``__getitem__`` hangs, as a read from storage that never answers."""

    def __len__(self) -> int:
        return 40

    def __getitem__(self, i: int):
        if i == 13:
            threading.Event().wait(60)  # a read that does not return (the worker is ended at the test's end)
        return np.full(4, i, np.float32), i


def test_a_worker_whose_read_hangs_fails_the_loader_after_fetch_timeout_s_naming_the_piece():
    spec = DataSpec(dataset=Hanging(), coordinated=False, holdout=0.0, chunk_size=8, fetch_timeout_s=1.0)
    with pytest.raises(PrepError, match=r"piece \d+: no worker process had it ready within data.fetch_timeout_s=1 s"):
        list(train_loader(spec, 8, epochs=1, num_workers=1))


class Slow:
    """Sample 13's ``__getitem__`` takes ``delay_s``."""

    def __init__(self, delay_s: float) -> None:
        self.delay_s = delay_s

    def __len__(self) -> int:
        return 40

    def __getitem__(self, i: int):
        if i == 13:
            threading.Event().wait(self.delay_s)
        return np.full(4, i, np.float32), i


def test_a_piece_later_than_fetch_timeout_s_fails_the_loader_whatever_the_liveness_checks_between(monkeypatch):
    """The waits for a piece check the workers every _LIVENESS_S; the last one ends at fetch_timeout_s (it
    ended at the next multiple of _LIVENESS_S, so this piece, 0.3 s late, was taken)."""
    from coordinated_prep.trial import workers

    monkeypatch.setattr(workers, "_LIVENESS_S", 1.0)
    quick = DataSpec(dataset=Slow(0.0), coordinated=False, holdout=0.0, chunk_size=8, fetch_timeout_s=30.0)
    assert len(list(train_loader(quick, 8, epochs=1, num_workers=1))) == 5  # the worker server started: no wait
    spec = DataSpec(dataset=Slow(1.8), coordinated=False, holdout=0.0, chunk_size=8, fetch_timeout_s=1.5)
    with pytest.raises(PrepError, match=r"within data.fetch_timeout_s=1.5 s \(waited 1\.[5-9] s\)"):
        list(train_loader(spec, 8, epochs=1, num_workers=1))


class Killing:
    """Sample 13's ``__getitem__`` kills its process, as the kernel's OOM killer would a worker's."""

    def __len__(self) -> int:
        return 40

    def __getitem__(self, i: int):
        if i == 13:
            os.kill(os.getpid(), signal.SIGKILL)
        return np.full(4, i, np.float32), i


def test_a_worker_killed_off_the_main_thread_fails_the_loader_naming_the_piece_not_after_the_timeout():
    """Tune runs a trainable in a thread, where DataLoader's SIGCHLD check is not installed: the loader
    checks its workers every few seconds, so the death is named, not a timeout after fetch_timeout_s."""
    spec = DataSpec(dataset=Killing(), coordinated=False, holdout=0.0, chunk_size=8, fetch_timeout_s=120.0)
    raised: list[BaseException] = []

    def read() -> None:
        try:
            list(train_loader(spec, 8, epochs=1, num_workers=1))
        except BaseException as e:  # handed to the test's thread
            raised.append(e)

    reader = threading.Thread(target=read)
    reader.start()
    reader.join(timeout=100)
    assert not reader.is_alive() and len(raised) == 1, raised
    assert isinstance(raised[0], PrepError), raised[0]
    assert re.search(r"piece \d+: worker process\(es\) \[\d+\] preparing it died .*lower the loader's num_workers",
                     str(raised[0])), raised[0]


def test_torchvision_exclusions_hold():
    with pytest.raises(ConfigError, match="only transforms or transform/target_transform"):
        DataSpec(dataset=images(), transforms=lambda x, y: (x, y), target_transform=int)
    with pytest.raises(StructureError, match=r"not an \(input, target\) pair"):
        list(train_loader(DataSpec(dataset=ArrayDataset(np.zeros((8, 2))), target_transform=int, coordinated=False,
                                   holdout=0.0), 4, epochs=1, num_workers=0))


def test_views_of_a_user_pipeline_read_once_and_draw_each_view_anew():
    spec = DataSpec(dataset=images(), transform=AUGMENT, coordinated=False, holdout=0.0, chunk_size=16, views=2)
    batches = list(train_loader(spec, 16, epochs=1, num_workers=0))
    ids = np.concatenate([b.indices.numpy() for b in batches])
    repeats = np.concatenate([b.repeats.numpy() for b in batches])
    assert_exactly_once([ids[repeats == 0], ids[repeats > 0]], range(96))
    digests = np.concatenate([batch_digests(b) for b in batches])
    first = dict(zip(ids[repeats == 0].tolist(), digests[repeats == 0].tolist()))
    assert sum(first[i] != d for i, d in zip(ids[repeats > 0].tolist(), digests[repeats > 0].tolist())) > 90


def test_pin_memory_without_an_accelerator_warns_and_serves_as_before():
    spec = DataSpec(dataset=images(), coordinated=False, holdout=0.0)
    if torch.cuda.is_available():
        pytest.skip("an accelerator is present: pinning is used")
    with pytest.warns(UserWarning, match="pin_memory=True, but no accelerator"):
        loader = train_loader(spec, 32, epochs=1, num_workers=0, pin_memory=True)
    assert sum(len(b) for b in loader) == 96


_AFTER_RAY = """
import sys, warnings
import numpy as np, ray
from coordinated_prep import DataSpec, train_loader
from coordinated_prep.trial.workers import WorkerPieces, _grpc_threads
from tests.harness import batch_digests
from tests.test_datasets import AUGMENT, Holding, images

if __name__ == "__main__":
    ray.init(address=sys.argv[1], log_to_driver=False)  # a driver of the suite's Ray: no instance to start
    ray.shutdown()
    assert _grpc_threads() > 0, "ray.shutdown() left no gRPC threads: this check tests nothing"
    spec = DataSpec(dataset=images(), transform=AUGMENT, coordinated=False, holdout=0.0, chunk_size=16)
    chosen = []
    start = WorkerPieces.start
    WorkerPieces.start = lambda self, g: (chosen.append(self._context), start(self, g))[1]
    forked = [batch_digests(b) for b in train_loader(spec, 8, epochs=1, num_workers=2)]
    here = [batch_digests(b) for b in train_loader(spec, 8, epochs=1, num_workers=0)]
    assert len(forked) == len(here) == 12 and all(np.array_equal(a, b) for a, b in zip(forked, here))
    print("context", chosen[0].get_start_method())
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        # A lambda transform travels by value (pipeline/carried.py), so its workers start from the forkserver too.
        chosen.clear()
        lam = DataSpec(dataset=images(), transform=lambda x: x, coordinated=False, holdout=0.0, chunk_size=16)
        assert sum(len(b) for b in train_loader(lam, 8, epochs=1, num_workers=2)) == 96
        print("lambda context", chosen[0].get_start_method() if chosen[0] else "fork")
        # A dataset that pickle refuses (a lambda inside it) keeps fork and says so.
        chosen.clear()
        held = DataSpec(dataset=Holding(images()), transform=AUGMENT, coordinated=False, holdout=0.0, chunk_size=16)
        assert sum(len(b) for b in train_loader(held, 8, epochs=1, num_workers=2)) == 96
    print("warned", [str(w.message) for w in seen if "does not pickle" in str(w.message)])
"""


class Holding:
    """A map-style dataset holding a lambda: cloudpickle (Ray's, the group key's) takes it, pickle does not."""

    def __init__(self, inner) -> None:
        self.inner, self.pick = inner, lambda sample: sample

    def __len__(self) -> int:
        return len(self.inner)

    def __getitem__(self, i: int):
        return self.pick(self.inner[i])


def test_workers_start_from_a_forkserver_where_ray_left_grpc_threads(ray_session, tmp_path):
    """A process that has run Ray keeps gRPC's threads after ``ray.shutdown()``; workers forked beside
    them may crash, so they start from a forkserver, and their pieces are those of the reading thread."""
    import subprocess
    import sys

    from tests.conftest import REPO

    script = tmp_path / "after_ray.py"
    script.write_text(_AFTER_RAY)
    address = ray_session.get_runtime_context().gcs_address  # the subprocess connects to it, then leaves
    done = subprocess.run([sys.executable, str(script), address], cwd=REPO, capture_output=True, text=True, timeout=300,
                          env={**__import__("os").environ, "PYTHONPATH": REPO})
    assert done.returncode == 0, done.stderr[-3000:]
    assert "context forkserver" in done.stdout, done.stdout
    assert "lambda context forkserver" in done.stdout, done.stdout
    [warned] = [line for line in done.stdout.splitlines() if line.startswith("warned")]
    assert "the spec does not pickle" in warned and "<lambda>" in warned and "num_workers=0" in warned, warned


class PerClipNorm:
    """Normalise a clip by its own mean and standard deviation: a reduction torch splits by its thread count."""

    def __call__(self, clip):
        clip = torch.as_tensor(clip)
        return (clip - clip.mean()) / clip.std()


def clips(n: int = 32, samples: int = 160_000) -> ArrayDataset:
    """``n`` clips of 10 s at 16 kHz (float32 noise), with labels."""
    rng = np.random.default_rng(3)
    return ArrayDataset((rng.standard_normal((n, samples)) * 3 + 1).astype(np.float32), np.arange(n) % 4)


def test_a_large_reduction_gives_a_worker_s_bytes_whatever_the_trainer_s_torch_threads():
    """Workers and prep actors prepare with one torch thread; so must this process, and give its threads back."""
    spec = DataSpec(dataset=clips(), transform=PerClipNorm(), eval_transform=PerClipNorm(), holdout=0.25,
                    chunk_size=8, coordinated=False)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(4)
        here = [batch_digests(b) for b in train_loader(spec, 8, epochs=1, num_workers=0)]
        held = [batch_digests(b) for b in eval_loader(spec, 8)]
        assert torch.get_num_threads() == 4, "the trainer's thread count is given back after preparing"
        torch.set_num_threads(1)  # as a prep actor evaluates
        held_alone = [batch_digests(b) for b in eval_loader(spec, 8)]
    finally:
        torch.set_num_threads(threads)
    workers = [batch_digests(b) for b in train_loader(spec, 8, epochs=1, num_workers=1)]
    assert len(here) == len(workers) == 3 and all(np.array_equal(a, b) for a, b in zip(here, workers))
    assert len(held) == 1 and np.array_equal(held[0], held_alone[0])
