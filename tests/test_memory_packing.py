"""Trial packing: GPU shares, margins, trials per GPU, the error for a trial that cannot fit, gpu: auto."""

import textwrap
import warnings

import pytest

from coordinated_prep import ConfigError
from coordinated_prep.memory_tool.auto import NO_GPU, plan_gpu
from coordinated_prep.memory.packing import GpuAuto, cap_gpu_memory, gpu_fraction, need_bytes, pack
from coordinated_prep.sweep.config import load_sweep

GiB = 2**30


def test_the_fraction_is_one_over_the_trials_that_fit():
    assert need_bytes(10 * GiB, 0.1, 0) == 11 * GiB
    assert gpu_fraction(10 * GiB, 80 * GiB, margin=0.1, context_bytes=0) == 0.1428  # 7 fit: 1/7 rounded down
    assert gpu_fraction(10 * GiB, 80 * GiB, margin=0.0, context_bytes=0) == 0.125  # 8 fit exactly
    assert gpu_fraction(10 * GiB, 80 * GiB, margin=0.0, context_bytes=1) == 0.1428  # one byte more: 7
    assert gpu_fraction(50 * GiB, 80 * GiB, margin=0.1) == 1.0
    assert gpu_fraction(1, 80 * GiB, margin=0.0, context_bytes=0) == 0.0001  # Ray's smallest unit


def test_pack_gives_every_trial_the_share_of_the_largest():
    p = pack({"a b16": 5 * GiB, "a b64": 20 * GiB, "a b32": 10 * GiB}, 80 * GiB, margin=0.1, context_bytes=GiB)
    assert p.worst == "a b64" and p.per_gpu == 3 and p.fraction == 0.3333
    assert p.need_bytes == 23 * GiB  # 20 * 1.1 + 1
    assert p.per_gpu * p.fraction <= 1.0
    # the allocator cap leaves the CUDA context outside it: (0.3333 * 80 - 1) / 80, rounded down
    assert p.memory_fraction == 0.3207 and p.memory_fraction < p.fraction


def test_a_configuration_that_cannot_fit_names_itself_and_the_bytes():
    with pytest.raises(ConfigError, match=r"resnet18 b512 224px none needs 88\.00 GiB .* one GPU has 80\.00 GiB"):
        pack({"resnet18 b64 224px none": 10 * GiB, "resnet18 b512 224px none": 80 * GiB}, 80 * GiB, margin=0.1,
             context_bytes=0)
    with pytest.raises(ConfigError, match="no configurations"):
        pack({}, 80 * GiB)
    with pytest.raises(ConfigError, match="margin"):
        gpu_fraction(GiB, 80 * GiB, margin=-0.1)


def test_margin_and_cap_are_validated():
    with pytest.raises(ConfigError, match="gpu_margin=-1"):
        GpuAuto(-1)
    with pytest.raises(ConfigError, match="gpu_memory_fraction=1.5"):
        cap_gpu_memory(1.5)
    assert cap_gpu_memory(None) is False


def _sweep(tmp_path, resources: str):
    path = tmp_path / "auto.yaml"
    path.write_text(textwrap.dedent(f"""
        trainable: small_cnn
        data: {{dataset: builtin:shapes, pipeline: {{size: 16}}}}
        search_space: {{lr: 0.1, batch_size: {{choice: [4, 8]}}, epochs: 1, memory: {{choice: [none, checkpoint]}}}}
        resources_per_trial: {resources}
        """))
    return str(path)


def test_gpu_auto_packs_with_the_measured_peaks(tmp_path):
    cfg = load_sweep(_sweep(tmp_path, "{cpu: 1, gpu: auto, gpu_margin: 0.25}"))
    assert cfg.gpu_auto == GpuAuto(0.25) and "gpu" not in cfg.resources_per_trial
    peaks = {"small_cnn b4 16px none": 3 * GiB, "small_cnn b8 16px none": 6 * GiB}
    packing = plan_gpu(cfg, 40 * GiB, measure=lambda c: peaks)
    assert packing.worst == "small_cnn b8 16px none" and packing.per_gpu == 5  # 6 * 1.25 + 0.5 = 8 GiB each, 40 GiB


def test_gpu_auto_on_a_machine_without_a_gpu_falls_back_to_the_cpu(tmp_path):
    from coordinated_prep.sweep.runner import trial_resources

    cfg = load_sweep(_sweep(tmp_path, "{cpu: 1, gpu: auto}"))
    with pytest.warns(UserWarning, match="no GPU"):
        assert plan_gpu(cfg, None) is None
    import torch

    if not torch.cuda.is_available():
        with pytest.warns(UserWarning, match="the trials run on the CPU"):
            resources, space = trial_resources(cfg)
        assert resources == {"cpu": 1.0} and "gpu_memory_fraction" not in space
    assert "set gpu: 0" in NO_GPU


@pytest.mark.parametrize("resources, words", [("{gpu: max}", "gpu='max' must be a number >= 0 or 'auto'"),
                                              ("{gpu: 1, gpu_margin: 0.2}", "gpu_margin applies to gpu: auto"),
                                              ("{gpu: auto, gpu_margin: x}", "gpu_margin='x'")])
def test_bad_gpu_resources_are_config_errors(tmp_path, resources, words):
    with pytest.raises(ConfigError, match=words):
        load_sweep(_sweep(tmp_path, resources))


def test_the_dry_run_says_what_gpu_auto_will_do(tmp_path, capsys):
    from coordinated_prep.cli import main

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the dry run notes it; it does not warn
        assert main(["sweep", _sweep(tmp_path, "{cpu: 1, gpu: auto}"), "--dry-run"]) == 0
    out = capsys.readouterr().out
    import torch

    assert ("no GPU" in out and "run on the CPU" in out) if not torch.cuda.is_available() else "measured" in out


def test_the_runner_gives_trials_the_packed_share_and_the_cap(tmp_path, monkeypatch):
    """With a GPU (faked: its size and the measured peaks), Tune's request and each trial's cap follow the packing."""
    from coordinated_prep.memory_tool import auto
    from coordinated_prep.sweep.runner import trial_resources

    monkeypatch.setattr(auto, "gpu_bytes", lambda: 40 * GiB)
    monkeypatch.setattr(auto, "measure_peaks", lambda cfg: {"small_cnn b8 16px none": 6 * GiB})
    resources, space = trial_resources(load_sweep(_sweep(tmp_path, "{cpu: 1, gpu: auto, gpu_margin: 0.25}")))
    assert resources == {"cpu": 1.0, "gpu": 0.2}  # 5 trials of 8 GiB on a 40 GiB GPU
    assert space["gpu_memory_fraction"] == pytest.approx(0.1875)  # (8 GiB - 0.5 GiB of context) / 40 GiB
    assert "data" in space and "memory" in space
