"""The ready trainables: models build at the configured width and the small CNN learns builtin:shapes."""

import torch

from coordinated_prep import DataSpec
from trainables import REGISTRY, resnet, small_cnn


def test_resnet18_width_is_configurable():
    narrow, full = resnet.build(10, {"width": 16}), resnet.build(10, {})
    assert narrow(torch.zeros(2, 3, 32, 32)).shape == (2, 10)
    assert sum(p.numel() for p in narrow.parameters()) < sum(p.numel() for p in full.parameters()) / 10
    assert set(REGISTRY) == {"small_cnn", "resnet18"}


def test_small_cnn_learns_builtin_shapes_well_above_chance():
    reports = []
    config = {"data": DataSpec(coordinated=False, pipeline={"size": 48}), "lr": 0.05, "batch_size": 32,
              "epochs": 3, "width": 16}
    small_cnn.fit(config, small_cnn.build, reports.append)
    assert [r["epoch"] for r in reports] == [1, 2, 3]
    assert reports[-1]["accuracy"] > 0.3, reports  # chance is 0.1 for ten classes
    assert all(0 <= r["stall_fraction"] <= 1 for r in reports)
