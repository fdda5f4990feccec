"""GroupRegistry membership under interleavings, on a plain asyncio loop with fake actor handles (no Ray).

Each test stops one call at an await (a gate), runs the competing call into the gap, then opens the
gate: the order of events is fixed by the test, not by timing.
"""

from __future__ import annotations

import asyncio
import subprocess
from typing import Any, Callable

import pytest
import ray

from coordinated_prep.errors import DatasetError, PrepError
from coordinated_prep.spec import DataSpec
from coordinated_prep.stream import indexes as indexes_module
from coordinated_prep.stream import registry as registry_module
from coordinated_prep.stream import runs as runs_module
from coordinated_prep.stream import watch as watch_module
from coordinated_prep.stream.registry import GroupRegistry
from coordinated_prep.stream.watch import Process, this_process

NODE = "ab" * 28  # a node id is 28 bytes in hex
NODE2 = "cd" * 28


class _Method:
    """``handle.method.remote(*args)`` of a fake actor: a coroutine, as awaiting an ObjectRef is."""

    def __init__(self, fn: Callable[..., Any]) -> None:
        self._fn = fn

    def remote(self, *args: Any) -> Any:
        return self._fn(*args)


class _Coordinator:
    """A fake coordinator: alive until killed or ``die()``; its fingerprint and liveness can be gated."""

    made: list["_Coordinator"] = []

    def __init__(self, *args: Any) -> None:
        self.alive, self.killed, self.closed = True, False, False
        self.left: list[str] = []
        self.ready_gate: asyncio.Event | None = None  # held shut: the liveness check waits
        self.index_gate: asyncio.Event | None = None  # held shut: the group's index check waits
        self.index_error: BaseException | None = None
        self.__ray_ready__ = _Method(self._ready)
        self.fingerprint = _Method(self._fingerprint)
        self.leave_trial = _Method(self._async(lambda trial: self.left.append(trial)))
        self.set_budget = _Method(self._async(lambda share: None))
        self.report = _Method(self._async(lambda: {}))
        self.close = _Method(self._async(self._close))
        self.join_point = _Method(self._async(lambda: 0))
        self.join_ranks = _Method(self._async(self._join_ranks))
        self.leave = _Method(self._async(lambda consumer, token=None: self.left.append(consumer)))
        # asked on the processes' node, as the real one is: here every process is on this machine
        self.ended = _Method(self._async(lambda processes: [Process(*p).ended() for p in processes]))
        self.joined: list[str] = []
        self.made.append(self)

    def _join_ranks(self, consumer: str, ranks: dict[int, Any], world: int, start: int, epochs: Any,
                    part: Any = None) -> Any:
        self.joined += [f"{consumer}@{rank}" for rank in ranks]
        return {"tokens": {rank: rank for rank in ranks}, "info": {"start": 0 if start is None else start, "name": "fake"}}

    def die(self) -> None:
        self.alive = False

    def _close(self) -> None:
        self.closed = True

    @staticmethod
    def _async(fn: Callable[..., Any]) -> Callable[..., Any]:
        async def call(*args: Any) -> Any:
            return fn(*args)
        return call

    async def _ready(self) -> None:
        if self.ready_gate is not None:
            await self.ready_gate.wait()
        if not self.alive:
            raise ray.exceptions.RayActorError()

    async def _fingerprint(self) -> str:
        if self.index_gate is not None:
            await self.index_gate.wait()
        if self.index_error is not None:
            raise self.index_error
        return "same index"


class _PrepActor:
    """A fake prep actor: its probe answers at once with the built-in pipeline's layout."""

    @staticmethod
    async def _probe(spec: DataSpec, mode: str = "train") -> Any:
        from coordinated_prep.pipeline.chunk import image_layout
        from coordinated_prep.pipeline.probe import Probe

        layout = image_layout((3, spec.pipeline.size, spec.pipeline.size))
        return 100, Probe(layout, layout.sample_bytes())

    probe = _Method(_probe)


class _Pool:
    node, actors, budget_bytes, reserved_cpus = NODE, [_PrepActor()], 10**9, 1.0


class _Here:
    """``ray.get_runtime_context()`` of the registry: it runs on ``NODE`` (no Ray started)."""

    @staticmethod
    def get_node_id() -> str:
        return NODE


