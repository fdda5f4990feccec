"""Trials that read parts of one dataset (``subset``, ``fraction``, ``fold``) share one stream (issue 34, point 4)."""

from __future__ import annotations

import dataclasses
import glob
import json
import textwrap
import threading

import numpy as np
import pytest
import ray
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from ray import tune

from coordinated_prep import DataSpec, eval_loader, train_loader
from coordinated_prep.errors import ConfigError
from coordinated_prep.pipeline.part import held_out, part_ids
from coordinated_prep.plan import holdout_split
from coordinated_prep.sweep.config import load_sweep
from coordinated_prep.sweep.runner import run_sweep
from coordinated_prep.sweep.preflight import preflight
from tests.conftest import live_coordprep_actors
from tests.harness import check_trial_records, stream_samples
from tests.recording import Gate, load_records


@settings(max_examples=60, deadline=None)
@given(n=st.integers(2, 400), holdout=st.sampled_from([0.0, 0.1, 0.25]), k=st.integers(2, 7),
       fractions=st.lists(st.floats(0.01, 1.0), min_size=2, max_size=4))
def test_fractions_are_nested_and_folds_partition_the_training_split(n, holdout, k, fractions):
    train, held = holdout_split(n, holdout)
    base = DataSpec(holdout=holdout)
    parts = [part_ids(DataSpec(holdout=holdout, fraction=f), n) for f in sorted(fractions)]
    for small, large in zip(parts, parts[1:]):  # a data-budget fidelity: each budget inside the next
        assert np.isin(small, large).all()
    for f, part in zip(sorted(fractions), parts):
        assert part.size == max(1, round(f * train.size)) and np.isin(part, train).all()
    assert part_ids(base, n) is None and np.array_equal(held_out(base, n), held)
    if k > train.size:
        with pytest.raises(ConfigError, match="leave a fold empty"):
            part_ids(DataSpec(holdout=holdout, fold=(k, 0)), n)
        return
    folds = [held_out(DataSpec(holdout=holdout, fold=(k, i)), n) for i in range(k)]
    assert np.array_equal(np.sort(np.concatenate(folds)), train), "the folds cover the training split, each once"
    assert max(f.size for f in folds) - min(f.size for f in folds) <= 1
    for i, fold in enumerate(folds):  # fold i trains on the others and evaluates on itself
        trains_on = part_ids(DataSpec(holdout=holdout, fold=(k, i)), n)
        assert np.array_equal(np.sort(np.concatenate([trains_on, fold])), train)
        assert not np.isin(fold, trains_on).any()
        assert np.array_equal(trains_on, part_ids(DataSpec(holdout=holdout, fold=(k, i), seed=9), n)), "seed-free"


def test_the_part_is_left_out_of_the_group_and_bad_parts_are_refused_by_name():
    specs = [DataSpec(), DataSpec(fraction=0.3), DataSpec(fold=[5, 1]), DataSpec(subset=[4, 2, 9])]
    assert len({s.group_key for s in specs}) == 1, "trials differing only in their part share one group"
    assert len(set(specs)) == 4 and specs[2].fold == (5, 1) and specs[3].subset == (4, 2, 9)
    assert DataSpec().group_key != DataSpec(seed=1).group_key
    for kwargs, named in [(dict(fraction=0.0), "data.fraction=0.0"), (dict(fraction=1.5), "data.fraction=1.5"),
                          (dict(fold=(5, 5)), "fold 5 does not exist among 5"), (dict(fold=(1, 0)), "folds 1"),
                          (dict(fold=7), "data.fold=7 must be a pair"), (dict(subset=[3, 1, 3]), "index 3 2 times"),
                          (dict(subset=[]), "holds no sample"), (dict(subset=[0.5]), "integer dataset indices"),
                          (dict(fraction=0.5, subset=[1]), "subset and fraction both")]:
        with pytest.raises(ConfigError, match=named):
            DataSpec(**kwargs)
    train, held = holdout_split(100, 0.1)
    for index, why in [(int(held[0]), "is held out for evaluation"), (100, "is past the dataset's 100 samples")]:
        with pytest.raises(ConfigError, match=f"index {index} {why}"):
            part_ids(DataSpec(subset=[int(train[0]), index]), 100)


def _epochs(loader, epochs: int) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    out = []
    for _ in range(epochs):
        batches = list(loader)
        out.append(tuple(torch.cat([getattr(b, name) for b in batches]) for name in ("indices", "stream_epochs",
                                                                                      "images")))
        assert len(batches) == len(loader)
    return out


