"""How many CPU threads torch's kernels use (`--threads N`, `LLM(..., threads=N)`).

Default: the physical cores this process may run on. Decode is memory-bound; SMT siblings
share a core's load ports, so a thread per logical CPU only adds contention. Tests may pin 1.

Spin-waiting: OpenMP threads that finish a parallel region spin before they sleep; a decode
step runs ~150 regions (the linears, attention). libgomp's default spin (300k iterations) is
fastest on an idle machine, but two such processes on the same cores hold each other's cores:
~18 ms/token alone became 0.65-1.2 s/token each (measured, BENCHMARKS.md Runtime). Sleeping at
once (OMP_WAIT_POLICY=PASSIVE) costs ~40% alone (a wake-up per region). The package sets
`GOMP_SPINCOUNT=3000` at import (draftsmith/__init__.py, before torch loads OpenMP) unless the
environment sets OMP_WAIT_POLICY or GOMP_SPINCOUNT: alone as fast as the default (within
noise), ~47 ms/token each for two processes instead of a collapse. It only takes effect when
draftsmith is imported before torch (the CLI always is).

Sharing cores with another busy process is a different problem (a thread of ours without a core
stalls every region): `ThreadGovernor` lowers the thread count while other processes keep cores
busy (serve / generate / regen / cache / LLM when no thread count is given).
"""

from __future__ import annotations

import os
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from draftsmith.errors import DraftsmithError, DraftsmithWarning


def physical_cores() -> int:
    """Physical cores among the CPUs this process may use (Linux sysfs; os.cpu_count elsewhere)."""
    try:
        cpus = sorted(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return max(1, os.cpu_count() or 1)
    cores: set[tuple[str, str]] = set()
    for c in cpus:
        topo = Path(f"/sys/devices/system/cpu/cpu{c}/topology")
        try:
            cores.add(((topo / "physical_package_id").read_text().strip(), (topo / "core_id").read_text().strip()))
        except OSError:
            return max(1, len(cpus))
    return max(1, len(cores))


def within_cpus(threads: int) -> int:
    """`threads`, or the CPUs this process may use where it asks for more, with a warning: past the CPUs
    threads only wait on each other, and torch's thread pool died of a segmentation fault at 100000
    (no message). A command written for a bigger machine still runs."""
    try:
        cpus = len(os.sched_getaffinity(0))  # the CPUs this process may use (taskset, a cgroup cpuset)
    except AttributeError:  # not Linux
        cpus = os.cpu_count() or 1
    if threads > cpus:
        warnings.warn(DraftsmithWarning(f"{threads} threads asked for, but this process may use {cpus} CPUs; "
                                        f"using {cpus}"), stacklevel=2)
        return cpus
    return threads


def configure_threads(threads: int | None = None) -> int:
    """Set torch's intra-op threads to `threads` (at most the CPUs: within_cpus). None keeps the
    current setting (so a caller's own `torch.set_num_threads` stands) but never more than the
    physical cores: torch's default on an SMT machine is one thread per logical CPU. Returns the
    count in force."""
    if threads is None:
        threads = min(torch.get_num_threads(), physical_cores())
    if isinstance(threads, bool) or not isinstance(threads, int) or threads < 1:
        raise DraftsmithError(f"threads must be a positive integer, got {threads!r}")
    threads = within_cpus(threads)
    if torch.get_num_threads() != threads:
        torch.set_num_threads(threads)
    return threads


@dataclass(frozen=True)
class CpuSample:
    """Seconds of CPU time: the whole machine's busy time and this process's, at a wall time."""

    wall: float
    busy: float
    own: float


def read_cpu(proc: Path = Path("/proc")) -> CpuSample | None:
    """The machine's busy CPU time (/proc/stat: user, nice, system, irq, softirq, steal) and this
    process's (/proc/self/stat: utime + stime, all threads); None where /proc does not say (not Linux)."""
    try:
        vals = [int(x) for x in (proc / "stat").read_text().split("\n", 1)[0].split()[1:]]
        busy = sum(vals[i] for i in (0, 1, 2, 5, 6, 7) if i < len(vals))
        st = (proc / "self" / "stat").read_text()
        fields = st[st.rindex(")") + 2 :].split()  # the command name may hold spaces
        own = int(fields[11]) + int(fields[12])  # stat fields 14 and 15
        hz = os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, AttributeError):
        return None
    return CpuSample(time.monotonic(), busy / hz, own / hz)


class ThreadGovernor:
    """Leaves the cores other busy processes use to them: every `interval_s` it measures how many
    cores the rest of the machine kept busy and runs torch's kernels on what is left (at least 1,
    at most `max_threads`), with a dead band against flapping.

    Why: a step runs ~150 parallel regions, each ending when every thread has done its share. Beside
    a process that keeps the cores busy with long regions (a batched regeneration), a thread of ours
    waits for CPU time at each of them: on a 2-core machine plain decoding at 2 threads took ~28
    ms/token alone and 65-72 beside `draftsmith regen`, 350-370 in some episodes, where 1 thread ran
    at 44-57 (BENCHMARKS.md, "Plain decoding beside a busy process"). Alone it keeps all `max_threads`;
    outputs do not depend on the thread count."""

    DEAD_BAND = 0.7  # cores: move only when the free cores differ this much from the threads in use

    def __init__(self, max_threads: int, interval_s: float = 2.0, read: Callable[[], CpuSample | None] = read_cpu,
                 set_threads: Callable[[int], None] = torch.set_num_threads) -> None:
        self.max_threads, self.interval_s, self._read, self._set = max_threads, interval_s, read, set_threads
        self.threads = max_threads
        self._last = read()

    @property
    def active(self) -> bool:
        """False where the machine's CPU time cannot be read (then it never changes anything)."""
        return self._last is not None and self.max_threads > 1

    def step(self) -> int:
        """Call often (once per engine step): re-decides at most every interval_s. Returns the threads in use."""
        last = self._last
        if last is None or self.max_threads <= 1 or time.monotonic() - last.wall < self.interval_s:
            return self.threads
        now = self._read()
        if now is None or now.wall <= last.wall:
            return self.threads
        others = max(0.0, (now.busy - last.busy) - (now.own - last.own)) / (now.wall - last.wall)
        self._last = now
        want = threads_beside(self.max_threads, others, self.threads, self.DEAD_BAND)
        if want != self.threads:
            self._set(want)
            self.threads = want
        return self.threads


def threads_beside(max_threads: int, others: float, current: int, dead_band: float) -> int:
    """Threads to run with `others` cores busy elsewhere: the free cores, rounded, in [1, max_threads];
    `current` unless the free cores are more than `dead_band` away from it."""
    free = max_threads - others
    if abs(free - current) <= dead_band:
        return current
    return max(1, min(max_threads, round(free)))
