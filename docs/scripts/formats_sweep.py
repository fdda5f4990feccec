"""Raw files, Parquet and tar shards under a sweep, from local disk and from a server with latency
(issue 35, point 5; docs/benchmarks.md).

The 4,096 photographs of ``builtin:photos`` (500 x 375 px JPEGs) as the ImageFolder itself, as
Parquet (``coordprep convert``, its default row groups) and as 64 tar shards of 64 samples. Each run
is one sweep of N trials sharing one group (the built-in 224 px crop and flip, batches of 64, one
epoch, a 5 ms step per batch), on a Ray instance started once; the sweep's time counts the searcher's
start and close (the pool's start included). Local runs follow an eviction of the format's files from
the page cache. Remote runs read the tar shards, and the Parquet dataset by its manifest's URL, from
``tests/servers.py``'s HTTP server on loopback, which answers every request ``--latency-ms`` late and
counts them; the node's shard cache is emptied before each run. Raw files are read from the same
server as an ImageFolder URL: one GET per file and node (``pipeline/sources/remote_folder.py``). The
format ``tar shard index`` is the same shards named by a shard index (``tar/train.json``), so read
shard by shard as the epoch needs them (``pipeline/sources/shard_index.py``).

    PYTHONPATH=. .venv/bin/python docs/scripts/formats_sweep.py --trials 1 8 --latency-ms 10 50
"""

from __future__ import annotations

import argparse
import glob
import os
import shutil
import tempfile
import time


def trial(config: dict) -> None:
    """One epoch in batches of 64 with a 5 ms step; reports when the first batch came and how many samples."""
    from ray import tune

    from coordinated_prep import train_loader

    loader = train_loader(config, batch_size=64, epochs=1)
    first, samples = None, 0
    for batch in loader:
        first = first or time.time()
        samples += len(batch)
        time.sleep(0.005)  # stands for an accelerator's step
    tune.report({"first_batch_at": first, "samples": samples})


def run(dataset: str, trials: int) -> dict:
    from ray import tune

    from coordinated_prep import CoordinatedSearcher, DataSpec

    spec = DataSpec(dataset=dataset, pipeline={"size": 224}, seed=0)
    started = time.time()
    searcher = CoordinatedSearcher(max_concurrent=trials)
    analysis = tune.run(tune.with_resources(trial, {"cpu": 0.1}), config={"data": spec}, num_samples=trials,
                        search_alg=searcher, verbose=0)
    [group] = searcher.group_reports().values()
    searcher.close()
    wall = time.time() - started
    results = [t.last_result for t in analysis.trials]
    served = sum(r["samples"] for r in results)
    return {"wall_s": wall, "samples_per_s": served / wall, "prepared": group["samples_prepared"], "served": served,
            "first_batch_s": (min(r["first_batch_at"] for r in results) - started,
                              max(r["first_batch_at"] for r in results) - started)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--latency-ms", type=float, nargs="+", default=[10, 50])
    parser.add_argument("--remote-only", action="store_true", help="skip the runs from local disk")
    parser.add_argument("--mbps", type=float, default=0, help="the server's link in MB/s, shared by every request "
                        "(default: unlimited, loopback)")
    parser.add_argument("--formats", nargs="+", default=["raw files", "tar shards", "Parquet"],
                        help="the remote runs' formats (default: these three; 'tar shard index' as well)")
    args = parser.parse_args()
    os.environ.setdefault("COORDPREP_CACHE", tempfile.mkdtemp(prefix="formats-bench-"))
    import ray

    from coordinated_prep.analyze.measure import evict
    from coordinated_prep.convert.parquet import convert_imagefolder
    from coordinated_prep.convert.tar import convert_to_tar
    from coordinated_prep.pipeline.sources import folder_root
    from coordinated_prep.pipeline.sources.remote import shard_cache_dir
    from coordinated_prep.pipeline.sources.shard_index import write_shard_index
    from coordinated_prep.pipeline.sources.tar_shards import TarShardSource
    from tests.servers import Server

    work = tempfile.mkdtemp(prefix="formats-")
    photos = folder_root("builtin:photos")
    parquet = convert_imagefolder(photos, os.path.join(work, "parquet")).out
    tar = convert_to_tar(photos, os.path.join(work, "tar"), shard_size=64).out
    shards = sorted(glob.glob(os.path.join(tar, "*.tar")))
    os.symlink(photos, os.path.join(work, "raw"))  # served as an ImageFolder URL
    pattern = "shard-{%s..%s}.tar" % (os.path.basename(shards[0])[6:12], os.path.basename(shards[-1])[6:12])
    counts = [len(TarShardSource(path)) for path in shards]
    write_shard_index(os.path.join(tar, "train.json"), [os.path.basename(p) for p in shards], counts)
    local = {"raw files": (photos, glob.glob(os.path.join(photos, "*", "*"))),
             "Parquet": (parquet, glob.glob(os.path.join(parquet, "*"))),
             "tar shards": (os.path.join(tar, pattern), shards)}
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"PYTHONPATH": os.getcwd(), "COORDPREP_CACHE": os.environ["COORDPREP_CACHE"]}})
    print("| format | where | N | sweep | samples/s | first batch (first, last trial) | requests | MB fetched |")
    print("|---|---|---|---|---|---|---|---|")
    for n in args.trials:
        for name, (dataset, files) in ({} if args.remote_only else local).items():
            evict(files)
            shutil.rmtree(shard_cache_dir(), ignore_errors=True)
            r = run(dataset, n)
            print(f"| {name} | local disk | {n} | {r['wall_s']:.1f} s | {r['samples_per_s']:,.0f} | "
                  f"{r['first_batch_s'][0]:.1f} s, {r['first_batch_s'][1]:.1f} s | - | - |", flush=True)
        for latency in args.latency_ms:
            os.environ["COORDPREP_SERVER_LATENCY_MS"] = str(latency)
            os.environ["COORDPREP_SERVER_MBPS"] = str(args.mbps)
            link = f", {args.mbps:g} MB/s" if args.mbps else ""
            remote = {"raw files": "raw/", "tar shards": f"tar/{pattern}", "tar shard index": "tar/train.json",
                      "Parquet": "parquet/coordprep-parquet.json"}
            for name, path in ((n, p) for n, p in remote.items() if n in args.formats):
                log = os.path.join(work, f"requests-{n}-{latency:g}-{name.replace(' ', '-')}")
                with Server("http", log, work) as server:
                    shutil.rmtree(shard_cache_dir(), ignore_errors=True)
                    r = run(f"{server.url}/{path}", n)
                    asked = server.requests()
                gets = [p for (method, p), k in asked.items() for _ in range(k) if method == "GET"]
                files = [os.path.join(work, p.lstrip("/")) for p in gets]
                fetched = sum(os.path.getsize(f) for f in files if os.path.isfile(f)) / 2**20  # listings apart
                print(f"| {name} | HTTP, {latency:g} ms a request{link} | {n} | {r['wall_s']:.1f} s | "
                      f"{r['samples_per_s']:,.0f} | {r['first_batch_s'][0]:.1f} s, {r['first_batch_s'][1]:.1f} s | "
                      f"{sum(asked.values())} ({len(gets)} GET) | {fetched:.0f} |", flush=True)
    ray.shutdown()
    shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
