"""Iterable datasets read by shard (coordinated_prep/pipeline/streamed.py): the contract against the
map-style twin of the same samples, a team's own IterableDataset and Hugging Face's streamed one, each
shard read once per node, and each refusal. The shared sweeps, and ray.data (which needs Ray), are in
tests/test_user_pipelines.py ("streamed", "ray_data")."""

from __future__ import annotations

import dataclasses
import os
import pickle

import numpy as np
import pytest
import torch
from torchvision.transforms import v2

from coordinated_prep import DataSpec, eval_loader, train_loader
from coordinated_prep.errors import ConfigError, DatasetError
from coordinated_prep.pipeline import ArrayDataset, Factory
from coordinated_prep.pipeline.streamed import StreamedShards

AUGMENT = v2.Compose([v2.RandomResizedCrop(8, scale=(0.5, 1.0), antialias=True), v2.RandomHorizontalFlip()])


def images(n: int = 90, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    return rng.integers(0, 256, (n, 3, 12, 12), dtype=np.uint8), np.arange(n) % 5


class Shards(torch.utils.data.IterableDataset):
    """A team's own iterable dataset under the contract: ``n_shards`` and ``shard(num_shards, index)``.

    Its shards are slices of arrays standing for files in a bucket; every read of a shard is counted
    in ``log`` (a file: the sweep's processes count too), so a test sees how often each was read.
    """

    def __init__(self, log: str | None = None, n: int = 90, shards: int = 4, seed: int = 0) -> None:
        self.log, self.n, self.n_shards, self.seed = log, n, shards, seed

    @property
    def log_path(self) -> str:
        """``log``, or a file in the session's dataset cache (every process of the sweep has it)."""
        return self.log or os.path.join(os.environ["COORDPREP_CACHE"], f"shard-reads-{self.n}-{self.seed}")

    def shard(self, num_shards: int, index: int):
        with open(self.log_path, "a") as f:
            f.write(f"{index}\n")
        x, y = images(self.n, self.seed)
        bounds = np.linspace(0, self.n, num_shards + 1).astype(int)
        for i in range(bounds[index], bounds[index + 1]):
            yield torch.from_numpy(x[i]), int(y[i])

    def __iter__(self):  # what a DataLoader over it reads: every shard in turn
        for k in range(self.n_shards):
            yield from self.shard(self.n_shards, k)


def ray_row(row: dict) -> dict:
    """Row ``id`` of a ray.data pipeline: a 3 x 12 x 12 image drawn from its id, and a label."""
    i = int(row["id"])
    return {"image": np.random.default_rng(i).integers(0, 256, (3, 12, 12), dtype=np.uint8), "label": i % 5}


def ray_rows(n: int):
    """A ray.data pipeline of ``n`` rows, lazy (nothing runs until it is read or materialized)."""
    import ray.data

    return ray.data.range(n).map(ray_row)


def ray_pair(sample: dict):
    """A ray.data row to an augmented (image, label) pair: one transform of the whole sample."""
    return AUGMENT(torch.from_numpy(np.array(sample["image"]))), int(sample["label"])


def _logged(log: str) -> list[int]:
    if not os.path.exists(log):
        return []
    with open(log) as f:
        return [int(line) for line in f]


def reads(log: str) -> list[int]:
    """How often each shard was read, by shard."""
    return np.bincount(_logged(log)).tolist()


def batches(spec: DataSpec, epochs: int = 2, workers: int = 0) -> list:
    loader = train_loader(spec, batch_size=16, epochs=epochs, num_workers=workers)
    return [b for _ in range(epochs) for b in loader]


def assert_same_batches(a: list, b: list) -> None:
    assert len(a) == len(b) and a
    for x, y in zip(a, b):
        assert torch.equal(x.indices, y.indices) and torch.equal(x.images, y.images) and torch.equal(x.labels, y.labels)


def test_a_team_s_sharded_iterable_gives_its_map_style_twin_s_batches_and_reads_each_shard_once(tmp_path):
    log = str(tmp_path / "reads")
    common = dict(transform=AUGMENT, seed=7, chunk_size=8, segments=3, holdout=0.2, coordinated=False)
    streamed = DataSpec(dataset=Shards(log), **common)
    assert isinstance(streamed.dataset, StreamedShards) and streamed.dataset.n_shards == 4
    twin = DataSpec(dataset=ArrayDataset(*(torch.from_numpy(a) for a in images())), **common)
    assert_same_batches(batches(streamed), batches(twin))
    # A forked loader worker, an evaluation, and a copy of the spec (as it travels) read the node's spill.
    assert_same_batches(batches(pickle.loads(pickle.dumps(streamed)), workers=1), batches(twin, workers=1))
    held = [list(eval_loader(s, 16)) for s in (streamed, twin)]
    assert_same_batches(*held)
    assert reads(log) == [1, 1, 1, 1], "each shard read once on this node, whoever read the samples"
    assert len(os.listdir(streamed.dataset.folder)) == 4 * 3  # per shard: samples, offsets, the lock


def shards(n: int, seed: int) -> Shards:
    """A factory of :class:`Shards`, as YAML names a dataset (``{factory: tests.test_streamed:shards, ...}``)."""
    return Shards(n=n, seed=seed)


def test_a_factory_of_a_sharded_iterable_is_read_by_shard_in_each_process_that_builds_it():
    common = dict(transform=AUGMENT, seed=2, chunk_size=8, segments=2, holdout=0.1, coordinated=False)
    made = DataSpec(dataset=Factory("tests.test_streamed:shards", {"n": 50, "seed": 3}), **common)
    assert_same_batches(batches(made), batches(DataSpec(dataset=Shards(n=50, seed=3), **common)))


def test_empty_shards_a_len_of_its_own_and_a_copy_of_the_spec_change_nothing(tmp_path):
    gappy = DataSpec(dataset=Gappy(str(tmp_path / "g")), coordinated=False).dataset
    x, y = images(40)
    bounds = np.linspace(0, 40, 6).astype(int)  # shards of 8: 0-7, (8-15 empty), 16-23, (24-31 empty), 32-39
    kept = [i for k in (0, 2, 4) for i in range(bounds[k], bounds[k + 1])]
    assert len(gappy) == 24 and [int(gappy[j][1]) for j in range(24)] == [int(y[i]) for i in kept]
    assert all(torch.equal(gappy[j][0], torch.from_numpy(x[i])) for j, i in enumerate(kept))
    assert gappy.describe(8).endswith("shard 2, sample 0") and "out of range" in gappy.describe(24)
    sized = DataSpec(dataset=Sized(str(tmp_path / "s")), coordinated=False)
    assert isinstance(sized.dataset, StreamedShards) and len(sized.dataset) == 90
    spec = DataSpec(dataset=Shards(str(tmp_path / "k")), coordinated=False)
    copy = dataclasses.replace(pickle.loads(pickle.dumps(spec)), chunk_size=spec.chunk_size)  # validated anew
    assert copy.group_key == spec.group_key and copy.dataset.key == spec.dataset.key
    assert spec.dataset_name.endswith("test_streamed.Shards")


def test_a_hugging_face_dataset_streamed_by_shard_gives_the_map_style_one_s_batches():
    import datasets  # here, not at the top: the sweep's processes import this module for Shards

    x, y = images(60, seed=2)
    table = datasets.Dataset.from_dict({"image": list(x), "label": y.tolist()})

    def pair(sample):  # one transform of the whole sample, as a team writes one for Hugging Face's dicts
        return AUGMENT(torch.as_tensor(np.asarray(sample["image"], dtype=np.uint8))), sample["label"]

    common = dict(transform=pair, seed=3, chunk_size=8, segments=2, holdout=0.25, coordinated=False)
    streamed = DataSpec(dataset=table.to_iterable_dataset(num_shards=3), **common)
    assert isinstance(streamed.dataset, StreamedShards) and streamed.dataset.n_shards == 3
    assert len(streamed.dataset) == 60 and streamed.dataset.describe(25).endswith("shard 1, sample 5")
    assert_same_batches(batches(streamed), batches(DataSpec(dataset=table, **common)))
    plain = DataSpec(dataset=table.to_iterable_dataset(num_shards=3), coordinated=False)  # its pickle varies
    assert dataclasses.replace(pickle.loads(pickle.dumps(plain))).group_key == plain.group_key


class Broken(Shards):
    def shard(self, num_shards: int, index: int):
        if index == 2:
            with open(self.log_path, "a") as f:
                f.write(f"{index}\n")
            raise OSError("connection reset by peer")
        yield from super().shard(num_shards, index)


class Gappy(Shards):
    """Shards 1 and 3 of 5 are empty."""

    def __init__(self, log: str) -> None:
        super().__init__(log, n=40, shards=5)

    def shard(self, num_shards: int, index: int):
        if index not in (1, 3):
            yield from super().shard(num_shards, index)


class Sized(Shards):
    """A torch IterableDataset with __len__ too (it inherits a __getitem__ that raises)."""

    def __len__(self) -> int:
        return self.n


class Flaky(Shards):
    """Its shard 1 fails on the first read (a connection reset), as a remote read may."""

    def shard(self, num_shards: int, index: int):
        first = index == 1 and 1 not in np.flatnonzero(np.bincount(_logged(self.log_path), minlength=2))
        yield from super().shard(num_shards, index)
        if first:
            raise ConnectionResetError("connection reset by peer")


class Unpicklable(Shards):
    def shard(self, num_shards: int, index: int):
        yield lambda: index


class Empty(Shards):
    def shard(self, num_shards: int, index: int):
        yield from ()


def test_what_breaks_the_contract_is_refused_naming_the_dataset_the_shard_and_the_fix(tmp_path):
    class Plain(torch.utils.data.IterableDataset):
        def __iter__(self):
            yield from range(3)

    with pytest.raises(ConfigError, match=r"has no __len__: .*give it n_shards and "
                                          r"shard\(num_shards, index\)"):
        DataSpec(dataset=Plain())
    bad = Shards(str(tmp_path / "a"))
    bad.n_shards = 0
    with pytest.raises(ConfigError, match=r"n_shards=0 must be an int >= 1"):
        DataSpec(dataset=bad)
    broken = DataSpec(dataset=Broken(str(tmp_path / "b")), coordinated=False).dataset
    for _ in range(2):  # asked again, the shards spilled before the failure are not read again; the failed one is
        with pytest.raises(DatasetError, match=r"test_streamed.Broken: reading shard 2 of 4 failed 3 times, last "
                                               r"with OSError: connection reset by peer; if that is a passing fault, check"):
            len(broken)
        assert reads(str(tmp_path / "b"))[2] in (3, 6)
    assert reads(str(tmp_path / "b")) == [1, 1, 6], "3 reads of the failed shard per ask, the others once"
    flaky = DataSpec(dataset=Flaky(str(tmp_path / "f")), coordinated=False).dataset
    assert len(flaky) == 90 and reads(str(tmp_path / "f")) == [1, 2, 1, 1], "a failed read is tried again"
    twin = Shards(str(tmp_path / "t"))
    assert [flaky[i][1] for i in range(90)] == [label for _, label in twin], "the retry's samples, not the half read"
    with pytest.raises(DatasetError, match=r"sample 0 of shard 0 does not pickle"):
        len(DataSpec(dataset=Unpicklable(str(tmp_path / "c")), coordinated=False).dataset)
    with pytest.raises(DatasetError, match=r"its 4 shards yielded no sample"):
        len(DataSpec(dataset=Empty(str(tmp_path / "d")), coordinated=False).dataset)
    import datasets

    with pytest.raises(ConfigError, match=r"give one split \(dataset\['train'\]\)"):
        DataSpec(dataset=datasets.IterableDatasetDict({"train": datasets.Dataset.from_dict(
            {"label": [1, 2]}).to_iterable_dataset()}))


def test_a_ray_data_datasets_spill_is_named_within_its_cluster_so_a_later_cluster_never_reads_it(monkeypatch):
    """A fresh Ray cluster numbers a driver's objects from the start again, so two runs' datasets can have
    blocks with the same ids and other rows: the spill's key holds the cluster's session name too."""
    from coordinated_prep.pipeline import streamed

    class Ref:
        def hex(self) -> str:
            return "00ffffffffffffffffffffffffffffffffffffff0100000001e1f505"  # a driver's first ray.put

    class MaterializedDataset:  # a stand-in: what RayDataRows reads of one
        def get_internal_block_refs(self):
            return [Ref()]

    keys = []
    for session in ("session_2026-11-29_08-00-00_1_1", "session_2026-11-29_09-00-00_2_2"):
        monkeypatch.setattr(streamed, "_session_name", lambda: session)
        keys.append(streamed.RayDataRows(MaterializedDataset()).key)
    assert keys[0] != keys[1]
    assert streamed.RayDataRows(MaterializedDataset()).key == keys[1], "one cluster: one key (its nodes share a spill)"
