"""The Coordinator's own bookkeeping, its class run in this process (no prep actors, so it prepares nothing)."""

from __future__ import annotations

import asyncio
import subprocess
import sys

from coordinated_prep import DataSpec
from coordinated_prep.stream.watch import Process, _start_time


def test_a_detached_consumer_is_forgotten_when_its_process_ends_or_its_trial_is_over(ray_session, small_dataset):
    from coordinated_prep.stream.coordinator import Coordinator

    spec = DataSpec(dataset=small_dataset, pipeline={"size": 16}, chunk_size=8)

    async def scenario() -> tuple[list[str], list[str], list[str], dict, dict]:
        # The actor's class, run in this process: no prep actors, so it prepares nothing.
        coordinator = Coordinator.__ray_metadata__.modified_class(spec, "test-coordinator", [], 1 << 20)
        child = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
        try:  # each reads a part of the split (a data-budget fidelity): the coordinator keeps its mask
            a = await coordinator.join("a", 1, Process(child.pid, _start_time(child.pid), None),
                                       {"subset": None, "fraction": 0.5, "fold": None})
            b = await coordinator.join("b#2", 1, part={"subset": None, "fraction": 0.3, "fold": None})
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
            return before, after_exit, after_done, coordinator.parts, coordinator.part_masks
        finally:
            child.kill()
            child.wait(timeout=30)

    before, after_exit, after_done, parts, masks = asyncio.run(scenario())
    assert before == ["a", "b#2"]
    assert after_exit == ["b#2"], "a detached trial's entry goes when its process ends"
    assert after_done == [], "a detached trial's entry goes when Tune reports the trial over"
    assert parts == {} and masks == {}, "and so do their parts' masks (a byte per sample each)"


class _LandingActor:
    """A prep actor that prepares nothing: each piece's task lands when the test lands it."""

    def __init__(self) -> None:
        self.prepare = self  # ``actor.prepare.options(num_returns=2).remote(...)``
        self.pending: list[tuple[asyncio.Future, int]] = []  # (its timing's future, its samples)

    def options(self, **_: object) -> "_LandingActor":
        return self

    def remote(self, key, box, epoch, indices, layout) -> tuple[asyncio.Future, str]:
        future = asyncio.get_running_loop().create_future()
        self.pending.append((future, len(indices)))
        return future, "piece"


def test_pieces_of_a_length_sorted_dataset_are_charged_their_real_bytes(ray_session, small_dataset):
    """The probe saw the dataset's shortest samples (a length-sorted speech set) and every piece
    lands at 15 times its estimate: the group is charged what landed and stays within its budget or
    one piece (before: four pieces reserved at the estimate took 15 times the budget while
    ``staged_bytes`` said it was within it)."""
    from types import SimpleNamespace

    from coordinated_prep.stream.coordinator import Coordinator
    from coordinated_prep.pipeline.chunk import ChunkTiming
    from coordinated_prep.pipeline.probe import Probe
    from coordinated_prep.pipeline.structure import LeafSpec, Layout

    spec = DataSpec(dataset=small_dataset, pipeline={"size": 16}, chunk_size=8)
    layout = Layout(("tuple", (("leaf",), ("leaf",))),
                    (LeafSpec("ragged", "float32", None), LeafSpec("dense", "int64", ())))  # audio clips, labels
    probed, real = 100, 1500  # bytes per sample: what the probe saw, what the pieces hold
    budget = 4 * 8 * probed

    async def scenario() -> list[tuple[int, int]]:
        actors = [_LandingActor(), _LandingActor()]
        coordinator = Coordinator.__ray_metadata__.modified_class(spec, "test-sizes", actors, budget, None,
                                                                    (200, Probe(layout, probed)))
        coordinator.producer = asyncio.get_running_loop().create_future()  # the test drives production
        coordinator.buffer.join("a")
        steps = []
        for _ in range(3):
            while coordinator._producer_state() == "go":
                coordinator._reserve_and_submit()
            for actor in actors:
                for future, samples in actor.pending:
                    future.set_result(SimpleNamespace(**ChunkTiming(0.0, 0.0)._asdict() | {"nbytes": samples * real}))
                actor.pending.clear()
            await asyncio.gather(*list(coordinator.settling))
            buffer = coordinator.buffer
            steps.append((buffer.staged_bytes, sum(coordinator.plan.chunk_len(g) * real for g in buffer.slots)))
            oldest = min(buffer.slots)
            buffer.fetched("a", oldest, coordinator.plan.chunk_len(oldest))
        coordinator.producer.cancel()
        await coordinator.close(1.0)
        return steps

    for staged, held in asyncio.run(scenario()):
        assert staged == held, f"staged_bytes says {staged}, the landed pieces hold {held}"
        assert held <= max(budget, 8 * real), f"{held} bytes staged for a budget of {budget}"


