"""WebDataset tar shards as a dataset: the source's contract against the ImageFolder it came from,
webdataset's own writer and reader, the converter, the refusals, and a shared sweep over shards."""

from __future__ import annotations

import io
import json
import os
import subprocess
import pickle
import shutil
import tarfile

import numpy as np
import pytest
import torch
import webdataset as wds
from ray import tune

from coordinated_prep import CoordinatedSearcher, DataSpec
from coordinated_prep.cli import main
from coordinated_prep.convert import convert_imagefolder
from coordinated_prep.convert import convert_to_tar
from coordinated_prep.errors import ConfigError, DatasetError
from coordinated_prep.pipeline.sources import folder_root, open_source
from coordinated_prep.pipeline.sources.parquet import ParquetSource
from coordinated_prep.pipeline.sources.shard_index import write_shard_index
from coordinated_prep.pipeline.sources.tar_shards import TarShardSource
from coordinated_prep.plan import stream_plan
from tests.conftest import live_coordprep_actors
from tests.harness import assert_same_unshared_batches, check_trial_records
from tests.recording import load_records, record


def _write_with_webdataset(folder: str, out: str, per_shard: int) -> list[str]:
    """Shards as a team writes them: webdataset's TarWriter, one sample per ImageFolder file."""
    source = open_source.__wrapped__(folder)
    os.makedirs(out, exist_ok=True)
    paths = []
    for k, lo in enumerate(range(0, len(source), per_shard)):
        paths.append(os.path.join(out, f"train-{k:04d}.tar"))
        with wds.TarWriter(paths[-1]) as sink:
            for i in range(lo, min(len(source), lo + per_shard)):
                ext = os.path.splitext(source.describe(i))[1].lstrip(".").lower()
                sink.write({"__key__": f"sample{i:05d}", ext: source.read(i), "cls": int(source.labels[i])})
    return paths


def test_shards_written_by_webdataset_read_as_the_imagefolder_byte_for_byte(small_dataset, tmp_path):
    paths = _write_with_webdataset(small_dataset, str(tmp_path / "wds"), per_shard=70)
    folder = open_source.__wrapped__(small_dataset)
    pattern = str(tmp_path / "wds" / "train-{0000..0002}.tar")
    for dataset in (str(tmp_path / "wds"), pattern):
        source = open_source.__wrapped__(dataset)
        assert isinstance(source, TarShardSource) and source.shards == tuple(paths)
        assert len(source) == len(folder) and np.array_equal(source.labels, folder.labels)
        assert all(source.read(i) == folder.read(i) for i in range(len(folder)))
        assert source.describe(75) == f"{paths[1]}#sample00075"
        assert folder_root(dataset) is None, "no ImageFolder walk of a folder of shards"
    again = pickle.loads(pickle.dumps(source))
    assert again.read(-1) == folder.read(len(folder) - 1)
    assert [s if isinstance(s, bytes) else None for s in source.read_many([0, 179])] == [folder.read(0), folder.read(179)]
    assert isinstance(open_source.__wrapped__(paths[0]), TarShardSource), "one .tar file is a dataset too"


