"""Trial-side batching (unshared mode, no Ray): batch sizes, exact epochs, determinism."""

import numpy as np
import pytest

from coordinated_prep import ConfigError, DataSpec, eval_loader, train_loader
from coordinated_prep.plan import holdout_split
from tests.harness import assert_exactly_once


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
