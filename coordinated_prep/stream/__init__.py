"""The shared stream's actors (no torch here): the registry of a sweep, each data group's coordinator on
each node with its staging buffer, and the watch of the trials' processes.

Ownership runs from the searcher's registry down (:mod:`coordinated_prep.stream.registry`); the
pure scheduling logic (:mod:`~coordinated_prep.stream.staging`, :mod:`~coordinated_prep.stream.eval_set`)
is plain Python, tested without Ray.
"""