def test_convert_writes_shards_webdataset_reads_and_reads_them_back(small_dataset, tmp_path, capsys):
    assert main(["convert", small_dataset, str(tmp_path / "tar"), "--format", "tar", "--shard-size", "64"]) == 0
    assert "3 shards, 180 samples" in capsys.readouterr().out
    folder, shards = open_source.__wrapped__(small_dataset), open_source.__wrapped__(str(tmp_path / "tar"))
    assert len(shards) == len(folder) and np.array_equal(shards.labels, folder.labels)
    assert all(shards.read(i) == folder.read(i) for i in range(len(folder)))
    # webdataset's own reader finds every sample, its image and its class
    seen = list(wds.WebDataset(str(tmp_path / "tar" / "shard-{000000..000002}.tar"), shardshuffle=False))
    assert [int(s["__key__"]) for s in seen] == list(range(180))
    assert all(int(s["cls"]) == folder.labels[i] and (s.get("jpg") or s.get("png")) == folder.read(i)
               for i, s in enumerate(seen))
    # and shards convert on to Parquet, the same bytes in the same order
    out = convert_imagefolder(str(tmp_path / "tar"), str(tmp_path / "pq"), shard_size=100, row_group_size=10).out
    parquet = ParquetSource(out)
    assert all(parquet.read(i) == folder.read(i) for i in range(len(folder)))
    # converting twice gives the same bytes (no clock in the shards)
    again = convert_to_tar(small_dataset, str(tmp_path / "tar2"), shard_size=64)
    assert [open(p, "rb").read() for p in again.shards] == [open(p, "rb").read() for p in shards.shards]


def test_unshared_batches_over_shards_equal_the_imagefolders(small_dataset, tmp_path):
    assert_same_unshared_batches(small_dataset, convert_to_tar(small_dataset, str(tmp_path / "tar"), shard_size=50).out)


def _tar(path: str, members: dict[str, bytes] | list[tuple[str, bytes]]) -> str:
    with tarfile.open(path, "w") as tar:
        for name, data in members.items() if isinstance(members, dict) else members:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return path


def test_shards_that_break_the_layout_are_refused_naming_shard_key_and_fix(small_dataset, tmp_path):
    jpeg = open_source.__wrapped__(small_dataset).read(0)
    (tmp_path / "a").mkdir()
    no_label = _tar(str(tmp_path / "a" / "s.tar"), {"x1.jpg": jpeg, "x1.cls": b"0", "x2.jpg": jpeg})
    with pytest.raises(DatasetError, match=r"s\.tar, sample 'x2': no 'cls' member .*TarWriter"):
        open_source.__wrapped__(no_label)
    (tmp_path / "b").mkdir()
    with pytest.raises(DatasetError, match=r"sample 'x1': no image member \(has \['cls', 'txt'\]"):
        open_source.__wrapped__(_tar(str(tmp_path / "b" / "s.tar"), {"x1.txt": b"a cat", "x1.cls": b"1"}))
    (tmp_path / "c").mkdir()
    with pytest.raises(DatasetError, match=r"holds b'cat', not a class index"):
        open_source.__wrapped__(_tar(str(tmp_path / "c" / "s.tar"), {"x1.jpg": jpeg, "x1.cls": b"cat"}))
    (tmp_path / "h").mkdir()
    with pytest.raises(DatasetError, match=r"sample 'x1': its members are not consecutive"):  # webdataset: 3 samples
        open_source.__wrapped__(_tar(str(tmp_path / "h" / "s.tar"), [("x1.jpg", jpeg), ("x1.cls", b"0"), ("x2.jpg", jpeg),
                                                                     ("x2.cls", b"0"), ("x1.png", jpeg)]))
    (tmp_path / "i").mkdir()
    with pytest.raises(DatasetError, match=r"sample 'x1': two 'jpg' members"):
        open_source.__wrapped__(_tar(str(tmp_path / "i" / "s.tar"), {"x1.jpg": jpeg, "x1.JPG": jpeg, "x1.cls": b"0"}))
    (tmp_path / "s").mkdir()
    with open(tmp_path / "s" / "x1.jpg", "wb") as f:  # a file with a hole, which GNU tar -S stores in pieces
        f.write(jpeg)
        f.seek(1 << 20)
        f.write(jpeg)
    (tmp_path / "s" / "x1.cls").write_bytes(b"0")
    subprocess.run(["tar", "-S", "-cf", "s.tar", "x1.jpg", "x1.cls"], cwd=tmp_path / "s", check=True)
    for name in ("x1.jpg", "x1.cls"):
        os.remove(tmp_path / "s" / name)
    with pytest.raises(DatasetError, match=r"s\.tar, member 'x1\.jpg' is a sparse file .*without --sparse"):
        open_source.__wrapped__(str(tmp_path / "s"))
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "s.tar").write_bytes(b"not a tar at all" * 64)
    with pytest.raises(DatasetError, match=r"s\.tar is not a readable tar file.*uncompressed tar"):
        open_source.__wrapped__(str(tmp_path / "d"))
    _write_with_webdataset(small_dataset, str(tmp_path / "e"), per_shard=100)
    with pytest.raises(DatasetError, match=r"1 of its 3 shards are missing, first .*train-0002\.tar"):
        open_source.__wrapped__(str(tmp_path / "e" / "train-{0000..0002}.tar"))
    with pytest.raises(DatasetError, match=r"no such directory; .*WebDataset tar shards"):
        open_source.__wrapped__(str(tmp_path / "nowhere"))
    assert main(["convert", small_dataset, str(tmp_path / "f"), "--format", "tar", "--row-group-size", "4"]) == 2
    with pytest.raises(ConfigError, match=r"holds \['mine.txt'\], which coordprep convert did not write"):
        (tmp_path / "g").mkdir()
        (tmp_path / "g" / "mine.txt").write_text("keep me")
        convert_to_tar(small_dataset, str(tmp_path / "g"), overwrite=True)
    assert (tmp_path / "g" / "mine.txt").read_text() == "keep me"
    done = convert_to_tar(small_dataset, str(tmp_path / "j"), shard_size=100)
    for over in (str(tmp_path / "j" / "shard-{000000..000001}.tar"), f"file://{tmp_path / 'j'}"):
        with pytest.raises(ConfigError, match=r"holds or lies inside the source dataset .*would delete"):
            convert_to_tar(over, str(tmp_path / "j"), overwrite=True)  # shards over themselves: nothing deleted
    os.symlink(tmp_path / "j", tmp_path / "link")
    with pytest.raises(ConfigError, match=r"holds or lies inside the source dataset .*would delete"):
        convert_to_tar(str(tmp_path / "j"), str(tmp_path / "link"), overwrite=True)  # through a link
    assert all(os.path.getsize(p) > 0 for p in done.shards)
    assert len(open_source.__wrapped__(f"file://{tmp_path / 'j'}")) == 180, "a file:// folder of shards"