@pytest.fixture
def registry(monkeypatch: pytest.MonkeyPatch) -> GroupRegistry:
    _Coordinator.made = []
    starting: list[asyncio.Event | None] = []  # the gate a new coordinator's index check waits on

    def make(*args: Any) -> _Coordinator:
        found = _Coordinator(*args)
        found.index_gate = starting.pop(0) if starting else None
        return found

    monkeypatch.setattr(registry_module.Coordinator, "options", lambda **kw: _Method(make), raising=False)
    monkeypatch.setattr(indexes_module, "check_same_index", lambda *args: None)
    monkeypatch.setattr(ray, "kill", lambda actor: setattr(actor, "killed", True))

    async def no_index(self: GroupRegistry, dataset: str, node: str) -> tuple[None, int]:
        return None, 0  # the node's index of the dataset: not what these tests are about

    monkeypatch.setattr(GroupRegistry, "_coordinator_index", no_index)
    monkeypatch.setattr(ray, "get_runtime_context", _Here)
    found = GroupRegistry("test")
    found._pools[NODE] = _Pool()
    found.next_index_gate = starting  # type: ignore[attr-defined]
    return found


def _spec(seed: int = 0) -> DataSpec:
    return DataSpec(dataset="builtin:shapes", seed=seed)


async def _until_blocked(task: asyncio.Task, lock: asyncio.Lock) -> None:
    """Let ``task`` run until it waits (for ``lock``, which the test's other call holds)."""
    for _ in range(100):  # yields of the loop, not time: each lets every ready task take one step
        await asyncio.sleep(0)
    assert lock.locked() and not task.done(), "the completion went ahead inside the start"


async def _start_gated(registry: GroupRegistry, trial: str) -> tuple[asyncio.Event, asyncio.Future]:
    """``trial`` asks for its group, whose new coordinator's index check waits at a gate (shut)."""
    gate = asyncio.Event()
    registry.next_index_gate.append(gate)
    starting = asyncio.ensure_future(registry.group_for(_spec(), trial, NODE))
    for _ in range(100):  # yields of the loop, not time: the start runs up to the gate
        await asyncio.sleep(0)
    return gate, starting


def test_a_completion_during_the_liveness_check_does_not_destroy_the_joiners_group(registry):
    async def scenario() -> None:
        first = await registry.group_for(_spec(), "X", NODE)
        first.ready_gate = asyncio.Event()  # Y's join stops in the liveness check
        joining = asyncio.ensure_future(registry.group_for(_spec(), "Y", NODE))
        await asyncio.sleep(0)
        done = asyncio.ensure_future(registry.trial_done("X"))  # X, the last member, completes now
        await _until_blocked(done, registry._lock(next(iter(registry._groups))))
        first.ready_gate.set()
        got = await joining
        await done
        assert got is first and not got.killed and not got.closed, "Y was handed a destroyed coordinator"
        assert first.left == ["X"], "X left the group Y keeps alive"
        await registry.trial_done("Y")
        assert got.killed and not registry._groups and not registry._members

    asyncio.run(scenario())


def test_a_dead_members_completion_does_not_destroy_the_replacement_being_built(registry):
    async def scenario() -> None:
        dead = await registry.group_for(_spec(), "C", NODE)
        assert await registry.group_for(_spec(), "D", NODE) is dead
        dead.die()  # the coordinator dies; Tune retries C, and D completes (failed for good)
        gate, retry = await _start_gated(registry, "C")  # the replacement's index check waits
        assert len(_Coordinator.made) == 2, "the retry is building a replacement"
        done = asyncio.ensure_future(registry.trial_done("D"))
        await _until_blocked(done, registry._lock(next(iter(registry._groups))))
        gate.set()
        replacement = await retry
        await done
        assert replacement is _Coordinator.made[1] and not replacement.killed and not replacement.closed
        assert registry._members[next(iter(registry._groups))] == {"C"}
        await registry.trial_done("C")
        assert replacement.killed and not registry._groups

    asyncio.run(scenario())


def test_a_completion_during_a_new_groups_start_waits_and_keeps_it(registry):
    async def scenario() -> None:
        gate, starting = await _start_gated(registry, "A")
        done = asyncio.ensure_future(registry.trial_done("A"))  # a retried A's earlier incarnation completing
        await _until_blocked(done, registry._lock(next(iter(registry._groups))))
        gate.set()
        got = await starting
        await done
        assert got.killed and not registry._groups, "A's completion came after its join: the group ends"
        assert not registry._members and not registry._trial_groups

    asyncio.run(scenario())


