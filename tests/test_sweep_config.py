"""The YAML sweep schema: valid files parse; every mistake names the file, the key and what is allowed."""

import textwrap

import pytest

from coordinated_prep import ConfigError
from coordinated_prep.sweep.config import Dimension, load_sweep

GOOD = """
trainable: small_cnn
data: {dataset: builtin:shapes, seed: 3, pipeline: {size: 32}}
search_space:
  lr: {loguniform: [0.001, 0.1]}
  batch_size: {choice: [16, 32]}
  width: {grid: [8, 16]}
  momentum: {uniform: [0.8, 0.95]}
  depth: {randint: [1, 4]}
  epochs: 2
num_samples: 2
max_concurrent_trials: 2
scheduler: {type: asha, grace_period: 1}
"""


def _write(tmp_path, text: str) -> str:
    path = tmp_path / "sweep.yaml"
    path.write_text(textwrap.dedent(text))
    return str(path)


def test_every_example_in_experiments_is_valid():
    for name in ("default", "asha", "unshared", "cached"):
        cfg = load_sweep(f"experiments/{name}.yaml")
        assert cfg.data.dataset == "builtin:shapes"


def test_a_good_file_parses_into_dataclasses(tmp_path):
    cfg = load_sweep(_write(tmp_path, GOOD))
    assert cfg.data.seed == 3 and cfg.data.pipeline.size == 32
    assert cfg.search_space["lr"] == Dimension("loguniform", (0.001, 0.1)) and cfg.search_space["epochs"] == 2
    assert cfg.scheduler.type == "asha" and cfg.max_concurrent_trials == 2
    space = cfg.param_space()
    assert space["data"] is cfg.data and "grid_search" in space["width"]
    assert cfg.cache is None


def test_a_cache_is_configured_with_units(tmp_path):
    cfg = load_sweep(_write(tmp_path, GOOD + "cache: {capacity_bytes: 256MiB, partitioned: false}\n"))
    assert cfg.cache.capacity_bytes == 256 * 2**20 and cfg.cache.partitioned is False


@pytest.mark.parametrize("change, message", [
    (("num_samples: 2", "num_sample: 2"), r"top level: unknown key\(s\) \['num_sample'\]; allowed:"),
    (("num_samples: 2", "num_samples: two"), "num_samples='two' must be an integer >= 1"),
    (("{loguniform: [0.001, 0.1]}", "{logunifrm: [0.001, 0.1]}"), r"search_space.lr: .* exactly one key out of"),
    (("{loguniform: [0.001, 0.1]}", "{loguniform: [0, 0.1]}"), "search_space.lr.loguniform=.* low > 0"),
    (("trainable: small_cnn", "trainable: nope"), "trainable='nope' is not registered"),
    (("trainable: small_cnn", "trainable: os:nonexistent_fn"), "cannot import it"),
    (("dataset: builtin:shapes", "dataset: /no/such/dir"), r"data.dataset='/no/such/dir': no such directory"),
    (("seed: 3", "seed: -3"), "data.seed=-3"),
    (("{size: 32}", "{size: 0}"), "data.pipeline.size=0"),
    (("{type: asha, grace_period: 1}", "{type: hyperband}"), "scheduler must be a mapping with type one of"),
    (("num_samples: 2", "num_samples: 2\nnum_samples: 3"), "duplicate key 'num_samples'"),
    (("num_samples: 2", "num_samples: 2\nresources_per_trial: {cpu: -1}"), "resources_per_trial.cpu=-1"),
    (("{choice: [16, 32]}", "{choice: [0, 32]}"), "search_space.batch_size: 0 must be an integer >= 1"),
    (("epochs: 2", "epochs: 0.5"), "search_space.epochs: 0.5 must be an integer >= 1"),
    (("  epochs: 2\n", ""), "search_space.epochs is required by trainable 'small_cnn'"),
    (("num_samples: 2", "num_samples: 2\ncache: {capacity_bytes: lots}"), "cache.capacity_bytes='lots' must be"),
    (("num_samples: 2", "num_samples: 2\ncache: {capacity: 1GiB}"), r"cache: unknown key\(s\) \['capacity'\]"),
    (("num_samples: 2", "num_samples: 2\ncache: 1GiB"), "cache must be a mapping"),
])
def test_mistakes_name_the_file_key_and_allowed_values(tmp_path, change, message):
    path = _write(tmp_path, GOOD.replace(*change))
    with pytest.raises(ConfigError, match=message) as info:
        load_sweep(path)
    assert str(info.value).startswith(path)


def test_yaml_is_read_with_a_safe_loader(tmp_path):
    path = _write(tmp_path, GOOD + "ray: !!python/object/apply:os.system ['echo pwned']\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_sweep(path)


def test_missing_file(tmp_path):
    with pytest.raises(ConfigError, match="no such experiment file"):
        load_sweep(str(tmp_path / "nope.yaml"))
