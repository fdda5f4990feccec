"""The YAML sweep schema: valid files parse; every mistake names the file, the key and what is allowed."""

import importlib.util
import os
import textwrap

import pytest
from ray.tune.schedulers import FIFOScheduler, PopulationBasedTraining
from ray.tune.schedulers.async_hyperband import AsyncHyperBandScheduler
from ray.tune.search import BasicVariantGenerator, ConcurrencyLimiter
from ray.tune.search.sample import Categorical, Float, Integer, LogUniform

from coordinated_prep import ConfigError
from coordinated_prep.cli import main
from coordinated_prep.tune.schedulers import HyperBandScheduler
from coordinated_prep.tune.searcher import CoordinatedSearcher
from coordinated_prep.sweep.algorithms import PBTSpec, SearchSpec
from coordinated_prep.sweep.config import Dimension, load_sweep
from coordinated_prep.sweep.runner import _scheduler, _search_algorithm

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
    for name in ("default", "asha", "unshared", "cached", "optuna", "pbt", "hyperband", "ddp", "grid", "cv", "fidelity"):
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


def test_a_dataset_in_object_storage_parses_and_a_folder_url_that_is_neither_is_named(tmp_path):
    for url in ("s3://bucket/photos/coordprep-parquet.json", "s3://bucket/photos/shard-{000000..000063}.tar",
                "s3://bucket/photos/train.json"):  # the last a shard index (wids)
        assert load_sweep(_write(tmp_path, GOOD.replace("dataset: builtin:shapes", f"dataset: '{url}'"))).data.dataset == url
    with pytest.raises(ConfigError, match=r"no such directory; .* or the URL of its coordprep-parquet\.json.*a shard "
                                          r"index's \.json"):
        load_sweep(_write(tmp_path, GOOD.replace("dataset: builtin:shapes", f"dataset: {tmp_path}/none/train.json")))