def test_a_failed_start_takes_back_only_the_membership_it_added(registry):
    async def scenario() -> None:
        gate, starting = await _start_gated(registry, "A")
        _Coordinator.made[0].index_error = DatasetError("the index differs on this node")
        gate.set()
        with pytest.raises(DatasetError, match="index differs"):
            await starting
        assert _Coordinator.made[0].killed and not registry._groups
        assert not registry._members and not registry._trial_groups, "a trial that never joined is no member"

    asyncio.run(scenario())


def test_a_group_start_allows_time_per_file_and_names_the_dataset_and_the_fix(monkeypatch):
    from coordinated_prep.naming import CALL_TIMEOUT_S
    from coordinated_prep.stream.indexes import start_bound_s

    assert start_bound_s(1_281_167) > 1_281_167 * 0.002, "an ImageNet-sized tree gets more than 2 ms per file"
    assert start_bound_s(0) == CALL_TIMEOUT_S

    class Silent:  # a coordinator whose fingerprint never comes
        class fingerprint:
            @staticmethod
            def remote():
                return asyncio.get_running_loop().create_future()

    monkeypatch.setattr(indexes_module, "CALL_TIMEOUT_S", 0.01)
    found = GroupRegistry("s")
    with pytest.raises(DatasetError) as error:
        asyncio.run(found._check_index("/nfs/imagenet/train", "node-7", Silent(), 0))
    message = str(error.value)
    assert "/nfs/imagenet/train" in message and "node-7" in message and "coordprep convert" in message


# -- memberships that must not outlive their owner --------------------------------------------
async def _yields(n: int = 100) -> None:
    for _ in range(n):  # yields of the loop, not time: each lets every ready task take one step
        await asyncio.sleep(0)


class _Worker:
    """A process of this machine standing for a worker of a run: it runs until :meth:`end`."""

    def __init__(self) -> None:
        self._child = subprocess.Popen(["cat"], stdin=subprocess.PIPE)
        self.process = Process(self._child.pid, watch_module._start_time(self._child.pid) or "", None)

    def end(self) -> Process:
        self._child.stdin.close()  # cat exits at the end of its input
        self._child.wait()
        return self.process


def _ended_process() -> Process:
    """A process of this machine that has ended."""
    return _Worker().end()


def test_a_placement_that_ends_after_its_trial_completed_leaves_nothing_behind(registry):
    async def scenario() -> None:
        registry._pools[NODE2] = _Pool()
        gate = asyncio.Event()
        registry.next_index_gate.append(gate)  # the coordinator on NODE starts slowly
        ranks = [asyncio.ensure_future(registry.meet(_spec(), "T", "T", rank, 2, node, 1, this_process(None), 30.0))
                 for rank, node in ((0, NODE), (1, NODE2))]
        await _yields()
        assert len(_Coordinator.made) == 1, "the placement waits for the first node's coordinator"
        done = asyncio.ensure_future(registry.trial_done("T"))  # Tune: T failed (its ranks timed out)
        await _yields()
        gate.set()  # the first node's start ends; the placement goes on to the second node
        await done
        answers = await asyncio.gather(*ranks, return_exceptions=True)
        assert not registry._groups and not registry._members and not registry._trial_groups, \
            "a membership was added for a trial reported done"
        assert all(c.killed for c in _Coordinator.made), "a coordinator placed for a done trial survives"
        assert all(isinstance(a, PrepError) and "T" in str(a) for a in answers), answers
        assert not registry._rendezvous
        with pytest.raises(PrepError, match="T"):  # a late loader of the done trial joins nothing
            await registry.group_for(_spec(), "T", NODE)
        assert not registry._members and all(c.killed for c in _Coordinator.made)

    asyncio.run(scenario())


def test_a_restored_sweep_reruns_a_trial_that_completed_with_an_error(registry):
    async def scenario() -> None:
        await registry.group_for(_spec(), "E", NODE)
        await registry.trial_done("E")  # Tune: E errored
        with pytest.raises(PrepError, match="E"):
            await registry.group_for(_spec(), "E", NODE)
        await registry.restored()  # Tuner.restore(resume_errored=True) in the same driver
        await registry.group_for(_spec(), "E", NODE)
        assert registry._members and "E" in registry._trial_groups

    asyncio.run(scenario())


