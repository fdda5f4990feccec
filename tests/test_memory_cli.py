"""memory: in the sweep schema, the configurations coordprep memory measures, and the command end to end."""

import json
import textwrap

import pytest

from coordinated_prep import ConfigError
from coordinated_prep.cli import main
from coordinated_prep.memory_tool.configs import memory_configs, values
from coordinated_prep.memory.spec import MemoryMode
from coordinated_prep.sweep.config import Dimension, load_sweep


def _sweep(tmp_path, memory: str, extra: str = "") -> str:
    path = tmp_path / "memory.yaml"
    path.write_text(textwrap.dedent(f"""
        name: tiny
        storage_path: {tmp_path / "runs"}
        trainable: small_cnn
        data: {{dataset: builtin:shapes, pipeline: {{size: 16}}}}
        search_space:
          lr: 0.1
          batch_size: 4
          width: 4
          epochs: 1
          memory: {memory}
        """) + extra)
    return str(path)


def test_memory_modes_in_a_search_space(tmp_path):
    cfg = load_sweep(_sweep(tmp_path, "{choice: [none, checkpoint, {budget: 0.3}]}"))
    assert cfg.search_space["memory"] == Dimension("choice", ("none", "checkpoint", {"budget": 0.3}))
    cfg = load_sweep(_sweep(tmp_path, "{budget: 0.3}"))  # a constant: budget is no distribution's name
    assert cfg.search_space["memory"] == {"budget": 0.3} and cfg.param_space()["memory"] == {"budget": 0.3}
    assert load_sweep(_sweep(tmp_path, "checkpoint")).search_space["memory"] == "checkpoint"


@pytest.mark.parametrize("memory, words", [
    ("checkpointing", "search_space.memory='checkpointing' must be none, checkpoint or {budget: f}"),
    ("{budget: 2}", "budget=2 must be a number in"),
    ("{choice: [none, {budget: 0}]}", r"search_space.memory.choice\[1\].*budget=0"),
    ("{uniform: [0.1, 0.5]}", "a uniform distribution cannot pick memory modes"),
    ("{chioce: [none, checkpoint]}", "must have exactly one key out of"),  # a misspelt distribution stays an error
])
def test_bad_memory_values_are_config_errors(tmp_path, memory, words):
    with pytest.raises(ConfigError, match=words):
        load_sweep(_sweep(tmp_path, memory))


def test_the_configurations_to_measure():
    space = {"batch_size": Dimension("choice", (16, 32, 16)), "width": Dimension("randint", (4, 9)),
             "memory": Dimension("grid", ("none", {"budget": 0.5})), "lr": Dimension("loguniform", (0.01, 1.0))}
    configs = memory_configs("resnet18", space, 64)
    assert [c.label for c in configs] == ["resnet18 w6 b16 64px none", "resnet18 w6 b16 64px budget=0.5",
                                          "resnet18 w6 b32 64px none", "resnet18 w6 b32 64px budget=0.5"]
    assert configs[1].trial_config() == {"batch_size": 16, "width": 6, "memory": {"budget": 0.5}}
    assert memory_configs("small_cnn", {"batch_size": 8}, 32)[0].memory == MemoryMode()
    searched = memory_configs("small_cnn", {"batch_size": 8, "data.pipeline.size": Dimension("choice", (32, 64))}, 16)
    assert [c.size for c in searched] == [32, 64], "a searched crop size: each of its values, not the base's"
    assert values(Dimension("uniform", (1.0, 3.0))) == [2.0] and values(Dimension("loguniform", (1, 100))) == [10.0]


def test_the_example_experiment_measures_five_modes():
    from coordinated_prep.memory_tool.run import sweep_configs

    cfg = load_sweep("experiments/memory.yaml")
    assert [c.memory.label for c in sweep_configs(cfg)] == ["none", "checkpoint", "budget=0.5", "budget=0.4",
                                                                        "budget=0.3"]
    assert cfg.gpu_auto is not None and cfg.data.pipeline.size == 224


def test_coordprep_memory_end_to_end(tmp_path, capsys):
    path = _sweep(tmp_path, "{grid: [none, checkpoint]}")
    out = tmp_path / "out"
    assert main(["memory", path, "--out", str(out), "--steps", "1", "--warmup", "0", "--threads", "1"]) == 0
    report = json.loads((out / "memory.json").read_text())
    rows = {r["memory"]: r for r in report["rows"]}
    assert set(rows) == {"none", "checkpoint"}
    assert 0 < rows["checkpoint"]["activation_bytes"] < rows["none"]["activation_bytes"]
    assert rows["checkpoint"]["param_bytes"] == rows["none"]["param_bytes"] > 0
    assert rows["checkpoint"]["activation_ratio"] > 1 and rows["none"]["peak_kind"] == "cpu_estimate"
    assert (out / "memory.png").stat().st_size > 1000
    assert "small_cnn w4 b4 16px checkpoint" in capsys.readouterr().out


def test_coordprep_memory_rejects_bad_options(tmp_path, capsys):
    assert main(["memory", _sweep(tmp_path, "none"), "--steps", "0"]) == 2
    assert "--steps=0" in capsys.readouterr().err
