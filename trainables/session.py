"""Where a trainable reports each epoch and finds the state it resumes from: Tune's session, and the
checkpoint file every session writes and reads.

:class:`~trainables.distributed.TrainSession` (Ray Train's side) and :func:`trainables.common.fit`
both import from here, so neither needs the other for it.
"""

from __future__ import annotations

import os
import tempfile
from typing import Any, Protocol

import torch

from coordinated_prep.errors import ConfigError

#: The file a checkpoint of :func:`trainables.common.fit` holds: ``torch.save`` of plain state dicts
#: (loaded weights-only).
STATE_FILE = "state.pt"


class Session(Protocol):
    """Where a trainable reports each epoch and finds the state it resumes from."""

    def restore(self) -> dict[str, Any] | None:
        """The state saved with the latest checkpoint (model, optimizer, schedule, epoch), or None."""

    def report(self, metrics: dict[str, Any], state: dict[str, Any]) -> None:
        """Report one epoch's metrics with the state to resume from after it."""


class TuneSession:
    """Ray Tune's: each epoch's state is a checkpoint (``tune.report(..., checkpoint=...)``), and a
    retried, restored or PBT-exploited trial resumes from ``tune.get_checkpoint()``."""

    def restore(self) -> dict[str, Any] | None:
        from ray import tune

        checkpoint = tune.get_checkpoint()
        return None if checkpoint is None else load_state(checkpoint)

    def report(self, metrics: dict[str, Any], state: dict[str, Any]) -> None:
        from ray import tune

        with tempfile.TemporaryDirectory(prefix="coordprep-ckpt-") as d:
            save_state(d, state)
            tune.report(metrics, checkpoint=tune.Checkpoint.from_directory(d))  # Tune copies it to storage


def save_state(directory: str, state: dict[str, Any]) -> None:
    """Write ``state`` into a checkpoint directory (weights-only ``torch.save``)."""
    torch.save(state, os.path.join(directory, STATE_FILE))


def load_state(checkpoint: Any) -> dict[str, Any]:
    """The state a Tune or Ray Train checkpoint written by :func:`save_state` holds.

    Raises:
        ConfigError: The checkpoint has no state file (it was written by something else).
    """
    with checkpoint.as_directory() as d:
        path = os.path.join(d, STATE_FILE)
        if not os.path.exists(path):
            raise ConfigError(f"checkpoint {checkpoint.path}: no {STATE_FILE}; it was not written by "
                              "trainables.common.fit, so this trial cannot resume from it")
        return torch.load(path, map_location="cpu", weights_only=True)


__all__ = ["STATE_FILE", "Session", "TuneSession", "load_state", "save_state"]
