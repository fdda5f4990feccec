"""How the CoordinatedSearcher wraps the search algorithm it is given: how many suggestions it may
hold back (its window, :mod:`coordinated_prep.tune.order`), and who limits how many trials run.

- **Tune's variants** (``searcher=None``, a ``BasicVariantGenerator``): looking ahead changes only
  the order, so the window is :data:`~coordinated_prep.tune.order.DEFAULT_WINDOW`, and the
  generator's ``max_concurrent`` is applied by the CoordinatedSearcher, around the window.
- **A model-based Searcher** (Optuna, HyperOpt): each suggestion asked ahead is made from the
  results so far, as if that many more trials ran at once. The window is therefore small,
  :data:`SEARCHER_WINDOW` (a bounded look-ahead). Trials that run at once are limited around the
  window. The searcher itself is limited to ``max_concurrent + window - 1`` suggestions in flight
  (:func:`limit`), so it is never asked more than ``window - 1`` ahead of the trials that run. A
  ``ConcurrencyLimiter`` passed in is unwrapped, and its limit is applied the same way.
- **Another SearchAlgorithm**: only it knows its order and its limit. Its suggestions go out as
  they come (window 1).

``order="tune"`` keeps every algorithm's own order (window 1). Nothing here changes which
configs are tried.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any

from ray.tune.search import BasicVariantGenerator, ConcurrencyLimiter, SearchAlgorithm, Searcher, SearchGenerator

from coordinated_prep.errors import ConfigError
from coordinated_prep.tune.order import DEFAULT_WINDOW

#: Suggestions a model-based Searcher is asked for ahead of the trials that run (the order picks among them).
SEARCHER_WINDOW = 4


@dataclass(frozen=True)
class Wrapped:
    """The inner search algorithm and how the CoordinatedSearcher drives it.

    Attributes:
        inner: What Tune's hooks are delegated to.
        window: Most suggestions held back at once (1: released as they come).
        ahead: Whether the CoordinatedSearcher holds suggestions and limits running trials itself.
        max_concurrent: Most trials running at once (0: no limit).
        base: The Searcher inside ``inner`` before any limiter of ours (None: not a Searcher).
    """

    inner: SearchAlgorithm
    window: int
    ahead: bool
    max_concurrent: int
    base: Searcher | None = None


def limit(inner: SearchGenerator, base: Searcher, n: int, window: int) -> ConcurrencyLimiter:
    """Limit ``base``, run by ``inner``, to the suggestions of ``n`` running trials and ``window - 1``
    held back (what a release leaves in the window); Tune sizes its pending trials by this limiter."""
    inner.searcher = ConcurrencyLimiter(base, n + window - 1)
    return inner.searcher


def wrap(searcher: Searcher | SearchAlgorithm | None, max_concurrent: int, order: str,
         window: int | None) -> Wrapped:
    """The inner algorithm for ``CoordinatedSearcher(searcher, max_concurrent=..., order=..., window=...)``.

    Raises:
        ConfigError: ``window`` is not an integer >= 1, is asked of a SearchAlgorithm that keeps
            its own order, or a ``ConcurrencyLimiter`` passed in disagrees with ``max_concurrent``.
    """
    if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window < 1):
        raise ConfigError(f"CoordinatedSearcher: window={window!r} must be an integer >= 1 (1: no look-ahead)")
    grouped = order == "group"
    if searcher is None or isinstance(searcher, BasicVariantGenerator):
        inner = searcher or BasicVariantGenerator()
        if inner.max_concurrent:  # its limit is applied around the window
            if max_concurrent and max_concurrent != inner.max_concurrent:
                raise ConfigError(f"CoordinatedSearcher: max_concurrent={max_concurrent} and the "
                                  f"BasicVariantGenerator's max_concurrent={inner.max_concurrent} disagree; set one of "
                                  "them")
            max_concurrent, inner.max_concurrent = inner.max_concurrent, 0
        return Wrapped(inner, (window or DEFAULT_WINDOW) if grouped else 1, True, max_concurrent)
    if isinstance(searcher, Searcher):
        if isinstance(searcher, ConcurrencyLimiter) and grouped and not searcher.batch:
            if max_concurrent and max_concurrent != searcher.max_concurrent:
                raise ConfigError(f"CoordinatedSearcher: max_concurrent={max_concurrent} and the ConcurrencyLimiter's "
                                  f"max_concurrent={searcher.max_concurrent} disagree; set one of them")
            max_concurrent, searcher = searcher.max_concurrent, searcher.searcher
        size = (window or SEARCHER_WINDOW) if grouped else 1
        inner = SearchGenerator(searcher)
        if max_concurrent:
            limit(inner, searcher, max_concurrent, size)
        return Wrapped(inner, size, size > 1, max_concurrent, searcher)
    if isinstance(searcher, SearchAlgorithm):
        if max_concurrent:
            raise ConfigError("CoordinatedSearcher: set max_concurrent on the SearchAlgorithm you pass, not here")
        if window not in (None, 1):
            raise ConfigError(f"CoordinatedSearcher: window={window}: a {type(searcher).__name__} keeps its own order; "
                              "pass a Tune Searcher (e.g. OptunaSearch) to look ahead of it")
        return Wrapped(searcher, 1, False, 0)
    raise ConfigError(f"CoordinatedSearcher: searcher={searcher!r} is not a Tune Searcher or SearchAlgorithm")


__all__ = ["SEARCHER_WINDOW", "Wrapped", "limit", "tune_run_locals", "wrap"]


def tune_run_locals() -> dict[str, Any]:
    """The local variables of the ``tune.run`` (``Tuner.fit``) now calling the searcher; {} if none.

    Two are read there, a few frames up from ``set_search_properties``, because Tune (2.x,
    ``ray.tune.tune.run``) passes them nowhere a search algorithm sees: ``max_concurrent_trials``,
    which it wraps around a ``Searcher`` but drops with a warning for a ``SearchAlgorithm``, and
    ``placeholder_resolvers``, which turn a suggested config's hidden values (a DataSpec) back into
    objects (:mod:`coordinated_prep.tune.groups`).
    """
    frame = sys._getframe(1)
    for _ in range(8):
        if frame is None:
            return {}
        if frame.f_code.co_name == "run" and frame.f_globals.get("__name__") == "ray.tune.tune":
            return dict(frame.f_locals)
        frame = frame.f_back
    return {}
