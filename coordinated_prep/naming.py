"""Names that tie trials to their sweep's registry: the Ray namespace, actor names, the config key."""

from __future__ import annotations

NAMESPACE = "coordinated_prep"

#: Config key under which CoordinatedSearcher puts its session id (a primitive, so Tune keeps it).
SESSION_KEY = "__coordprep__"


def registry_name(session: str) -> str:
    """Actor name of the group registry of searcher session ``session``."""
    return f"coordprep-{session}"