@pytest.mark.parametrize("part", [dict(fraction=0.3), dict(fold=(5, 2)), dict(subset=[5, 17, 100, 3])])
def test_an_unshared_part_is_the_whole_streams_rows_of_it_in_order_with_the_same_bytes(small_dataset, part):
    """A trial reading a part prepares only its samples, and gets exactly the rows of those samples
    that the whole stream holds: the same order, epochs and bytes (so a shared trial's cut equals it)."""
    base = dict(dataset=small_dataset, coordinated=False, chunk_size=16, segments=3, seed=3, pipeline={"size": 32})
    whole = _epochs(train_loader(DataSpec(**base), 10, epochs=2, num_workers=0), 2)
    spec = DataSpec(**base, **part)
    ids = part_ids(spec, 180)
    for workers in (0, 2):
        loader = train_loader(spec, 7, epochs=2, num_workers=workers)
        assert loader.samples_per_epoch == ids.size and loader.private_samples == 0
        for (indices, epochs, images), (all_indices, all_epochs, all_images) in zip(_epochs(loader, 2), whole):
            keep = torch.from_numpy(np.isin(all_indices.numpy(), ids))
            assert torch.equal(indices, all_indices[keep]) and torch.equal(epochs, all_epochs[keep])
            assert torch.equal(images, all_images[keep]), "bytes differ from the whole stream's"
        assert loader.private_samples == 2 * ids.size, "it prepared its part only"
    evaluated = torch.cat([b.indices for b in eval_loader(spec, 8)]).numpy()
    assert np.array_equal(evaluated, held_out(spec, 180)), "a fold evaluates on its fold, others on the holdout"
    with pytest.raises(ConfigError, match="index 1000 is past the dataset's 180 samples"):
        train_loader(DataSpec(**base, subset=[1, 1000]), 8, num_workers=0)


def test_a_yaml_subset_outside_the_split_fails_the_dry_run_naming_the_value(small_dataset, tmp_path):
    held = int(holdout_split(180, 0.1)[1][0])
    path = tmp_path / "bad.yaml"
    path.write_text(textwrap.dedent(f"""
        trainable: small_cnn
        data: {{dataset: {small_dataset}, subset: [0, 1]}}
        search_space: {{data.subset.1: {{grid: [2, {held}]}}, lr: 0.1, batch_size: 8, width: 4, epochs: 1}}
    """))
    with pytest.raises(ConfigError, match=rf"data.subset.1.*{held}.*index {held} is held out for evaluation"):
        preflight(load_sweep(str(path)))


def test_a_three_fold_cross_validation_of_two_configs_from_yaml_prepares_each_sample_once_per_epoch(
        ray_session, small_dataset, tmp_path, warm_pool):
    path = tmp_path / "cv.yaml"
    path.write_text(textwrap.dedent(f"""
        name: cv
        storage_path: {tmp_path / "runs"}
        trainable: tests.recording:record
        data: {{dataset: {small_dataset}, pipeline: {{size: 32}}, seed: 3, holdout: 0.0, fold: [3, 0],
                chunk_size: 16, segments: 4}}
        search_space: {{data.fold.1: {{grid: [0, 1, 2]}}, epochs: 2,
                        evaluate: true, out: {tmp_path / "records"}, gate: cv-all-began, gate_after: 0}}
        max_concurrent_trials: 3          # together: each piece is prepared once for all 3
        resources_per_trial: {{cpu: 0.1}}
        metric: score
        pool: {{keep_warm: true}}   # the prep actors an earlier test kept, kept again for the next
    """))
    # Tune starts trial processes two at a time here: a trial may begin after the first ones ended,
    # and a group that ended prepares again for it. So each trial waits after its first epoch until
    # all 3 have read one (a clean clone's run had one trial begin on a second coordinator).
    gate = Gate.options(name="cv-all-began", namespace="coordinated_prep").remote()
    opener = threading.Thread(target=lambda: ray.get(gate.wait_arrivals.remote(3, 300), timeout=330) and ray.get(
        gate.open.remote(), timeout=60), daemon=True)
    opener.start()
    cfg = load_sweep(str(path))
    # Two configs, one trial per fold (3 trial processes, not 6): fold 2 reads batches of 12, folds 0 and 1 of 8.
    cfg = dataclasses.replace(cfg, search_space={
        **cfg.search_space, "batch_size": tune.sample_from(lambda c: 12 if c["data.fold.1"] == 2 else 8)})
    summary = run_sweep(cfg, verbose=0)
    opener.join(timeout=30)
    trials = summary["trials"]
    assert len(trials) == 3 and all(t["status"] == "TERMINATED" for t in trials), trials
    [group] = summary["groups"].values()  # 3 folds, 2 batch sizes: one data group
    specs = [DataSpec(dataset=small_dataset, pipeline={"size": 32}, seed=3, holdout=0.0, fold=(3, i), chunk_size=16,
                      segments=4) for i in range(3)]
    parts = [part_ids(s, 180) for s in specs]
    records = load_records(str(tmp_path / "records"))
    evaluated = {}  # trial -> samples of its last evaluation, from what it reported to Tune
    for result in glob.glob(str(tmp_path / "runs" / "cv" / "*" / "result.json")):
        last = json.loads(open(result).read().splitlines()[-1])
        evaluated[last["trial_id"]] = last["eval_samples"]
    folds, sizes = [], {}
    for trial in trials:  # each trial: exactly its folds once per epoch, with the bytes it would prepare alone
        epochs = records[trial["trial"]]
        [fold] = [i for i, p in enumerate(parts) if np.array_equal(np.sort(epochs[0]["indices"]), p)]
        check_trial_records(specs[fold], epochs, trial["batch_size"], trial["trial"])
        assert evaluated[trial["trial"]] == held_out(specs[fold], 180).size, "it evaluates on its own fold"
        folds.append(fold)
        sizes[fold] = trial["batch_size"]
    assert sorted(folds) == [0, 1, 2] and sizes == {0: 8, 1: 8, 2: 12}, "each fold trained once, by its config"
    starts = [int(records[t["trial"]][0]["start"]) for t in trials]
    assert group["coordinators"] == 1, group
    assert group["samples_prepared"] == stream_samples(starts, 2, 180, 16), "each piece prepared once for all folds"
    assert group["samples_prepared"] < 3 * 2 * 180, "three groups, one per fold, would prepare 3x"
    assert group["samples_served"] == sum(2 * parts[f].size for f in folds), "a trial is served its part only"
    assert live_coordprep_actors() == []