def _piece_bytes(registry: GroupRegistry) -> int:
    """Bytes of one piece of ``_spec()`` as the fake prep actor probes it."""
    from coordinated_prep.plan import piece_size

    samples, probe = asyncio.run(_PrepActor._probe(_spec()))
    return piece_size(None, samples) * probe.sample_bytes


def test_runs_without_tune_leave_their_groups_when_their_processes_end(registry):
    registry._pools[NODE].budget_bytes = 2 * _piece_bytes(registry)  # room for two groups' pieces, not three

    async def scenario() -> None:
        for seed in range(5):  # one after another, each run a group of its own (another seed)
            run, workers = f"train:sweep:run{seed}", [_Worker(), _Worker()]
            ranks = [asyncio.ensure_future(registry.meet(_spec(seed), run, run, rank, 2, NODE, 1, worker.process,
                                                         30.0)) for rank, worker in enumerate(workers)]
            placed = [await rank for rank in ranks]
            assert placed[0]["coordinator"] is _Coordinator.made[-1]
            for worker in workers:
                worker.end()  # the run ends: no Tune reports it
        assert len(registry._groups) <= 2 and all(c.killed for c in _Coordinator.made[:-2]), \
            "the ended runs' coordinators still hold the node's budget"
        live = this_process(None)  # a run with one worker, whose process runs: it stays
        await registry.group_for(_spec(9), "train:sweep:alive", NODE, live)
        await registry._reap()
        assert "train:sweep:alive" in registry._trial_groups and not _Coordinator.made[-1].killed
        assert set(registry._trial_groups) <= {"train:sweep:alive", "train:sweep:run4"}

    asyncio.run(scenario())


def test_a_run_leaves_on_the_registrys_timer_and_a_tune_trial_does_not(registry, monkeypatch):
    monkeypatch.setattr(runs_module, "_REAP_S", 0.01)

    async def scenario() -> None:
        tune_trial = await registry.group_for(_spec(1), "abc_00001", NODE, _ended_process())  # Tune's: paused
        run = await registry.group_for(_spec(2), "train:one:worker", NODE, _ended_process())
        await asyncio.wait_for(registry._reaper, 5.0)  # the timer ends when no run is left to watch
        assert run.killed and not registry._runs, "the run's group outlived its process"
        assert not tune_trial.killed and registry._members == {next(iter(registry._groups)): {"abc_00001"}}, \
            "a paused Tune trial keeps its group until Tune reports it complete"

    asyncio.run(scenario())


def test_ranks_on_one_node_start_where_it_holds_pieces_whatever_it_releases_meanwhile(registry):
    """The ranks' start on one node is its coordinator's join point when it registers them: a piece
    released between a question and the registration (another trial of the group read on) cannot
    leave them behind, preparing their own pieces (a clean clone's run saw both ranks of a trial do so)."""
    async def scenario() -> None:
        coordinator = await registry.group_for(_spec(), "reader", NODE)  # the group runs, its trial reads on
        low = [3]

        def join_point() -> int:  # the reader's next fetch releases a piece right after this answer
            low[0] += 1
            return low[0] - 1

        def join_ranks(consumer: str, ranks: dict, world: int, start: int | None, epochs: Any, part: Any = None) -> Any:
            if start is not None and start < low[0]:
                return None  # released already: the ranks would prepare their own pieces
            return {"tokens": {rank: rank for rank in ranks}, "info": {"start": low[0] if start is None else start}}

        coordinator.join_point = _Method(_Coordinator._async(join_point))
        coordinator.join_ranks = _Method(_Coordinator._async(join_ranks))
        ranks = [asyncio.ensure_future(registry.meet(_spec(), "R", "R", rank, 2, NODE, 1, this_process(None), 30.0))
                 for rank in (0, 1)]
        placed = [await rank for rank in ranks]
        assert all(p["info"] is not None for p in placed), "a release between asking and registering left them behind"
        assert {p["start"] for p in placed} == {p["info"]["start"] for p in placed} == {3}

    asyncio.run(scenario())


def test_ranks_on_one_node_whose_coordinator_dies_as_they_are_placed_are_placed_on_a_new_one(registry):
    async def scenario() -> None:
        first = await registry.group_for(_spec(), "reader", NODE)

        async def dies(*args: Any) -> Any:  # the coordinator dies as it would register the ranks
            first.die()
            raise ray.exceptions.RayActorError()

        first.join_ranks = _Method(dies)
        ranks = [asyncio.ensure_future(registry.meet(_spec(), "R", "R", rank, 2, NODE, 1, this_process(None), 30.0))
                 for rank in (0, 1)]
        placed = [await rank for rank in ranks]
        [replacement] = [c for c in _Coordinator.made if c is not first]
        assert all(p["coordinator"] is replacement and p["info"] is not None for p in placed), placed
        assert replacement.joined == ["R@0", "R@1"]

    asyncio.run(scenario())


