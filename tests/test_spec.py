"""DataSpec and PipelineSpec: validation at construction, grouping by equality."""

import os
import textwrap

import pytest

from coordinated_prep import ConfigError, DataSpec, PipelineSpec


def test_equal_specs_share_a_group_key_and_different_ones_do_not():
    a = DataSpec(pipeline={"size": 64})
    assert a == DataSpec(pipeline=PipelineSpec(size=64)) and a.group_key == DataSpec(pipeline={"size": 64}).group_key
    assert a.group_key != DataSpec(pipeline={"size": 64}, seed=1).group_key
    assert a.group_key != DataSpec(pipeline={"size": 64, "hflip": 0.0}).group_key
    assert hash(a) == hash(DataSpec(pipeline={"size": 64}))


@pytest.mark.parametrize("kwargs, message", [
    ({"chunk_size": 0}, "data.chunk_size=0 must be an integer >= 1"),
    ({"seed": -1}, "data.seed=-1"),
    ({"holdout": 1.0}, "data.holdout=1.0"),
    ({"staging_bytes": -5}, "data.staging_bytes=-5"),
    ({"staging_bytes": 100}, "smaller than one piece"),
    ({"coordinated": "yes"}, "data.coordinated='yes' must be true or false"),
    ({"pipeline": {"size": 0}}, "data.pipeline.size=0"),
    ({"pipeline": {"scale": [0.5, 1.5]}}, "upper bound must be at most 1.0"),
    ({"pipeline": {"size": 64, "eval_resize": 32}}, "centre crop must fit"),
    ({"pipeline": {"backend": "opencv"}}, "data.pipeline.backend='opencv'"),
    ({"pipeline": {"sise": 64}}, r"unknown key\(s\) \['sise'\]"),
])
def test_bad_values_name_the_key_and_the_rule(kwargs, message):
    with pytest.raises(ConfigError, match=message):
        DataSpec(**kwargs)


def test_from_mapping_rejects_unknown_keys_by_name():
    with pytest.raises(ConfigError, match=r"data: unknown key\(s\) \['sed'\]; allowed keys are"):
        DataSpec.from_mapping({"sed": 1})


def test_repr_is_short():
    assert repr(DataSpec(seed=3)) == "DataSpec(seed=3)"


def test_a_relative_dataset_path_is_made_absolute_and_groups_with_the_absolute_one(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    relative = DataSpec(dataset="./data")
    assert relative.dataset == str(tmp_path / "data")
    assert relative.group_key == DataSpec(dataset=str(tmp_path / "data")).group_key
    assert DataSpec(dataset="builtin:shapes").dataset == "builtin:shapes"


@pytest.mark.parametrize("key, moved", [("prep_actors", "pool.actors"), ("staging_fraction", "pool.staging_fraction")])
def test_keys_that_moved_to_the_node_pool_say_where(key, moved):
    with pytest.raises(ConfigError, match=rf"data.{key} belongs to the node's prep pool now.*{moved}"):
        DataSpec.from_mapping({key: 2})


class _HoldsAnOpenFile:
    """A map-style dataset that opened its file in ``__init__`` (it must open it lazily)."""

    def __init__(self, path: str) -> None:
        self.file = open(path, "rb")

    def __len__(self) -> int:
        return 4

    def __getitem__(self, i: int):
        return self.file.read(1), 0


def test_a_dataset_holding_an_open_file_is_refused_naming_the_file(tmp_path):
    path = tmp_path / "labels.bin"
    path.write_bytes(b"\0" * 8)
    dataset = _HoldsAnOpenFile(str(path))
    try:
        with pytest.raises(ConfigError, match=f"open file.*{path.name}.*created lazily"):
            DataSpec(dataset=dataset)  # cloudpickle would send a copy of the file's bytes instead
    finally:
        dataset.file.close()


class Squares:
    """A map-style dataset of a user's own."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[int, int]:
        return i * i, i


def test_a_process_that_only_passes_a_spec_on_never_unpickles_its_transforms(tmp_path):
    """The registry, a coordinator and a shared trial read a spec's group key and options only: its
    transforms.v2 pipeline stays pickled there (unpickling it imports torchvision), and becomes an
    object where it is read, equal to the sender's."""
    import pickle
    import subprocess
    import sys

    from torchvision.transforms import v2

    spec = DataSpec(dataset=Squares(4), transform=v2.Compose([v2.RandomResizedCrop(24)]), seed=3)
    once = pickle.loads(pickle.dumps(spec))
    path = tmp_path / "spec.pkl"
    path.write_bytes(pickle.dumps(once))  # passed on without being read: the same bytes go on
    reader = textwrap.dedent(f"""
        import pickle, sys
        spec = pickle.loads(open({str(path)!r}, "rb").read())
        seen = (spec.group_key, spec.seed, spec.user_transforms, spec.dataset_name, spec.chunk_size)
        assert "torchvision" not in sys.modules, "reading the options unpickled the transforms"
        again = pickle.loads(pickle.dumps(spec))
        assert "torchvision" not in sys.modules, "passing the spec on unpickled them"
        print(*seen[:4], len(spec.dataset))
    """)
    out = subprocess.run([sys.executable, "-c", reader], capture_output=True, text=True, timeout=120,
                         cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == [spec.group_key, "3", "True", "Squares", "4"]
    assert once.transform.transforms[0].size == (24, 24) and once == spec