@pytest.mark.parametrize("world,drop_last,whole", [(2, False, True), (3, False, False), (3, True, True)])
def test_data_parallel_ranks_split_their_part_of_each_epoch_in_equal_steps(small_dataset, world, drop_last, whole):
    """The ranks of a trial reading a fold cut global batches from the fold's rows of each piece, as
    from a whole epoch: disjoint fresh rows that cover the fold, and the same steps on every rank.
    ``whole``: the pieces hold the whole split, as a shared group's do; else only the fold's samples."""
    from coordinated_prep.trial.loader import TrainLoader
    from coordinated_prep.trial.shard import Shard
    from coordinated_prep.trial.streams import PrivateStream
    from coordinated_prep.pipeline.part import Part

    spec = DataSpec(dataset=small_dataset, coordinated=False, chunk_size=16, seed=3, pipeline={"size": 16},
                    fold=(4, 1))
    ids = part_ids(spec, 180)
    fresh, steps = [], set()
    for rank in range(world):
        stream = PrivateStream(dataclasses.replace(spec, fold=None) if whole else spec)
        loader = TrainLoader(stream, 5, epochs=1, shard=Shard(rank, world, drop_last), part=Part(ids, 180))
        batches = list(loader)
        steps.add(len(batches))
        assert len(batches) == len(loader)
        fresh.append(torch.cat([b.indices[b.repeats == 0] for b in batches]).numpy())
    assert len(steps) == 1, f"unequal steps {steps}: DDP's all-reduce would hang"
    got = np.concatenate(fresh)
    assert np.unique(got).size == got.size and np.isin(got, ids).all(), "fresh rows disjoint, inside the fold"
    assert got.size == (ids.size // world * world if drop_last else ids.size)


def test_a_part_of_shared_pieces_equals_the_pieces_prepared_for_the_part_with_views_and_ragged_leaves():
    """What a shared trial keeps of whole pieces (views laid view-major, ragged rows, an uneven last
    piece) equals what it prepares alone for its part: rows, repeats, epochs and bytes; and no kept row
    holds on to a whole piece."""
    from coordinated_prep.trial.loader import TrainLoader
    from coordinated_prep.trial.streams import PrivateStream
    from coordinated_prep.pipeline.part import Part
    from coordinated_prep.trial.subset import PartPiece
    from tests.test_structure import Samples

    boxes = lambda i: (np.full((2, 4, 4), i, np.uint8), {"boxes": np.full((i % 4, 4), i, np.float32)})  # noqa: E731
    spec = DataSpec(dataset=Samples(boxes, n=70), coordinated=False, holdout=0.0, chunk_size=16, segments=2, views=2,
                    fraction=0.4)
    whole = PrivateStream(dataclasses.replace(spec, fraction=None))
    part = Part(part_ids(spec, 70), 70)
    shared_like, alone = (TrainLoader(s, 6, epochs=2, views=2, part=p)
                          for s, p in ((whole, part), (PrivateStream(spec), part)))
    for _ in range(2):
        a, b = list(shared_like), list(alone)
        assert len(a) == len(b) == len(shared_like) == len(alone) == -(-2 * part.size // 6)
        for x, y in zip(a, b, strict=True):
            for name in ("indices", "repeats", "stream_epochs"):
                assert torch.equal(getattr(x, name), getattr(y, name)), name
            assert torch.equal(x.images, y.images)
            assert all(torch.equal(p, q) for p, q in zip(x.labels["boxes"], y.labels["boxes"], strict=True))
        rows = torch.cat([x.indices for x in a])
        fresh = rows[torch.cat([x.repeats for x in a]) == 0]
        assert sorted(fresh.tolist()) == part.ids.tolist() and rows.numel() == 2 * part.size
    piece = whole.next_piece()
    cut = PartPiece(piece, np.array([1, 3]))
    assert all(r.base is None for r in cut.leaves[1]), "a kept ragged row is a copy, not a view of the piece"
    assert cut.row_labels[1].tolist() == [0, 0] and cut.indices.tolist() == piece.indices[[1, 3]].tolist()
