"""The shared exactly-once harness, run with the user pipelines: CIFAR-style arrays through a v2.Compose
with RandAugment, segmentation (image and mask cropped together), audio (waveforms to log-mel), a
detection-like target whose boxes vary in number, and a team's own IterableDataset read by shard.
Each is a real sweep of concurrent trials sharing one group; each trial's epochs hold every training
sample once, with the bytes the unshared pipeline makes in this process (prepared in the sweep by two
prep actors, piece by piece in turn)."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
from ray import tune
from torchvision import tv_tensors
from torchvision.transforms import v2

from coordinated_prep import CoordinatedSearcher, DataSpec, PoolSpec, eval_loader, train_loader
from coordinated_prep.errors import ConfigError
from coordinated_prep.pipeline import ArrayDataset, Factory
from coordinated_prep.trial.batching import batched
from coordinated_prep.pipeline.chunk import eval_chunk, prepare_chunk
from coordinated_prep.pipeline.probe import probe, train_indices
from coordinated_prep.pipeline.transforms import make_pipeline
from coordinated_prep.plan import holdout_split
from tests.conftest import live_coordprep_actors
from tests.harness import assert_exactly_once, batch_digests, stream_samples
from tests.test_datasets import OwnGenerator
from tests.test_streamed import AUGMENT, Shards, assert_same_batches, batches, ray_pair, ray_rows, reads

EPOCHS = 2
pytestmark = pytest.mark.usefixtures("warm_pool")  # the module's sweeps keep their prep actors for the next


class Detection:
    """Images with 0-3 boxes each (a detection-like ragged target), as tv_tensors."""

    def __init__(self, n: int = 120) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        k = i % 4
        image = tv_tensors.Image(torch.full((3, 16, 16), i % 251, dtype=torch.uint8))
        boxes = tv_tensors.BoundingBoxes(torch.tensor([[j, j, j + 4.0, j + 6.0] for j in range(k)]).reshape(k, 4),
                                         format="XYXY", canvas_size=(16, 16))
        return image, {"boxes": boxes, "labels": torch.arange(k, dtype=torch.int64) + i}


PIPELINES = {
    "cifar_v2": dict(dataset=Factory("trainables.data.cifar:make", {"n": 150}),
                     transform=Factory("trainables.data.cifar:train_transform"),
                     eval_transform=Factory("trainables.data.cifar:eval_transform")),
    "segmentation": dict(dataset=Factory("trainables.data.segmentation:make", {"n": 80}),
                         transforms=Factory("trainables.data.segmentation:train_transforms"),
                         eval_transforms=Factory("trainables.data.segmentation:eval_transforms")),
    "audio": dict(dataset=Factory("trainables.data.audio:make", {"n": 100}),
                  transform=Factory("trainables.data.audio:train_transform"),
                  eval_transform=Factory("trainables.data.audio:eval_transform")),
    "detection": dict(dataset=Detection(64), transforms=v2.Compose([v2.RandomHorizontalFlip(), v2.ColorJitter(0.5)])),
    # A team's own IterableDataset, read by shard (coordinated_prep/pipeline/streamed.py).
    "streamed": dict(dataset=Shards(n=64, seed=1), transform=AUGMENT),
}


def _spec(name: str, **overrides) -> DataSpec:
    return DataSpec(**{**PIPELINES[name], "seed": 3, "chunk_size": 16, "segments": 4, "holdout": 0.1, **overrides})


FAILING = {
    # A transform that draws from its own generator: the seed cannot reach it.
    "unseedable": _spec("cifar_v2", transform=v2.Compose([v2.ToImage(), OwnGenerator()])),
    # A piece of 16 float 32 px is ~196 kB (another seed: a group of its own).
    "too_big": _spec("cifar_v2", staging_bytes=4096, seed=4),
}


def record_any(config: dict) -> None:
    """Save per epoch the indices, stream epochs and a digest of every sample (all its leaves)."""
    config = {**config, **config["trial"]}  # data and batch size, grid-searched together
    out = os.path.join(config["out"], tune.get_context().get_trial_id())
    os.makedirs(out, exist_ok=True)
    loader = train_loader(config, batch_size=config["batch_size"], epochs=EPOCHS)
    for epoch in range(EPOCHS):
        parts = [(b.indices.numpy(), b.stream_epochs.numpy(), batch_digests(b)) for b in loader if _typed(b)]
        np.savez(os.path.join(out, f"epoch{epoch}.npz"), *[np.concatenate(p) for p in zip(*parts)])
        held = [(b.indices.numpy(), batch_digests(b)) for b in eval_loader(config, 16)]
        np.savez(os.path.join(out, f"eval{epoch}.npz"), *[np.concatenate(p) for p in zip(*held)])
        tune.report({"epoch": epoch + 1})


def _typed(batch) -> bool:
    """True; in a trial of the detection group, raises unless each shared sample's boxes came back as
    the dataset's ``tv_tensors.BoundingBoxes`` with its metadata (what a ``collate_fn`` gets)."""
    for sample in batch.samples():
        boxes = sample[1]["boxes"] if isinstance(sample, tuple) and isinstance(sample[1], dict) else None
        if boxes is not None and not (type(boxes) is tv_tensors.BoundingBoxes and boxes.canvas_size == (16, 16)
                                      and boxes.format == tv_tensors.BoundingBoxFormat.XYXY):
            raise AssertionError(f"shared boxes lost their type or metadata: {boxes!r}")
    return True


