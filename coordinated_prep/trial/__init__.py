"""The trial's side (a Tune trial's process, or a Ray Train worker's; torch is here): the loaders, the
streams of pieces they read, echo, batches and a rank's share, and a private stream's worker processes.

What runs here may touch the trial's own memory and generators only; it reaches the shared stream
through the coordinator's actor handle (:mod:`coordinated_prep.stream`).
"""