def test_yaml_reads_numbers_as_python_does_merges_keys_and_expands_home(tmp_path):
    """``1e-3`` is a float (YAML 1.1 would read a string), ``<<: *base`` merges, ``~`` is the home folder;
    and a sweep's ``max_t`` is the largest ``epochs`` it searches over."""
    text = GOOD.replace("lr: {loguniform: [0.001, 0.1]}", "lr: {loguniform: [1e-3, 1E-1]}").replace(
        "  momentum: {uniform: [0.8, 0.95]}\n", "  <<: {momentum: 9e-1}\n").replace("epochs: 2", "epochs: {choice: [2, 6]}")
    cfg = load_sweep(_write(tmp_path, text + "storage_path: ~/runs\nray: {object_store_memory: 1GiB}\n"))
    assert cfg.search_space["lr"] == Dimension("loguniform", (0.001, 0.1)) and cfg.search_space["momentum"] == 0.9
    assert cfg.storage_path.startswith(os.path.expanduser("~")) and cfg.ray["object_store_memory"] == 2**30
    staged = load_sweep(_write(tmp_path, GOOD.replace("seed: 3,", "seed: 3, staging_bytes: 64MiB,")))
    assert staged.data.staging_bytes == 64 * 2**20, "with a unit, as pool.staging_bytes"
    assert _scheduler(cfg)._max_t == 6
    with pytest.raises(ConfigError, match=r"\d: cannot be read as an experiment file .*Is a directory"):
        load_sweep(str(tmp_path))
    from coordinated_prep.sweep.yaml_loader import load_yaml

    numbers = tmp_path / "numbers.yaml"  # YAML 1.2's numbers (1.1 read 15, '08', '-.5', '.5e3' and 90)
    numbers.write_text("[017, 08, -.5, .5e3, '1:30', 1:30, 0x10, 0o17, -0x1f, 1_000, +3, 1.5e-3, .inf, yes]")
    assert load_yaml(str(numbers)) == [17, 8, -0.5, 500.0, "1:30", "1:30", 16, 15, -31, 1000, 3, 0.0015, float("inf"),
                                       True]


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
    (("{type: asha, grace_period: 1}", "{type: bohb}"), "scheduler must be a mapping with type one of"),
    (("num_samples: 2", "num_samples: 2\nnum_samples: 3"), "duplicate key 'num_samples'"),
    (("num_samples: 2", "num_samples: 2\nresources_per_trial: {cpu: -1}"), "resources_per_trial.cpu=-1"),
    (("{choice: [16, 32]}", "{choice: [0, 32]}"), "search_space.batch_size: 0 must be an integer >= 1"),
    (("epochs: 2", "epochs: 0.5"), "search_space.epochs: 0.5 must be an integer >= 1"),
    (("  epochs: 2\n", "  epochs: 2\n  workers: {choice: [1, 0]}\n"),
     r"search_space.workers: 0 must be an integer >= 1 \(trainable 'small_cnn'\)"),
    (("  epochs: 2\n", "  epochs: 2\n  worker_failures: -1\n"), "search_space.worker_failures: -1 must be an integer >= 0"),
    (("  epochs: 2\n", ""), "search_space.epochs is required by trainable 'small_cnn'"),
    (("num_samples: 2", "num_samples: 2\ncache: {capacity_bytes: lots}"), "cache.capacity_bytes='lots' must be"),
    (("num_samples: 2", "num_samples: 2\ncache: {capacity: 1GiB}"), r"cache: unknown key\(s\) \['capacity'\]"),
    (("num_samples: 2", "num_samples: 2\ncache: 1GiB"), "cache must be a mapping"),
    (("  epochs: 2\n", "  epochs: 2\n  echo: {choice: [1, twice]}\n"),
     r"search_space.echo.choice\[1\]='twice' is not a valid echo setting .* use 1 or 'off'"),
    (("  epochs: 2\n", "  epochs: 2\n  echo: {uniform: [1, 3]}\n"), "cannot pick echo settings"),
    (("seed: 3,", "seed: 3, views: 0,"), "data.views=0 must be an integer >= 1"),
    (("dataset: builtin:shapes", "dataset: {factory: 'no_such_pkg.data:make'}"),
     r"data.dataset: factory 'no_such_pkg.data:make': module 'no_such_pkg.data' does not import \(ModuleNotFoundError"),
    (("dataset: builtin:shapes", "dataset: {factory: 'os.path:no_such_fn'}"),
     r"data.dataset: factory 'os.path:no_such_fn': 'os.path' has no attribute 'no_such_fn'"),
    (("dataset: builtin:shapes", "dataset: {factory: 'os.path:join', arg: {}}"),
     r"data.dataset: a factory mapping has the keys 'factory' .* and 'args' \(optional\); got \['arg', 'factory'\]"),
    (("dataset: builtin:shapes", "dataset: {factory: os.path.join}"), r"factory='os.path.join' must be an import path"),
    (("seed: 3,", "seed: 3, transform: {factory: 'torchvision.transforms.v2:NoSuchTransform'},"),
     r"data.transform: factory .* has no attribute 'NoSuchTransform'"),
    (("  epochs: 2\n", "  epochs: 2\n  widht: 8\n"), r"search_space.widht: trainable 'small_cnn' reads no such key; "
                                                       r"did you mean 'width'\?"),
    (("  epochs: 2\n", "  epochs: 2\n  yes: 3\n"), r"search_space: the key True is not a name .* quote it"),
    (("{type: asha, grace_period: 1}", "{type: asha, grace_period: 5}"),
     r"scheduler.grace_period=5 is past a trial's length, max_t=2 \(search_space.epochs\)"),
    (("num_samples: 2", "num_samples: 2\nresources_per_trial: {cpu: 0, gpu: 0}"), r"a trial needs some resource"),
    (("num_samples: 2", "num_samples: 2\nray: {num_cpus: two}"), r"ray.num_cpus='two' must be an integer >= 1"),
    (("{loguniform: [0.001, 0.1]}", "{loguniform: [0.001, .inf]}"), r"search_space.lr: inf must be a number > 0 and finite"),
    (("seed: 3,", "seed: 3, lease_s: .nan,"), r"data.lease_s=nan must be a positive, finite number of seconds"),
    (("momentum: {uniform: [0.8, 0.95]}", "momentum: yes"), r"search_space.momentum: True must be a number in \(0, 1\)"),
    (("  epochs: 2\n", "  epochs: 2\n  eval_batch_size: {choice: [64, 0]}\n"),
     r"search_space.eval_batch_size: 0 must be an integer >= 1 \(trainable 'small_cnn'\)"),
    (("  epochs: 2\n", "  epochs: 2\n  weight_decay: .nan\n"), r"search_space.weight_decay: nan must be a number >= 0"),
    (("num_samples: 2", "num_samples: 2\nmetric: acuracy"), r"metric='acuracy': trainable 'small_cnn' reports no such "
                                                             r"metric; did you mean 'accuracy'\? \(it reports \["),
    (("trainable: small_cnn", "trainable: seg_unet"), r"metric='accuracy': trainable 'seg_unet' reports .*'miou'"),
    (("num_samples: 2", "num_samples: 2\nray: {include_dashboard: maybe}"), r"ray.include_dashboard='maybe' must be"),
    (("num_samples: 2", "num_samples: 2\npool: {1: 2, actrs: 3}"), r"pool: unknown key\(s\) \[1, 'actrs'\]"),
    (("num_samples: 2", "num_samples: 2\n{[1, 2]: 3}: 4"), r"line \d+: a list cannot be a key"),
    (("{size: 32}", "{size: 32, hflip: true}"), r"data.pipeline.hflip=True must be a probability"),
    (("{size: 32}", "{size: 32, scale: [true, true]}"), r"data.pipeline.scale=\[True, True\] must be a pair of numbers"),
    (("seed: 3,", "seed: 3, holdout: false,"), r"data.holdout=False must be a fraction"),
])
def test_mistakes_name_the_file_key_and_allowed_values(tmp_path, change, message):
    path = _write(tmp_path, GOOD.replace(*change))
    with pytest.raises(ConfigError, match=message) as info:
        load_sweep(path)
    assert str(info.value).startswith(path)


def test_echo_is_searched_like_any_hyperparameter(tmp_path):
    cfg = load_sweep(_write(tmp_path, GOOD.replace("  epochs: 2\n", "  epochs: 2\n  echo: {choice: [1, 2, auto]}\n")))
    assert cfg.search_space["echo"].args == (1, 2, "auto")
    assert "echo" not in repr(cfg.data), "echo is the trial's, not part of the data group"
    mapping = "  epochs: 2\n  echo: {mode: batch, factor: 2, buffer: 64}\n"
    cfg = load_sweep(_write(tmp_path, GOOD.replace("  epochs: 2\n", mapping)))
    assert cfg.search_space["echo"] == {"mode": "batch", "factor": 2, "buffer": 64}
    with pytest.raises(ConfigError, match=r"search_space.echo=.*not a valid echo setting"):
        load_sweep(_write(tmp_path, GOOD.replace("  epochs: 2\n", "  epochs: 2\n  echo: {mode: loud}\n")))


