"""Issue 22, item 6: the smaller fixes (bookkeeping bounds, start bounds, finalizers, evaluation skips)."""

from __future__ import annotations

import asyncio
import subprocess
import sys

import pytest

from coordinated_prep import DataSpec
from coordinated_prep.errors import DatasetError
from coordinated_prep.watch import Process, _start_time


def test_a_group_start_allows_time_per_file_and_names_the_dataset_and_the_fix(monkeypatch):
    from coordinated_prep import registry
    from coordinated_prep.registry import GroupRegistry, start_bound_s

    assert start_bound_s(1_281_167) > 1_281_167 * 0.002, "an ImageNet-sized tree gets more than 2 ms per file"
    assert start_bound_s(0) == registry._CALL_TIMEOUT_S

    class Silent:  # a coordinator whose fingerprint never comes
        class fingerprint:
            @staticmethod
            def remote():
                return asyncio.get_running_loop().create_future()

    monkeypatch.setattr(registry, "_CALL_TIMEOUT_S", 0.01)
    found = GroupRegistry.__ray_metadata__.modified_class("s")
    with pytest.raises(DatasetError) as error:
        asyncio.run(found._check_index("/nfs/imagenet/train", "node-7", Silent(), 0))
    message = str(error.value)
    assert "/nfs/imagenet/train" in message and "node-7" in message and "coordprep convert" in message
