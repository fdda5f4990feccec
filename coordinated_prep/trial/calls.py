"""A trial's calls to its sweep's actors: finding the registry, and waiting for an answer with a deadline."""

from __future__ import annotations

from typing import Any

import ray

from coordinated_prep.errors import ConfigError, PrepError
from coordinated_prep.naming import NAMESPACE, registry_name


def has_registry() -> bool:
    """Whether a group registry runs in this Ray job (a CoordinatedSearcher's or a PrepService's)."""
    if not ray.is_initialized():
        return False
    try:
        ray.get_actor(registry_name(ray.get_runtime_context().get_job_id()), namespace=NAMESPACE)
    except ValueError:
        return False
    return True


def find_registry(trial: str) -> Any:
    """The sweep's group registry, found by this Ray job (the driver's, which runs the sweep).

    Raises:
        ConfigError: No CoordinatedSearcher runs this sweep.
    """
    job = ray.get_runtime_context().get_job_id()
    try:
        return ray.get_actor(registry_name(job), namespace=NAMESPACE)
    except ValueError:
        raise ConfigError(
            f"trial {trial}: config has a DataSpec with coordinated=True, but no CoordinatedSearcher runs this "
            "sweep (no data-group registry in this Ray job): run it with search_alg=CoordinatedSearcher() "
            "(tune.run or tune.TuneConfig) and keep the searcher open until the sweep ends, or set "
            "coordinated=False"
        ) from None


def fetch(ref: ray.ObjectRef, trial: str, doing: str, timeout: float) -> Any:
    """``ray.get(ref)`` within ``timeout``; any failure is a PrepError naming ``trial`` and what it was doing."""
    try:
        return ray.get(ref, timeout=timeout)
    except ray.exceptions.GetTimeoutError:
        raise PrepError(f"trial {trial}: timed out after {timeout}s {doing}") from None
    except ray.exceptions.RayTaskError as e:
        cause = e.cause if isinstance(getattr(e, "cause", None), PrepError) else e
        raise PrepError(f"trial {trial}: {doing} failed: {cause}") from e
    except ray.exceptions.RayActorError as e:
        raise PrepError(f"trial {trial}: the actor serving it died while {doing}: {e}") from e
    except ray.exceptions.RayError as e:  # e.g. the piece was lost with its owner
        raise PrepError(f"trial {trial}: {doing} failed: {e}") from e