def test_a_shard_index_reads_each_shard_when_a_sample_of_it_is_read_and_refuses_what_breaks_it(small_dataset,
                                                                                                  tmp_path):
    folder = open_source.__wrapped__(small_dataset)
    out = convert_to_tar(small_dataset, str(tmp_path / "tar"), shard_size=50).out
    names = [f"shard-{k:06d}.tar" for k in range(4)]
    write_shard_index(str(tmp_path / "tar" / "train.json"), names, [50, 50, 50, 30])  # relative to its folder
    source = open_source.__wrapped__(str(tmp_path / "tar" / "train.json"))
    assert (len(source), source.shard_sizes) == (180, (50, 50, 50, 30))
    assert source.describe(120) == f"{out}/shard-000002.tar#sample 20", "an error's description reads nothing"
    assert source.read(120) == folder.read(120) and source.describe(120) == f"{out}/shard-000002.tar#00000120"
    eager = open_source.__wrapped__(out)
    assert eager.shard_sizes is None, "a folder of shards is read whole at the start, planned over its samples"
    assert source.classes == eager.classes == ("0", "1", "2"), "without classes in the index: every shard read"
    assert np.array_equal(np.asarray(source.labels), folder.labels) and source.labels[-1] == folder.labels[-1]
    # A shard index names its shards by URL as well, and a base_path; the fingerprint digests the index.
    from coordinated_prep.pipeline.sources.fingerprint import index_fingerprint

    write_shard_index(str(tmp_path / "elsewhere.json"), [os.path.join(out, n) for n in names], [50, 50, 50, 30],
                      classes=["a", "b", "c"])
    moved = open_source.__wrapped__(str(tmp_path / "elsewhere.json"))
    assert moved.classes == ("a", "b", "c") and moved.read(179) == folder.read(179)
    write_shard_index(str(tmp_path / "two.json"), [os.path.join(out, n) for n in names], [50, 50, 50, 30],
                      classes=["a", "b"])  # the shards hold class 2 as well: refused where read, naming it
    with pytest.raises(DatasetError, match=r"shard \S+shard-000003\.tar: sample '\d+' has class 2, but its index "
                                           r"\S+two\.json names 2 classes \(0 to 1\); list every class"):
        open_source.__wrapped__(str(tmp_path / "two.json")).labels[179]
    assert index_fingerprint(moved).kind == "tar shards" and index_fingerprint(moved) != index_fingerprint(source)

    def index(doc) -> str:
        path = tmp_path / f"bad-{len(os.listdir(tmp_path))}.json"
        path.write_text(doc if isinstance(doc, str) else json.dumps(doc))
        return str(path)

    for doc, named in [("{not json", r"cannot be read as JSON .*widsindex create"),
                       ({"wids_version": 1}, r"no 'shardlist' of shards"),
                       ({"shardlist": [{"url": names[0]}]}, r"shardlist\[0\] is \{'url': .*'nsamples' \(an int >= 1\)"),
                       ({"shardlist": [{"url": names[0], "nsamples": 0}]}, r"shardlist\[0\]"),
                       ({"shardlist": [{"url": names[0], "nsamples": 50}], "classes": "abc"}, r"'classes' is 'abc'")]:
        with pytest.raises(DatasetError, match=named) as e:
            open_source.__wrapped__(index(doc))
        assert "shard index " + str(tmp_path) in str(e.value)
    with pytest.raises(DatasetError, match=r"1 of its 2 shards do not exist, first \S+/gone\.tar; fix their url"):
        open_source.__wrapped__(index({"shardlist": [{"url": os.path.join(out, names[0]), "nsamples": 50},
                                                     {"url": "gone.tar", "nsamples": 5}]}))  # at the start
    with pytest.raises(DatasetError, match=r"shard index \S+/none\.json cannot be opened .*check the path"):
        open_source.__wrapped__(str(tmp_path / "none.json"))
    # Where shards are looked for: a relative base_path from the index's folder (not the process's), a
    # URL's leading / from its host, file:// as a local path; climbing above a host is refused.
    from coordinated_prep.pipeline.sources.shard_index import read_shard_index

    assert read_shard_index(index({"base_path": "tar", "shardlist": [{"url": names[1], "nsamples": 50}]})).urls == (
        os.path.join(out, names[1]),)
    found = read_shard_index(index({"base_path": "https://host:8443/ds/", "shardlist": [
        {"url": "/shards/a.tar", "nsamples": 1}, {"url": "../b.tar", "nsamples": 1},
        {"url": f"file://{out}/{names[0]}", "nsamples": 1}, {"url": "s3://bucket/c.tar", "nsamples": 1}]}))
    assert found.urls == ("https://host:8443/shards/a.tar", "https://host:8443/b.tar", f"{out}/{names[0]}",
                          "s3://bucket/c.tar")
    # A query (a signature, a version) is the URL's own: the folder and base_path are its path's; file: URLs
    # with localhost, one slash or percent-escapes are local paths, and another host is refused.
    from coordinated_prep.pipeline.sources.shard_index import is_shard_index

    assert is_shard_index("https://h/d/train.json?v=2") and not is_shard_index("https://h/d/train.tar?x=.json")
    signed = read_shard_index(index({"base_path": "https://h/d/?sig=1", "shardlist": [{"url": "a.tar", "nsamples": 1}]}))
    assert signed.urls == ("https://h/d/a.tar",)
    spaced = tmp_path / "my dir"
    spaced.mkdir()
    shutil.copy(os.path.join(out, names[0]), spaced / "s.tar")
    local = read_shard_index(index({"shardlist": [{"url": f"file://localhost{spaced}/s.tar", "nsamples": 50},
                                                  {"url": f"file:{str(spaced).replace(' ', '%20')}/s.tar", "nsamples": 50}]}))
    assert local.urls == (f"{spaced}/s.tar",) * 2
    with pytest.raises(DatasetError, match=r"'file://otherhost/s\.tar' names the host 'otherhost'; .* file:///path"):
        read_shard_index(index({"shardlist": [{"url": "file://otherhost/s.tar", "nsamples": 1}]}))
    with pytest.raises(IndexError, match=r"label index 180 out of range for the 180 samples of \S+elsewhere\.json"):
        moved.labels[180]
    with pytest.raises(DatasetError, match=r"'\.\./\.\./x\.tar' climbs above https://host/"):
        read_shard_index(index({"base_path": "https://host/ds/", "shardlist": [{"url": "../../x.tar", "nsamples": 1}]}))