def test_yaml_is_read_with_a_safe_loader(tmp_path):
    path = _write(tmp_path, GOOD + "ray: !!python/object/apply:os.system ['echo pwned']\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_sweep(path)


def test_missing_file(tmp_path):
    with pytest.raises(ConfigError, match="no such experiment file"):
        load_sweep(str(tmp_path / "nope.yaml"))


SCHEDULER = "scheduler: {type: asha, grace_period: 1}"
#: GOOD without its grid key, which no model-based searcher takes.
NO_GRID = GOOD.replace("{grid: [8, 16]}", "{choice: [8, 16]}")


ALL_AT_ONCE = GOOD.replace("max_concurrent_trials: 2", "max_concurrent_trials: 0")  # what HyperBand needs


def _with(tmp_path, line: str, base: str = GOOD):
    """GOOD (epochs 2) with its scheduler line replaced by ``line``, parsed."""
    return load_sweep(_write(tmp_path, base.replace(SCHEDULER, line)))


def _fake_find_spec(monkeypatch, missing=(), present=()):
    """``importlib.util.find_spec`` answering None for ``missing`` and a spec for ``present``."""
    real = importlib.util.find_spec

    def find_spec(name, *args, **kwargs):
        if name in missing:
            return None
        if name in present:
            return importlib.machinery.ModuleSpec(name, None)
        return real(name, *args, **kwargs)

    monkeypatch.setattr(importlib.util, "find_spec", find_spec)


def _takes_sweep_metric(scheduler) -> bool:
    """True when the scheduler has no metric or mode of its own, so that Tune sets the sweep's
    (TuneConfig, the one source); Tune refuses to when a scheduler already has them."""
    return scheduler.set_search_properties("accuracy", "max") and scheduler._metric == "accuracy"


def test_fifo_and_asha_build_tunes_schedulers(tmp_path):
    assert type(_scheduler(_with(tmp_path, "scheduler: {type: fifo}"))) is FIFOScheduler
    asha = _scheduler(_with(tmp_path, "scheduler: {type: asha, grace_period: 1, reduction_factor: 3}"))
    assert isinstance(asha, AsyncHyperBandScheduler) and asha._max_t == 2 and asha._reduction_factor == 3
    assert _takes_sweep_metric(asha)


def test_hyperband_is_our_fixed_scheduler_run_for_the_sweeps_epochs(tmp_path):
    scheduler = _scheduler(_with(tmp_path, "scheduler: {type: hyperband}", ALL_AT_ONCE))
    assert type(scheduler) is HyperBandScheduler, "not Ray's own class: it hangs at the end of a bracket"
    assert scheduler._max_t_attr == 2 and scheduler._eta == 3 and scheduler._time_attr == "training_iteration"
    scheduler = _scheduler(_with(tmp_path, "scheduler: {type: hyperband, max_t: 9, reduction_factor: 2}", ALL_AT_ONCE))
    assert scheduler._max_t_attr == 9 and scheduler._eta == 2
    assert _takes_sweep_metric(scheduler)


def test_pbt_mutates_search_space_keys_through_tune_domains(tmp_path):
    """A trainable of the user's (module:function) may move any search-space key; a registered one not
    batch_size or depth, which its checkpoint fixes (the schedule's length, the model's shape)."""
    line = ("scheduler: {type: pbt, perturbation_interval: 2, quantile_fraction: 0.5, resample_probability: 0, "
            "synch: true, hyperparam_mutations: {lr: {loguniform: [0.001, 0.1]}, batch_size: {choice: [16, 32]}, "
            "depth: {randint: [1, 3]}}}")
    with pytest.raises(ConfigError, match=r"scheduler.hyperparam_mutations.batch_size: trainable 'small_cnn' cannot "
                                          r"change batch_size in a running trial"):
        _with(tmp_path, line)
    cfg = _with(tmp_path, line, GOOD.replace("trainable: small_cnn", "trainable: trainables.small_cnn:train"))
    assert cfg.scheduler == PBTSpec(hyperparam_mutations={"lr": Dimension("loguniform", (0.001, 0.1)),
                                                          "batch_size": Dimension("choice", (16, 32)),
                                                          "depth": Dimension("randint", (1, 3))},
                                    perturbation_interval=2, quantile_fraction=0.5, resample_probability=0,
                                    synch=True)
    pbt = _scheduler(cfg)
    assert type(pbt) is PopulationBasedTraining and pbt._time_attr == "training_iteration"
    assert (pbt._perturbation_interval, pbt._quantile_fraction, pbt._resample_probability, pbt._synch) == \
        (2, 0.5, 0, True)
    lr, batch, depth = (pbt._hyperparam_mutations[k] for k in ("lr", "batch_size", "depth"))
    assert isinstance(lr, Float) and isinstance(lr.get_sampler(), LogUniform) and (lr.lower, lr.upper) == (0.001, 0.1)
    assert isinstance(batch, Categorical) and batch.categories == [16, 32]
    assert isinstance(depth, Integer) and (depth.lower, depth.upper) == (1, 3)
    assert _takes_sweep_metric(pbt)


def test_pb2_builds_rays_pb2(tmp_path):
    pytest.importorskip("sklearn", reason="the pb2 extra is not installed (it is not a test dependency)")
    from ray.tune.schedulers.pb2 import PB2

    pb2 = _scheduler(_with(tmp_path, "scheduler: {type: pb2, perturbation_interval: 2, "
                                     "hyperparam_bounds: {lr: [0.001, 0.1]}}"))
    assert type(pb2) is PB2 and pb2._hyperparam_bounds == {"lr": [0.001, 0.1]} and pb2._perturbation_interval == 2
    assert _takes_sweep_metric(pb2)


@pytest.mark.parametrize("line, message", [
    ("{type: hyperband, grace_period: 1}",
     r"scheduler \(hyperband\): unknown key\(s\) \['grace_period'\]; allowed: \['type', 'max_t', 'reduction_factor'\]"),
    ("{type: hyperband, max_t: 0}", r"scheduler.max_t=0 must be an integer >= 1"),
    ("{type: hyperband, reduction_factor: 1}", r"scheduler.reduction_factor=1 must be a number > 1"),
    ("{type: asha, max_t: 1.5}", r"scheduler.max_t=1.5 must be an integer >= 1"),
    ("{type: pbt}", r"scheduler.hyperparam_mutations is required: a non-empty mapping"),
    ("{type: pbt, hyperparam_mutations: [lr]}", r"scheduler.hyperparam_mutations=\['lr'\] must be a mapping"),
    ("{type: pbt, hyperparam_mutations: {lr: {grid: [0.01, 0.1]}}}",
     r"scheduler.hyperparam_mutations.lr: .* must be a distribution.*grid is not one"),
    ("{type: pbt, hyperparam_mutations: {lr: 0.1}}", r"scheduler.hyperparam_mutations.lr: 0.1 must be a distribution"),
    ("{type: pbt, hyperparam_mutations: {lr: {loguniform: [0, 0.1]}}}",
     r"scheduler.hyperparam_mutations.lr.loguniform=\[0, 0.1\] needs low < high and low > 0"),
    ("{type: pbt, hyperparam_mutations: {lrr: {uniform: [0.01, 0.1]}}}",
     r"scheduler.hyperparam_mutations.lrr: 'lrr' is not a search_space key"),
    ("{type: pbt, hyperparam_mutations: {batch_size: {choice: [0, 16]}}}",
     r"scheduler.hyperparam_mutations.batch_size: trainable 'small_cnn' cannot change batch_size in a running"),
    ("{type: pbt, perturbation_interval: 0, hyperparam_mutations: {lr: {uniform: [0.01, 0.1]}}}",
     r"scheduler.perturbation_interval=0 must be an integer >= 1"),
    ("{type: pbt, quantile_fraction: 0.6, hyperparam_mutations: {lr: {uniform: [0.01, 0.1]}}}",
     r"scheduler.quantile_fraction=0.6 must be a number in \(0, 0.5\]"),
    ("{type: pbt, quantile_fraction: 0, hyperparam_mutations: {lr: {uniform: [0.01, 0.1]}}}",
     r"scheduler.quantile_fraction=0 must be"),
    ("{type: pbt, resample_probability: 1.5, hyperparam_mutations: {lr: {uniform: [0.01, 0.1]}}}",
     r"scheduler.resample_probability=1.5 must be a number from 0 to 1"),
    ("{type: pbt, synch: 1, hyperparam_mutations: {lr: {uniform: [0.01, 0.1]}}}",
     r"scheduler.synch=1 must be true or false"),
    ("{type: pbt, hyperparam_bounds: {lr: [0.01, 0.1]}}",
     r"scheduler \(pbt\): unknown key\(s\) \['hyperparam_bounds'\]; allowed: \['type', 'hyperparam_mutations', "
     r"'perturbation_interval', 'quantile_fraction', 'resample_probability', 'synch'\]"),
    ("{type: [pbt]}", r"scheduler must be a mapping with type one of \['fifo', 'asha', 'hyperband', 'pbt', 'pb2'\]"),
])
def test_scheduler_mistakes_name_the_key(tmp_path, line, message):
    path = _write(tmp_path, GOOD.replace(SCHEDULER, f"scheduler: {line}"))
    with pytest.raises(ConfigError, match=message) as info:
        load_sweep(path)
    assert str(info.value).startswith(path)


@pytest.mark.parametrize("line, message", [
    ("{type: pb2}", r"scheduler.hyperparam_bounds is required"),
    ("{type: pb2, hyperparam_bounds: {lr: [0.1, 0.01]}}",
     r"scheduler.hyperparam_bounds.lr=\[0.1, 0.01\] must be \[low, high\] numbers, low < high"),
    ("{type: pb2, hyperparam_bounds: {lr: 0.1}}", r"scheduler.hyperparam_bounds.lr=0.1 must be \[low, high\]"),
    ("{type: pb2, hyperparam_bounds: {lrr: [0.01, 0.1]}}",
     r"scheduler.hyperparam_bounds.lrr: 'lrr' is not a search_space key"),
    ("{type: pb2, hyperparam_bounds: {batch_size: [0, 32]}}",
     r"scheduler.hyperparam_bounds.batch_size: trainable 'small_cnn' cannot change batch_size"),
    ("{type: pb2, synch: true, hyperparam_bounds: {lr: [0.01, 0.1]}}",
     r"scheduler \(pb2\): unknown key\(s\) \['synch'\]; allowed: \['type', 'hyperparam_bounds', "
     r"'perturbation_interval', 'quantile_fraction'\]"),
])
def test_pb2_mistakes_name_the_key(tmp_path, monkeypatch, line, message):
    _fake_find_spec(monkeypatch, present=("GPy", "sklearn"))  # as if the pb2 extra were installed
    with pytest.raises(ConfigError, match=message):
        _with(tmp_path, f"scheduler: {line}")


def test_searchers_build_the_tune_search_algorithm_named(tmp_path):
    from ray.tune.search.optuna import OptunaSearch

    from coordinated_prep.tune.wrapping import SEARCHER_WINDOW

    cfg = load_sweep(_write(tmp_path, NO_GRID + "search: {type: optuna, seed: 7}\n"))
    assert cfg.search == SearchSpec("optuna", 7)
    search_alg, searcher = _search_algorithm(cfg)
    assert search_alg is searcher and isinstance(searcher, CoordinatedSearcher)
    limiter = searcher.searcher  # what Tune reads to know how many trials may be pending
    assert searcher._max_concurrent == 2 and searcher._order.window == SEARCHER_WINDOW, "2 run, 4 held to order"
    assert isinstance(limiter, ConcurrencyLimiter) and limiter.max_concurrent == 2 + SEARCHER_WINDOW - 1
    assert isinstance(limiter.searcher, OptunaSearch) and limiter.searcher._seed == 7
    unshared = load_sweep(_write(tmp_path, NO_GRID.replace("seed: 3", "seed: 3, coordinated: false")
                                 + "search: {type: optuna}\n"))
    search_alg, searcher = _search_algorithm(unshared)
    assert searcher is None and isinstance(search_alg, ConcurrencyLimiter) and search_alg.max_concurrent == 2
    assert isinstance(search_alg.searcher, OptunaSearch)


@pytest.mark.parametrize("search", ["", "search: {type: random, seed: 5}\n", "search: {type: grid}\n"])
def test_random_and_grid_are_tunes_variant_generator(tmp_path, search):
    base = GOOD
    if "grid" in search:  # a grid search takes grid keys and constants only
        base = GOOD.replace("{loguniform: [0.001, 0.1]}", "0.01").replace("{choice: [16, 32]}", "32")
        base = base.replace("{uniform: [0.8, 0.95]}", "0.9").replace("{randint: [1, 4]}", "{grid: [1, 2]}")
    _, searcher = _search_algorithm(load_sweep(_write(tmp_path, base + search)))
    generator = searcher._inner
    # The searcher applies the limit itself, around the suggestions it pulls ahead to order them by group.
    assert type(generator) is BasicVariantGenerator and generator.max_concurrent == 0 and searcher._max_concurrent == 2
    assert searcher.searcher.max_concurrent == 2, "Tune's pending-trial limit follows max_concurrent_trials"
    assert searcher._order.window > 1


def test_search_order_tune_keeps_tunes_order(tmp_path):
    cfg = load_sweep(_write(tmp_path, GOOD + "search: {type: random, order: tune}\n"))
    assert cfg.search.order == "tune"
    _, searcher = _search_algorithm(cfg)
    assert searcher._order.window == 1 and searcher._max_concurrent == 2


def test_a_model_based_search_looks_ahead_a_bounded_window(tmp_path):
    cfg = load_sweep(_write(tmp_path, NO_GRID + "search: {type: optuna, window: 3}\n"))
    _, searcher = _search_algorithm(cfg)
    assert searcher._order.window == 3 and searcher._max_concurrent == 2
    assert searcher.searcher.max_concurrent == 2 + 3 - 1, "Optuna is asked at most 2 suggestions ahead"


def test_a_seed_repeats_the_random_search(tmp_path):
    cfg = load_sweep(_write(tmp_path, GOOD + "search: {type: random, seed: 5}\n"))

    def sampled_lrs() -> list[float]:
        generator = cfg.search.to_tune(max_concurrent=0)
        experiment = {"run": cfg.trainable_fn(), "config": cfg.param_space(), "num_samples": 3}
        generator.add_configurations({"sweep": experiment})
        return [generator.next_trial().config["lr"] for _ in range(6)]  # 3 samples x the 2 widths of the grid

    first = sampled_lrs()
    assert first == sampled_lrs() and len(set(first)) == 6


@pytest.mark.parametrize("search, message", [
    ("{type: bayes}", r"search.type='bayes' must be one of \['random', 'grid', 'optuna', 'hyperopt'\]"),
    ("{type: optuna, seed: -1}", r"search.seed=-1 must be an integer >= 0"),
    ("{type: optuna, seed: 1.5}", r"search.seed=1.5 must be an integer >= 0"),
    ("{type: optuna, sampler: tpe}", r"search: unknown key\(s\) \['sampler'\]; allowed: \['type', 'seed', 'order', 'window'\]"),
    ("{type: optuna, window: 0}", r"search.window=0 must be an integer >= 1 \(1: no look-ahead\)"),
    ("{type: random, order: fifo}", r"search.order='fifo' must be 'group' \(a data group's trials run together\) or 'tune'"),
    ("optuna", r"search must be a mapping"),
    ("{type: optuna}", r"search_space.width: search.type=optuna cannot search a grid; write \{choice: \[8, 16\]\}"),
    ("{type: grid}", r"search_space.lr: search.type=grid takes only grid keys and constants, not loguniform"),
])
def test_search_mistakes_name_the_key(tmp_path, search, message):
    path = _write(tmp_path, GOOD + f"search: {search}\n")
    with pytest.raises(ConfigError, match=message) as info:
        load_sweep(path)
    assert str(info.value).startswith(path)


def test_hyperopt_takes_no_grid_either(tmp_path, monkeypatch):
    _fake_find_spec(monkeypatch, present=("hyperopt",))
    with pytest.raises(ConfigError, match=r"search_space.width: search.type=hyperopt cannot search a grid"):
        load_sweep(_write(tmp_path, GOOD + "search: {type: hyperopt}\n"))


@pytest.mark.parametrize("section, missing, message", [
    ("search: {type: optuna}", ("optuna",), r"search.type=optuna needs optuna, not installed: "
                                            r"pip install 'coordinated-prep\[optuna\]'"),
    ("search: {type: hyperopt, seed: 1}", ("hyperopt",), r"search.type=hyperopt needs hyperopt, not installed: "
                                                         r"pip install 'coordinated-prep\[hyperopt\]'"),
    ("scheduler: {type: pb2, hyperparam_bounds: {lr: [0.001, 0.1]}}", ("GPy", "sklearn"),
     r"scheduler.type=pb2 needs .*scikit-learn, not installed: pip install 'coordinated-prep\[pb2\]'"),
])
def test_a_missing_extra_is_named_with_its_pip_command(tmp_path, monkeypatch, capsys, section, missing, message):
    _fake_find_spec(monkeypatch, missing=missing)
    path = _write(tmp_path, NO_GRID.replace(SCHEDULER, section) if "scheduler" in section else NO_GRID + section + "\n")
    with pytest.raises(ConfigError, match=message):
        load_sweep(path)
    assert main(["sweep", path, "--dry-run"]) == 2, "the dry run shows it, before Ray starts"
    assert "pip install 'coordinated-prep[" in capsys.readouterr().err


def test_specs_are_validated_when_built_in_python_too():
    with pytest.raises(ConfigError, match="scheduler.hyperparam_mutations.lr: .*grid is not one"):
        PBTSpec(hyperparam_mutations={"lr": Dimension("grid", (0.01, 0.1))})
    with pytest.raises(ConfigError, match="search.seed=-2"):
        SearchSpec("random", seed=-2)


def test_hyperband_with_fewer_concurrent_trials_than_trials_is_refused(tmp_path):
    # GOOD has 2 samples x grid of 2 widths = 4 trials.
    hyperband = GOOD.replace("scheduler: {type: asha, grace_period: 1}", "scheduler: {type: hyperband, max_t: 2}")
    with pytest.raises(ConfigError, match=r"max_concurrent_trials=2 with scheduler hyperband and 4 trials: .*"
                                          r"set max_concurrent_trials: 0"):
        load_sweep(_write(tmp_path, hyperband))
    assert load_sweep(_write(tmp_path, hyperband.replace("max_concurrent_trials: 2", "max_concurrent_trials: 4")))
    assert load_sweep(_write(tmp_path, hyperband.replace("max_concurrent_trials: 2", "max_concurrent_trials: 0")))


#: GOOD with data keys in its search space (GOOD's data: builtin:shapes, seed 3, pipeline size 32).
DATA_KEYS = """  data.pipeline.scale: {grid: [[0.08, 1.0], [0.25, 1.0]]}
  data.pipeline.size: {choice: [96, 128]}
  data.pipeline.ratio.1: {uniform: [1.2, 1.5]}
  data.seed: 4
"""


def _with_data(tmp_path, keys: str, base: str = GOOD):
    return load_sweep(_write(tmp_path, base.replace("  epochs: 2\n", "  epochs: 2\n" + keys)))


def test_data_keys_search_places_inside_the_data_mapping(tmp_path):
    from ray.tune.search.sample import Function

    cfg = _with_data(tmp_path, DATA_KEYS)
    assert cfg.data.seed == 3 and cfg.data.pipeline.size == 32, "SweepConfig.data stays the base, as written"
    assert cfg.data_search.keys == ("data.pipeline.scale", "data.pipeline.size", "data.pipeline.ratio.1", "data.seed")
    space = cfg.param_space()
    assert space["data.pipeline.scale"] == {"grid_search": [[0.08, 1.0], [0.25, 1.0]]}
    assert isinstance(space["data.pipeline.size"], Categorical) and space["data.seed"] == 4
    assert isinstance(space["data"], Function), "Tune builds each trial's DataSpec from its resolved values"
    spec = space["data"].func({"data.pipeline.scale": [0.08, 1.0], "data.pipeline.size": 96,
                               "data.pipeline.ratio.1": 1.4, "data.seed": 4})
    assert spec.pipeline.scale == (0.08, 1.0) and spec.pipeline.size == 96 and spec.seed == 4
    assert spec.pipeline.ratio == (0.75, 1.4), "an item of a default pair: the other stays the default"
    assert spec.pipeline.eval_resize == 110, "derived from the searched size"
    same = cfg.data_search.spec({"data.pipeline.scale": (0.08, 1), "data.pipeline.size": 96,
                                 "data.pipeline.ratio.1": 1.4, "data.seed": 4})
    assert same == spec and same.group_key == spec.group_key, "equal values, one data group"


def test_analyze_measures_a_representative_trials_data(tmp_path):
    from coordinated_prep.analyze.run import representative_config

    config = representative_config(_with_data(tmp_path, DATA_KEYS))
    spec = config["data"]
    assert (spec.pipeline.scale, spec.pipeline.size, spec.seed) == ((0.08, 1.0), 96, 4), "first grid and choice values"
    assert spec.pipeline.ratio == (0.75, 1.35), "the middle of a range"


def test_grid_data_keys_count_as_trials(tmp_path):
    # GOOD: 2 samples x a grid of 2 widths; a grid of 2 data values doubles it.
    hyperband = GOOD.replace(SCHEDULER, "scheduler: {type: hyperband, max_t: 2}").replace(
        "max_concurrent_trials: 2", "max_concurrent_trials: 5")
    assert _with_data(tmp_path, "", hyperband)
    with pytest.raises(ConfigError, match=r"max_concurrent_trials=5 with scheduler hyperband and 8 trials"):
        _with_data(tmp_path, "  data.pipeline.size: {grid: [32, 48]}\n", hyperband)


def test_a_factorys_args_are_searched(tmp_path):
    cfg = load_sweep(_write(tmp_path, """
        trainable: small_cnn
        data:
          dataset: builtin:shapes
          transform: {factory: "torchvision.transforms.v2:RandomResizedCrop", args: {size: 32, scale: [0.3, 1.0]}}
        search_space:
          lr: 0.01
          batch_size: 16
          epochs: 1
          data.transform.args.scale.0: {uniform: [0.08, 0.5]}
          data.transform.args.antialias: {choice: [true, false]}
    """))
    spec = cfg.data_search({"data.transform.args.scale.0": 0.2, "data.transform.args.antialias": False})
    assert spec.transform.args == {"size": 32, "scale": [0.2, 1.0], "antialias": False}
    assert cfg.data_search.base["transform"]["args"]["scale"] == [0.3, 1.0], "the base is never changed"


@pytest.mark.parametrize("keys, message", [
    ("  data: {seed: 1}\n", r"search_space.data: the data spec belongs under the top-level 'data' key; search a value "
                            r"inside it with a dotted key"),
    ("  data.colour: 1\n", r"search_space.data.colour: data has no key 'colour'; allowed: \['dataset', 'pipeline',"),
    ("  data.pipeline.sise: {choice: [32, 64]}\n",
     r"search_space.data.pipeline.sise: data.pipeline has no key 'sise'; allowed: \['size', 'scale', 'ratio',"),
    ("  data.pipeline.scale.2: 0.5\n", r"search_space.data.pipeline.scale.2: data.pipeline.scale=\[0.25, 1.0\] is a "
                                       r"list of 2 item\(s\); address an item by its number, 0 to 1"),
    ("  data.pipeline.scale.low: 0.5\n", r"search_space.data.pipeline.scale.low: .* address an item by its number"),
    ("  data.seed.0: 1\n", r"search_space.data.seed.0: data.seed=3 is a single value with nothing inside to address; "
                           r"search_space.data.seed sets it whole"),
    ("  data.transform.args.p: 0.5\n", r"search_space.data.transform.args.p: data.transform=None is not a factory "
                                       r"mapping; .* give data.transform under data as \{factory: "),
    ("  data.coordinated: {choice: [true, false]}\n", r"search_space.data.coordinated: data.coordinated cannot be "
                                                      r"searched: it decides for the whole sweep"),
    ("  data.pipeline.: 1\n", r"search_space.data.pipeline.: a data key is data.<field>"),
    ("  data.pipeline.scale: {grid: [[0.2, 1.0]]}\n  data.pipeline.scale.0: 0.3\n",
     r"search_space.data.pipeline.scale.0 lies inside search_space.data.pipeline.scale: both would set it; keep one"),
    ("  data.pipeline.scale: {grid: [[0.08, 1.0], [0.5, 0.2]]}\n",
     r"search_space.data.pipeline.scale=\[0.5, 0.2\]: data.pipeline.scale=\[0.5, 0.2\] must satisfy 0 < low <= high; "
     r"change the values searched"),
    ("  data.pipeline.scale.0: {uniform: [0.2, 1.5]}\n",
     r"search_space.data.pipeline.scale.0=1.5: data.pipeline.scale=\[1.5, 1.0\] must satisfy 0 < low <= high"),
    ("  data.pipeline.size: {choice: [32, 4]}\n  data.seed: 1\n",
     r"search_space.data.pipeline.size=4 \(with data.seed=1\): data.pipeline.size=4 must be an integer in \[8, 4096\]"),
    ("  data.pipeline.size: {randint: [8, 5000]}\n", r"search_space.data.pipeline.size=4999: .* in \[8, 4096\]"),
    ("  data.pipeline.size: {uniform: [32, 64]}\n",
     r"search_space.data.pipeline.size=32.0: data.pipeline.size=32.0 must be an integer"),
    ("  data.pipeline.scale.0: {choice: [0.2, 0.9]}\n  data.pipeline.scale.1: {choice: [0.5, 1.0]}\n",
     r"search_space.data.pipeline.scale.0=0.9 \(with data.pipeline.scale.1=0.5\): .* must satisfy 0 < low <= high"),
    ("  data.dataset: {choice: [builtin:shapes, /no/such/dir]}\n",
     r"search_space.data.dataset='/no/such/dir': no such directory"),
    ("  data.pipeline.size: {grid: [32, 48]}\n", None),  # with search: optuna below
])
def test_data_key_mistakes_name_the_key_and_the_fix(tmp_path, keys, message):
    search = ""
    if message is None:
        search, message = "search: {type: optuna}\n", r"search_space.data.pipeline.size: search.type=optuna cannot " \
                                                       r"search a grid; write \{choice: \[32, 48\]\}"
    path = _write(tmp_path, NO_GRID.replace("  epochs: 2\n", "  epochs: 2\n" + keys) + search)
    with pytest.raises(ConfigError, match=message) as info:
        load_sweep(path)
    assert str(info.value).startswith(path)


@pytest.mark.parametrize("line, message", [
    ("{type: pbt, hyperparam_mutations: {data.pipeline.size: {choice: [32, 48]}}}",
     r"scheduler.hyperparam_mutations.data.pipeline.size: pbt would change a running trial's data, and a trial cannot "
     r"change data group mid-run"),
    ("{type: pbt, hyperparam_mutations: {lr: {uniform: [0.01, 0.1]}}}",
     r"search_space.data.pipeline.size: scheduler pbt copies a better trial's config, its data included, into a "
     r"worse trial mid-run"),
    ("{type: pb2, hyperparam_bounds: {data.pipeline.size: [32, 48]}}",
     r"scheduler.hyperparam_bounds.data.pipeline.size: pb2 would change a running trial's data"),
])
def test_population_schedulers_keep_each_trial_in_its_data_group(tmp_path, monkeypatch, line, message):
    _fake_find_spec(monkeypatch, present=("GPy", "sklearn"))  # as if the pb2 extra were installed
    base = GOOD.replace(SCHEDULER, f"scheduler: {line}")
    with pytest.raises(ConfigError, match=message):
        _with_data(tmp_path, "  data.pipeline.size: {choice: [32, 48]}\n", base)
    assert _with_data(tmp_path, "  data.pipeline.size: 48\n", GOOD.replace(
        SCHEDULER, "scheduler: {type: pbt, hyperparam_mutations: {lr: {uniform: [0.01, 0.1]}}}")), \
        "a constant data key keeps every trial in one group"


@pytest.mark.parametrize("search", ["random", "optuna", "hyperopt"])
def test_every_searcher_gives_each_trial_the_dataspec_of_its_values(tmp_path, search):
    """What Tune does with the param space (placeholders, the search algorithm, then the trial's resolution), no Ray."""
    import copy

    from ray.tune.impl.placeholder import create_resolvers_map, inject_placeholders
    from ray.tune.search import SearchGenerator

    from coordinated_prep.spec import DataSpec

    if search != "random":
        pytest.importorskip(search, reason=f"the {search} extra is not installed")
    keys = "  data.pipeline.scale.0: {uniform: [0.2, 0.6]}\n  data.pipeline.size: {choice: [32, 48]}\n"
    cfg = _with_data(tmp_path, keys, NO_GRID + f"search: {{type: {search}, seed: 0}}\n")
    resolvers = create_resolvers_map()
    space = inject_placeholders(copy.deepcopy(cfg.param_space()), resolvers)
    algorithm = cfg.search.to_tune(max_concurrent=0)
    if search != "random":
        algorithm = SearchGenerator(algorithm)
        algorithm.set_search_properties("accuracy", "max", space)
    algorithm.add_configurations({"sweep": {"run": cfg.trainable_fn(), "config": space, "num_samples": 4}})
    specs = []
    for _ in range(4):
        trial = algorithm.next_trial()
        trial.resolve_config_placeholders(resolvers)  # what Tune does when it adds the trial
        spec, config = trial.config["data"], trial.config
        assert isinstance(spec, DataSpec) and spec.pipeline.scale == (config["data.pipeline.scale.0"], 1.0)
        assert 0.2 <= spec.pipeline.scale[0] <= 0.6 and spec.pipeline.size == config["data.pipeline.size"]
        assert spec.seed == 3 and spec.pipeline.ratio == cfg.data.pipeline.ratio, "the rest as data gives it"
        specs.append(spec)
    assert len({s.group_key for s in specs}) == 4, "a continuous value: a data group per trial"


@pytest.mark.parametrize("workers", ["2", "{choice: [1, 2]}"])
def test_pbt_refuses_data_parallel_trials_whose_checkpoints_tune_never_receives(tmp_path, workers):
    text = GOOD.replace("  epochs: 2\n", f"  epochs: 2\n  workers: {workers}\n")
    path = _write(tmp_path, text.replace(SCHEDULER, "scheduler: {type: pbt, hyperparam_mutations: "
                                                    "{lr: {uniform: [0.01, 0.1]}}}"))
    with pytest.raises(ConfigError, match=r"search_space.workers: scheduler pbt copies a better trial's checkpoint"):
        load_sweep(path)
    load_sweep(_write(tmp_path, text))  # the same trials under GOOD's scheduler are fine
