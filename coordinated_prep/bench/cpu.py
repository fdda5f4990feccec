"""Where a benchmark run's CPU went: every process's CPU time sampled from ``/proc``, by role.

A :class:`ProcessSampler` reads ``/proc/<pid>/stat`` of every process twice a second in a
background thread while a Tune run goes on. Afterwards :meth:`ProcessSampler.shares` gives, for a
window of the run (the benchmark takes the one in which every trial reads), the share of the
machine's CPU each role used: the prep actors, the trials' processes, the coordinators, and the
rest (Ray's raylet and GCS, the driver, Tune, this sampler). Roles come from the process titles
Ray gives its workers (``ray::PrepActor.prepare``). :func:`machine_busy_s` reads the whole
machine's busy CPU time (``/proc/stat``), which the benchmark takes around Tune's launch of empty
trials. Linux only; elsewhere there is nothing to read and the results are None.
"""

from __future__ import annotations

import collections
import os
import threading
import time
from typing import Callable, Mapping

ROLES = ("prep", "trials", "coordinators", "other")
_TITLES = {"ray::PrepActor": "prep", "ray::ImplicitFunc": "trials", "ray::Coordinator": "coordinators"}

Snapshot = tuple[float, dict[int, tuple[int, str]]]  # (time, pid -> (CPU ticks, role))


def role_of(cmdline: str) -> str:
    """The role of a process from its command line (Ray sets a worker's to ``ray::Class.method``)."""
    title = cmdline.split(" ", 1)[0].split(".", 1)[0]
    return _TITLES.get(title, "other")


def cpu_by_role(before: Mapping[int, tuple[int, str]], after: Mapping[int, tuple[int, str]],
                ticks_per_s: float) -> dict[str, float]:
    """CPU seconds per role between two snapshots (a process started meanwhile counts from zero;
    one that ended meanwhile is missing from ``after`` and its last moments are lost)."""
    seconds = dict.fromkeys(ROLES, 0.0)
    for pid, (ticks, role) in after.items():
        seconds[role] += max(0, ticks - before.get(pid, (0, role))[0]) / ticks_per_s
    return seconds


def machine_busy_s() -> float | None:
    """CPU seconds all of the machine's cores have spent busy since boot (``/proc/stat``), or None."""
    try:
        with open("/proc/stat", encoding="ascii") as f:
            ticks = [int(v) for v in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    idle = ticks[3] + (ticks[4] if len(ticks) > 4 else 0)  # idle and iowait
    return (sum(ticks[:8]) - idle) / os.sysconf("SC_CLK_TCK")


def read_processes() -> dict[int, tuple[int, str]]:
    """pid -> (user + system CPU ticks of all its threads, role), for every process readable now."""
    found: dict[int, tuple[int, str]] = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", encoding="ascii", errors="replace") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            with open(f"/proc/{name}/cmdline", "rb") as f:
                cmdline = f.read(200).replace(b"\0", b" ").decode(errors="replace")
        except (OSError, IndexError):
            continue  # ended while we looked, or not ours to read
        found[int(name)] = (int(fields[11]) + int(fields[12]), role_of(cmdline))
    return found


class ProcessSampler:
    """Samples every process's CPU time every ``interval_s`` in a daemon thread, from :meth:`start`
    to :meth:`stop` (or in a ``with`` block).

    Keeps at most ``keep`` snapshots (the oldest are dropped): at two a second, 4,096 cover a
    34-minute run. ``reader`` takes one snapshot (default :func:`read_processes`).
    """

    def __init__(self, interval_s: float = 0.5, keep: int = 4096,
                 reader: Callable[[], dict[int, tuple[int, str]]] = read_processes) -> None:
        self.interval_s = interval_s
        self._read = reader
        self.available = os.path.isdir("/proc") and hasattr(os, "sysconf")
        self._snapshots: collections.deque[Snapshot] = collections.deque(maxlen=keep)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="coordprep-cpu-sampler", daemon=True)

    def start(self) -> None:
        """Start sampling (nothing happens where ``/proc`` is missing)."""
        if self.available:
            self._thread.start()

    def stop(self) -> None:
        """Stop sampling; the snapshots stay (idempotent)."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=10 * self.interval_s + 5)

    def __enter__(self) -> "ProcessSampler":
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _run(self) -> None:
        while True:
            before = time.time()
            found = self._read()  # hundreds of small reads: stamped with their midpoint
            self._snapshots.append(((before + time.time()) / 2, found))
            if self._stop.wait(self.interval_s):
                return

    def shares(self, start: float, end: float, cores: int) -> dict[str, float] | None:
        """Each role's share of the machine's CPU (``cores`` x seconds) between the first snapshot at
        or after ``start`` and the last at or before ``end`` (wall-clock ``time.time()``); None if
        fewer than two snapshots lie there."""
        inside = [s for s in self._snapshots if start <= s[0] <= end]
        if len(inside) < 2:
            return None
        (t0, before), (t1, after) = inside[0], inside[-1]
        seconds = cpu_by_role(before, after, os.sysconf("SC_CLK_TCK"))
        return {role: s / ((t1 - t0) * cores) for role, s in seconds.items()}
