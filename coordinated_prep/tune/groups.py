"""The data group of a trial Tune's search algorithm suggests, read from its config before Tune
adds the trial (what :class:`~coordinated_prep.tune.order.GroupOrder` orders by).

``tune.run`` hides every non-primitive config value (a DataSpec, a ``sample_from`` function such as
a YAML sweep's data search) behind a placeholder, which Tune resolves only when it adds the trial.
Here the placeholders that resolve without side effects are resolved on a copy: plain references,
and the data search (:class:`~coordinated_prep.sweep.data_space.DataSearch`), a pure function of
the config. A user's own ``sample_from`` function is never called (it may draw from a global random
state, and calling it would change the configs Tune then samples).
"""

from __future__ import annotations

import copy
import logging
from typing import Any, Mapping

from coordinated_prep.spec import DataSpec

logger = logging.getLogger(__name__)

_DEPTH = 4  # how deep into nested mappings and lists a DataSpec is looked for


def group_of(config: Mapping[str, Any], resolvers: Mapping[Any, list] | None) -> tuple[str, ...] | None:
    """The group keys of the coordinated DataSpecs in ``config`` (sorted), or None if it has none
    (or they cannot be resolved here: such a suggestion is released in Tune's order).

    Args:
        config: A suggested trial's config, placeholders included.
        resolvers: ``tune.run``'s placeholder resolvers (path -> resolvers), or None.
    """
    try:
        resolved = _resolved(config, resolvers) if resolvers else config
        keys = sorted({spec.group_key for spec in _specs(resolved, _DEPTH) if spec.coordinated})
    except Exception as e:  # an order hint only: Tune reports a bad config when it adds the trial
        logger.debug("coordinated_prep: no data group read from a suggested config: %r", e)
        return None
    return tuple(keys) or None


def _resolved(config: Mapping[str, Any], resolvers: Mapping[Any, list]) -> Any:
    from ray.tune.impl.placeholder import _FunctionResolver, resolve_placeholders

    from coordinated_prep.sweep.data_space import DataSearch

    def harmless(resolver: Any) -> bool:
        if not isinstance(resolver, _FunctionResolver):
            return True
        return isinstance(getattr(getattr(resolver, "_fn", None), "func", None), DataSearch)

    chosen = {path: kept for path, found in resolvers.items() if (kept := [r for r in found if harmless(r)])}
    copied = copy.deepcopy(dict(config))
    resolve_placeholders(copied, chosen)
    return copied


def _specs(value: Any, depth: int):
    if isinstance(value, DataSpec):
        yield value
    elif depth > 0 and isinstance(value, Mapping):
        for item in value.values():
            yield from _specs(item, depth - 1)
    elif depth > 0 and isinstance(value, (list, tuple)):
        for item in value:
            yield from _specs(item, depth - 1)
