"""A prep pool kept warm between the sweeps of one driver (``PoolSpec(keep_warm=True)``): the next
sweep of the same shape starts on the same prep actors, sees what changed in its dataset since,
and leaves nothing of the last sweep in the object store; a sweep of another shape, and
``release()``, give the CPUs back."""

from __future__ import annotations

import ray
from ray import tune

from coordinated_prep import CoordinatedSearcher, DataSpec, PoolSpec
from coordinated_prep.pipeline.sources import open_source
from coordinated_prep.pool import warm
from tests.conftest import live_coordprep_actors, plasma_objects, plasma_objects_settled, settled, settled_when
from tests.harness import check_trial_records
from tests.recording import Gate, load_records, pids_titled, record
from tests.utils import make_imagefolder


def _prep_actors() -> set[int]:
    """Processes of the live prep actors (by title: one Ray runs the tests)."""
    return set(pids_titled("ray::PrepActor"))


def _sweep(spec: DataSpec, pool: PoolSpec, out: str) -> None:
    """One trial of ``spec`` (batch size 8) with exact epochs of the unshared bytes: the subject is the
    pool's actors, which one trial uses as two would."""
    searcher = CoordinatedSearcher(pool=pool)
    analysis = tune.run(tune.with_resources(record, {"cpu": 0.25}),
                        config={"data": spec, "batch_size": 8, "epochs": 2, "out": out},
                        search_alg=searcher, verbose=0)
    searcher.close()
    assert all(t.status == "TERMINATED" for t in analysis.trials), [t.error_file for t in analysis.trials]
    records = load_records(out)
    for trial in analysis.trials:
        check_trial_records(spec, records[trial.trial_id], trial.config["batch_size"], trial.trial_id)


def test_a_kept_pool_serves_the_next_sweep_sees_its_new_files_and_gives_its_cpus_back(ray_session, tmp_path,
                                                                                       warm_pool):
    root = make_imagefolder(str(tmp_path / "data"), classes=2, per_class=20)
    spec = DataSpec(dataset=root, pipeline={"size": 32, "scale": [0.3, 1.0]}, seed=4, chunk_size=8, segments=2)
    node = ray.get_runtime_context().get_node_id()
    baseline = plasma_objects()

    # The first sweep starts on the pair an earlier test kept, if any (the suite runs this test after
    # the others that take warm_pool), or starts and keeps one.
    _sweep(spec, warm_pool, str(tmp_path / "first"))
    # An earlier test's prep actors that were not kept exit some hundreds of ms after its sweep closed.
    kept = settled_when(_prep_actors, lambda pids: len(pids) <= 2)
    assert len(kept) == 2 and warm.kept() == {node: (2, 0.5)}, "one actor per CPU, half the CPUs, kept"
    assert live_coordprep_actors() == [], "the registry and the coordinators end with the sweep"
    assert plasma_objects_settled(baseline) <= baseline, "the kept actors hold nothing of the sweep"

    # The dataset grows between the sweeps: the kept actors opened and indexed it before.
    make_imagefolder(root, classes=2, per_class=30)
    open_source.cache_clear()
    assert len(open_source(root)) == 60
    _sweep(spec, warm_pool, str(tmp_path / "second"))  # 60 samples, checked against the unshared bytes
    assert _prep_actors() == kept, "the second sweep ran on the kept actors and started none"
    assert plasma_objects_settled(baseline) <= baseline

    # Another shape (one actor reserving the same CPU): the kept pair must give its CPU back before
    # this pool can start; the new one is kept, and release() ends it. Starting the next sweep's
    # searcher is what starts its pool: no trial is needed for that.
    searcher = CoordinatedSearcher(pool=PoolSpec(actors=1, keep_warm=True))
    try:
        searcher.start()
    finally:
        searcher.close()
    assert warm.kept() == {node: (1, 1.0)} and settled(lambda: len(_prep_actors()), 1) == 1
    assert not kept & _prep_actors(), "the pair was killed"
    warm.release()
    assert warm.kept() == {} and settled(_prep_actors, set()) == set()
    assert live_coordprep_actors() == [] and plasma_objects_settled(baseline) <= baseline


@ray.remote(num_cpus=0)
class _Starting:
    """An actor still starting: its constructor waits until the test opens the Gate ``gate``."""

    def __init__(self, gate: str) -> None:
        ray.get(ray.get_actor(gate, namespace="coordinated_prep").wait_open.remote(60), timeout=90)


def test_trials_start_before_the_registry_only_on_kept_actors_that_all_answer(ray_session):
    """``warm.placed``: the searcher lets Tune place trials before its registry has started only when
    every node's pool is of lent actors that answer at once, so that they hold their CPUs already."""
    node = ray.get_runtime_context().get_node_id()
    gate = Gate.options(name="placed-starting", namespace="coordinated_prep").remote()
    kept = Gate.remote()  # any actor that answers stands for a kept prep actor here
    starting = _Starting.remote("placed-starting")
    try:
        ray.get(kept.__ray_ready__.remote(), timeout=60)
        assert not warm.placed({}), "no pool lent: the registry starts its own, and the sweep waits for it"
        assert warm.placed({node: [kept]})
        assert not warm.placed({"another-node": [kept]}), "a live node has no lent pool"
        assert not warm.placed({node: [kept, starting]}, timeout_s=0.5), "an actor still starting holds no CPU yet"
        ray.get(gate.open.remote(), timeout=60)
        ray.get(starting.__ray_ready__.remote(), timeout=60)
        assert warm.placed({node: [kept, starting]})
    finally:
        for actor in (kept, starting, gate):
            ray.kill(actor)
