"""Tar shards in object storage (and, over S3, Parquet and an ImageFolder of raw files): real servers
on loopback (HTTP, and moto's S3), counted on the server's side. Each shard is fetched once per node,
however many processes open the dataset; a shard that cannot be fetched is retried a bounded number
of times and then named."""

from __future__ import annotations

import errno
import fcntl
import glob
import os
import pickle
import re
import shutil
import textwrap
import threading
import time

import numpy as np
import pytest

from coordinated_prep.convert import convert_to_tar
from coordinated_prep.errors import DatasetError
from coordinated_prep.pipeline.sources import open_source, photos, remote
from coordinated_prep.pipeline.sources.shard_index import write_shard_index
from coordinated_prep.sweep.config import load_sweep
from coordinated_prep.sweep.runner import run_sweep
from coordinated_prep.trial.loader import resolve_spec
from tests.conftest import REPO, live_coordprep_actors, own_ray, settled, shared_ray_settings
from tests.harness import check_trial_records, train_ids
from tests.recording import load_records
from tests.servers import Server


@pytest.fixture
def shards(small_dataset, tmp_path) -> str:
    """The small dataset as 3 tar shards of 64, 64 and 52 samples."""
    return convert_to_tar(small_dataset, str(tmp_path / "served"), shard_size=64).out


def _gets(server: Server) -> dict[str, int]:
    return {path: n for (method, path), n in server.requests().items() if method == "GET"}


