"""The sweep's registry, from the driver's side: started once by the searcher, awaited, destroyed.

Its life cycle: :meth:`RegistryStart._ensure_registry` creates it (or finds a twin's, after
``Tuner.restore``) and calls its ``start``: every node's prep pool, placed. Where the pools hold
their CPUs already (kept warm and lent, :func:`coordinated_prep.pool.warm.placed`), Tune may place
trials before that start answers; otherwise the searcher waits, so that Tune cannot take the CPUs
first. A start that fails shuts the registry down and ends the sweep (:meth:`_await_start`). The
searcher's ``close`` destroys it (:func:`destroy`).
"""

from __future__ import annotations

import logging
import time
from typing import Any

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from coordinated_prep.errors import PrepError
from coordinated_prep.naming import NAMESPACE, registry_name
from coordinated_prep.pool import warm
from coordinated_prep.pool.spec import PoolSpec
from coordinated_prep.stream.registry import RegistryActor

logger = logging.getLogger("coordinated_prep.tune.searcher")

CALL_TIMEOUT_S = 60.0


class RegistryStart:
    """The searcher's registry and its start (a mixin of
    :class:`~coordinated_prep.tune.searcher.CoordinatedSearcher`, which sets ``_pool``, ``_cache``,
    ``_registry``, ``_starting``, ``_start_error`` and ``_lent``)."""

    _pool: PoolSpec
    _cache: Any
    _registry: Any
    _starting: Any
    _start_error: BaseException | None
    _lent: dict[str, list[Any]]
    session: str | None

    def _ensure_registry(self, wait: bool = True) -> None:
        """Start the registry and every node's prep pool, once.

        The pools must hold their CPUs before Tune places trials on them, so this waits until they
        are ready, with one exception when Tune asks for a trial (``wait=False``): every node's pool
        is made of actors kept warm by the driver's last sweep that answer at once, so they hold
        their CPUs already. Tune's first trial then starts while the registry does (about 1 s on 2
        cores); a trial that asks for its group before the start is done waits for it in the
        registry. A start that failed is noted when Tune reports a result or a completion (a failed
        trial's completion waits for a pending start) and raised at Tune's next request for a trial,
        which ends the sweep as a failed start did before; the searcher is finished only after
        (:meth:`is_finished`), so that request comes.
        """
        if self._start_error is not None:
            raise self._start_error  # never a second registry after a failed start
        if self._registry is not None:
            self._await_start(block=wait)
            return
        context = ray.get_runtime_context()
        # Every trial of the sweep runs in the driver's Ray job and finds the registry by its id; a
        # restored searcher finds its twin's registry (get_if_exists). It lives on the driver's node,
        # as long as the driver.
        job = self.session = context.get_job_id()
        try:  # a twin's, still running (Tuner.restore in this driver): its pools are up, nothing to lend
            registry = ray.get_actor(registry_name(job), namespace=NAMESPACE)
        except ValueError:
            self._lent = warm.lend(self._pool)  # the last sweep's prep actors, if it kept them warm
            registry = RegistryActor.options(
                name=registry_name(job), namespace=NAMESPACE, get_if_exists=True,
                scheduling_strategy=NodeAffinitySchedulingStrategy(node_id=context.get_node_id(), soft=False),
            ).remote(job, self._cache, self._pool, self._lent)
        self._registry, self._starting = registry, registry.start.remote()
        self._start_by = time.monotonic() + self._pool.start_timeout_s + CALL_TIMEOUT_S
        if wait or not warm.placed(self._lent):
            self._await_start()

    def _await_start(self, block: bool = True) -> None:
        """Wait for the registry's start (``block=False``: only if it has answered, or its time is up).
        A start that failed leaves nothing behind: the registry is shut down, the lent actors are not kept.

        Raises:
            PrepError: A node's pool did not start (names the node and the fix).
        """
        if self._starting is None:
            return
        left = self._start_by - time.monotonic()  # a start that has not answered by then has failed
        if not block and left > 0 and not ray.wait([self._starting], timeout=0)[0]:
            return
        try:
            try:
                pools = ray.get(self._starting, timeout=max(left, 0.0))
            except ray.exceptions.GetTimeoutError:
                raise PrepError(f"the sweep's prep pools did not start within pool.start_timeout_s="
                                f"{self._pool.start_timeout_s}s (+{CALL_TIMEOUT_S:.0f}s): the nodes' CPUs are "
                                "held by something else; free them, or raise pool.start_timeout_s") from None
        except Exception:
            registry, self._registry, self._starting = self._registry, None, None
            destroy(registry)  # nothing is left behind by a sweep that cannot start
            warm.give_back(self._lent, PoolSpec())  # nor kept: an actor of them may be why
            self._lent = {}
            raise
        self._starting = None
        logger.info("coordinated_prep: prep pools ready on %d node(s): %s", len(pools), pools)

    def _note_start(self, block: bool) -> None:
        """:meth:`_await_start` from Tune's result and completion hooks, which must not raise (Tune
        would count the error against the trial and go on): a failure is kept for Tune's next request."""
        try:
            self._await_start(block)
        except Exception as e:
            self._start_error = e


def destroy(registry: Any) -> None:
    """Shut a registry down (its groups, pools and caches), kill it, and wait until it is gone, so
    that its name (the job's) is free for the next sweep of this driver."""
    try:
        ray.get(registry.shutdown.remote(), timeout=CALL_TIMEOUT_S)
    except (ray.exceptions.RayError, ray.exceptions.GetTimeoutError) as e:
        logger.warning("coordinated_prep: a registry did not shut down cleanly: %s", e)
    # A call made after the kill may still be answered (the kill reaches the process later); one
    # pending since before it fails only once the process is gone and Ray has released its name.
    gone = registry.until_killed.remote()
    ray.kill(registry)
    try:
        ray.get(gone, timeout=CALL_TIMEOUT_S)
    except ray.exceptions.RayActorError:
        return
    except ray.exceptions.GetTimeoutError:
        pass
    logger.warning("coordinated_prep: a killed registry was still alive after %.0f s", CALL_TIMEOUT_S)
