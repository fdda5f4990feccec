"""Issue 22, item 6: the smaller fixes (bookkeeping bounds, start bounds, finalizers, evaluation skips)."""

from __future__ import annotations

import asyncio
import dataclasses
import subprocess
import sys

import pytest

from coordinated_prep import DataSpec
from coordinated_prep.errors import DatasetError
from coordinated_prep.watch import Process, _start_time


def test_a_detached_consumer_is_forgotten_when_its_process_ends_or_its_trial_is_over(ray_session, small_dataset):
    from coordinated_prep.coordinator import Coordinator

    spec = DataSpec(dataset=small_dataset, pipeline={"size": 16}, chunk_size=8)

    async def scenario() -> tuple[list[str], list[str], list[str]]:
        # The actor's class, run in this process: no prep actors, so it prepares nothing.
        coordinator = Coordinator.__ray_metadata__.modified_class(spec, "test-coordinator", [], 1 << 20)
        child = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
        try:
            a = await coordinator.join("a", 1, Process(child.pid, _start_time(child.pid), None))
            b = await coordinator.join("b#2", 1)
            for trial, info in (("a", a), ("b#2", b)):  # what the lease does to the trials holding the budget
                coordinator.buffer.leave(trial, info["token"])
                coordinator.evicted[trial] = info["token"]
            before = (await coordinator.report())["detached"]
            watch = coordinator.watch._tasks["a"]  # still watching a's process after the detachment
            child.stdin.close()
            child.wait(timeout=30)
            await asyncio.wait_for(watch, 30)  # the watch sees the process end and releases it
            after_exit = (await coordinator.report())["detached"]
            await coordinator.leave_trial("b")  # Tune reports trial b over (its second loader was detached)
            after_done = (await coordinator.report())["detached"]
            await coordinator.close(1.0)
            return before, after_exit, after_done
        finally:
            child.kill()
            child.wait(timeout=30)

    before, after_exit, after_done = asyncio.run(scenario())
    assert before == ["a", "b#2"]
    assert after_exit == ["b#2"], "a detached trial's entry goes when its process ends"
    assert after_done == [], "a detached trial's entry goes when Tune reports the trial over"


def test_a_group_start_allows_time_per_file_and_names_the_dataset_and_the_fix(monkeypatch):
    from coordinated_prep import registry
    from coordinated_prep.registry import GroupRegistry, start_bound_s

    assert start_bound_s(1_281_167) > 1_281_167 * 0.002, "an ImageNet-sized tree gets more than 2 ms per file"
    assert start_bound_s(0) == registry._CALL_TIMEOUT_S

    class Silent:  # a coordinator whose fingerprint never comes
        class fingerprint:
            @staticmethod
            def remote():
                return asyncio.get_running_loop().create_future()

    monkeypatch.setattr(registry, "_CALL_TIMEOUT_S", 0.01)
    found = GroupRegistry.__ray_metadata__.modified_class("s")
    with pytest.raises(DatasetError) as error:
        asyncio.run(found._check_index("/nfs/imagenet/train", "node-7", Silent(), 0))
    message = str(error.value)
    assert "/nfs/imagenet/train" in message and "node-7" in message and "coordprep convert" in message


def test_a_loader_dropped_without_close_leaves_its_group(ray_session, small_dataset):
    import gc

    from coordinated_prep import CoordinatedSearcher
    from coordinated_prep.loader import TrainLoader
    from coordinated_prep.streams import SharedStream
    from tests.conftest import settled

    spec = DataSpec(dataset=small_dataset, pipeline={"size": 16}, chunk_size=8)
    searcher = CoordinatedSearcher()
    searcher.start()
    try:
        kept = TrainLoader(SharedStream(spec, "t1", "t1", 8), 8)  # this one stays
        dropped = TrainLoader(SharedStream(spec, "t1", "t1#2", 8), 8)
        coordinator = kept._stream._coordinator

        def consumers() -> list[str]:
            return sorted(ray_session.get(coordinator.report.remote(), timeout=30)["consumers"])

        assert consumers() == ["t1", "t1#2"]
        del dropped  # never closed
        gc.collect()
        assert settled(consumers, ["t1"]) == ["t1"], "the dropped loader's consumer left its group"
        kept.close()
        assert settled(consumers, []) == []
    finally:
        searcher.close()


def test_evaluation_with_a_corrupt_held_out_file_under_skip(ray_session, tmp_path):
    from ray import tune

    from coordinated_prep import CoordinatedSearcher
    from coordinated_prep.plan import holdout_split
    from coordinated_prep.sources import ImageFolderSource
    from tests.recording import record
    from tests.utils import make_imagefolder

    root = make_imagefolder(str(tmp_path / "data"), classes=2, per_class=20)
    source = ImageFolderSource(root)
    _, held = holdout_split(len(source), 0.1)
    broken = source.paths[int(held[0])]
    with open(broken, "wb") as f:
        f.write(b"not a jpeg")
    spec = DataSpec(dataset=root, pipeline={"size": 16}, seed=1, chunk_size=8, holdout=0.1, on_error="skip")
    searcher = CoordinatedSearcher()
    try:
        analysis = tune.run(tune.with_resources(record, {"cpu": 0.25}), search_alg=searcher, verbose=0,
                            raise_on_failed_trial=False,
                            config={"data": spec, "batch_size": 8, "epochs": 1, "evaluate": True,
                                    "out": str(tmp_path / "out"), "n": tune.grid_search([1, 2])})
        [report] = searcher.eval_reports().values()
    finally:
        searcher.close()
    assert all(t.status == "TERMINATED" for t in analysis.trials), [t.error_file for t in analysis.trials]
    for t in analysis.trials:
        assert t.last_result["eval_samples"] == len(held) - 1, t  # evaluated without that one sample
    assert report["samples_skipped"] == 1 and report["skipped_files"] == [broken], report
    # Unshared (the same function in the trial's own process): the same sample left out.
    from coordinated_prep.loader import eval_loader
    assert sum(len(b) for b in eval_loader(dataclasses.replace(spec, coordinated=False), 8)) == len(held) - 1
