"""Index fingerprints: copies of a dataset on two nodes match only if they index the same samples."""

from __future__ import annotations

import os
import shutil

import pytest

from coordinated_prep import DatasetError
from coordinated_prep.convert import convert_imagefolder
from coordinated_prep.pipeline.sources import ImageFolderSource, ParquetSource, open_source
from coordinated_prep.pipeline.sources.fingerprint import check_same_index, index_fingerprint


def _copy(small_dataset: str, tmp_path, name: str) -> str:
    return shutil.copytree(small_dataset, str(tmp_path / name))


def _fp(root: str):
    return index_fingerprint(ImageFolderSource(root))


def test_identical_copies_at_other_paths_give_the_same_fingerprint(small_dataset, tmp_path):
    a, b = _fp(small_dataset), _fp(_copy(small_dataset, tmp_path, "copy"))
    assert a == b and a.kind == "imagefolder" and a.samples == 180 and a.classes == 3 and a.total_bytes > 0
    check_same_index(small_dataset, "node-a", a, "node-b", b)  # no error


def test_a_copy_with_one_more_file_is_refused_naming_both_nodes_and_the_counts(small_dataset, tmp_path):
    copy = _copy(small_dataset, tmp_path, "copy")
    first = ImageFolderSource(copy).paths[0]
    shutil.copy(first, os.path.join(os.path.dirname(first), "zz-extra" + os.path.splitext(first)[1]))
    a, b = _fp(small_dataset), _fp(copy)
    assert a.digest != b.digest and (a.samples, b.samples) == (180, 181)
    with pytest.raises(DatasetError) as e:
        check_same_index(small_dataset, "node-a", a, "node-b", b)
    message = str(e.value)
    assert small_dataset in message and "node node-a indexes 180 samples" in message
    assert "node node-b indexes 181 samples" in message and "different sample or class counts" in message


@pytest.mark.parametrize("change, what", [("resize", "files of other sizes"),
                                          ("rename", "other file names or labels"),
                                          ("move", "other file names or labels")])
def test_a_copy_with_one_file_changed_renamed_or_moved_to_another_class_differs(small_dataset, tmp_path, change, what):
    copy = _copy(small_dataset, tmp_path, "copy")
    source = ImageFolderSource(copy)
    path = source.paths[5]
    if change == "resize":
        with open(path, "ab") as f:
            f.write(b"\0")
    elif change == "rename":  # same name order, same size: only the name differs
        os.rename(path, path[:-4] + "a" + path[-4:])
    else:  # swap the first file of class 0 and the first of class 1 (counts and sizes may stay the same)
        other = source.paths[int((source.labels == 1).argmax())]
        tmp = path + ".swap"
        os.rename(path, tmp)
        os.rename(other, path.replace(source.classes[0], source.classes[1], 1))
        os.rename(tmp, other.replace(source.classes[1], source.classes[0], 1))
    a, b = _fp(small_dataset), _fp(copy)
    assert a.digest != b.digest
    if (a.samples, a.total_bytes) == (b.samples, b.total_bytes):
        with pytest.raises(DatasetError, match=what):
            check_same_index(small_dataset, "node-a", a, "node-b", b)


def test_parquet_fingerprints_follow_the_manifest_and_shards_not_the_directory(small_dataset, tmp_path):
    one = convert_imagefolder(small_dataset, str(tmp_path / "one"), shard_size=64).out
    two = convert_imagefolder(small_dataset, str(tmp_path / "two"), shard_size=64).out
    a, b = index_fingerprint(ParquetSource(one)), index_fingerprint(ParquetSource(two))
    assert a == b and a.kind == "parquet" and a.samples == 180
    smaller = _copy(small_dataset, tmp_path, "smaller")
    os.remove(ImageFolderSource(smaller).paths[-1])
    three = convert_imagefolder(smaller, str(tmp_path / "three"), shard_size=64).out
    c = index_fingerprint(ParquetSource(three))
    assert c.digest != a.digest and c.samples == 179
    with pytest.raises(DatasetError, match="differs between nodes"):
        check_same_index(one, "node-a", a, "node-b", c)


def test_builtin_datasets_have_a_stable_fingerprint():
    a = index_fingerprint(open_source("builtin:shapes"), "builtin:shapes")
    b = index_fingerprint(open_source("builtin:shapes"), "builtin:shapes")
    assert a == b and a.kind == "builtin" and a.samples == 3000 and a.total_bytes == 0