def test_without_start_times_a_live_process_is_not_ended_and_ranks_meet(registry, monkeypatch):
    monkeypatch.setattr(watch_module, "_start_time", lambda pid: None)  # no /proc (macOS)
    here = this_process(None)
    assert here.started == "" and not here.ended(), "a live process called ended"
    assert _ended_process().ended(), "a process that is gone still looks alive"

    async def scenario() -> None:
        ranks = [asyncio.ensure_future(registry.meet(_spec(), "M", "M", rank, 2, NODE, 1, this_process(None), 30.0))
                 for rank in (0, 1)]
        await _yields()
        meeting = registry._rendezvous[(_spec().group_key, "M")]
        assert sorted(meeting.arrivals) == [0, 1] and meeting.placing is not None, \
            "rank 0's arrival was taken back as ended: the ranks never meet"
        placed = [await rank for rank in ranks]
        assert {p["info"]["consumer"] for p in placed} == {"M@0", "M@1"}

    asyncio.run(scenario())


def test_without_start_times_a_coordinator_still_releases_a_consumer_whose_process_ended(monkeypatch):
    from coordinated_prep.stream.watch import ProcessWatch

    monkeypatch.setattr(watch_module, "_start_time", lambda pid: None)  # no /proc (macOS)
    released: list[str] = []

    async def on_end(consumer: str, token: int) -> None:
        released.append(consumer)

    async def scenario() -> None:
        watch = ProcessWatch(lambda consumer, token: not released, on_end)
        worker = _Worker()
        watch.add("t", 1, worker.process._replace(started=""))
        assert "t" in watch._tasks, "no watch where start times are unknown: the consumer waits for the lease"
        worker.end()
        await asyncio.wait_for(watch._tasks["t"], 10.0)
        assert released == ["t"]

    asyncio.run(scenario())


def test_a_run_whose_coordinator_died_leaves_and_its_group_gives_back_its_share(registry):
    async def scenario() -> None:
        dead = await registry.group_for(_spec(3), "train:r:dead", NODE, this_process(None))  # it still runs
        other = await registry.group_for(_spec(4), "abc_00002", NODE)

        async def gone(processes: Any) -> None:
            raise ray.exceptions.RayActorError()

        dead.ended = _Method(gone)  # the coordinator died
        await registry._reap()
        assert dead.killed and list(registry._groups.values())[0].actor is other, "the dead group keeps a share"
        assert "train:r:dead" not in registry._trial_groups and not registry._runs
        assert await registry.group_for(_spec(3), "train:r:dead", NODE, this_process(None)) is _Coordinator.made[-1]

    asyncio.run(scenario())


def test_a_meeting_whose_last_waiting_rank_gave_up_is_dropped(registry):
    async def scenario() -> None:
        with pytest.raises(PrepError, match=r"rank 0 of 2 waited 0.05s for ranks \[1\]"):
            await registry.meet(_spec(), "train:r:lonely", "train:r:lonely", 0, 2, NODE, 1, this_process(None), 0.05)
        assert not registry._rendezvous, "a run's abandoned meeting is kept for the registry's life"
        assert not registry._members and not registry._groups

    asyncio.run(scenario())


class _EvalActor(_PrepActor):
    """A fake prep actor for evaluation: held-out pieces land when the test lands them."""

    def __init__(self) -> None:
        self.pending: list[tuple[asyncio.Future, int]] = []  # (its (skipped, nbytes) future, first index)
        self.held_out = _Method(self._held_out)
        self.prepare_eval = self  # ``prepare_eval.options(num_returns=2).remote(...)``

    @staticmethod
    async def _held_out(spec: DataSpec) -> Any:
        import numpy as np

        from coordinated_prep.pipeline.chunk import image_layout
        from coordinated_prep.pipeline.probe import Probe

        return np.arange(240), Probe(image_layout((0,)), 10)  # 10 bytes per sample: the shortest ones

    def options(self, **_: Any) -> "_EvalActor":
        return self

    def remote(self, key: str, box: Any, indices: Any, layout: Any) -> tuple[asyncio.Future, str]:
        future = asyncio.get_running_loop().create_future()
        self.pending.append((future, int(indices[0])))
        return future, f"piece-{int(indices[0]) // 8}"


