"""Shared fixtures: one Ray instance for the session (a module that needs another starts its own), small
datasets, an isolated dataset cache."""

from __future__ import annotations

import os
import re
import sys
import time
from typing import Callable, TypeVar

import pytest

from tests.utils import make_imagefolder

T = TypeVar("T")

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Ray Train's own settings for a machine with no preemption: no watcher actor per run (one process
# fewer per data-parallel trial), and its controller polls the ranks every 0.5 s instead of 2 s, so a
# run's end and a rank's death are seen sooner. Set before any Ray starts: its processes inherit them.
os.environ.setdefault("RAY_TRAIN_ENABLE_PREEMPTION_WATCHER", "0")
os.environ.setdefault("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", "0.5")


@pytest.fixture(scope="session", autouse=True)
def _isolated_cache(tmp_path_factory):
    """Generated datasets go to a per-session cache, never the user's."""
    os.environ["COORDPREP_CACHE"] = str(tmp_path_factory.mktemp("coordprep-cache"))
    yield


#: Settings of the session's shared Ray instance: 2 CPUs as on the CI machines, no dashboard (its
#: processes took about 6% of the suite's CPU; tests/test_metrics.py runs a Ray of its own with it).
def shared_ray_settings() -> dict:
    return dict(address="local", num_cpus=2, include_dashboard=False,
                object_store_memory=512 * 2**20, log_to_driver=False,
                runtime_env={"env_vars": {"PYTHONPATH": REPO, "COORDPREP_CACHE": os.environ["COORDPREP_CACHE"]}})


_shared_ray_up = False  # whether the Ray instance this process is connected to is the shared one


@pytest.fixture(scope="module")
def ray_session():
    """The session's shared local Ray instance: started by the first module that asks for it and kept
    for the next (starting and stopping one costs 5 to 15 s on 2 cores, and 25 modules use it). A
    module that needs Ray started otherwise (a cluster, a metrics port, an S3 server's environment)
    calls :func:`own_ray` first. Each test leaves it as it found it: no actor of ours, no object."""
    import ray

    global _shared_ray_up
    if not (_shared_ray_up and ray.is_initialized()):
        own_ray()
        ray.init(**shared_ray_settings())
        _shared_ray_up = True
    yield ray


def own_ray() -> None:
    """Shut the shared instance down (if this process runs one) before a module starts its own."""
    global _shared_ray_up
    if "ray" in sys.modules and sys.modules["ray"].is_initialized():
        if "coordinated_prep.pool.warm" in sys.modules:
            sys.modules["coordinated_prep.pool.warm"].release()
        sys.modules["ray"].shutdown()
    _shared_ray_up = False


@pytest.fixture(scope="session")
def warm_pool():
    """The pool options of a test whose sweep may start on the prep actors an earlier test kept, and
    keeps them for the next (``PoolSpec(keep_warm=True)``, :mod:`coordinated_prep.pool.warm`): each
    sweep's start then skips 2 processes importing torch (about 8 s of a 35 s test on 2 cores)."""
    from coordinated_prep import PoolSpec

    return PoolSpec(keep_warm=True)


@pytest.fixture(autouse=True)
def _no_warm_pool_unless_asked(request):
    """A test of the shared Ray instance that does not take :func:`warm_pool` finds no kept prep actor
    holding CPUs. A test that does not use Ray leaves them be, for the next sweep (and the suite runs
    every test that takes :func:`warm_pool` after those that do not: see
    :func:`pytest_collection_modifyitems`)."""
    asks = set(request.fixturenames)
    if "ray_session" in asks and "warm_pool" not in asks and "coordinated_prep.pool.warm" in sys.modules:
        import ray

        if ray.is_initialized():
            sys.modules["coordinated_prep.pool.warm"].release()
    yield


@pytest.fixture(scope="session", autouse=True)
def _ray_down_at_the_end():
    yield
    own_ray()


@pytest.fixture
def node_cache(tmp_path, monkeypatch) -> str:
    """A node shard cache of this test's own (the session's is shared by every test), no backoff."""
    from coordinated_prep.pipeline.sources import remote

    monkeypatch.setenv("COORDPREP_CACHE", str(tmp_path / "node"))
    monkeypatch.setattr(remote, "BACKOFF_S", 0.0)
    return str(tmp_path / "node" / "shards")


@pytest.fixture(scope="module")
def small_dataset(tmp_path_factory) -> str:
    """An ImageFolder of 3 classes x 60 images (JPEG and PNG), 48 x 40 px."""
    return make_imagefolder(str(tmp_path_factory.mktemp("imagefolder")), classes=3, per_class=60)


