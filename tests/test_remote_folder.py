"""An ImageFolder of raw files in object storage, served by a real HTTP server on loopback and
counted on its side: indexed as a local ImageFolder of the same tree, each file fetched once per node
however many processes read it, failures bounded and named. (Over S3: test_remote_shards.py.)"""

from __future__ import annotations

import os
import shutil
import threading

import pytest

from coordinated_prep.errors import DatasetError, SampleError
from coordinated_prep.pipeline.sources import open_source, remote
from coordinated_prep.pipeline.sources.remote_folder import RemoteFolderSource
from coordinated_prep.sweep.config import _check_dataset
from tests.servers import Server


@pytest.fixture
def served(small_dataset, tmp_path):
    """The small ImageFolder (3 classes, nested folders, a non-image file) copied under an HTTP server."""
    shutil.copytree(small_dataset, tmp_path / "served" / "photos")
    with Server("http", str(tmp_path / "http.log"), str(tmp_path / "served")) as server:
        yield server, str(tmp_path / "served" / "photos")


def _file_gets(server: Server) -> dict[str, int]:
    return {p: n for (method, p), n in server.requests().items() if method == "GET" and "." in p.rsplit("/", 1)[-1]}


def test_a_folder_url_is_indexed_as_imagefolder_and_each_file_is_fetched_once_per_node(served, node_cache):
    server, folder = served
    local = open_source.__wrapped__(folder)
    url = f"{server.url}/photos"
    _check_dataset(url)  # a sweep's configuration takes it (no trailing slash needed)
    readers = [open_source.__wrapped__(url) for _ in range(4)]  # as the processes of one node
    assert all(isinstance(r, RemoteFolderSource) for r in readers)
    assert readers[0].classes == local.classes and list(readers[0].labels) == list(local.labels)
    n = len(local)
    orders = [list(range(n)), list(reversed(range(n))), list(range(0, n, 2)) + list(range(1, n, 2)), list(range(n))]
    got: list = [None] * 4
    errors: list = []

    def read(k: int) -> None:  # each thread holds its own lock file descriptions, as a process does
        try:
            pieces = [orders[k][s:s + 32] for s in range(0, n, 32)]
            got[k] = {i: data for piece in pieces for i, data in zip(piece, readers[k].read_many(piece))}
        except Exception as e:  # surfaced below
            errors.append(e)

    threads = [threading.Thread(target=read, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not errors, errors
    for k in range(4):
        assert all(got[k][i] == local.read(i) for i in range(n)), "the same bytes under the same index"
    gets = _file_gets(server)
    assert len(gets) == n and set(gets.values()) == {1}, "one GET per file for the node, whoever read it"
    assert readers[0].describe(7) == f"{server.url}/photos/" + os.path.relpath(local.describe(7), folder)
    copies = os.listdir(readers[0].folder)
    assert not [c for c in copies if c.endswith(".part")], "no partial copy left"

    again = open_source.__wrapped__(url + "/")  # a later sweep of the node: the copies, nothing fetched
    assert again.read(n - 1) == local.read(n - 1) and _file_gets(server) == gets


def test_opening_a_folder_reads_each_folder_page_once_and_a_tar_folder_its_top_once(served, tmp_path, node_cache):
    """A listing over HTTP asks for each folder's page once, with its trailing slash (without one the
    server redirects: a second request per folder), and nothing else; tar shards are found in the
    same one read of the folder's top."""
    from coordinated_prep.convert.tar import convert_to_tar

    server, folder = served
    open_source.__wrapped__(f"{server.url}/photos")  # as a user writes it, without the trailing slash
    pages = {"/photos/"} | {f"/photos/{os.path.relpath(d, folder)}/" for d, _, _ in os.walk(folder) if d != folder}
    assert server.requests() == {("GET", page): 1 for page in pages}, "each page once, no redirect, no HEAD"

    convert_to_tar(folder, str(tmp_path / "served" / "tars"), shard_size=64)
    before = server.requests()
    shards = open_source.__wrapped__(f"{server.url}/tars")
    asked = {k: n - before.get(k, 0) for k, n in server.requests().items() if n != before.get(k, 0)}
    assert {k: n for k, n in asked.items() if not k[1].endswith(".tar")} == {("GET", "/tars/"): 1}, asked
    assert len(shards) == len(open_source.__wrapped__(folder))


def test_a_listing_keeps_only_top_level_shards_and_ends_on_pages_that_link_into_themselves():
    from coordinated_prep.pipeline.sources import remote_folder

    class Store:  # an S3-like listing: names without the scheme
        protocol = ("s3", "s3a")

        def unstrip_protocol(self, name: str) -> str:
            return "s3://" + name

    entries = [{"name": "b/shards/x-1.tar", "type": "file"}, {"name": "b/shards/x-0.tar", "type": "file"},
               {"name": "b/shards/sub/y.tar", "type": "file"}, {"name": "b/shards/sub", "type": "directory"}]
    assert remote.shard_urls(Store(), "b/shards/", entries) == ["s3://b/shards/x-0.tar", "s3://b/shards/x-1.tar"]
    # s3fs lists a prefix with no children as the prefix itself: no shard under it
    assert remote.shard_urls(Store(), "b/x.tar/", [{"name": "b/x.tar", "type": "file"}]) == []

    class Looping:  # a server whose folder a/ is a symlink to itself (each a longer URL of the same page)
        protocol = ("http", "https")

        def ls(self, path: str, detail: bool = True) -> list[dict]:
            return [{"name": path + "a/", "type": "directory", "size": None}]

    with pytest.raises(DatasetError, match=f"folders nest deeper than {remote_folder.MAX_DEPTH} levels"):
        remote_folder._tree(Looping(), "http://h/photos", "http://h/photos/")

    class Escaping:  # links fsspec keeps (they start with the page's URL) that lead up, or back to the page
        protocol = ("http", "https")

        def ls(self, path: str, detail: bool = True) -> list[dict]:
            assert path == "http://h/photos/", f"followed {path}"
            return [{"name": path + name, "type": kind, "size": None}
                    for name, kind in [("%2E%2E/", "directory"), ("%2e%2e/other/", "directory"), ("./", "directory"),
                                       ("cat/%2E%2E/x.jpg", "file"), ("/", "directory"), ("cat.jpg", "file")]]

    assert list(remote_folder._tree(Escaping(), "http://h/photos", "http://h/photos/")) == ["http://h/photos/cat.jpg"]


def test_a_file_gone_since_listing_is_that_samples_error_and_a_failing_store_is_named_after_bounded_retries(
        served, node_cache):
    server, folder = served

    def a_jpeg(cls: str) -> str:
        return os.path.join(folder, cls, min(f for f in os.listdir(os.path.join(folder, cls)) if f.endswith(".jpg")))

    shutil.copy(a_jpeg("class_1"), os.path.join(folder, "class_1", "broken-0.jpg"))  # a GET of broken-* fails with 503
    deleted = a_jpeg("class_2")
    source = open_source.__wrapped__(f"{server.url}/photos/")
    broken = next(i for i in range(len(source)) if source.describe(i).endswith("/broken-0.jpg"))
    gone = next(i for i in range(len(source))
                if source.describe(i).endswith("/class_2/" + os.path.basename(deleted)))
    os.remove(deleted)

    answers = source.read_many([0, gone, 1])
    assert isinstance(answers[1], SampleError) and answers[1].path == source.describe(gone)
    assert "no such file" in str(answers[1]) and answers[0] == open(open_source.__wrapped__(folder).describe(0),
                                                                   "rb").read()
    with pytest.raises(DatasetError, match=r"1 file\(s\) could not be fetched in 3 attempts \(http://\S+/photos/"
                                           r"class_1/broken-0\.jpg\), last error .*503.*check the URL"):
        source.read_many([2, broken])
    assert _file_gets(server)["/photos/class_1/broken-0.jpg"] == remote.ATTEMPTS, "a bounded number of attempts"
    fetched = _file_gets(server)
    assert fetched["/photos/" + os.path.relpath(source.describe(2), f"{server.url}/photos")] == 1
    before = source.read(2)  # fetched in the call that failed: kept, not fetched again
    assert before == open(os.path.join(folder, os.path.relpath(source.describe(2), f"{server.url}/photos")),
                          "rb").read() and _file_gets(server) == fetched


def test_a_folder_url_with_neither_class_folders_nor_shards_is_refused_naming_what_it_may_hold(tmp_path, node_cache):
    (tmp_path / "flat").mkdir()
    (tmp_path / "flat" / "a.jpg").write_bytes(b"x")
    with Server("http", str(tmp_path / "http.log"), str(tmp_path)) as server:
        with pytest.raises(DatasetError, match=r"holds no class folders and no \*\.tar shards: a folder in object "
                                               r"storage is read as an ImageFolder .* or as WebDataset tar shards"):
            open_source.__wrapped__(f"{server.url}/flat/")


def _read_in_a_forked_process(source, ids, out):
    out.put([bytes(b) if isinstance(b, (bytes, bytearray)) else repr(b) for b in source.read_many(ids)])


def test_a_forked_loader_worker_fetches_and_a_class_without_images_is_refused(served, node_cache):
    """A DataLoader's workers are forked from the trial, and fsspec's filesystems refuse to run in a
    forked child: the source looks its filesystem up again there."""
    import multiprocessing

    server, folder = served
    source = open_source.__wrapped__(f"{server.url}/photos")
    local = open_source.__wrapped__(folder)
    source.read(0)  # the parent's filesystem is in use before the fork
    queue = multiprocessing.get_context("fork").Queue()
    child = multiprocessing.get_context("fork").Process(target=_read_in_a_forked_process, args=(source, [5, 6], queue))
    child.start()
    got = queue.get(timeout=60)
    child.join(timeout=60)
    assert got == [local.read(5), local.read(6)]
    assert all(n == 1 for n in _file_gets(server).values()) and len(_file_gets(server)) == 3

    os.makedirs(os.path.join(folder, "class_9"))
    with open(os.path.join(folder, "class_9", "readme.txt"), "w") as f:
        f.write("no image here")
    with pytest.raises(DatasetError, match=r"class folder 'class_9' holds no images with extensions .*; add images "
                                           r"or remove the folder"):
        open_source.__wrapped__(f"{server.url}/photos/")


def test_a_cache_that_cannot_lock_is_named_and_leaves_no_lock_held(served, node_cache, monkeypatch):
    import fcntl

    server, folder = served
    source = open_source.__wrapped__(f"{server.url}/photos")
    real, calls = fcntl.flock, []

    def failing(fd, op):  # the node runs out of locks at the third file of the piece
        calls.append(op)
        if op == fcntl.LOCK_EX | fcntl.LOCK_NB and len(calls) == 3:
            raise OSError(37, "No locks available")
        return real(fd, op)

    monkeypatch.setattr(fcntl, "flock", failing)
    with pytest.raises(DatasetError, match=r"the node's copies in \S+ cannot be written or locked .*No locks "
                                           r"available"):
        source.read_many([0, 1, 2, 3])
    monkeypatch.setattr(fcntl, "flock", real)
    assert not _file_gets(server), "nothing was fetched"
    for i in (0, 1):  # taken before the failure, released by it
        with open(source._copies[i] + ".lock", "a+b") as f:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    assert source.read_many([0, 1]) == [open_source.__wrapped__(folder).read(i) for i in (0, 1)]
    assert sorted(_file_gets(server).values()) == [1, 1]