def _reference(spec: DataSpec, epochs: np.ndarray, indices: np.ndarray) -> np.ndarray:
    """The digest the unshared pipeline gives each (stream epoch, index), prepared in this process."""
    pipeline = make_pipeline(spec)
    layout = probe(pipeline, spec.seed, train_indices(len(pipeline), spec.holdout), spec.ragged).layout
    out = np.empty(len(indices), dtype=np.uint64)
    for e in np.unique(epochs):
        sel = epochs == e
        chunk, _ = prepare_chunk(pipeline, layout, spec.seed, int(e), indices[sel])
        [batch] = batched(iter([chunk]), len(chunk))
        out[sel] = batch_digests(batch)
    return out


def _reference_eval(spec: DataSpec) -> tuple[np.ndarray, np.ndarray]:
    pipeline = make_pipeline(spec)
    held = holdout_split(len(pipeline), spec.holdout)[1]
    layout = probe(pipeline, spec.seed, held, spec.ragged, 1, "eval").layout
    [batch] = batched(iter([eval_chunk(pipeline, layout, spec.seed, held)]), len(held))
    return batch.indices.numpy(), batch_digests(batch)


@pytest.fixture(scope="module")
def ray_datasets(ray_session):
    """The module's two ray.data pipelines, materialized in the driver one after the other: the second
    runs on the worker process the first started (it imports torch for the rows' function), not anew."""
    return ray_rows(100).materialize(), ray_rows(60).materialize()


@pytest.fixture(scope="module")
def pipelines_sweep(ray_session, ray_datasets, tmp_path_factory, warm_pool):
    """One sweep of every user pipeline, two trials each (batch sizes 8 and 12): six data groups; and
    one trial of each FAILING spec (two groups more), which must fail at its start. Those are listed
    last, so the processes they end (a failed trial's is not reused) are seldom needed again. Two
    trials at a time, each group's together: two processes, reused (starting one costs more than a
    trial here)."""
    out = str(tmp_path_factory.mktemp("pipelines"))
    specs = {name: _spec(name) for name in PIPELINES}
    # A ray.data pipeline, materialized in the driver (it needs Ray), its rows spilled once per node.
    specs["ray_data"] = DataSpec(dataset=ray_datasets[0], transform=ray_pair, seed=3, chunk_size=16, segments=4,
                                 holdout=0.1)
    runs = [{"data": spec, "batch_size": b} for spec in specs.values() for b in (8, 12)]
    runs += [{"data": spec, "batch_size": 8} for spec in FAILING.values()]
    searcher = CoordinatedSearcher(pool=PoolSpec(actors=2, keep_warm=True))
    analysis = tune.run(tune.with_resources(record_any, {"cpu": 0.5}),
                        config={"trial": tune.grid_search(runs), "out": out}, search_alg=searcher, reuse_actors=True,
                        verbose=0, raise_on_failed_trial=False)
    reports = searcher.group_reports()
    searcher.close()
    failing = {spec.group_key: name for name, spec in FAILING.items()}
    errors = {}  # the error file's text of each FAILING spec's trial
    for trial in analysis.trials:
        name = failing.get(trial.config["trial"]["data"].group_key)
        if name is not None:
            assert trial.status == "ERROR", name
            with open(trial.error_file) as f:
                errors[name] = f.read()
    assert sorted(errors) == sorted(FAILING)
    trials = [t for t in analysis.trials if t.config["trial"]["data"].group_key not in failing]
    return specs, trials, reports, out, live_coordprep_actors(), errors


