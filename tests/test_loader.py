"""Trial-side batching (unshared mode, no Ray): batch sizes, exact epochs, determinism."""

import random
import threading

import numpy as np
import pytest
import torch

from coordinated_prep import ConfigError, DataSpec, SampleError, eval_loader, train_loader
from coordinated_prep.pipeline import ArrayDataset
from coordinated_prep.plan import holdout_split
from tests.harness import assert_exactly_once, batch_digests


@pytest.fixture(scope="module")
def spec(small_dataset):
    return DataSpec(dataset=small_dataset, pipeline={"size": 24}, chunk_size=8, segments=3, coordinated=False)


@pytest.mark.parametrize("batch_size", [1, 7, 8, 16, 50, 1000])
def test_each_epoch_holds_every_sample_once_in_batches_of_the_trial_size(spec, batch_size):
    loader = train_loader(spec, batch_size=batch_size)
    train_ids, _ = holdout_split(180, spec.holdout)
    epochs = []
    for _ in range(2):
        batches = list(loader)
        assert len(batches) == len(loader)
        assert all(len(b) == batch_size for b in batches[:-1]) and 0 < len(batches[-1]) <= batch_size
        b = batches[0]
        assert b.images.dtype.is_floating_point is False and tuple(b.images.shape[1:]) == (3, 24, 24)
        assert str(b.labels.dtype) == "torch.int64" and str(b.indices.dtype) == "torch.int64"
        epochs.append(np.concatenate([b.indices.numpy() for b in batches]))
    assert_exactly_once(epochs, train_ids)
    assert not np.array_equal(epochs[0], epochs[1]), "epochs are reshuffled"


def test_same_seed_same_bytes_across_batch_sizes(spec):
    a = next(iter(train_loader(spec, batch_size=8)))
    b = next(iter(train_loader(spec, batch_size=16)))
    assert np.array_equal(a.images.numpy(), b.images.numpy()[:8])


def test_eval_loader_covers_the_held_out_split(spec):
    _, held = holdout_split(180, spec.holdout)
    got = np.concatenate([b.indices.numpy() for b in eval_loader(spec, batch_size=5)])
    assert np.array_equal(got, held)


def test_bad_batch_size_and_missing_spec_are_clear_errors(spec):
    with pytest.raises(ConfigError, match="batch_size=0 must be a positive integer"):
        train_loader(spec, batch_size=0)
    with pytest.raises(ConfigError, match="no 'data' entry"):
        train_loader({"lr": 0.1}, batch_size=8)


def test_an_epoch_cut_short_does_not_shift_the_next(spec):
    reference = train_loader(spec, batch_size=10)
    expected = [np.concatenate([b.indices.numpy() for b in reference]) for _ in range(3)]
    loader = train_loader(spec, batch_size=10)
    first = np.concatenate([b.indices.numpy() for b in loader])
    for step, _ in enumerate(loader):  # epoch 1 stops after two batches, as a max-steps loop would
        if step == 1:
            break
    third = np.concatenate([b.indices.numpy() for b in loader])
    assert np.array_equal(first, expected[0])
    assert np.array_equal(third, expected[2]), "epoch 2 must be the stream's epoch 2, whatever epoch 1 did"


# --- pin_memory: preparation stays on the loop's thread (coordinated_prep.pipeline.seeding) ---------------------

_PIECE = 8  # samples per piece, and per batch: each batch is one piece


class _Gate:
    """Where the loop's thread meets a preparation that runs on another thread (a pinning thread that prepares)."""

    def reset(self, owner: int) -> None:
        self.owner, self.elsewhere = owner, 0
        self.entered, self.drew = threading.Event(), threading.Event()


_GATE = _Gate()


class _Noisy:
    """Draws from all three global generators. Run off the loop's thread (``_GATE.owner``), the first sample of the
    second piece waits inside the transform until the loop has drawn: the interleaving a training step can meet."""

    def __call__(self, x):
        if threading.get_ident() != _GATE.owner:
            _GATE.elsewhere += 1
            if _GATE.elsewhere == _PIECE + 1:
                _GATE.entered.set()
                _GATE.drew.wait(30)
        return torch.as_tensor(x) + torch.rand(x.shape) + float(np.random.rand()) + random.random()