def test_a_sweep_over_tar_shards_shares_exact_epochs(ray_session, small_dataset, tmp_path, warm_pool):
    """Named by a shard index, so read shard by shard: the pieces come from the plan that takes the
    shards in a seeded order (a folder or pattern of shards: tests/test_remote_shards.py's sweeps)."""
    out = convert_to_tar(small_dataset, str(tmp_path / "tar"), shard_size=40).out
    write_shard_index(os.path.join(out, "train.json"), [f"shard-{k:06d}.tar" for k in range(5)], [40] * 4 + [20])
    spec = DataSpec(dataset=os.path.join(out, "train.json"), pipeline={"size": 32}, seed=3, chunk_size=8, segments=3)
    searcher = CoordinatedSearcher(pool=warm_pool)
    analysis = tune.run(tune.with_resources(record, {"cpu": 0.25}), search_alg=searcher, verbose=0,
                        config={"data": spec, "batch_size": tune.grid_search([8, 12]), "epochs": 2,
                                "out": str(tmp_path / "records"), "delay_s": 0.02})
    reports = searcher.group_reports()
    searcher.close()
    assert all(t.status == "TERMINATED" for t in analysis.trials), [t.error_file for t in analysis.trials]
    records = load_records(str(tmp_path / "records"))
    for trial in analysis.trials:
        check_trial_records(spec, records[trial.trial_id], trial.config["batch_size"], trial.trial_id)
    [group] = reports.values()
    assert group["samples_served"] > group["samples_prepared"], group  # the two trials shared pieces
    plan = stream_plan(180, spec.seed, spec.holdout, spec.chunk_size, spec.segments, (40, 40, 40, 40, 20))
    pieces = {frozenset(plan.chunk_samples(g).tolist()) for g in range(3 * plan.chunks_per_epoch)}
    [eights] = [records[t.trial_id] for t in analysis.trials if t.config["batch_size"] == 8]
    assert all(frozenset(e["indices"][lo: lo + 8].tolist()) in pieces for e in eights
               for lo in range(0, len(e["indices"]), 8)), "each batch of 8 is a piece of the plan over shards"
    assert live_coordprep_actors() == []


def test_an_iterable_dataset_is_refused_with_the_way_to_give_its_data(small_dataset, tmp_path):
    paths = _write_with_webdataset(small_dataset, str(tmp_path / "wds"), per_shard=100)
    with pytest.raises(ConfigError, match=r"has no __len__.*give the shards themselves as the dataset: dataset='"):
        DataSpec(dataset=wds.WebDataset(paths, shardshuffle=False))

    class Stream(torch.utils.data.IterableDataset):
        def __iter__(self):
            yield from range(3)

    with pytest.raises(ConfigError, match=r"has no __len__: .*WebDataset tar shards or Parquet by path"):
        DataSpec(dataset=Stream())
