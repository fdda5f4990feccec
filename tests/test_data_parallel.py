"""Data-parallel trials: Ray Train workers inside Tune trials (and Ray Train alone) read disjoint
shares of their trial's epochs from one shared stream."""

from __future__ import annotations

import math
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
import warnings

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from ray import tune

from coordinated_prep import CoordinatedSearcher, DataSpec, PoolSpec, PrepService, train_loader
from coordinated_prep.errors import ConfigError, PrepError
from coordinated_prep.trial.loader import resolve_spec
from coordinated_prep.trial.batching import Batch
from coordinated_prep.trial.shard import Shard, ShardBatcher, rank_counts
from coordinated_prep.pipeline.structure import make_layout
from coordinated_prep.stream.registry import _Rendezvous
from coordinated_prep.stream.staging import StagingBuffer
from coordinated_prep.sweep.config import load_sweep
from coordinated_prep.sweep.runner import run_sweep
from coordinated_prep.stream.watch import _start_time, this_process
from tests.conftest import live_coordprep_actors, plasma_objects, plasma_objects_settled
from tests.harness import assert_exactly_once, reference_digests, stream_samples, train_ids
from tests.recording import Gate, OpenOnResult, record_rank, record_ranks

#: This module's sweeps keep a pool of 1 prep actor holding 0.5 CPU (two trials' Ray Train workers
#: take the rest): tests/conftest.py runs them after the other modules' sweeps, which keep another.
KEPT_POOL_SHAPE = (1, 0.5)

# -- the shard, without Ray ----------------------------------------------------------------
class _Stream:
    """A Batcher stand-in: global batches of ``size`` cut from the sample ids ``rows``."""

    def __init__(self, rows: list[int], size: int) -> None:
        self.batch_size, self._rows, self.stats = size, list(rows), None

    def ready(self) -> bool:
        return True

    def next(self) -> Batch | None:
        rows, self._rows = self._rows[: self.batch_size], self._rows[self.batch_size:]
        if not rows:
            return None
        ids = torch.tensor(rows, dtype=torch.int64)
        layout = make_layout([(np.zeros((2,), np.uint8), 0)], (), "test")
        return Batch(layout, [ids.to(torch.uint8).unsqueeze(1).repeat(1, 2), ids], ids, torch.zeros_like(ids))


def _batches_per_rank(n: int, world: int, batch: int, drop_last: bool) -> int:
    """Global batches of an epoch of ``n`` that leave each rank at least one row (the oracle)."""
    size = world * batch
    return sum(1 for s in range(0, n, size) if not drop_last or min(size, n - s) >= world)


def _cut(rows: list[int], n: int, world: int, batch: int, shard: Shard) -> list[Batch]:
    planned = rank_counts(n, batch, shard)[1]
    return list(ShardBatcher(_Stream(rows, world * batch), batch, shard, planned))  # type: ignore[arg-type]