def _seed_all(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def _draws() -> tuple:
    """What a training step draws: mixup's permutation, a NumPy and a Python draw."""
    return torch.randperm(16).tolist(), np.random.rand(2).tolist(), random.random()


@pytest.fixture
def fake_pinning(monkeypatch):
    """Pinning without an accelerator: the same background thread, with ``pin_memory`` a copy."""
    from coordinated_prep.trial import loader as loader_module

    monkeypatch.setattr(loader_module, "_accelerator", lambda who: True)
    monkeypatch.setattr(torch.Tensor, "pin_memory", lambda self: self.clone())


def test_pinned_bytes_equal_unpinned_while_the_loop_draws_and_its_draws_are_its_own(fake_pinning):
    data = ArrayDataset(np.arange(48 * 4, dtype=np.float32).reshape(48, 4), np.arange(48))
    spec = DataSpec(dataset=data, transform=_Noisy(), holdout=0.0, chunk_size=_PIECE, coordinated=False)
    _GATE.reset(threading.get_ident())
    want = [batch_digests(b) for b in train_loader(spec, _PIECE, epochs=1, num_workers=0)]
    _seed_all(11)
    expected = [_draws() for _ in want]  # the loop's draws with no loader at all
    _seed_all(11)
    got, drawn = [], []
    for batch in train_loader(spec, _PIECE, epochs=1, num_workers=0, pin_memory=True):
        got.append(batch_digests(batch))
        if _GATE.elsewhere and not _GATE.drew.is_set():  # prepared on another thread: draw while it is inside
            assert _GATE.entered.wait(30), "the other thread never reached the second piece"
            drawn.append(_draws())
            _GATE.drew.set()
        else:
            drawn.append(_draws())
    assert len(got) == len(want) and all(np.array_equal(a, b) for a, b in zip(got, want)), \
        "pinned bytes must be the unpinned bytes, whatever the loop draws meanwhile"
    assert drawn == expected, "the loop's own draws were reseeded or rewound by a preparation"
    assert _GATE.elsewhere == 0, "a piece was prepared off the thread that iterates the loader"


def test_pinning_passes_a_preparation_error_to_the_loop_and_an_epoch_cut_short_ends_cleanly(fake_pinning):
    class Flaky:
        def __len__(self) -> int:
            return 32

        def __getitem__(self, i: int):
            if i == 13:
                raise OSError("truncated record")
            return np.full(4, i, np.float32), i

    with pytest.raises(SampleError, match=r"sample 13"):
        list(train_loader(DataSpec(dataset=Flaky(), coordinated=False, holdout=0.0, chunk_size=8), 8, epochs=1,
                          num_workers=0, pin_memory=True))
    data = ArrayDataset(np.arange(48 * 4, dtype=np.float32).reshape(48, 4), np.arange(48))
    loader = train_loader(DataSpec(dataset=data, holdout=0.0, chunk_size=8, coordinated=False), 8, epochs=2,
                          num_workers=0, pin_memory=True)
    for _ in loader:
        break  # the pinning thread may be waiting for the loop to prepare a piece: it must not hang
    assert sorted(np.concatenate([b.indices.numpy() for b in loader]).tolist()) == list(range(48))


def test_eval_loader_is_a_full_pass_at_every_iter_and_knows_its_length(small_dataset):
    spec = DataSpec(dataset=small_dataset, pipeline={"size": 16}, coordinated=False, holdout=0.2)
    loader = eval_loader(spec, batch_size=7)
    first = [b.indices.numpy() for b in loader]
    second = [b.indices.numpy() for b in loader]  # Lightning iterates validation data every epoch
    assert len(first) == len(second) == len(loader) > 1
    assert all(np.array_equal(a, b) for a, b in zip(first, second))
    with pytest.raises(ConfigError, match="batch_size=0"):
        eval_loader(spec, batch_size=0)  # at the call, not at the first batch


def test_an_iterator_made_and_never_read_takes_no_epoch(spec):
    """Lightning calls iter() once to check that a loader is iterable, and drops the iterator."""
    loader = train_loader(spec, 16, epochs=2, num_workers=0)
    iter(loader)
    first = list(loader)
    assert loader.epoch == 1 and set(torch.cat([b.stream_epochs for b in first]).tolist()) == {0}
    assert len(list(loader)) == len(first) and loader.epoch == 2  # both declared epochs are still there


def test_a_loader_is_freed_by_its_last_reference(spec):
    """No reference cycle holds a loader: a shared trial's loader leaves its group when Tune drops it (a
    paused trial), not at a later garbage collection (a `loader.dataset` holding its loader stalled a PBT sweep)."""
    import gc
    import weakref

    loader = train_loader(spec, 8, epochs=2)
    next(iter(loader))
    assert len(loader.dataset) == loader.samples_per_epoch == 162  # the small dataset's training split
    freed = weakref.ref(loader)
    gc.disable()
    try:
        del loader
        assert freed() is None
    finally:
        gc.enable()