def plasma_objects() -> int:
    """Objects in the node's object store now (from Ray's memory summary)."""
    import ray
    from ray._private.internal_api import memory_summary

    # The address of this test's Ray: another instance on the machine must not make it ambiguous.
    summary = memory_summary(address=ray.get_runtime_context().gcs_address, stats_only=True)
    match = re.search(r"Plasma memory usage \d+ MiB, (\d+) objects", summary)
    assert match, "Ray's memory summary changed format"
    return int(match.group(1))


def settled(probe: Callable[[], T], expected: T, timeout_s: float = 10.0) -> T:
    """``probe()`` as soon as it returns ``expected``, or its value after ``timeout_s``.

    For what Ray finishes asynchronously after the call that caused it returned, with no event to
    wait on: a killed actor's process exits, and a freed object leaves the store, some hundreds of
    milliseconds later (measured: 12 objects, none referenced, gone 0.5-1.0 s after
    ``searcher.close()`` returned). A real leak is still there after the deadline and fails the
    caller's comparison.
    """
    return settled_when(probe, lambda value: value == expected, timeout_s)


def settled_when(probe: Callable[[], T], done: Callable[[T], bool], timeout_s: float = 10.0) -> T:
    """``probe()`` as soon as ``done`` holds for it, or its value after ``timeout_s`` (see :func:`settled`)."""
    deadline = time.monotonic() + timeout_s
    while not done(value := probe()) and time.monotonic() < deadline:
        time.sleep(0.2)  # polling state Ray offers no event for, bounded by the deadline
    return value


def plasma_objects_settled(baseline: int, timeout_s: float = 10.0) -> int:
    """Objects in the store once Ray's frees have landed: as soon as there are no more than
    ``baseline`` (a test compares ``<= baseline``: the baseline may still hold an object an earlier
    test of the module was freeing, which is gone by the end; a leak stays above it)."""
    return settled_when(plasma_objects, lambda count: count <= baseline, timeout_s)


def live_coordprep_actors() -> list[str]:
    """Names of our actors still alive (registry, coordinators)."""
    import ray

    return [a["name"] for a in ray.util.list_named_actors(all_namespaces=True) if a["name"].startswith("coordprep")]


#: Fixtures that start Ray (a module's instance, or a cluster of several nodes).
_RAY_FIXTURES = {"ray_session", "cluster", "s3_ray"}


def pytest_collection_modifyitems(config, items):
    """Mark every test that starts Ray or runs a sweep as ``sweep``: the quick tier
    (``pytest -m "not sweep"``) is the pure logic, the loaders and the single-process pipelines.

    And order the tests so that the processes they start are started as few times as possible (each
    prep actor imports torch and torchvision: about 4 CPU-seconds on 2 cores), stably, in 3 blocks:

    1. every test that keeps no pool warm (pure ones, and those that start a pool of their own);
    2. the tests that take :func:`warm_pool`: the first starts the kept pool and every later one of
       its shape starts on it, the modules of another shape (``KEPT_POOL_SHAPE`` set) last;
    3. the modules that start a Ray of their own (they call :func:`own_ray`), each whole, in their
       order: the shared instance is stopped once, before them.

    A module's tests may then not be contiguous: its module-scoped fixtures are set up once per run
    of its tests (the shared Ray is not: it is kept, see :func:`ray_session`)."""
    def block(item) -> tuple[bool, bool, bool]:
        module = getattr(item, "module", None)
        own = getattr(module, "own_ray", None) is own_ray
        warm = "warm_pool" in getattr(item, "fixturenames", ())
        return own, own or warm, warm and getattr(module, "KEPT_POOL_SHAPE", None) is not None

    items.sort(key=block)  # stable
    for item in items:
        if _RAY_FIXTURES & set(getattr(item, "fixturenames", ())) or item.get_closest_marker("soak"):
            item.add_marker(pytest.mark.sweep)


_EXIT_STATUS: list[int] = []


def pytest_sessionfinish(session, exitstatus):
    _EXIT_STATUS.append(int(exitstatus))


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config):
    """Exit with the session's status, skipping the interpreter's teardown.

    After every test has run and pytest has printed its summary, the process has crashed in the
    interpreter's final teardown (SIGSEGV, exit status 139) in 3 of about 8 full runs on the
    2-core machines: native destructors of the libraries loaded in this process (DALI pipelines,
    DALI issue 6166; Ray's core worker) run there in no defined order. Nothing of ours is left to
    clean up by then (each module shut its Ray instance down), so the status is returned at once.
    """
    if _EXIT_STATUS and not hasattr(config, "workerinput"):  # not in a pytest-xdist worker
        import sys

        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(_EXIT_STATUS[-1])