@settings(max_examples=200, deadline=None)
@given(n=st.integers(1, 300), world=st.integers(1, 5), batch=st.integers(1, 17), drop_last=st.booleans())
def test_ranks_read_disjoint_shares_of_equal_length_that_cover_the_epoch(n, world, batch, drop_last):
    per_rank = []
    for rank in range(world):
        shard = Shard(rank, world, drop_last)
        batches = _cut(list(range(n)), n, world, batch, shard)
        assert all(len(b) == batch for b in batches[:-1]) and all(0 < len(b) <= batch for b in batches)
        assert sum(len(b) for b in batches) == shard.samples(n)
        assert len(batches) == _batches_per_rank(n, world, batch, drop_last) == rank_counts(n, batch, shard)[1]
        for b in batches:  # the leaves travel with their rows
            assert torch.equal(b.leaves[1], b.indices) and torch.equal(b.leaves[0][:, 0], b.indices.to(torch.uint8))
        per_rank.append(batches)
    assert len({len(bs) for bs in per_rank}) == 1, "every rank cuts the same number of batches"
    fresh = np.concatenate([b.indices[b.repeats == 0].numpy() for bs in per_rank for b in bs] or [np.zeros(0)])
    pads = np.concatenate([b.repeats[b.repeats != 0].numpy() for bs in per_rank for b in bs] or [np.zeros(0)])
    if drop_last:
        assert len(pads) == 0 and len(fresh) == world * (n // world) and len(np.unique(fresh)) == len(fresh)
    else:
        assert_exactly_once([fresh], range(n), f"n={n} world={world} batch={batch}")
        assert len(pads) == world * math.ceil(n / world) - n and (pads < 0).all(), "pads are marked, not fresh"


def test_a_rank_whose_epoch_ends_short_of_its_planned_batches_raises_rather_than_hang_its_siblings():
    # skipped samples never shorten a rank's epoch (tests/test_shard.py: pieces are put back to their
    # planned lengths first); missing pieces would, and the rank says so instead of stopping early
    shard = Shard(1, 2)
    with pytest.raises(PrepError, match="rank 1 of 2: this epoch held 2 of its 3 planned batches"):
        _cut(list(range(8)), 10, 2, 2, shard)


def test_a_bad_shard_is_a_clear_error():
    with pytest.raises(ConfigError, match="rank=2 must be below world=2"):
        Shard(2, 2)
    with pytest.raises(ConfigError, match="world=0"):
        Shard(0, 0)


def test_ranks_joining_together_start_on_one_piece_and_hold_it_until_each_fetched_it():
    buffer = StagingBuffer(10**6, lambda g: g, lookahead=4)
    buffer.join("other")
    for g in range(3):  # another trial is two pieces in: the ranks start where it can serve them too
        slot = buffer.reserve(10)
        buffer.mark_ready(slot.g, ("piece", 1))
        buffer.request("other", g)
        buffer.fetched("other", g, 1)
    tokens, start = buffer.join_together(["t@0", "t@1"], pieces=4)
    assert len(set(tokens)) == 2 and {buffer.consumers[c].start for c in ("t@0", "t@1")} == {start}
    for g in range(start, start + 2):
        slot = buffer.slots.get(g) or buffer.reserve(10)
        buffer.mark_ready(slot.g, ("piece", 1)) if slot.state.value == "reserved" else None
        buffer.request("t@0", g)
        buffer.fetched("t@0", g, 1)
        assert g in buffer.slots and "t@1" in buffer.slots[g].waiting, "kept for the rank that has not fetched it"


def test_a_dead_worker_groups_arrivals_do_not_complete_a_new_groups_meeting():
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    gone = this_process(None)._replace(pid=dead.pid, started=_start_time(dead.pid) or "?")
    dead.wait()  # the old group's rank 0 arrived, and died before its sibling did
    meeting = _Rendezvous(world=2)
    meeting.arrivals = {0: ("here", gone, 1), 1: ("there", gone, 1)}
    meeting.drop_gone("here")
    assert sorted(meeting.arrivals) == [1], "a rank that ended on the registry's node is taken back; others wait"
    meeting.arrivals[0] = ("here", this_process(None), 1)
    meeting.drop_gone("here")
    assert sorted(meeting.arrivals) == [0, 1], "a live rank stays"


# -- real sweeps -------------------------------------------------------------------------
def _spec(root: str, **kw) -> DataSpec:
    return DataSpec(dataset=root, pipeline={"size": 24, "scale": (0.5, 1.0)}, chunk_size=16, holdout=0.2, **kw)


def _load(out: str) -> dict[str, dict[int, list[dict]]]:
    """Per trial, per rank: its recorded epochs in order."""
    found: dict[str, dict[int, list[dict]]] = {}
    for trial in sorted(os.listdir(out)):
        if not os.path.isdir(os.path.join(out, trial)) or trial == "train-storage":  # Ray Train's own files
            continue
        ranks = sorted(d for d in os.listdir(os.path.join(out, trial)) if d[4:].isdigit() and d.startswith("rank"))
        for rank_dir in ranks:
            files = sorted(os.listdir(os.path.join(out, trial, rank_dir)), key=lambda f: int(f[5:-4]))
            found.setdefault(trial, {})[int(rank_dir[4:])] = [dict(np.load(os.path.join(out, trial, rank_dir, f)))
                                                             for f in files]
    return found


def _check_ranks(spec: DataSpec, ranks: dict[int, list[dict]], world: int, epochs: int, batch: int, who: str) -> None:
    """Per epoch: the ranks' fresh samples are the epoch exactly once, their batch counts are equal,
    and every row's bytes are the unshared pipeline's."""
    ids = train_ids(spec)
    assert sorted(ranks) == list(range(world)), f"{who}: ranks {sorted(ranks)}"
    for e in range(epochs):
        rows = [ranks[r][e] for r in range(world)]
        assert all(len(r) == epochs for r in ranks.values()), f"{who}: epochs per rank {[len(r) for r in ranks.values()]}"
        assert len({len(r["batch_sizes"]) for r in rows}) == 1, f"{who} epoch {e}: unequal batch counts"
        assert all(int(r["world"]) == world for r in rows)
        fresh = np.concatenate([r["indices"][r["repeats"] == 0] for r in rows])
        assert_exactly_once([fresh], ids, f"{who} epoch {e}")
        assert all(len(r["indices"]) == math.ceil(len(ids) / world) for r in rows), "pads even the ranks out"
        assert len({int(r["start"]) for r in rows}) == 1, f"{who}: the ranks started on different pieces"
        for r in rows:
            want = reference_digests(spec, r["stream_epochs"], r["indices"])
            assert np.array_equal(r["digests"], want), f"{who}: bytes differ from the unshared pipeline"


@pytest.mark.usefixtures("warm_pool")  # its pool's shape stays for the module's next sweep
def test_two_trials_of_two_train_workers_share_one_group_and_split_each_epoch(ray_session, small_dataset, tmp_path):
    baseline = plasma_objects()
    spec = _spec(small_dataset)
    searcher = CoordinatedSearcher(pool=PoolSpec(actors=1, cpus=0.5, keep_warm=True))
    analysis = tune.run(tune.with_resources(record_ranks, {"cpu": 0.1}), search_alg=searcher, verbose=0,
                        config={"data": spec, "workers": 2, "batch_size": 8, "epochs": 2, "out": str(tmp_path),
                                "score": tune.grid_search([1, 2])})
    reports = searcher.group_reports()
    searcher.close()
    assert all(t.status == "TERMINATED" for t in analysis.trials), [t.error_file for t in analysis.trials]
    records = _load(str(tmp_path))
    assert sorted(records) == sorted(t.trial_id for t in analysis.trials), "the trial id reached the workers"
    for trial, ranks in records.items():
        _check_ranks(spec, ranks, 2, 2, 8, trial)
        assert all(int(e["private_samples"]) == 0 for r in ranks.values() for e in r), "every rank read shared pieces"
    [report] = reports.values()
    n = len(train_ids(spec))
    assert report["cohorts"] == 2 and report["trials_joined"] == 4, report
    # Both trials' ranks read the group's one stream: each piece from the first trial's start to the
    # later one's end prepared once, however late the second worker group met (never a pass per trial
    # or per rank), and just the (stream epoch, sample) pairs some rank read.
    starts = {t: int(ranks[0][0]["start"]) for t, ranks in records.items()}
    assert report["starts"] == starts, report
    seen = {(int(e), int(i)) for ranks in records.values() for r in ranks.values() for row in r
            for e, i, rep in zip(row["stream_epochs"], row["indices"], row["repeats"]) if rep == 0}
    assert report["samples_prepared"] == len(seen) == stream_samples(starts.values(), 2, n, spec.chunk_size), report
    assert report["samples_served"] == 2 * 2 * n, "two trials' two epochs: the ranks of a trial read its epoch once"
    assert live_coordprep_actors() == [] and plasma_objects_settled(baseline) <= baseline


@pytest.mark.usefixtures("warm_pool")  # its pool's shape stays for the module's next sweep
def test_a_rank_killed_mid_epoch_restarts_the_worker_group_with_exact_epochs(ray_session, small_dataset, tmp_path):
    spec = _spec(small_dataset)
    gate = Gate.options(name="rank-checkpointed", namespace="coordinated_prep").remote()
    searcher = CoordinatedSearcher(pool=PoolSpec(actors=1, cpus=0.5, keep_warm=True))
    analysis = tune.run(tune.with_resources(record_ranks, {"cpu": 0.1}), search_alg=searcher, verbose=0,
                        callbacks=[OpenOnResult("rank-checkpointed", epoch=1)],
                        config={"data": spec, "workers": 2, "batch_size": 8, "epochs": 3, "out": str(tmp_path),
                                "fault": "kill_rank", "max_failures": 1, "gate": "rank-checkpointed"})
    reports = searcher.group_reports()
    searcher.close()
    del gate  # held until here: the killed rank waits on it
    assert all(t.status == "TERMINATED" for t in analysis.trials), [t.error_file for t in analysis.trials]
    assert (tmp_path / "killed-rank").exists(), "the fault was injected"
    [(trial, ranks)] = _load(str(tmp_path)).items()
    _check_ranks(spec, ranks, 2, 3, 8, trial)
    # Killed in epoch 1: the restarted group resumed from the checkpoint of epoch 0 on both ranks.
    assert [int(ranks[r][e]["resumed_from"]) for r in (0, 1) for e in (0, 1, 2)] == [0, 1, 1] * 2
    [report] = reports.values()
    assert report["cohorts"] == 2, "the restarted worker group joined as a new cohort"
    assert live_coordprep_actors() == []


@pytest.mark.usefixtures("warm_pool")  # the pool the sharing test above kept: same shape
def test_the_ready_trainable_trains_with_ddp_on_two_workers_from_yaml(ray_session, small_dataset, tmp_path):
    """One trial: that two trials' ranks share one pass is the sharing test's property, above."""
    name = f"ddp-{tmp_path.name}"
    path = tmp_path / "ddp.yaml"
    path.write_text(textwrap.dedent(f"""
        name: {name}
        storage_path: {tmp_path / "runs"}
        trainable: small_cnn
        data: {{dataset: {small_dataset}, pipeline: {{size: 24}}, chunk_size: 16, holdout: 0.2}}
        pool: {{actors: 1, cpus: 0.5, keep_warm: true}}
        search_space: {{lr: 0.05, batch_size: 8, width: 4, epochs: 3, workers: 2, cpu_per_worker: 0.2}}
        resources_per_trial: {{cpu: 0.1}}
    """))
    cfg = load_sweep(str(path))
    summary = run_sweep(cfg, verbose=0)
    storage = os.path.join(tempfile.gettempdir(), "coordprep-train", name)
    try:
        kept = {t: [d for d in os.listdir(os.path.join(storage, t))
                    if d.startswith("checkpoint_") and os.path.isdir(os.path.join(storage, t, d))]
                for t in os.listdir(storage)}
    finally:
        shutil.rmtree(storage, ignore_errors=True)
    [trial] = summary["trials"]
    assert trial["status"] == "TERMINATED", trial
    assert trial["ranks"] == 2 and trial["epochs"] == 3 and trial["private_samples"] == 0, trial
    [group] = summary["groups"].values()
    spec = resolve_spec({"data": cfg.data})
    n = len(train_ids(spec))
    assert list(group["starts"]) == [trial["trial"]], group
    # One pass over the stream for the trial's two ranks: each prepared sample went to one rank.
    assert group["samples_prepared"] == group["samples_served"] == 3 * n, group
    assert list(kept) == [trial["trial"]], kept
    assert len(kept[trial["trial"]]) == 2, f"the newest two of three checkpoints are kept: {kept}"
    assert live_coordprep_actors() == []


def _train_alone(config: dict) -> None:
    record_rank(config)


@pytest.mark.usefixtures("warm_pool")  # the pool the sharing test above kept: same shape
def test_ray_train_alone_shards_the_epoch_with_a_prep_service(ray_session, small_dataset, tmp_path):
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    spec = _spec(small_dataset)
    with PrepService(pool=PoolSpec(actors=1, cpus=0.5, keep_warm=True)) as service:
        TorchTrainer(_train_alone, train_loop_config={"data": spec, "batch_size": 8, "epochs": 2, "out": str(tmp_path)},
                     scaling_config=ScalingConfig(num_workers=2, resources_per_worker={"CPU": 0.2}),
                     run_config=RunConfig(name="alone", storage_path=str(tmp_path / "train-storage"))).fit()
        reports = service.group_reports()
    records = {t: r for t, r in _load(str(tmp_path)).items() if t.startswith("train:")}
    [(run, ranks)] = records.items()
    assert run.startswith("train:alone:"), run
    _check_ranks(spec, ranks, 2, 2, 8, run)
    [report] = reports.values()
    assert report["cohorts"] == 1 and report["samples_prepared"] == 2 * len(train_ids(spec)), report
    assert live_coordprep_actors() == []


def test_a_loader_that_finds_no_trial_warns_once_that_sharing_is_off(small_dataset):
    spec = _spec(small_dataset)
    from coordinated_prep.trial import loader as loader_module

    loader_module._WARNED.clear()
    with pytest.warns(UserWarning, match="sharing is off: this process is neither a Tune trial nor a Ray Train worker"):
        first = train_loader({"data": spec}, batch_size=8, epochs=1, num_workers=0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # said once per process
        second = train_loader({"data": spec}, batch_size=8, epochs=1, num_workers=0)
    assert sum(len(b) for b in first) == len(train_ids(spec)) == sum(len(b) for b in second)


def test_ray_train_v1_ranks_share_too(ray_session, tmp_path):
    """Train V1 runs in a driver process of its own (its flag is read when Ray Train is imported),
    on the module's Ray instance."""
    import json
    import subprocess
    import sys

    from tests.conftest import REPO

    address = ray_session.get_runtime_context().gcs_address
    done = subprocess.run([sys.executable, "-m", "tests.train_v1", str(tmp_path), address], cwd=REPO, capture_output=True,
                          text=True, timeout=600, env={**os.environ, "PYTHONPATH": REPO})
    assert done.returncode == 0, done.stderr[-3000:]
    found = json.load(open(tmp_path / "reports.json"))
    assert found["errors"] == []
    [group] = found["groups"].values()
    n = group["samples_per_epoch"]
    assert group["samples_prepared"] == 2 * n and group["cohorts"] == 1, group
    files = sorted(f for f in os.listdir(tmp_path) if f.endswith(".npy"))
    assert len(files) == 4, files
    for epoch in range(2):
        ranks = [np.load(tmp_path / f) for f in files if f.endswith(f"epoch{epoch}.npy")]
        assert len(ranks) == 2 and len(ranks[0]) == len(ranks[1]) == n // 2
        assert len(np.unique(np.concatenate(ranks))) == n, "the ranks' shares are disjoint and cover the epoch"


@pytest.mark.parametrize("options, error", [
    ({"echo": "auto"}, "echo='auto' echoes while this rank's data is late"),
    ({"views": 2}, "data.views=2 lays a piece's views one after another"),
    ({"drop_last": True, "world": 500}, "leaves each rank nothing"),
])
def test_what_would_give_ranks_unequal_epochs_is_refused(small_dataset, monkeypatch, options, error):
    from coordinated_prep import ConfigError
    from coordinated_prep.trial import loader as loader_module
    from coordinated_prep.context import Whereabouts

    world = options.pop("world", 2)
    monkeypatch.setattr(loader_module, "whereabouts", lambda stamped: Whereabouts("t1", 0, world, True))
    spec = _spec(small_dataset, coordinated=False, views=options.pop("views", 1))
    with pytest.raises(ConfigError, match=error):
        train_loader({"data": spec}, batch_size=8, epochs=1, num_workers=0, **options)
    ranks = [train_loader({"data": _spec(small_dataset, coordinated=False)}, batch_size=8, epochs=1, num_workers=0,
                          echo="example:2")]  # fixed echo is fine
    assert ranks[0].world == 2 and ranks[0].rank == 0 or world != 2