def _opened_at_once(url: str, n: int) -> list:
    """``url`` opened by ``n`` threads at once (each holds its own lock file descriptions, as the
    processes of a node do); fails the test if any raised or did not finish."""
    opened: list = [None] * n
    errors: list = []

    def open_one(k: int) -> None:
        try:
            opened[k] = open_source.__wrapped__(url)
        except Exception as e:  # surfaced below
            errors.append(e)

    threads = [threading.Thread(target=open_one, args=(k,)) for k in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not errors and all(s is not None for s in opened), errors
    return opened


def test_shards_over_http_are_fetched_once_per_node_and_read_byte_for_byte(small_dataset, shards, node_cache,
                                                                           tmp_path):
    folder = open_source.__wrapped__(small_dataset)
    with Server("http", str(tmp_path / "http.log"), shards) as server:
        url = f"{server.url}/shard-{{000000..000002}}.tar"
        opened = _opened_at_once(url, 4)
        assert _gets(server) == {f"/shard-{k:06d}.tar": 1 for k in range(3)}, "one GET per shard for the node"
        for source in opened:
            assert len(source) == len(folder) and all(source.read(i) == folder.read(i) for i in (0, 63, 64, 179))
        assert opened[0].describe(70) == f"{server.url}/shard-000001.tar#00000070", "errors name the URL"
        copies = [os.path.basename(p) for p in opened[0].shards]
        assert sorted(os.listdir(node_cache)) == sorted(copies + [c + ".lock" for c in copies]), "no temporary file"

        listed = open_source.__wrapped__(server.url + "/")  # a folder: its listing names the shards
        assert listed.shards == opened[0].shards and _gets(server)["/"] >= 1
        assert all(n == 1 for p, n in _gets(server).items() if p.endswith(".tar")), "the copies are used"

        with pytest.raises(DatasetError, match=r"shard http://127\.0\.0\.1:\d+/shard-000003\.tar does not exist; "
                                               r"check the URL"):
            open_source.__wrapped__(f"{server.url}/shard-{{000002..000003}}.tar")
        # one lookup (fsspec tries a GET after the HEAD's 404), no fetch attempts; the cached shard not fetched again
        assert _gets(server).get("/shard-000003.tar", 0) <= 1 and _gets(server)["/shard-000002.tar"] == 1
        with pytest.raises(DatasetError, match=r"^2 of 3 shards could not be fetched \(http://\S+/shard-000003\.tar, "
                                               r"http://\S+/shard-000004\.tar\); the first: shard \S+ does not exist"):
            open_source.__wrapped__(f"{server.url}/shard-{{000002..000004}}.tar")  # one run names every URL to fix

        shutil.copy(os.path.join(shards, "shard-000002.tar"), os.path.join(shards, "broken-000002.tar"))
        with pytest.raises(DatasetError, match=r"shard http://127\.0\.0\.1:\d+/broken-000002\.tar: could not be "
                                               r"fetched in 3 attempts, last error .*503"):
            open_source.__wrapped__(f"{server.url}/broken-000002.tar")
        assert _gets(server)["/broken-000002.tar"] == remote.ATTEMPTS, "a bounded number of attempts"

        first = os.path.join(shards, "shard-000000.tar")
        os.utime(first, (os.path.getmtime(first) + 100,) * 2)  # the shard replaced at its URL: a new version
        assert open_source.__wrapped__(url).read(0) == folder.read(0)
        assert _gets(server)["/shard-000000.tar"] == 2 and _gets(server)["/shard-000001.tar"] == 1


def test_shards_named_by_a_shard_index_are_fetched_one_by_one_as_their_samples_are_read(small_dataset, shards,
                                                                                        node_cache, tmp_path):
    """A WebDataset shard index (wids JSON) gives the dataset's size and the shards' counts: opening it
    fetches the index alone, a sample's read fetches its shard (once per node), and a shard that holds
    another count than the index says is refused, naming both."""
    folder = open_source.__wrapped__(small_dataset)
    write_shard_index(os.path.join(shards, "train.json"), [f"shard-{k:06d}.tar" for k in range(3)], [64, 64, 52],
                      classes=list(folder.classes))
    with Server("http", str(tmp_path / "http.log"), shards) as server:
        source = open_source.__wrapped__(f"{server.url}/train.json")
        assert (len(source), source.shard_sizes, source.classes) == (180, (64, 64, 52), folder.classes)
        assert _gets(server) == {"/train.json": 1}, "no shard before a sample of it is read"
        assert source.read(70) == folder.read(70) and source.labels[70] == folder.labels[70]
        tars = [line.split()[1] for line in open(tmp_path / "http.log") if line.startswith("GET /shard-")]
        assert tars[0] == "/shard-000001.tar", "the shard that holds it first; the others follow behind it"
        again = pickle.loads(pickle.dumps(source))  # as a prep actor gets it: its copies come from the node's cache
        assert all(again.read(i) == folder.read(i) for i in range(180))
        assert np.array_equal(np.asarray(again.labels), folder.labels)
        assert _gets(server) == {"/train.json": 1, **{f"/shard-{k:06d}.tar": 1 for k in range(3)}}

        write_shard_index(os.path.join(shards, "wrong.json"), [f"shard-{k:06d}.tar" for k in range(3)], [64, 60, 56])
        wrong = open_source.__wrapped__(f"{server.url}/wrong.json")
        assert wrong.read(0) == folder.read(0)
        with pytest.raises(DatasetError, match=r"shard http://\S+/shard-000001\.tar holds 64 samples, its index "
                                               r"http://\S+/wrong\.json says 60; write the index again"):
            wrong.read(100)


def test_a_process_done_reading_a_shard_index_exits_without_fetching_the_rest(shards, node_cache, tmp_path,
                                                                              monkeypatch):
    """The shards behind the reads are fetched by daemon threads: a process that read one sample of a
    40-shard index exits then, not after every shard has come (it waited for all 40 GETs)."""
    import subprocess
    import sys

    first = os.path.join(shards, "shard-000000.tar")
    names = [f"copy-{k:03d}.tar" for k in range(40)]
    for name in names:
        os.link(first, os.path.join(shards, name))
    write_shard_index(os.path.join(shards, "many.json"), names, [64] * 40)
    monkeypatch.setenv("COORDPREP_SERVER_LATENCY_MS", "200")  # 40 shards behind at 16 at a time: 3 rounds
    with Server("http", str(tmp_path / "http.log"), shards) as server:
        script = ("from coordinated_prep.pipeline.sources import open_source\n"
                  f"assert open_source({server.url + '/many.json'!r}).read(100)\n")
        subprocess.run([sys.executable, "-c", script], check=True, timeout=120, cwd=REPO)
        at_exit = sum(n for path, n in _gets(server).items() if path.startswith("/copy-"))
    assert 1 <= at_exit < 40, f"{at_exit} shards fetched before the process could exit"


def test_a_parquet_dataset_named_by_its_manifests_url_is_fetched_once_per_node_and_read_byte_for_byte(
        small_dataset, node_cache, tmp_path):
    from coordinated_prep.convert.parquet import convert_imagefolder

    folder = open_source.__wrapped__(small_dataset)
    served = convert_imagefolder(small_dataset, str(tmp_path / "served"), shard_size=64, row_group_size=16).out
    parts = sorted(f for f in os.listdir(served) if f.endswith(".parquet"))
    assert len(parts) == 3
    with Server("http", str(tmp_path / "http.log"), served) as server:
        url = f"{server.url}/coordprep-parquet.json"
        opened = _opened_at_once(url, 4)
        assert _gets(server) == {"/coordprep-parquet.json": 1, **{f"/{p}": 1 for p in parts}}, "one GET per file"
        for source in opened:
            assert len(source) == len(folder) and all(source.read(i) == folder.read(i) for i in (0, 63, 64, 179))
            assert np.array_equal(source.labels, folder.labels) and source.classes == tuple(folder.classes)
        assert opened[0].describe(70) == f"{server.url}/{parts[1]}#row 6", "errors name the URL"
        assert open_source.__wrapped__(url).read(100) == folder.read(100)
        assert all(n == 1 for n in _gets(server).values()), "opened again: the node's copies, nothing fetched"
        first = os.path.join(served, parts[0])
        os.utime(first, (os.path.getmtime(first) + 100,) * 2)  # a shard replaced at its URL: a new version
        assert open_source.__wrapped__(url).read(0) == folder.read(0)
        assert _gets(server)[f"/{parts[0]}"] == 2 and _gets(server)["/coordprep-parquet.json"] == 1, "never stale"

        manifest = os.path.join(served, "coordprep-parquet.json")
        os.utime(manifest, (os.path.getmtime(manifest) + 100,) * 2)  # rewritten at its URL: a new version
        os.rename(os.path.join(served, parts[2]), os.path.join(served, "gone.parquet"))
        with pytest.raises(DatasetError, match=rf"shard {server.url}/{parts[2]} does not exist"):
            open_source.__wrapped__(url)  # the manifest's new version lists a shard the store lacks
        assert _gets(server)["/coordprep-parquet.json"] == 2 and _gets(server)[f"/{parts[0]}"] == 2
        assert not [f for f in os.listdir(node_cache) if ".tmp-" in f], "a failed open leaves no half-built folder"
        os.makedirs(os.path.join(served, "bad"))
        with open(os.path.join(served, "bad", "coordprep-parquet.json"), "w") as f:
            f.write("not a manifest")
        with pytest.raises(DatasetError, match=re.escape(f"dataset '{server.url}/bad': cannot read the manifest "
                                                         f"{server.url}/bad/coordprep-parquet.json")):
            open_source.__wrapped__(f"{server.url}/bad/coordprep-parquet.json")  # named by its URL

        with pytest.raises(DatasetError, match=r"holds no \*\.tar shards; a Parquet dataset in object storage is "
                                               r"named by its manifest's URL \(http://\S+/coordprep-parquet\.json\)"):
            open_source.__wrapped__(server.url + "/")


def test_a_parquet_fetch_longer_than_the_lock_wait_is_not_undone_by_another_openers_clean_up(small_dataset, node_cache,
                                                                                             tmp_path, monkeypatch):
    """An opener removes what a killed builder left (older than LOCK_WAIT_S). A live builder whose
    shards take longer than that to fetch must not lose its folder to it, nor publish one without
    its manifest."""
    from coordinated_prep.convert.parquet import convert_imagefolder

    served = convert_imagefolder(small_dataset, str(tmp_path / "served"), shard_size=64, row_group_size=16).out
    url = f"file://{served}/coordprep-parquet.json"
    fetched, ancient = remote.fetched, (1, 1)

    class Gave(Exception):
        pass

    def another_opener(urls):  # opens the same dataset while the first one fetches its shards, then gives up
        if urls[0] == url:
            return fetched(urls)
        raise Gave

    def slow_fetch(urls):  # the first opener: its shards take longer than LOCK_WAIT_S
        if urls[0] != url:
            for left in glob.glob(os.path.join(node_cache, "parquet-*.tmp-*")):
                os.utime(left, ancient)
            monkeypatch.setattr(remote, "fetched", another_opener)
            with pytest.raises(Gave):
                remote.fetched_parquet(url)  # its clean-up ran: what looked left by a killed builder is gone
            monkeypatch.setattr(remote, "fetched", slow_fetch)
        return fetched(urls)

    monkeypatch.setattr(remote, "fetched", slow_fetch)
    folder = remote.fetched_parquet(url)
    assert sorted(os.listdir(folder)) == sorted(os.listdir(served)), "the manifest and every shard"
    source = open_source.__wrapped__(url)
    assert len(source) == len(open_source.__wrapped__(small_dataset)) and source.read(5)
    assert not glob.glob(os.path.join(node_cache, "parquet-*.tmp-*")), "nothing left half-built"


def _blocked_flocks() -> int:
    """Blocked requests for a flock on this machine (``/proc/locks``' "->" lines)."""
    with open("/proc/locks") as f:
        return sum(1 for line in f if "-> FLOCK" in line)


def test_openers_waiting_for_a_holder_that_gives_up_raise_its_error_without_fetching_again(shards, node_cache,
                                                                                          tmp_path, monkeypatch):
    shutil.copy(os.path.join(shards, "shard-000000.tar"), os.path.join(shards, "broken-000000.tar"))
    gate, first = threading.Event(), threading.Lock()
    download = remote._download

    def gated(*args) -> None:  # the lock holder's first attempt waits until the others wait on the lock
        if first.acquire(blocking=False):
            gate.wait(timeout=60)
        download(*args)

    monkeypatch.setattr(remote, "_download", gated)
    with Server("http", str(tmp_path / "http.log"), shards) as server:
        url = f"{server.url}/broken-000000.tar"
        errors: list[BaseException] = []

        def open_one() -> None:
            try:
                open_source.__wrapped__(url)
            except Exception as e:  # each opener's error, compared below
                errors.append(e)

        base = _blocked_flocks()
        threads = [threading.Thread(target=open_one) for _ in range(4)]
        for t in threads:
            t.start()
        assert settled(_blocked_flocks, base + 3, timeout_s=30) == base + 3, "three openers wait on the lock"
        gate.set()
        for t in threads:
            t.join(timeout=60)
        assert len(errors) == 4 and all(isinstance(e, DatasetError) for e in errors), errors
        assert len({str(e) for e in errors}) == 1 and "could not be fetched in 3 attempts" in str(errors[0]), errors
        assert _gets(server)["/broken-000000.tar"] == remote.ATTEMPTS, "the holder's attempts only"

        with pytest.raises(DatasetError, match="could not be fetched in 3 attempts"):  # asked later: tried again
            open_source.__wrapped__(url)
        assert _gets(server)["/broken-000000.tar"] == 2 * remote.ATTEMPTS


def _lock_is_free(path: str) -> bool:
    with open(path, "a+b") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False
        fcntl.flock(f, fcntl.LOCK_UN)
        return True


def _holding(url: str, downloading: threading.Event) -> tuple[threading.Thread, list]:
    """A thread of this process that opens ``url`` (the lock's holder), once its download began; what it opened."""
    held: list = []
    holder = threading.Thread(target=lambda: held.append(open_source.__wrapped__(url)))
    holder.start()
    assert downloading.wait(timeout=30), "the holder started its download"
    return holder, held


def test_an_opener_waiting_for_a_hung_holder_gives_up_naming_the_lock_and_never_keeps_it(shards, node_cache,
                                                                                         tmp_path, monkeypatch):
    monkeypatch.setattr(remote, "LOCK_WAIT_S", 0.5)
    downloading, hung = threading.Event(), threading.Event()
    download = remote._download

    def hanging(*args) -> None:  # the holder's download hangs until the test lets it go on
        downloading.set()
        hung.wait(timeout=60)
        download(*args)

    monkeypatch.setattr(remote, "_download", hanging)
    with Server("http", str(tmp_path / "http.log"), shards) as server:
        url = f"{server.url}/shard-000000.tar"
        holder, held = _holding(url, downloading)
        with pytest.raises(DatasetError, match="has been fetching it and wrote nothing for 0.5 s") as e:
            open_source.__wrapped__(url)  # waits 0.5 s for the lock, then names it
        [lock] = [os.path.join(node_cache, f) for f in os.listdir(node_cache) if f.endswith(".lock")]
        assert url in str(e.value) and f"fuser {lock}" in str(e.value), str(e.value)
        hung.set()
        holder.join(timeout=60)
        assert len(held) == 1 and len(held[0]) == 64, "the holder fetched and indexed the shard"
        # The abandoned wait took the lock once the holder let it go, and let it go at once.
        assert settled(lambda: _lock_is_free(lock), True), "an abandoned wait kept the lock"
        assert len(open_source.__wrapped__(url)) == 64  # the copy, not fetched again
        assert _gets(server)["/shard-000000.tar"] == 1, "the waiter that gave up fetched nothing"


def test_an_opener_waits_on_a_holder_whose_fetch_takes_longer_than_the_lock_wait_while_it_writes(
        shards, node_cache, tmp_path, monkeypatch):
    """A large shard may take longer than LOCK_WAIT_S to fetch: the waiters wait on while its
    ``.part`` grows, and fetch nothing themselves."""
    monkeypatch.setattr(remote, "LOCK_WAIT_S", 0.3)
    downloading = threading.Event()

    def slow(fs, remote_path: str, local: str) -> None:  # a holder that writes a little at a time, for 5 waits
        downloading.set()
        data = fs.cat_file(remote_path)
        with open(local, "wb") as f:
            for i in range(10):
                f.write(data[i * len(data) // 10:(i + 1) * len(data) // 10])
                f.flush()
                time.sleep(0.15)  # the network's pace, not a wait for anyone

    monkeypatch.setattr(remote, "_download", slow)
    with Server("http", str(tmp_path / "http.log"), shards) as server:
        url = f"{server.url}/shard-000000.tar"
        holder, held = _holding(url, downloading)
        waited = time.monotonic()
        assert len(open_source.__wrapped__(url)) == 64, "the waiter reads the holder's copy"
        assert time.monotonic() - waited > 0.3, "it waited longer than LOCK_WAIT_S"
        holder.join(timeout=60)
        assert len(held) == 1 and len(held[0]) == 64
        assert _gets(server)["/shard-000000.tar"] == 1, "fetched once, by the holder"


def test_a_full_node_cache_is_named_at_once_not_retried_as_the_stores_fault(shards, node_cache, tmp_path,
                                                                             monkeypatch):
    attempts = []

    def full(fs, remote_path: str, local: str) -> None:
        attempts.append(local)
        raise OSError(errno.ENOSPC, "No space left on device", local)

    monkeypatch.setattr(remote, "_download", full)
    with Server("http", str(tmp_path / "http.log"), shards) as server:
        with pytest.raises(DatasetError, match=rf"the node's shard cache {re.escape(node_cache)} cannot hold it "
                                               r"\(\[Errno 28\] No space left on device.*\$COORDPREP_CACHE"):
            open_source.__wrapped__(f"{server.url}/shard-000000.tar")
    assert len(attempts) == 1, "a full disk is not the network: no retry"
    assert not [f for f in os.listdir(node_cache) if f.endswith((".part", ".failed"))]


def test_shards_parquet_and_raw_files_in_an_s3_compatible_store_read_with_credentials_from_the_environment(
        shards, node_cache, tmp_path, monkeypatch, small_dataset):
    import s3fs

    with Server("s3", str(tmp_path / "s3.log")) as server:
        for name, value in (("AWS_ENDPOINT_URL", server.url), ("AWS_ACCESS_KEY_ID", "testing"),
                            ("AWS_SECRET_ACCESS_KEY", "testing"), ("AWS_DEFAULT_REGION", "us-east-1")):
            monkeypatch.setenv(name, value)
        s3fs.S3FileSystem.clear_instance_cache()
        store = s3fs.S3FileSystem()
        store.mkdir("photos")
        for name in sorted(os.listdir(shards)):
            store.put_file(os.path.join(shards, name), f"photos/train/{name}")
        before = _gets(server)
        source = open_source.__wrapped__("s3://photos/train/shard-{000000..000002}.tar")
        again = open_source.__wrapped__("s3://photos/train/")  # listed: the same shards, none fetched again
        local = open_source.__wrapped__(shards)
        assert len(source) == len(local) and all(source.read(i) == local.read(i) for i in range(len(local)))
        assert again.shards == source.shards
        fetched = {p: n - before.get(p, 0) for p, n in _gets(server).items() if p.endswith(".tar")}
        assert fetched == {f"/photos/train/shard-{k:06d}.tar": 1 for k in range(3)}, fetched
        assert source.describe(0) == "s3://photos/train/shard-000000.tar#00000000"

        from coordinated_prep.convert.parquet import convert_imagefolder  # the same samples as Parquet

        parquet = convert_imagefolder(shards, str(tmp_path / "parquet"), shard_size=100).out
        for name in sorted(os.listdir(parquet)):
            store.put_file(os.path.join(parquet, name), f"photos/parquet/{name}")
        records = open_source.__wrapped__("s3://photos/parquet/coordprep-parquet.json")
        assert len(records) == len(local) and all(records.read(i) == local.read(i) for i in range(len(local)))
        fetched = {p: n - before.get(p, 0) for p, n in _gets(server).items() if "/parquet/" in p}
        assert fetched == {"/photos/parquet/coordprep-parquet.json": 1, "/photos/parquet/part-00000.parquet": 1,
                           "/photos/parquet/part-00001.parquet": 1}, fetched

        tree = str(tmp_path / "raw")  # the same samples as raw files, an ImageFolder, with names fsspec would glob
        shutil.copytree(small_dataset, tree)
        first = sorted(os.listdir(os.path.join(tree, "class_1")))[0]
        for name in ("x[1].jpg", "[1].jpg", "x*.jpg", "x?.jpg"):
            shutil.copy(os.path.join(tree, "class_1", first), os.path.join(tree, "class_1", name))
        store.put(tree, "photos/raw", recursive=True)
        raw = open_source.__wrapped__("s3://photos/raw")
        images = open_source.__wrapped__(tree)
        assert raw.classes == images.classes and np.array_equal(raw.labels, images.labels)
        assert raw.read_many(list(range(len(images)))) == [images.read(i) for i in range(len(images))]
        assert open_source.__wrapped__("s3://photos/raw/").read(5) == images.read(5)  # the node's copy
        fetched = {p: n - before.get(p, 0) for p, n in _gets(server).items() if "/raw/" in p}
        assert len(fetched) == len(images) and set(fetched.values()) == {1}, "one GET per file and node"
        with open(raw._copies[5], "r+b") as f:  # a copy a crash cut short (copies are renamed whole, not synced)
            f.truncate(10)
        assert open_source.__wrapped__("s3://photos/raw/").read(5) == images.read(5), "shorter than listed: fetched again"
        path = "/photos/raw/" + os.path.relpath(images.describe(5), tree)
        assert _gets(server)[path] - before.get(path, 0) == 2, "one GET more, for that file only"
        s3fs.S3FileSystem.clear_instance_cache()


#: The shipped experiment's shards (experiments/s3-shards.yaml): the sweep below reads the same URL.
S3_DATASET = "s3://coordprep-demo/photos/shard-{000000..000063}.tar"


@pytest.fixture(scope="module")
def s3_ray(tmp_path_factory):
    """An S3-compatible server (moto's) on loopback, and this module's own Ray instance, whose
    workers find it through the usual environment: the endpoint and credentials in ``AWS_*``
    variables, as every node of a real cluster would have them."""
    import ray
    import s3fs

    log = str(tmp_path_factory.mktemp("s3") / "s3.log")
    with Server("s3", log) as server, pytest.MonkeyPatch.context() as env:
        aws = {"AWS_ENDPOINT_URL": server.url, "AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
               "AWS_DEFAULT_REGION": "us-east-1"}
        for name, value in aws.items():
            env.setenv(name, value)  # the driver's
        s3fs.S3FileSystem.clear_instance_cache()
        own_ray()  # this module's Ray is its own: the workers' environment is fixed when it starts
        settings = shared_ray_settings()
        settings["runtime_env"]["env_vars"].update(aws)
        ray.init(**settings)
        try:
            yield server
        finally:
            ray.shutdown()
            s3fs.S3FileSystem.clear_instance_cache()


def test_a_yaml_sweep_of_eight_trials_over_64_shards_of_photographs_in_s3_fetches_each_shard_once(s3_ray, tmp_path,
                                                                                                  monkeypatch):
    import s3fs

    # 64 shards of 2 real photographs each (500 x 375 JPEG crops of builtin:photos' photograph, 64 per
    # class), in the bucket and folder experiments/s3-shards.yaml reads.
    monkeypatch.setattr(photos, "IMAGES_PER_CLASS", 64)
    subset = photos.ensure_photos(str(tmp_path / "photos"))
    shards = convert_to_tar(subset, str(tmp_path / "shards"), shard_size=2).out
    assert len(os.listdir(shards)) == 64
    store = s3fs.S3FileSystem()
    store.mkdir("coordprep-demo")
    store.put(shards + "/", "coordprep-demo/photos/", recursive=True)
    assert S3_DATASET in open(os.path.join(REPO, "experiments", "s3-shards.yaml")).read()
    before = _gets(s3_ray)

    path = tmp_path / "s3.yaml"
    path.write_text(textwrap.dedent(f"""
        name: s3
        storage_path: {tmp_path / "runs"}
        trainable: tests.recording:record
        data: {{dataset: "{S3_DATASET}", pipeline: {{size: 32}}, seed: 3, chunk_size: 8, segments: 4}}
        search_space: {{batch_size: {{grid: [8, 12]}}, epochs: 2, out: {tmp_path / "records"}, delay_s: 0.005}}
        num_samples: 4
        max_concurrent_trials: 4
        reuse_actors: true
        resources_per_trial: {{cpu: 0.25}}
        metric: score
    """))
    cfg = load_sweep(str(path))
    summary = run_sweep(cfg, verbose=0)
    trials = summary["trials"]
    assert len(trials) == 8 and all(t["status"] == "TERMINATED" for t in trials), trials
    spec = resolve_spec({"data": cfg.data})
    records = load_records(str(tmp_path / "records"))
    assert sorted(records) == sorted(t["trial"] for t in trials)
    for trial in trials:  # every trial: exact epochs, with the bytes it would prepare alone
        check_trial_records(spec, records[trial["trial"]], trial["batch_size"], trial["trial"])
    # The driver, the coordinator, the prep actors and eight trials opened the dataset: one GET of
    # each shard for the whole sweep, counted by the server.
    fetched = {p: n - before.get(p, 0) for p, n in _gets(s3_ray).items() if p.endswith(".tar")}
    assert fetched == {f"/coordprep-demo/photos/shard-{k:06d}.tar": 1 for k in range(64)}, fetched
    [group] = summary["groups"].values()
    assert group["samples_served"] == 8 * 2 * len(train_ids(spec)), group
    assert live_coordprep_actors() == []
