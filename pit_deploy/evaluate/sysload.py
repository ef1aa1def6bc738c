"""How busy the machine was while a measurement ran, beside the measuring process's own CPU
time — so a benchmark taken on a shared, noisy machine says so (``docs/conventions.md``,
"Benchmark conventions"). Linux ``/proc/stat``; elsewhere the foreign load is unknown."""

from __future__ import annotations

import os
import resource
import sys
import time
from dataclasses import dataclass
from pathlib import Path


def _machine_busy_s() -> float | None:
    """CPU seconds all cores spent not idle since boot (``/proc/stat``), or ``None``."""
    stat = Path("/proc/stat")
    if not stat.is_file():
        return None
    fields = stat.read_text().splitlines()[0].split()[1:]
    values = [int(v) for v in fields]
    idle = values[3] + (values[4] if len(values) > 4 else 0)  # idle + iowait
    return (sum(values[:8]) - idle) / os.sysconf("SC_CLK_TCK")


def _own_cpu_s() -> float:
    t = os.times()
    return t.user + t.system


@dataclass
class LoadWindow:
    """A measured interval: wall time, the machine's busy CPU time, this process's CPU time."""

    wall_s: float = 0.0
    machine_busy_s: float | None = None
    process_cpu_s: float = 0.0

    @property
    def foreign_cores(self) -> float | None:
        """Average number of cores other processes kept busy during the interval."""
        if self.machine_busy_s is None or self.wall_s <= 0:
            return None
        return max(0.0, self.machine_busy_s - self.process_cpu_s) / self.wall_s


class measure_load:
    """``with measure_load() as w: ...`` fills ``w`` (a :class:`LoadWindow`) on exit."""

    def __enter__(self) -> LoadWindow:
        self.window = LoadWindow()
        self._t, self._busy, self._cpu = time.perf_counter(), _machine_busy_s(), _own_cpu_s()
        return self.window

    def __exit__(self, *exc: object) -> None:
        w = self.window
        w.wall_s = time.perf_counter() - self._t
        busy = _machine_busy_s()
        w.machine_busy_s = None if busy is None or self._busy is None else busy - self._busy
        w.process_cpu_s = _own_cpu_s() - self._cpu


def peak_rss_mb() -> float:
    """Peak resident set size of this process's own memory so far, in MiB.

    Linux: ``VmHWM`` of ``/proc/self/status``, the high-water mark of this address space.
    ``ru_maxrss`` would be wrong for a benchmark cell: Linux carries the parent's resident size
    at ``fork`` into the child's ``ru_maxrss`` across ``exec``, so a cell started by a large
    parent would report the parent's memory. Elsewhere ``ru_maxrss`` is the fallback.
    """
    status = Path("/proc/self/status")
    if status.is_file():
        for line in status.read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024.0
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss / (1024.0 * 1024.0) if sys.platform == "darwin" else rss / 1024.0
