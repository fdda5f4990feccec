"""GroupRegistry membership under interleavings, on a plain asyncio loop with fake actor handles (no Ray).

Each test stops one call at an await (a gate), runs the competing call into the gap, then opens the
gate: the order of events is fixed by the test, not by timing.
"""

from __future__ import annotations

import asyncio
from typing import Any, Callable

import pytest
import ray

from coordinated_prep import registry as registry_module
from coordinated_prep.errors import DatasetError
from coordinated_prep.registry import GroupRegistry
from coordinated_prep.spec import DataSpec

NODE = "ab" * 28  # a node id is 28 bytes in hex


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
        self.made.append(self)

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


@pytest.fixture
def registry(monkeypatch: pytest.MonkeyPatch) -> GroupRegistry:
    _Coordinator.made = []
    starting: list[asyncio.Event | None] = []  # the gate a new coordinator's index check waits on

    def make(*args: Any) -> _Coordinator:
        found = _Coordinator(*args)
        found.index_gate = starting.pop(0) if starting else None
        return found

    monkeypatch.setattr(registry_module.Coordinator, "options", lambda **kw: _Method(make), raising=False)
    monkeypatch.setattr(registry_module, "check_same_index", lambda *args: None)
    monkeypatch.setattr(ray, "kill", lambda actor: setattr(actor, "killed", True))

    async def no_index(self: GroupRegistry, dataset: str, node: str) -> tuple[None, int]:
        return None, 0  # the node's index of the dataset: not what these tests are about

    monkeypatch.setattr(GroupRegistry, "_coordinator_index", no_index)
    found = GroupRegistry("test")
    found._pools[NODE] = _Pool()
    found.next_index_gate = starting  # type: ignore[attr-defined]
    return found


def _spec() -> DataSpec:
    return DataSpec(dataset="builtin:shapes", seed=0)


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
    from coordinated_prep.registry import start_bound_s

    assert start_bound_s(1_281_167) > 1_281_167 * 0.002, "an ImageNet-sized tree gets more than 2 ms per file"
    assert start_bound_s(0) == registry_module._CALL_TIMEOUT_S

    class Silent:  # a coordinator whose fingerprint never comes
        class fingerprint:
            @staticmethod
            def remote():
                return asyncio.get_running_loop().create_future()

    monkeypatch.setattr(registry_module, "_CALL_TIMEOUT_S", 0.01)
    found = GroupRegistry("s")
    with pytest.raises(DatasetError) as error:
        asyncio.run(found._check_index("/nfs/imagenet/train", "node-7", Silent(), 0))
    message = str(error.value)
    assert "/nfs/imagenet/train" in message and "node-7" in message and "coordprep convert" in message
