"""Parquet datasets: byte-for-byte round trips, row-group-sized reads, clear errors, ``coordprep convert``."""

from __future__ import annotations

import io
import json
import os
import pickle
import shutil
import subprocess
import sys
import time

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch

from coordinated_prep import ConfigError, DatasetError, SampleError
from coordinated_prep.cli import _ProgressBar, main
from coordinated_prep.convert import convert_imagefolder
from coordinated_prep.pipeline.sources import ImageFolderSource, ParquetSource, open_source, shapes
from coordinated_prep.pipeline.sources.parquet import MANIFEST
from tests.harness import assert_same_unshared_batches


@pytest.fixture(scope="module")
def shapes_root(tmp_path_factory) -> str:
    """builtin:shapes's generator at 20 images per class (the full 3,000 take seconds to draw)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setitem(shapes.VARIANTS, "shapes", (shapes.IMAGE_SIZE, shapes.IMAGE_SIZE, 20))
        return shapes.ensure_shapes(str(tmp_path_factory.mktemp("shapes") / "shapes"))


def _assert_same_samples(theirs, ours) -> None:
    assert len(ours) == len(theirs) and ours.classes == theirs.classes
    assert ours.labels.dtype == np.int64 and np.array_equal(ours.labels, theirs.labels)
    for i in range(len(theirs)):
        assert ours.read(i) == theirs.read(i), f"sample {i} differs"


@pytest.mark.parametrize("shard_size, row_group_size", [(64, 8), (1024, 16), (7, 3)])
def test_round_trip_is_byte_for_byte_with_the_imagefolder(shapes_root, tmp_path, shard_size, row_group_size):
    result = convert_imagefolder(shapes_root, str(tmp_path / "pq"), shard_size=shard_size,
                                 row_group_size=row_group_size)
    images = ImageFolderSource(shapes_root)
    assert result.samples == len(images) == 200 and len(result.shards) == -(-200 // shard_size)
    assert result.image_bytes == sum(os.path.getsize(p) for p in images.paths)
    assert sorted(os.listdir(tmp_path / "pq")) == sorted([MANIFEST, *map(os.path.basename, result.shards)])
    ours = open_source(str(tmp_path / "pq"))
    assert isinstance(ours, ParquetSource)
    _assert_same_samples(images, ours)
    last = len(images) - 1
    assert ours.describe(last) == f"{result.shards[-1]}#row {last - shard_size * (len(result.shards) - 1)}"
    again = convert_imagefolder(str(tmp_path / "pq"), str(tmp_path / "pq2"), shard_size=50, row_group_size=5)
    assert len(again.shards) == 4  # a Parquet dataset converts again, e.g. to other shard sizes
    _assert_same_samples(images, ParquetSource(again.out))


def test_png_jpeg_and_nested_files_round_trip(small_dataset, tmp_path):
    convert_imagefolder(small_dataset, str(tmp_path / "pq"), shard_size=50, row_group_size=4)
    _assert_same_samples(ImageFolderSource(small_dataset), ParquetSource(str(tmp_path / "pq")))


def test_a_read_decodes_one_row_group_of_the_image_column_only(shapes_root, tmp_path, monkeypatch):
    out = convert_imagefolder(shapes_root, str(tmp_path / "pq"), shard_size=64, row_group_size=8).out
    source = ParquetSource(out)
    reads: list[tuple[int, list[str]]] = []  # (rows decoded, columns) of every read from a shard

    def recording(name):
        original = getattr(pq.ParquetFile, name)

        def read(self, *args, **kwargs):
            table = original(self, *args, **kwargs)
            reads.append((table.num_rows, table.column_names))
            return table
        return read

    for name in ("read", "read_row_group", "read_row_groups"):
        monkeypatch.setattr(pq.ParquetFile, name, recording(name))
    monkeypatch.setattr(pq.ParquetFile, "iter_batches", None)  # no reader may stream a whole shard either
    order = np.random.default_rng(0).permutation(len(source))
    for i in order[:50]:
        before = len(reads)
        source.read(int(i))
        assert len(reads) - before <= 1
        assert all(rows <= 8 and columns == ["image"] for rows, columns in reads[before:]), reads[before:]
    reads.clear()
    fresh = pickle.loads(pickle.dumps(source))  # no handles or cached row groups travel with it
    for i in range(len(fresh)):
        fresh.read(i)
    assert len(reads) == 200 // 8 and sum(rows for rows, _ in reads) == 200, "neighbours come from the cache"


# Forked from a fresh interpreter: by this point the pytest process holds the threads of earlier
# modules (Ray's gRPC, DALI, torch), and a fork of a many-threaded process may crash in the child
# whatever the source does (CI saw one such segfault). The fresh parent holds exactly what a
# training script's would: an opened shard and a cached row group.
_FORKED_READS = """
import pickle, sys
import torch
from coordinated_prep.pipeline.sources import ParquetSource

