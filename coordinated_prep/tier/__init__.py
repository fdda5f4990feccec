"""The node's decoded tier: prefix outputs (decoded, resized samples) kept across data groups and epochs.

- :mod:`~coordinated_prep.tier.book`: the bookkeeping and the life cycle of a kept output (pure).
- :mod:`~coordinated_prep.tier.actor`: the node's actor that owns kept outputs in the object store.
- :mod:`~coordinated_prep.tier.client`: a prep actor's side of it.

Where the prefix comes from: :mod:`coordinated_prep.pipeline.split`.
"""
