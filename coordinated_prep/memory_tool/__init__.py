"""``coordprep memory`` and ``gpu: auto``: a sweep's configurations, one training step of each measured,
the report, and the GPU packing of a sweep's trials from those measurements. It imports the sweep and
the trainables; the memory modes library it measures (:mod:`coordinated_prep.memory`) imports neither."""
