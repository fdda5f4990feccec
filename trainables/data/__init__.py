"""Generated datasets and their transform factories for the ready examples (no downloads, no files).

Each module's ``make(...)`` builds a map-style dataset (``__len__``, ``__getitem__``, ``classes``)
deterministically from its arguments, and its ``train_transform``/``eval_transform`` (or the joint
``train_transforms``/``eval_transforms``) build the pipelines a ``DataSpec`` names, so a YAML sweep
can name them as ``{factory: "trainables.data.<module>:<function>", args: {...}}``. They import torch
and torchvision only: a prep actor that builds them does not import the trainables. ``photos`` has a
transform only, for the built-in ``builtin:photos`` (``coordprep bench experiments/bench-v2.yaml``).
"""
