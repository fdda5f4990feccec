"""Evaluation sets at the registry: each held-out split prepared once per sweep, within its bytes."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import ray

from coordinated_prep import metrics
from coordinated_prep.errors import ConfigError, CoordinatedPrepError
from coordinated_prep.stream.eval_set import EvalSet, eval_key, eval_pieces
from coordinated_prep.plan import piece_size
from coordinated_prep.spec import DataSpec

logger = logging.getLogger(__name__)


class Evals:
    """The registry's half for evaluation (:class:`~coordinated_prep.stream.registry.GroupRegistry` inherits it).

    It owns ``_evals`` (an :class:`EvalSet` per evaluation pipeline, until shutdown) and the watches of
    its pieces in flight, both created by the registry's constructor.
    """

    async def eval_plan(self, spec: DataSpec, trial: str, node: str | None = None) -> dict[str, Any]:
        """One evaluation of ``trial`` with ``spec``'s pipeline: the resident pieces' references and
        the number of pieces (those past the resident ones come from :meth:`eval_piece`).

        The first call for a pipeline starts its preparation on ``node``'s pool (see
        :mod:`coordinated_prep.stream.eval_set`); every later one, from any trial, prepares nothing.
        """
        node = node or ray.get_runtime_context().get_node_id()
        key = eval_key(spec)
        async with self._lock(key):  # one preparation per pipeline
            if key not in self._evals:
                self._evals[key] = await self._start_eval(key, spec, node)
                if self._evals[key].refs:
                    await self._split(node)  # the node's groups share what its resident pieces leave
        found = self._evals[key]
        for i in sorted(found.failed):  # a failed resident piece is not kept: prepared again for this one
            self._retry_resident(found, i)
        plan = found.plan()
        found.evaluations += 1
        found.samples_served += plan["samples"]
        metrics.inc("eval_samples_served", plan["samples"], pipeline=key)
        logger.debug("trial %s evaluates with %s", trial, key)
        return plan

    async def eval_piece(self, key: str, i: int) -> dict[str, Any]:
        """Evaluation piece ``i`` of ``key``, past the resident ones of the reader's plan: resident if
        it has become so since (the next pieces in order become resident now if they fit), else
        prepared now for this one reader."""
        found = self._evals[key]
        if self._grow_resident(found, upto=i):
            await self._split(found.node)
        if i < len(found.refs):
            if i in found.failed:
                self._retry_resident(found, i)
            return {"ref": found.refs[i]}
        indices = found.pieces[i]
        found.samples_prepared += len(indices)
        metrics.inc("eval_samples_prepared", len(indices), pipeline=key)
        return {"ref": self._prepare_eval(found, i, resident=False)}

    async def eval_reports(self) -> dict[str, dict[str, Any]]:
        """Per evaluation pipeline: held-out samples, resident pieces, prepared against served."""
        return {key: found.report() for key, found in self._evals.items()}

    def _eval_bytes(self, node: str) -> int:
        """Bytes the resident evaluation pieces hold in ``node``'s object store."""
        return sum(e.resident_bytes for e in self._evals.values() if e.node == node)

    async def _start_eval(self, key: str, spec: DataSpec, node: str) -> EvalSet:
        """Cut the held-out split into pieces and start preparing the resident ones on ``node``."""
        pool = await self._pool(node)
        try:
            held, start = await asyncio.wait_for(pool.actors[0].held_out.remote(spec), spec.fetch_timeout_s)
        except asyncio.TimeoutError:
            raise ConfigError(f"evaluation set {key} ({spec.dataset_name}): preparing its first held-out samples took "
                              f"longer than data.fetch_timeout_s={spec.fetch_timeout_s}s; raise it, or make the "
                              "evaluation transform cheaper") from None
        except ray.exceptions.RayTaskError as e:
            raise (e.cause if isinstance(e.cause, CoordinatedPrepError) else e) from None
        found = EvalSet(key, spec, node, eval_pieces(held, piece_size(spec.chunk_size, len(held))),
                        layout=start.layout, sample_bytes=start.sample_bytes, spec_box=[ray.put(spec)])
        resident = self._grow_resident(found)
        logger.info("evaluation set %s: %d held-out samples in %d pieces on node %s, %d resident so far (%d bytes "
                    "estimated)", key, len(held), len(found.pieces), node, resident, found.resident_bytes)
        return found

    def _eval_allowance(self, found: EvalSet) -> int:
        """Bytes ``found``'s resident pieces may take: the node's evaluation share less the others'."""
        others = sum(e.resident_bytes for e in self._evals.values() if e.node == found.node and e is not found)
        return max(int(self._pools[found.node].budget_bytes * self._pool_spec.eval_fraction) - others, 0)

    def _grow_resident(self, found: EvalSet, upto: int = -1) -> int:
        """Make the next pieces resident, in order, while their estimates fit (:meth:`EvalSet.admits`),
        at most one per prep actor in flight (pieces up to ``upto``, asked for now, regardless)."""
        most = len(self._pools[found.node].actors)
        added = 0
        while found.admits(self._eval_allowance(found), None if len(found.refs) <= upto else most):
            found.refs.append(None)
            self._retry_resident(found, len(found.refs) - 1)
            added += 1
        return added

    def _retry_resident(self, found: EvalSet, i: int) -> None:
        """Prepare resident piece ``i`` (again, if it failed)."""
        found.failed.discard(i)
        found.refs[i] = self._prepare_eval(found, i, resident=True)
        found.samples_prepared += len(found.pieces[i])
        metrics.inc("eval_samples_prepared", len(found.pieces[i]), pipeline=found.key)

    async def _resident_landed(self, found: EvalSet, i: int, nbytes: int | None, samples: int) -> None:
        """Charge resident piece ``i`` its real bytes (None: it failed), drop the trailing resident
        pieces the allowance cannot hold, make more resident while they fit, and re-split the node."""
        if self._evals.get(found.key) is not found:
            return  # shut down, or a set nobody keeps
        before = found.resident_bytes
        if nbytes is not None:
            found.land(i, nbytes, samples)
        dropped = found.shed(self._eval_allowance(found))
        if dropped:
            logger.info("evaluation set %s: pieces %s no longer fit the node's evaluation allowance at their real "
                        "size (%d bytes per sample); they are streamed", found.key, sorted(dropped), found.sample_bytes)
        self._grow_resident(found)
        if found.resident_bytes != before:
            await self._split(found.node)  # the node's groups share what the real bytes leave

    def _prepare_eval(self, found: EvalSet, i: int, resident: bool) -> ray.ObjectRef:
        """Submit evaluation piece ``i`` to its node's pool; the registry owns the result. Its skipped
        samples are counted and logged, and a failed ``resident`` piece is marked to prepare again,
        when the task ends (:meth:`_eval_settled`)."""
        actors = self._pools[found.node].actors
        actor = actors[next(self._eval_turn) % len(actors)]
        skipped, piece = actor.prepare_eval.options(num_returns=2).remote(found.key, found.spec_box, found.pieces[i],
                                                                          found.layout)
        task = asyncio.get_running_loop().create_task(self._eval_settled(found, i, skipped, resident))
        self._eval_watches.add(task)
        task.add_done_callback(self._eval_watches.discard)
        return piece

    async def _eval_settled(self, found: EvalSet, i: int, skipped_ref: ray.ObjectRef, resident: bool) -> None:
        """Count and log (once per sample) what piece ``i`` skipped; mark a failed resident piece."""
        try:
            skipped, nbytes = await skipped_ref
        except Exception as e:  # the reading trials get the error itself, naming the file
            if resident and self._evals.get(found.key) is found and i < len(found.refs):
                found.failed.add(i)
            metrics.inc("errors", 1, group=found.key, kind="failed_piece")
            logger.warning("evaluation set %s: piece %d failed%s: %s", found.key, i,
                           " (it is prepared again at the next evaluation)" if resident else "", e)
            if resident:
                await self._resident_landed(found, i, None, 0)
            return
        for index, path, reason in skipped:
            if index not in found.skipped:
                found.skipped[index] = path
                metrics.inc("errors", 1, group=found.key, kind="skipped_sample")
                logger.warning("evaluation set %s: skipping held-out sample %d (%s): %s", found.key, index, path,
                               reason)
        if resident:
            await self._resident_landed(found, i, nbytes, len(found.pieces[i]) - len(skipped))