class _AnsweringActor:
    """A prep actor whose every piece is ready at once (its bytes: 100 per sample)."""

    def __init__(self) -> None:
        self.prepare = self

    def options(self, **_: object) -> "_AnsweringActor":
        return self

    def remote(self, key, box, epoch, indices, layout) -> tuple[asyncio.Future, str]:
        from types import SimpleNamespace

        from coordinated_prep.pipeline.chunk import ChunkTiming

        future = asyncio.get_running_loop().create_future()
        future.set_result(SimpleNamespace(**ChunkTiming(0.0, 0.0)._asdict() | {"nbytes": 100 * len(indices)}))
        return future, "piece"


def test_a_slower_trial_that_keeps_fetching_is_never_detached_by_the_lease(ray_session, small_dataset):
    """The lease is the longest time production waits for the trials holding the oldest piece: a trial
    that fetches the oldest piece well within it each time, however much slower than another, holds
    nothing that long. Before, the lease's clock ran on from the first stall while production went on
    between stalls, and detached such a trial one lease after its first stall."""
    from coordinated_prep.pipeline.probe import Probe
    from coordinated_prep.pipeline.chunk import image_layout
    from coordinated_prep.stream.coordinator import Coordinator

    spec = DataSpec(dataset=small_dataset, pipeline={"size": 16}, chunk_size=8, segments=2, lease_s=1.0, holdout=0.0)

    async def scenario() -> tuple[list[str], int, int]:
        coordinator = Coordinator.__ray_metadata__.modified_class(
            spec, "test-lease", [_AnsweringActor()], 4 * 8 * 100, None, (180, Probe(image_layout((0,)), 100)))
        a = (await coordinator.join("a", 5))["token"]
        b = (await coordinator.join("b", 5))["token"]
        failed: list[str] = []

        async def fast() -> None:  # two requests in flight, as a trial's loader keeps them
            pending = []
            for g in range(60):
                pending.append(asyncio.ensure_future(coordinator.fetch("a", a, g, 30)))
                if len(pending) >= 2 and (await pending.pop(0))["status"] != "ok":
                    return

        async def slow() -> None:
            for g in range(60):
                await asyncio.sleep(0.4)  # a step of 0.4 s per piece (the trial's compute), well within the lease
                answer = await coordinator.fetch("b", b, g, 30)
                if answer["status"] != "ok":
                    failed.append(f"piece {g}: {answer['status']}")
                    return

        slow_one = asyncio.ensure_future(slow())
        await asyncio.wait([asyncio.ensure_future(fast()), slow_one], timeout=3.0)
        report = await coordinator.report()
        slow_one.cancel()
        await coordinator.close(1.0)
        return failed, report["evictions"], report["pieces_prepared"]

    failed, evictions, prepared = asyncio.run(scenario())
    assert prepared >= 8, "production went on past the budget's 4 pieces while both trials read"
    assert failed == [] and evictions == 0, (failed, evictions)


def test_a_wait_that_outlasts_the_fetch_timeout_behind_a_straggler_names_it_and_the_lease(ray_session, small_dataset):
    from coordinated_prep.errors import PrepError
    from coordinated_prep.pipeline.chunk import image_layout
    from coordinated_prep.pipeline.probe import Probe
    from coordinated_prep.stream.coordinator import Coordinator

    spec = DataSpec(dataset=small_dataset, pipeline={"size": 16}, chunk_size=8, segments=2, lease_s=60.0, holdout=0.0)

    async def scenario() -> str:
        coordinator = Coordinator.__ray_metadata__.modified_class(
            spec, "test-lease-timeout", [_AnsweringActor()], 4 * 8 * 100, None, (180, Probe(image_layout((0,)), 100)))
        await coordinator.join("straggler", 5)  # joins and reads nothing
        b = (await coordinator.join("b", 5))["token"]
        try:
            for g in range(8):
                await coordinator.fetch("b", b, g, 1.0)
        except PrepError as e:
            return str(e)
        finally:
            await coordinator.close(1.0)
        return "no error"

    message = asyncio.run(scenario())
    assert "piece 4 was not prepared within 1.0s" in message, message
    assert "trials ['straggler'] have not read yet" in message and "lower data.lease_s" in message, message
