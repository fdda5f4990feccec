"""How ``coordprep sweep`` starts Ray (a loopback node by default, so nothing listens beyond the machine),
and a sweep whose configs a Tune searcher (Optuna) suggests, run from YAML end to end."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import textwrap
import time

from coordinated_prep.pipeline.sources.shapes import ensure_shapes
from coordinated_prep.sweep.config import load_sweep
from coordinated_prep.sweep.runner import LOOPBACK, init_kwargs, run_sweep
from tests.conftest import REPO

_START = """
import sys
import ray
from coordinated_prep.sweep.runner import start_ray
start_ray({"num_cpus": 1, "object_store_memory": 80 * 2**20, "metrics_export_port": int(sys.argv[1])})
print(ray.util.get_node_ip_address(), flush=True)
sys.stdin.readline()  # the test reads the listening sockets meanwhile
ray.shutdown()
"""


def test_init_arguments_default_to_a_loopback_node_and_dashboard():
    init = init_kwargs({"num_cpus": 2, "metrics_export_port": 8080})
    assert init == {"dashboard_host": LOOPBACK, "include_dashboard": False, "num_cpus": 2,
                    "_metrics_export_port": 8080, "_node_ip_address": LOOPBACK}
    assert init_kwargs({"node_ip_address": "10.0.0.5"})["_node_ip_address"] == "10.0.0.5"


def _listening_on(port: int) -> set[str]:
    """Local addresses listening on TCP ``port`` (IPv4 and IPv6), from /proc/net."""
    found = set()
    for table, family in (("/proc/net/tcp", socket.AF_INET), ("/proc/net/tcp6", socket.AF_INET6)):
        try:
            lines = open(table).read().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            local, state = line.split()[1], line.split()[3]
            address, hex_port = local.split(":")
            if state == "0A" and int(hex_port, 16) == port:  # 0A: LISTEN
                raw = bytes.fromhex(address)
                words = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
                found.add(socket.inet_ntop(family, words))
    return found


def test_a_sweeps_own_ray_instance_exports_metrics_on_loopback_only():
    with socket.socket() as s:
        s.bind((LOOPBACK, 0))
        port = s.getsockname()[1]
    env = {**os.environ, "PYTHONPATH": REPO}
    env.pop("RAY_ADDRESS", None)
    proc = subprocess.Popen([sys.executable, "-c", _START, str(port)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, text=True, env=env)
    try:
        assert proc.stdout.readline().strip() == LOOPBACK
        deadline = time.monotonic() + 60
        while not _listening_on(port) and time.monotonic() < deadline:  # the exporter starts with the agent
            time.sleep(0.5)
        assert _listening_on(port) == {LOOPBACK}
    finally:
        proc.communicate("\n", timeout=120)


_OPTUNA_SWEEP = """
name: optuna
storage_path: {runs}
trainable: small_cnn
data: {{dataset: "builtin:shapes", pipeline: {{size: 32}}, chunk_size: 64}}
pool: {{actors: 1}}
search_space: {{lr: {{loguniform: [0.01, 0.1]}}, batch_size: {{choice: [32, 64]}}, width: 4, epochs: 1}}
num_samples: 3
max_concurrent_trials: 3
resources_per_trial: {{cpu: 0.25}}
search: {{type: optuna, seed: 0}}
"""


def test_an_optuna_sweep_from_yaml_shares_its_data(ray_session, tmp_path):
    from ray.tune.search.optuna import OptunaSearch

    # Drawn once, here: otherwise every process that opens it first (trials, prep actors) draws its own
    # copy, racing (ensure_shapes keeps one): this test took 63 s that way, 42 s this way (loaded 2 cores).
    ensure_shapes()
    path = tmp_path / "optuna.yaml"
    path.write_text(textwrap.dedent(_OPTUNA_SWEEP.format(runs=tmp_path / "runs")))
    cfg = load_sweep(str(path))
    summary = run_sweep(cfg, verbose=0)
    assert [t["status"] for t in summary["trials"]] == ["TERMINATED"] * 3, summary["trials"]
    # The searcher was Optuna, seeded: TPE seeded with 0 suggests exactly these three configs first
    # (its first 10 come from its seeded random sampler, whatever the trials report).
    optuna = OptunaSearch(seed=0)
    optuna.set_search_properties("accuracy", "max", {k: cfg.search_space[k].to_tune() for k in ("lr", "batch_size")})
    expected = sorted((c["lr"], c["batch_size"]) for c in (optuna.suggest(f"t{i}") for i in range(3)))
    suggested = sorted((t["config"]["lr"], t["config"]["batch_size"]) for t in summary["trials"])
    assert suggested == expected and len({lr for lr, _ in suggested}) == 3
    [group] = summary["groups"].values()  # one data group: every config shares the same DataSpec
    assert group["trials_joined"] == 3
    assert group["samples_served"] == 3 * group["samples_per_epoch"], "each trial read its one epoch"
    assert group["samples_prepared"] < group["samples_served"], f"the trials shared no preparation: {group}"


def test_the_progress_line_names_each_groups_sharing_and_stall():
    from coordinated_prep.sweep.progress import format_progress

    line = format_progress(12.4, {"g1": {"samples_prepared": 1000, "samples_served": 2830}},
                           {"t1": ("g1", 0.02), "t2": ("g1", 0.04), "t3": ("g2", 0.5)})
    assert line.startswith("coordprep 12s | ")
    assert "group g1: sharing 2.83x (1,000 prepared, 2,830 served), stall 0.03 (2 trials reported)" in line
    assert "group g2: sharing - (0 prepared, 0 served), stall 0.50 (1 trial reported)" in line
    assert format_progress(0, {}, {}) == "coordprep 0s | no data group yet"