class Reads(torch.utils.data.Dataset):
    def __init__(self, source):
        self.source = source
    def __len__(self):
        return len(self.source)
    def __getitem__(self, i):
        return self.source.read(i)

source = ParquetSource(sys.argv[1])
source.read(100)
assert source._files and source._cache, "the parent must hold a handle and a cached row group before the fork"
loader = torch.utils.data.DataLoader(Reads(source), batch_size=None, num_workers=2, multiprocessing_context="fork",
                                     timeout=60)
sys.stdout.buffer.write(pickle.dumps(list(loader)))
"""


def test_dataloader_workers_forked_after_reads_get_the_same_bytes(small_dataset, tmp_path):
    out = convert_imagefolder(small_dataset, str(tmp_path / "pq"), shard_size=64).out
    done = subprocess.run([sys.executable, "-c", _FORKED_READS, out], capture_output=True, timeout=120)
    assert done.returncode == 0, done.stderr.decode(errors="replace")[-2000:]
    folder = ImageFolderSource(small_dataset)
    assert pickle.loads(done.stdout) == [folder.read(i) for i in range(len(folder))]


def test_errors_name_the_manifest_shard_and_fix(shapes_root, tmp_path):
    out = tmp_path / "pq"
    convert_imagefolder(shapes_root, str(out), shard_size=64, row_group_size=8)
    manifest = json.loads((out / MANIFEST).read_text())
    with pytest.raises(DatasetError, match=f"no {MANIFEST} manifest.*coordprep convert"):
        ParquetSource(shapes_root)
    (out / MANIFEST).write_text("{not json")
    with pytest.raises(DatasetError, match="cannot read the manifest.*--overwrite"):
        ParquetSource(str(out))
    (out / MANIFEST).write_text(json.dumps(dict(manifest, version=99)))
    with pytest.raises(DatasetError, match="format version 99.*reads version 1"):
        ParquetSource(str(out))
    shards = [dict(s) for s in manifest["shards"]]
    shards[1]["rows"] += 1
    (out / MANIFEST).write_text(json.dumps(dict(manifest, shards=shards, rows=manifest["rows"] + 1)))
    with pytest.raises(DatasetError, match="part-00001.parquet holds 64 rows, but the manifest says 65"):
        ParquetSource(str(out))
    (out / MANIFEST).write_text(json.dumps(manifest))
    (out / "part-00002.parquet").write_bytes(b"PAR1 truncated")
    with pytest.raises(DatasetError, match="part-00002.parquet cannot be read as Parquet"):
        ParquetSource(str(out))
    (out / "part-00002.parquet").unlink()
    with pytest.raises(DatasetError, match="part-00002.parquet is missing"):
        ParquetSource(str(out))
    (out / MANIFEST).unlink()
    with pytest.raises(DatasetError, match=f"Parquet files but no {MANIFEST}"):
        open_source(str(out))


def _with_field(out, manifest, field, value) -> None:
    """Write ``manifest`` with ``field`` (``rows``, or ``shards.0.file`` for the first shard's file) set to ``value``."""
    manifest = json.loads(json.dumps(manifest))
    if field.startswith("shards."):
        _, k, key = field.split(".")
        manifest["shards"][int(k)][key] = value
    else:
        manifest[field] = value
    (out / MANIFEST).write_text(json.dumps(manifest))


@pytest.mark.parametrize("field, value, named", [
    ("shards.0.file", "../outside.parquet", r"shards\[0\]\.file='\.\./outside\.parquet' leaves the dataset directory"),
    ("shards.0.file", "sub/../../outside.parquet", r"shards\[0\]\.file=.* leaves the dataset directory"),
    ("shards.0.file", "/etc/passwd", r"shards\[0\]\.file='/etc/passwd' is an absolute path"),
    ("shards.0.file", 7, r"shards\[0\]\.file=7 must be a file name"),
    ("shards.1.file", "part-00000.parquet", r"shards\[1\]\.file='part-00000\.parquet' names a shard listed before"),
    ("rows", "lots", r"rows='lots' must be an integer >= 0"),
    ("rows", 1.5, r"rows=1\.5 must be an integer >= 0"),
    ("shards.0.rows", "64", r"shards\[0\]\.rows='64' must be an integer >= 0"),
    ("shards.0.rows", -1, r"shards\[0\]\.rows=-1 must be an integer >= 0"),
    ("row_group_size", True, r"row_group_size=True must be an integer >= 1"),
    ("row_group_size", 0, r"row_group_size=0 must be an integer >= 1"),
    ("classes", [1, 2], r"classes=\[1, 2\] must be a non-empty list of class names"),
    ("shards", {"file": "x"}, r"shards=\{'file': 'x'\} must be a list"),
])
def test_a_manifest_field_that_cannot_be_trusted_is_a_dataset_error_naming_file_field_and_value(
        shapes_root, tmp_path, field, value, named):
    out = tmp_path / "pq"
    convert_imagefolder(shapes_root, str(out), shard_size=64, row_group_size=8)
    manifest = json.loads((out / MANIFEST).read_text())
    (tmp_path / "outside.parquet").write_bytes((out / "part-00000.parquet").read_bytes())  # a valid shard, outside
    _with_field(out, manifest, field, value)
    with pytest.raises(DatasetError, match=named) as e:
        open_source.__wrapped__(str(out))
    assert str(out / MANIFEST) in str(e.value) and "--overwrite" in str(e.value)


def test_a_shard_symlinked_out_of_the_dataset_directory_is_refused(shapes_root, tmp_path):
    out = tmp_path / "pq"
    convert_imagefolder(shapes_root, str(out), shard_size=64, row_group_size=8)
    (out / "part-00000.parquet").rename(tmp_path / "elsewhere.parquet")
    (out / "part-00000.parquet").symlink_to(tmp_path / "elsewhere.parquet")
    with pytest.raises(DatasetError, match=r"shards\[0\]\.file='part-00000\.parquet' resolves to .*outside"):
        ParquetSource(str(out))


def test_a_shard_broken_after_opening_is_a_sample_error_naming_index_and_shard(shapes_root, tmp_path):
    out = convert_imagefolder(shapes_root, str(tmp_path / "pq"), shard_size=64, row_group_size=8).out
    source = ParquetSource(out)  # shards are opened on first read, not here
    with open(source.shards[1], "r+b") as f:
        f.truncate(100)
    with pytest.raises(SampleError, match=r"sample 70 \(.*part-00001.parquet#row 6\): cannot read") as e:
        source.read(70)
    assert e.value.index == 70
    assert source.read(3) == ImageFolderSource(shapes_root).read(3)


@pytest.mark.parametrize("kwargs, named", [({"shard_size": 0}, "shard_size=0"),
                                           ({"row_group_size": -1}, "row_group_size=-1"),
                                           ({"shard_size": 8, "row_group_size": 16}, "larger than shard_size=8")])
def test_bad_sizes_are_config_errors_naming_the_option(small_dataset, tmp_path, kwargs, named):
    with pytest.raises(ConfigError, match=named):
        convert_imagefolder(small_dataset, str(tmp_path / "pq"), **kwargs)
    assert not (tmp_path / "pq").exists()


def test_overwrite_replaces_only_what_convert_wrote(small_dataset, tmp_path):
    out = tmp_path / "pq"
    convert_imagefolder(small_dataset, str(out), shard_size=20)
    with pytest.raises(ConfigError, match="is not empty.*--overwrite"):
        convert_imagefolder(small_dataset, str(out), shard_size=100)
    result = convert_imagefolder(small_dataset, str(out), shard_size=100, overwrite=True)
    assert sorted(os.listdir(out)) == [MANIFEST, "part-00000.parquet", "part-00001.parquet"]
    assert len(ParquetSource(str(out))) == result.samples == 180
    (out / "notes.txt").write_text("mine")
    with pytest.raises(ConfigError, match="notes.txt.*did not write"):
        convert_imagefolder(small_dataset, str(out), overwrite=True)
    assert (out / "notes.txt").read_text() == "mine" and len(ParquetSource(str(out))) == 180
    with pytest.raises(ConfigError, match="inside the source dataset"):
        convert_imagefolder(small_dataset, os.path.join(small_dataset, "parquet"))
    os.symlink(out, tmp_path / "link")  # the source through a link: --overwrite would delete it
    with pytest.raises(ConfigError, match="inside the source dataset"):
        convert_imagefolder(str(out), str(tmp_path / "link"), overwrite=True)
    assert len(ParquetSource(str(out))) == 180, "the source is whole"


def test_an_interrupted_conversion_leaves_no_dataset(small_dataset, tmp_path):
    broken = tmp_path / "src"
    shutil.copytree(small_dataset, broken)
    victim = ImageFolderSource(str(broken)).paths[150]

    def vanish(done: int, total: int) -> None:
        if done == 120 and os.path.exists(victim):  # the file goes while the second shard is written
            os.remove(victim)

    with pytest.raises(SampleError, match=r"sample 150 \(.*cannot read the file"):
        convert_imagefolder(str(broken), str(tmp_path / "pq"), shard_size=100, progress=vanish)
    assert os.listdir(tmp_path / "pq") == ["part-00000.parquet"], "complete shards only, no temporary file"
    with pytest.raises(DatasetError, match="no coordprep-parquet.json manifest"):
        open_source(str(tmp_path / "pq"))


def test_unshared_batches_are_byte_identical_to_the_imagefolders(small_dataset, tmp_path):
    out = convert_imagefolder(small_dataset, str(tmp_path / "pq"), shard_size=64, row_group_size=8).out
    assert_same_unshared_batches(small_dataset, out)


def test_cli_convert_end_to_end(small_dataset, tmp_path, capsys):
    out = tmp_path / "pq"
    assert main(["convert", small_dataset, str(out), "--shard-size", "50", "--row-group-size", "10"]) == 0
    captured = capsys.readouterr()
    assert "4 shards, 180 samples" in captured.out and str(out) in captured.out
    assert "converting [" in captured.err and "180/180" in captured.err and captured.err.endswith("\n")
    assert sorted(os.listdir(out)) == [MANIFEST] + [f"part-{k:05d}.parquet" for k in range(4)]
    assert main(["convert", small_dataset, str(out)]) == 2
    assert "is not empty" in capsys.readouterr().err
    assert main(["convert", small_dataset, str(out), "--overwrite", "--shard-size", "500"]) == 0
    assert len(os.listdir(out)) == 2
    assert main(["convert", str(tmp_path / "missing"), str(tmp_path / "pq2")]) == 2
    assert "missing': no such directory" in capsys.readouterr().err
    assert main(["convert", small_dataset, str(tmp_path / "pq3"), "--row-group-size", "0"]) == 2
    assert "row_group_size=0 (--row-group-size)" in capsys.readouterr().err


def test_progress_bar_redraws_at_most_ten_times_a_second_and_ends_its_line():
    stream = io.StringIO()
    bar = _ProgressBar(stream, "converting")
    t0 = time.perf_counter()
    for done in range(1, 5001):
        bar.update(done, 5000)
    elapsed = time.perf_counter() - t0
    text = stream.getvalue()
    assert text.count("\r") <= 2 + elapsed / 0.1
    assert text.split("\r")[-1].startswith("converting [" + "#" * 30 + "] 5000/5000") and text.endswith("/s)\n")
    bar.close()
    assert stream.getvalue() == text, "close adds nothing after a complete bar"
