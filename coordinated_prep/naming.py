"""How trials find their sweep's registry: the Ray namespace and the registry's name per Ray job.

Every trial of a sweep runs in the Ray job of the driver that runs the sweep (Tune creates the
trials' actors from it), so the job id names the sweep's registry: nothing is put into trial
configs, and a sweep restored by a new driver (``Tuner.restore``) is found by its restored trials.
One CoordinatedSearcher per driver process runs at a time.
"""

from __future__ import annotations

NAMESPACE = "coordinated_prep"
#: The bound of one call from the registry to another actor that answers at once (bookkeeping, no preparation).
CALL_TIMEOUT_S = 30.0
#: The bound of a liveness question to an actor (is it up; have these processes ended).
LIVENESS_TIMEOUT_S = 10.0


def registry_name(job: str) -> str:
    """Actor name of the group registry of the sweep run by Ray job ``job`` (its hex id)."""
    return f"coordprep-{job}"
