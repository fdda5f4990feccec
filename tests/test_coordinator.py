"""The Coordinator's own bookkeeping, its class run in this process (no prep actors, so it prepares nothing)."""

from __future__ import annotations

import asyncio
import subprocess
import sys

from coordinated_prep import DataSpec
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