def test_resident_evaluation_pieces_are_charged_their_real_bytes_and_the_groups_share_the_rest(registry, monkeypatch):
    """A length-sorted held-out split (in index order, piece ``i`` lands at ``i + 1`` times the
    probe's bytes per sample): the resident pieces stay within the node's evaluation allowance at
    their real bytes, and the node's groups are given what those leave (before: every piece that fit
    at the probe's estimate was made resident at once, holding 12 times the allowance, and the groups
    were split as if there were none)."""
    actor = _EvalActor()

    class Pool:
        node, actors, budget_bytes, reserved_cpus = NODE, [actor], 2 * 3200, 1.0  # an allowance of 3200

    registry._pools[NODE] = Pool()
    monkeypatch.setattr(ray, "put", lambda value: value)
    shares: list[int] = []

    def real(piece: int) -> int:
        return 8 * 10 * (piece + 1)

    async def scenario() -> Any:
        coordinator = await registry.group_for(DataSpec(dataset="builtin:shapes", pipeline={"size": 8}, chunk_size=2),
                                               "X", NODE)
        coordinator.set_budget = _Method(coordinator._async(shares.append))
        spec = DataSpec(dataset="builtin:shapes", chunk_size=8)
        plan = await registry.eval_plan(spec, "X", NODE)
        assert (await registry.eval_piece(plan["key"], 1))["ref"] == "piece-1", "made resident for its reader"
        while actor.pending:  # land what is in flight; what that makes resident lands in the next round
            landing, watches = list(actor.pending), list(registry._eval_watches)
            actor.pending.clear()
            for future, first in landing:
                future.set_result(((), real(first // 8)))
            await asyncio.gather(*watches)
        return registry._evals[plan["key"]]

    found = asyncio.run(scenario())
    resident = len(found.refs)
    assert resident and found.refs == [f"piece-{i}" for i in range(resident)]
    held = sum(real(i) for i in range(resident))
    assert held <= 3200, f"{resident} resident pieces hold {held} bytes for an allowance of 3200"
    assert found.resident_bytes == held and shares[-1] == 2 * 3200 - held
    assert found.samples_prepared == 8 * resident, "each resident piece prepared once"


# -- a group kept for the trials its searcher released (coordinated_prep/stream/linger.py) -----------

def test_a_group_with_more_trials_released_outlives_its_last_member_and_the_next_trial_reads_on_from_it(registry):
    async def scenario() -> None:
        first = await registry.group_for(_spec(), "A", NODE)
        [key] = registry._groups
        await registry.trial_done("A", keep=[_spec().group_key])  # the searcher released B, not started yet
        assert not first.killed and registry._lingering.timer(key) is not None, "kept, on a deadline"
        assert first.left == ["A"], "A left the coordinator: what it did not fetch is kept for B"
        assert await registry.group_for(_spec(), "B", NODE) is first, "B reads on from the pieces A left"
        assert registry._lingering.timer(key) is None, "a member again: no deadline"
        await registry.trial_done("B")  # nothing more released for it
        assert first.killed and not registry._groups and not registry._members

    asyncio.run(scenario())


def test_a_kept_group_that_no_trial_joins_is_destroyed_at_its_deadline(registry):
    async def scenario() -> None:
        registry._lingering.seconds = 0.0
        first = await registry.group_for(_spec(), "A", NODE)
        [key] = registry._groups
        await registry.trial_done("A", keep=[_spec().group_key, "another group's key"])
        deadline = registry._lingering.timer(key)
        assert deadline is not None and not first.killed
        await deadline  # the deadline passes with no member: destroyed, as at once without a keep
        assert first.killed and first.closed and not registry._groups and not registry._members
        assert registry._lingering.timer(key) is None
        assert await registry.group_for(_spec(), "C", NODE) is _Coordinator.made[1], "a later trial: a new one"

    asyncio.run(scenario())


def test_only_the_groups_named_are_kept_and_a_sweeps_end_destroys_a_kept_one(registry):
    async def scenario() -> None:
        kept = await registry.group_for(_spec(1), "A", NODE)
        other = await registry.group_for(_spec(2), "A", NODE)
        await registry.trial_done("A", keep=[_spec(1).group_key])
        assert not kept.killed and other.killed, "only the group that more trials will read is kept"
        [key] = registry._groups
        assert registry._lingering.timer(key) is not None
        registry._pools.clear()  # the fake pool has nothing to kill
        await registry.shutdown()
        assert kept.killed and not registry._groups and registry._lingering.timer(key) is None

    asyncio.run(scenario())


def test_a_group_starting_on_the_node_takes_a_kept_groups_share_and_a_failed_join_keeps_it_on_a_deadline(registry):
    async def scenario() -> None:
        kept = await registry.group_for(_spec(1), "A", NODE)
        [key] = registry._groups
        await registry.trial_done("A", keep=[_spec(1).group_key])
        kept.ready_gate = asyncio.Event()  # B's join stops in the liveness check, after it cancelled the deadline
        joining = asyncio.ensure_future(registry.group_for(_spec(1), "B", NODE))
        for _ in range(100):  # yields of the loop, not time
            await asyncio.sleep(0)
        assert registry._lingering.timer(key) is None and not joining.done()
        joining.cancel()  # B's call fails there (cancelled): the group has no member again
        with pytest.raises(asyncio.CancelledError):
            await joining
        assert registry._lingering.timer(key) is not None and not kept.killed, "kept again, on a deadline"
        kept.ready_gate = None
        other = await registry.group_for(_spec(2), "C", NODE)  # another group starts on the node
        assert kept.killed and not other.killed and list(registry._groups) != [key]
        assert registry._lingering.timer(key) is None

    asyncio.run(scenario())


@pytest.mark.parametrize("seed", range(20))
def test_kept_groups_under_random_joins_completions_and_deadlines(registry, seed):
    """Safety after every step of a random schedule (joins, completions that keep or not, deadlines
    passing, groups starting beside kept ones): a live group has a member or a deadline, a deadline
    belongs to a live memberless group, a trial never gets a destroyed coordinator. Liveness: once
    every trial completed, the timers alone, nobody else acting, leave nothing behind."""
    import random

    rng = random.Random(seed)
    specs = [_spec(1), _spec(2)]

    def check() -> None:
        for key, group in registry._groups.items():
            assert not group.actor.killed, f"a destroyed coordinator is still the group's: {key}"
            assert registry._members.get(key) or registry._lingering.timer(key) is not None, \
                f"group {key} has no member and no deadline: it would stay until the sweep's end"
        for key in registry._lingering.keys():
            assert key in registry._groups and not registry._members.get(key), f"a deadline without its group: {key}"

    async def scenario() -> None:
        registry._lingering.seconds = 3600.0  # deadlines pass when the schedule says (the "deadline" step)
        joined: dict[str, DataSpec] = {}
        done: set[str] = set()
        for step in range(60):
            action = rng.choice(["join", "join", "done", "deadline"])
            if action == "join":
                trial = f"t{rng.randrange(8)}"
                if trial in done:
                    continue
                spec = joined.setdefault(trial, rng.choice(specs))
                got = await registry.group_for(spec, trial, NODE)
                assert not got.killed, f"step {step}: {trial} was handed a destroyed coordinator"
            elif action == "done" and set(joined) - done:
                trial = rng.choice(sorted(set(joined) - done))
                keep = [s.group_key for s in specs if rng.random() < 0.5]
                await registry.trial_done(trial, keep=keep)
                done.add(trial)
            elif action == "deadline" and registry._lingering.keys():
                key = rng.choice(registry._lingering.keys())  # its deadline passes: what the timer then does
                registry._lingering.cancel(key)
                await registry._leave(None, key)
            check()
        for trial in sorted(set(joined) - done):  # the sweep's trials complete, keeping as they please
            await registry.trial_done(trial, keep=[s.group_key for s in specs if rng.random() < 0.5])
            check()
        registry._lingering.seconds = 0.0
        for key in registry._lingering.keys():  # the real timers from here on, due at once
            registry._keep(key)
        deadlines = [registry._lingering.timer(k) for k in registry._lingering.keys()]
        await asyncio.wait_for(asyncio.gather(*deadlines), 10)  # a bound, not a sleep: they are due now
        assert not registry._groups and not registry._members and not registry._lingering.keys()
        assert all(c.killed for c in _Coordinator.made), "every coordinator destroyed, by its deadline at the latest"

    asyncio.run(scenario())