@pytest.mark.parametrize("name", [*PIPELINES, "ray_data"])
def test_user_pipelines_share_exact_epochs_with_the_unshared_bytes(pipelines_sweep, name):
    specs, every, reports, out_dir, left, _ = pipelines_sweep
    assert all(t.status == "TERMINATED" for t in every), [t.error_file for t in every]
    spec = specs[name]
    report = reports[spec.group_key]
    trials = [t for t in every if t.config["trial"]["data"].group_key == spec.group_key]
    assert len(trials) == 2
    pipeline = make_pipeline(spec)
    train = train_indices(len(pipeline), spec.holdout)
    want_eval = _reference_eval(spec)
    served = 0
    for trial in trials:
        out = os.path.join(out_dir, trial.trial_id)
        epochs = [np.load(os.path.join(out, f"epoch{e}.npz")) for e in range(EPOCHS)]
        assert_exactly_once([e["arr_0"] for e in epochs], train, f"{name} {trial.trial_id}")
        for e in epochs:
            assert np.array_equal(e["arr_2"], _reference(spec, e["arr_1"], e["arr_0"])), \
                f"{name}: shared bytes differ from the unshared pipeline's"
            served += len(e["arr_0"])
        for k in range(EPOCHS):
            held = np.load(os.path.join(out, f"eval{k}.npz"))
            assert np.array_equal(held["arr_0"], want_eval[0]) and np.array_equal(held["arr_1"], want_eval[1])
    assert report["samples_served"] == served, report
    # Each piece from the first trial's start to the later one's end prepared once, wherever the
    # second trial joined (shared from its start on). Had the first one left before the second began
    # (a slot freed late: 14 trials, 2 at a time), each had a coordinator and a stream of its own.
    starts = list(report["starts"].values())
    if report["coordinators"] == 1:
        want = stream_samples(starts, EPOCHS, len(train), spec.chunk_size)
    else:
        assert report["coordinators"] == len(trials), report
        want = sum(stream_samples([s], EPOCHS, len(train), spec.chunk_size) for s in starts)
    assert report["samples_prepared"] == want, report
    assert report["prep_actors"] == 2 and report["pieces_prepared"] >= 2, report
    assert left == []


def test_a_streamed_dataset_s_shards_are_each_read_once_for_the_whole_sweep(pipelines_sweep):
    """Its prep actors, coordinator and trials, and the references above, read the node's spill."""
    dataset = PIPELINES["streamed"]["dataset"]
    assert reads(dataset.log_path) == [1] * dataset.n_shards


def test_a_materialized_ray_dataset_gives_the_batches_of_its_rows_map_style_read_once_per_node(ray_datasets):
    from ray import cloudpickle

    common = dict(seed=4, chunk_size=8, segments=2, holdout=0.2, coordinated=False)
    with pytest.raises(ConfigError, match=r"is lazy: .*materialize it in the driver before the sweep"):
        DataSpec(dataset=ray_rows(60), transform=ray_pair, **common)
    streamed = DataSpec(dataset=ray_datasets[1], transform=ray_pair, **common)
    assert repr(streamed.dataset) == "StreamedShards(ray.data.Dataset, 1 shards)"
    rows = list(streamed.dataset.source.shard(1, 0))  # in the blocks' order, which materialize() chose
    twin = DataSpec(dataset=ArrayDataset(np.stack([r["image"] for r in rows]), np.array([r["label"] for r in rows])),
                    transform=lambda x: AUGMENT(torch.from_numpy(np.asarray(x))), **common)
    assert_same_batches(batches(streamed), batches(twin))
    spilled = os.stat(streamed.dataset._path(0, "samples")).st_ino  # a spill again would be a new file
    again = cloudpickle.loads(cloudpickle.dumps(streamed))  # the spec as another process of the node gets it
    assert_same_batches(batches(again), batches(twin))
    assert os.stat(again.dataset._path(0, "samples")).st_ino == spilled, "the rows were read once on this node"
    assert again.group_key == streamed.group_key and not streamed.dataset.source.dataset.context.execution_options \
        .preserve_order, "the user's dataset is left as it was"


@pytest.fixture(scope="module")
def failed_trials(pipelines_sweep):
    """The error file's text of each FAILING spec's trial (in the sweep above)."""
    return pipelines_sweep[-1]


def test_a_transform_that_cannot_be_seeded_fails_the_trials_start_with_the_reason(failed_trials):
    text = failed_trials["unseedable"]
    assert "other values when prepared twice from the same seed" in text, text[-2000:]


def test_a_sample_too_big_for_the_staging_budget_is_refused_naming_the_fix(failed_trials):
    text = failed_trials["too_big"]
    assert "more than the group's staging budget" in text and "lower data.chunk_size" in text, text[-2000:]
