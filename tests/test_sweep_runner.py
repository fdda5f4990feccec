"""How ``coordprep sweep`` starts Ray: a loopback node by default, so nothing listens beyond the machine."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time

from coordinated_prep.sweep.runner import LOOPBACK, init_kwargs
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
