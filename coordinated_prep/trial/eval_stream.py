"""Where a trial's evaluation pieces come from: the sweep's evaluation set (shared) or its own process."""

from __future__ import annotations

import collections
import logging
from typing import Iterator

import ray

from coordinated_prep.pipeline.chunk import PreparedChunk, eval_chunk
from coordinated_prep.stream.eval_set import STREAM_AHEAD, eval_pieces
from coordinated_prep.pipeline.part import held_out
from coordinated_prep.plan import piece_size
from coordinated_prep.pipeline.probe import probe
from coordinated_prep.pipeline.transforms import make_pipeline
from coordinated_prep.spec import DataSpec
from coordinated_prep.trial.calls import fetch, find_registry

logger = logging.getLogger(__name__)


def private_eval_pieces(spec: DataSpec) -> Iterator[PreparedChunk]:
    """The held-out split in index order, prepared in this process (unshared, or outside Tune)."""
    pipeline = make_pipeline(spec)
    held = held_out(spec, len(pipeline))  # the held-out split, or the trial's validation fold
    layout = probe(pipeline, spec.seed, held, spec.ragged, 1, "eval", "data (evaluation)").layout
    for indices in eval_pieces(held, piece_size(spec.chunk_size, len(held))):
        skipped: list[tuple[int, str, str]] = []
        yield eval_chunk(pipeline, layout, spec.seed, indices, spec.on_error, skipped)
        for index, path, reason in skipped:  # on_error="skip": left out of this evaluation
            logger.warning("evaluation: skipping held-out sample %d (%s): %s", index, path, reason)


def shared_eval_pieces(spec: DataSpec, trial: str) -> Iterator[PreparedChunk]:
    """The held-out split in index order, from the sweep's evaluation set for ``spec``'s pipeline.

    Resident pieces are read from the object store as they are (prepared once for the sweep);
    pieces past them are requested at most :data:`STREAM_AHEAD` ahead and dropped once read.

    Raises:
        PrepError: A piece cannot be had (a bad sample, a timeout); names the trial.
    """
    registry = find_registry(trial)
    timeout = spec.fetch_timeout_s
    node = ray.get_runtime_context().get_node_id()
    plan = fetch(registry.eval_plan.remote(spec, trial, node), trial, "starting its evaluation", timeout)
    resident: list[ray.ObjectRef] = plan["refs"]
    pending: collections.deque[ray.ObjectRef] = collections.deque()  # streamed answers, in piece order
    requested = len(resident)
    for i in range(plan["pieces"]):
        if i < len(resident):
            yield fetch(resident[i], trial, f"reading evaluation piece {i}", timeout).guarded()
            continue
        while requested < plan["pieces"] and len(pending) < STREAM_AHEAD:  # bounded look-ahead
            pending.append(registry.eval_piece.remote(plan["key"], requested))
            requested += 1
        answer = fetch(pending.popleft(), trial, f"asking for evaluation piece {i}", timeout)
        yield fetch(answer["ref"], trial, f"reading evaluation piece {i}", timeout).guarded()  # others read it too

